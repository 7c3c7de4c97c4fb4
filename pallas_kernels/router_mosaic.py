"""The MoE router after its gate as one Mosaic GPU kernel: DeepSeek's group-limited top-k, the
weights at the chosen experts and their normalization, in one launch.

XLA compiles that chain as a kernel per reduction (a group's best two, the groups' ranking, the
experts' places, the indices at places 0..k-1, the weights: six launches a MoE layer at B 1 after
the gate, `jaxspec.pallas_kernels.ranks`), each a few microseconds of launch for 256 numbers a token. Here
one program routes one token: its warpgroup holds the E scores, two a thread (E / 128 a thread in
Mosaic GPU's strided layout), and every selection is a reduction over the whole warpgroup (warp
`redux` of int32 keys, then shared memory across the four warps):

  1. keys = the IEEE total-order keys of scores + bias (`order_keys`), as the reference compares
     (V3's sigmoid scores taken here from the gate's logits, `logits`);
  2. with n_group > 1, per group: its best key (max), the lowest index holding it (min), the best
     key of the rest (max); the group's score is the two values' sum, and a group is kept where
     fewer than `topk_group` groups are ahead of it (more score, or as much at a lower index);
     the experts of the other groups take the key of -inf;
  3. k rounds of: the best key among the experts not yet taken, the lowest index holding it, and
     the score there (a max over the one lane that holds it, as a key: exact);
  4. the weights' sum left to right, times its reciprocal, times the scaling factor.

That is the reference's arithmetic (`models.moe.choose`) in the reference's order, so the experts and
the weights equal it bit for bit (the tests compare the bits in interpret mode). A token's result is
its own program's: it does not depend on the tokens beside it.

Rows of experts not a multiple of 128 (the tiny test models) are padded with experts that count as
taken from the start. The results leave as rows of 128 lanes ([T, 128], the first k used), one TMA
store each.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .cost import stating
from .mosaic_gpu import compiler_params, interpret_params, interpreting, store
from .order_keys import LOWEST_KEY as LOWEST, ordered_values, total_order_keys

LANES = 128  # a warpgroup's threads; a token's experts are padded to a multiple of it
# A TMA copy moves at most this many elements along a dimension: longer rows arrive in pieces.
TMA_BOX = 256


def _pieces(width: int) -> list[tuple[int, int]]:
    """[0, width) as (start, size) pieces of at most TMA_BOX elements."""
    return [(start, min(TMA_BOX, width - start)) for start in range(0, width, TMA_BOX)]


def _router_kernel(scores_gmem, bias_gmem, experts_gmem, weights_gmem, row, bias, experts_out, weights_out,
                   arrived, *, num_experts: int, logits: bool, n_group: int, topk_group: int, top_k: int,
                   norm: bool, scaling: float):
    """One token. scores_gmem [T, Ep] float32 (the gate's logits where `logits`), bias_gmem [Ep]
    float32 (Ep = E padded to a multiple of LANES); experts_gmem [T, LANES] int32, weights_gmem
    [T, LANES] float32 (the first top_k lanes written); row, bias: SMEM [1, Ep], [Ep];
    experts_out, weights_out: SMEM [1, LANES]; arrived: one barrier per TMA piece of the scores
    and of the bias."""
    token = jax.lax.axis_index("token")
    width = row.shape[1]
    pieces = _pieces(width)
    for i, (start, size) in enumerate(pieces):
        columns = pl.ds(start, size)
        plgpu.copy_gmem_to_smem(scores_gmem.at[pl.ds(token, 1), columns], row.at[:, columns], arrived.at[i])
        plgpu.copy_gmem_to_smem(bias_gmem.at[columns], bias.at[columns], arrived.at[len(pieces) + i])
    for i in range(2 * len(pieces)):
        plgpu.barrier_wait(arrived.at[i])

    strided = plgpu.Layout.WG_STRIDED((width,), vec_size=1)
    score = plgpu.layout_cast(row[0], strided)
    if logits:
        score = jax.nn.sigmoid(score)
    key = total_order_keys(score + plgpu.layout_cast(bias[...], strided))
    index = plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, (width,), 0), strided)
    if n_group > 1:
        per_group = num_experts // n_group
        groups = [(index >= g * per_group) & (index < (g + 1) * per_group) for g in range(n_group)]
        group_keys = []
        for inside in groups:
            mine = jnp.where(inside, key, LOWEST)
            best = jnp.max(mine)
            if per_group > 1:  # the group's second best: its best among the other indices
                first = jnp.min(jnp.where(inside & (mine == best), index, width))
                second = jnp.max(jnp.where(inside & (index != first), key, LOWEST))
                group_keys.append(total_order_keys(ordered_values(best) + ordered_values(second)))
            else:
                group_keys.append(best)
        dropped = total_order_keys(jnp.float32(-jnp.inf))
        for g, inside in enumerate(groups):
            ahead = functools.reduce(jnp.add, [
                ((group_keys[h] > group_keys[g]) | ((group_keys[h] == group_keys[g]) & (h < g))).astype(jnp.int32)
                for h in range(n_group) if h != g])
            key = jnp.where(inside & (ahead >= topk_group), dropped, key)
    score_key = total_order_keys(score)
    taken = index >= num_experts  # the padding, never chosen
    chosen, weights = [], []
    for _ in range(top_k):
        candidate = jnp.where(taken, LOWEST, key)
        best = jnp.max(candidate)
        pick = jnp.min(jnp.where((candidate == best) & ~taken, index, width))
        taken = taken | (index == pick)
        chosen.append(pick)
        weights.append(ordered_values(jnp.max(jnp.where(index == pick, score_key, LOWEST))))
    if norm:
        reciprocal = 1.0 / (functools.reduce(jnp.add, weights) + 1e-20)
        weights = [w * reciprocal for w in weights]
    weights = [w * scaling for w in weights]

    lanes = plgpu.Layout.WG_STRIDED((LANES,), vec_size=1)
    lane = plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, (LANES,), 0), lanes)
    experts_row = lane * 0  # zeros in the lanes' layout (a constant would be a splat, which `where` cannot carry)
    weights_row = experts_row.astype(jnp.float32)
    for j in range(top_k):
        experts_row = jnp.where(lane == j, chosen[j], experts_row)
        weights_row = jnp.where(lane == j, weights[j], weights_row)
    store(experts_out.at[0], experts_row)
    store(weights_out.at[0], weights_row)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(experts_out, experts_gmem.at[pl.ds(token, 1)])
    plgpu.copy_smem_to_gmem(weights_out, weights_gmem.at[pl.ds(token, 1)])
    plgpu.wait_smem_to_gmem(0)


def router_mosaic(scores: jax.Array, bias: jax.Array, *, n_group: int, topk_group: int, top_k: int,
                  norm_topk_prob: bool, scaling: float, logits: bool = False,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`models.moe.choose` (learned routing) on the Mosaic GPU kernel: scores [T, E] float32 (the
    gate's), bias [E] -> (weights [T, top_k] float32, experts [T, top_k] int32), bit for bit the
    reference's. n_group must divide E;
    top_k <= min(E, LANES). logits: `scores` are the gate's logits, and the kernel takes their
    `jax.nn.sigmoid` itself (V3's scoring: one launch fewer than XLA's sigmoid beside the kernel;
    compiled for sm_90a, its PTX is XLA's, instruction for instruction). `interpret` runs it on
    the CPU simulator (`mosaic_gpu.interpreting`)."""
    num_tokens, num_experts = scores.shape
    if bias.shape != (num_experts,):
        raise ValueError(f"bias: shape {bias.shape} must be ({num_experts},), one per expert of scores {scores.shape}")
    if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group={n_group}, topk_group={topk_group}: n_group must divide the {num_experts} "
                         "experts and 1 <= topk_group <= n_group")
    if not 1 <= top_k <= min(num_experts, LANES):
        raise ValueError(f"top_k={top_k}: must be in [1, {min(num_experts, LANES)}]")
    kwargs = dict(logits=bool(logits), n_group=n_group, topk_group=topk_group, top_k=top_k,
                  norm=bool(norm_topk_prob), scaling=float(scaling), interpret=interpret)
    if not interpret:
        return _router_mosaic(scores, bias, **kwargs)
    with interpreting():
        return _router_mosaic(scores, bias, **kwargs)


# `interpret` also keys the jit cache: a kernel traced for the simulator is never reused for a GPU.
@functools.partial(jax.jit, static_argnames=("logits", "n_group", "topk_group", "top_k", "norm", "scaling",
                                             "interpret"))
def _router_mosaic(scores, bias, *, logits, n_group, topk_group, top_k, norm, scaling, interpret):
    num_tokens, num_experts = scores.shape
    if num_tokens == 0:  # CUDA refuses an empty grid, and there is nothing to route
        return jnp.zeros((0, top_k), jnp.float32), jnp.zeros((0, top_k), jnp.int32)
    width = pl.cdiv(num_experts, LANES) * LANES
    scores, bias = scores.astype(jnp.float32), bias.astype(jnp.float32)
    if width != num_experts:  # the padding is masked in the kernel; its values are never read as scores
        scores = jnp.pad(scores, ((0, 0), (0, width - num_experts)))
        bias = jnp.pad(bias, (0, width - num_experts))
    pieces = len(_pieces(width))
    kernel = plgpu.kernel(
        functools.partial(_router_kernel, num_experts=num_experts, logits=logits, n_group=n_group,
                          topk_group=topk_group, top_k=top_k, norm=norm, scaling=scaling),
        kernel_name="router_mosaic",
        out_type=(jax.ShapeDtypeStruct((num_tokens, LANES), jnp.int32),
                  jax.ShapeDtypeStruct((num_tokens, LANES), jnp.float32)),
        grid=(num_tokens,), grid_names=("token",),
        scratch_types=[plgpu.SMEM((1, width), jnp.float32), plgpu.SMEM((width,), jnp.float32),
                       plgpu.SMEM((1, LANES), jnp.int32), plgpu.SMEM((1, LANES), jnp.float32),
                       plgpu.Barrier(num_arrivals=1, num_barriers=2 * pieces)],
        compiler_params=compiler_params(), interpret=interpret_params() if interpret else None)
    # Per token: the choice and its keys over E, a reduction pass per selection (3 a group, 3 a
    # pick), the weights; the scores, bias and two result rows cross memory once.
    passes = 3 * (n_group if n_group > 1 else 0) + 3 * top_k + 2
    cost = pl.CostEstimate(flops=num_tokens * width * passes, transcendentals=num_tokens * width if logits else 0,
                           bytes_accessed=num_tokens * (width + 2 * LANES) * 4 + width * 4)
    with stating(cost, "router"):
        experts, weights = kernel(scores, bias)
    return weights[:, :top_k], experts[:, :top_k]
