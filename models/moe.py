"""DeepSeek-V3 / V4 mixture of experts: a router with bias-corrected, group-limited top-k (or V4's
hash routing), routed SwiGLU experts and a shared expert.

Routing (DeepSeek-V3 `Gate`, `topk_method="noaux_tc"`; transformers' DeepseekV4TopKRouter):
  1. scores = sigmoid(x @ gate) (V3, V3.2), or sqrt(softplus(x @ gate)) (`scoring_func`
     "sqrtsoftplus", V4)                                     [T, E], float32
  2. choice = scores + e_score_correction_bias               (the bias only steers selection)
  3. with n_group > 1: a group's score is the sum of its top-2 choice values; keep the best
     `topk_group` groups, mask the rest to -inf
  4. experts = top-k(choice); weights = scores at those experts (no bias)
  5. norm_topk_prob: weights /= sum(weights); then weights *= routed_scaling_factor
The selections of 3 and 4, and the grouped path's sort of the assignments by expert, count
comparisons for a decode step's few tokens instead of sorting (`pallas_kernels.ranks`: on a GPU a sort is
launches a step pays at every layer); more tokens sort, to the same integers. The sum of 5 adds a
token's k weights left to right (a reduction would be a kernel of its own).
V4's hash layers (`mlp_layer_types` "hash_moe", transformers' DeepseekV4HashRouter) skip 2-4:
experts = tid2eid[token id], a fixed table [V, k], and have no bias; the weights are still the
learned gate's scores at those experts (5).
Output = sum_k weights_k * expert_k(x) + shared_experts(x), each expert a SwiGLU whose gate and up
projections V4 clamps at `swiglu_limit` (`layers.swiglu`; V3: no clamp).

Two equal ways to run the experts; `expert_path` is the one place that picks (T = tokens in the
call, k = num_experts_per_tok, E = n_routed_experts):

* "grouped": the T * k assignments sorted by expert, then three grouped matmuls
  (`pallas_kernels.grouped_matmul`: rows of one expert times that expert's matrix), each expert's
  weights read once; the results are put back in assignment order and summed over k per token in
  a fixed order (a gather, not a scatter-add, whose order a GPU does not fix). On the "pallas"
  backend this is the only path, at every T: the Pallas kernel reads only the experts that have
  rows, so decode costs what it routes. On "xla" it is `jax.lax.ragged_dot`, for T * k > E.
* "gathered" (xla backend, T * k <= E: CPU decode and verification windows): each assignment
  gathers its expert's weights and multiplies by them; no sort. Faster on the CPU than
  ragged_dot, which XLA's CPU backend lowers to a matmul over every expert for every token
  (docs/model-interface.md has the figures). It materializes the chosen experts' weights
  ([T, k, D, H]), so it is never used on a GPU.

XLA's GPU backend lowers `ragged_dot` to one dense matmul over all E experts (256x the routed
flops at DeepSeek-V3's shapes): hence the Pallas kernel there (`benchmarks/moe.py` times the three).
The xla backend's choice by T means a token's output can depend on how many tokens share the call
(the two paths round differently); the pallas path's kernel keeps a token's bits independent of T.

Expert parallelism (on a mesh, `jaxspec.sharding`: inside the loop's shard_map each device holds
E / n experts and its own rows):
  1. dispatch: each device routes its own tokens, then all-gathers tokens and expert ids over the
     row axes, so every device sees all T tokens. Not an all-to-all: in decode T is small, and with
     top-8 of 256 experts on 8 devices a token's experts span about 5.3 devices on average
     (8 * (1 - (7/8)^8)), so an ideal deduplicated all-to-all moves ~2/3 of the all-gather's bytes
     while needing capacity or ragged-size bookkeeping (`ragged_all_to_all`) and a second sort;
  2. compute: each device runs the same path over its experts only. Sorted by expert, its
     assignments are one contiguous run of rows (`_grouped`); the gathered path masks the others;
  3. combine: a reduce-scatter (`combine_shards`) of the per-assignment outputs [T, k, D], not of
     per-token partial sums: each assignment is nonzero on exactly one device, so the cross-device
     sum adds exact zeros, and the weighted k-sum then runs per token in the same fixed order as on
     one device. The mesh output equals the single-device output bit for bit when both take the
     same path; the price is k times the bytes of a partial-sum reduce-scatter.
On one device (no shard_map, `current()` is None) none of this runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model_config import ModelConfig
from jaxspec.pallas_kernels import grouped_matmul, ranks, resolve_backend
from jaxspec.pallas_kernels.backend import interpret_mode
from jaxspec.pallas_kernels.block_fp8 import dequantize
from jaxspec.sharding import Parallel, current

from .layers import MLP, param, swiglu, weight_params
from .stack import in_place


def route(config: ModelConfig, x: jax.Array, gate_weight: jax.Array, bias: jax.Array | None, *,
          experts: jax.Array | None = None, backend: str = "auto"):
    """x [T, D], gate_weight [D, E], bias [E] -> (weights [T, k] float32, experts [T, k] int32).

    experts: None (learned top-k), or [T, k] expert ids fixed in advance (hash routing: the
    weights are the scores there; bias is unused and may be None). backend: as `choose`'s."""
    logits = x.astype(jnp.float32) @ gate_weight.astype(jnp.float32)
    if experts is None and config.scoring_func == "sigmoid" and _routes_on_mosaic(backend):
        return _mosaic_route(config, logits, bias, logits=True)  # the sigmoid in the kernel too
    if config.scoring_func == "sqrtsoftplus":
        scores = jnp.sqrt(jax.nn.softplus(logits))
    else:
        scores = jax.nn.sigmoid(logits)
    return choose(config, scores, bias, experts=experts, backend=backend)


def choose(config: ModelConfig, scores: jax.Array, bias: jax.Array | None, *, experts: jax.Array | None = None,
           backend: str = "auto"):
    """The router after its gate (steps 2-5 of the module docstring): scores [T, E] float32, bias
    [E] -> (weights [T, k] float32, experts [T, k] int32); experts as for `route`.

    backend: as the kernels' (`pallas_kernels.resolve_backend`, op "router"). Where it resolves to
    "mosaic" and the program lowers for a GPU, learned routing runs as one Mosaic GPU kernel
    (`pallas_kernels.router_mosaic`, the same bits); everywhere else, and for hash routing, this
    function's own jnp, which XLA compiles as a kernel per reduction. Interpreted on the CPU the
    kernel would cost seconds a layer, so a model on "mosaic" there keeps the jnp (the kernel's
    own test interprets it). The router has no Triton kernel: "pallas", and "auto" until a
    measurement names the kernel in `AUTO_KERNELS`, run the jnp."""
    if experts is None and _routes_on_mosaic(backend):
        return _mosaic_route(config, scores, bias, logits=False)
    if experts is None:
        experts = _top_k_experts(config, scores + bias.astype(jnp.float32))
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if config.norm_topk_prob:
        # Added left to right, elementwise: one fusion with the gather and the division, where a
        # reduction over k would be a kernel of its own; and a token's sum in a fixed order. Times
        # the sum's reciprocal, as XLA rewrites a division by it anyway: written out, every
        # implementation (`pallas_kernels.router_mosaic`) rounds the same way.
        total = functools.reduce(jnp.add, (weights[:, j:j + 1] for j in range(weights.shape[1])))
        weights = weights * (1.0 / (total + 1e-20))
    return weights * config.routed_scaling_factor, experts.astype(jnp.int32)


def _routes_on_mosaic(backend: str) -> bool:
    """Whether learned routing runs on the Mosaic GPU kernel (`choose`)."""
    return resolve_backend(backend, "router") == "mosaic" and not interpret_mode()


def _mosaic_route(config: ModelConfig, values: jax.Array, bias: jax.Array, *, logits: bool):
    """`choose` on the Mosaic GPU kernel, from the scores or (`logits`, sigmoid scoring) the gate's
    logits; imported where it runs, as the ops import their Mosaic kernels."""
    from jaxspec.pallas_kernels.router_mosaic import router_mosaic

    return router_mosaic(values, bias, logits=logits, n_group=config.n_group, topk_group=config.topk_group,
                         top_k=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                         scaling=config.routed_scaling_factor)


def _top_k_experts(config: ModelConfig, choice: jax.Array) -> jax.Array:
    """choice [T, E] (scores + bias) -> the chosen experts [T, k], group-limited when n_group > 1."""
    num_tokens, num_experts = choice.shape
    if config.n_group > 1:
        per_group = num_experts // config.n_group
        grouped = choice.reshape(num_tokens, config.n_group, per_group)
        # The sum of each group's best 2 (DeepSeek's `topk(2).sum`), [T, G].
        group_score = ranks.sum_of_best_two(grouped) if per_group > 1 else grouped[..., 0]
        keep = ranks.places(group_score) < config.topk_group
        choice = jnp.where(jnp.repeat(keep, per_group, axis=1), choice, -jnp.inf)
    return ranks.top_k_indices(choice, config.num_experts_per_tok)


EXPERT_PATHS = ("grouped", "gathered")
# Expert parallelism exchanges at most this many of a device's tokens at a time (`MoE._expert_parallel`):
# with 8 devices, top-8 and V3.2's width, 4096 gathered tokens and 470 MB of per-assignment outputs.
EP_CHUNK_TOKENS = 512


def expert_path(num_assignments: int, num_experts: int, backend: str) -> str:
    """"grouped" or "gathered" (module docstring) for a call with `num_assignments` = T * k token-expert
    pairs on a resolved `backend` ("xla", "pallas" or "mosaic"): the only place the choice is made."""
    if backend != "xla" or num_assignments > num_experts:
        return "grouped"
    return "gathered"


def prefill_temp_bytes(config: ModelConfig, tokens: int, row_shards: int | None, itemsize: int,
                       backend: str) -> int:
    """An estimate, erring high, of the bytes a layer's feed-forward part holds at once for `tokens`
    tokens of one device (in activations of `itemsize` bytes, on the resolved `backend`): the larger
    of a dense MLP's gate, up and product [T, intermediate_size] and the routed experts' work.
    row_shards: on a mesh, how many devices' tokens the expert-parallel dispatch gathers
    (`MoE._routed`); None on one device.

    The routed experts' work for G gathered tokens (G = T on one device; on a mesh, one chunk of at
    most `EP_CHUNK_TOKENS` of each device's tokens, G = min(T, EP_CHUNK_TOKENS) x row_shards) and
    A = G x k assignments: the sorted inputs, the grouped matmuls' outputs and the unsorted outputs
    [A, D], the gate, up and SwiGLU [A, moe_intermediate_size], the gathered tokens [G, D], the
    shared experts' three [T, n_shared x moe_intermediate_size]; on a mesh also the chunks' stacked
    outputs [T, k, D] and one chunk's reduce-scatter result. Counting the three [A, D] buffers
    together errs high (the sorted inputs die before the outputs exist): checked against sm_90a
    compiles in docs/model-interface.md. Where `expert_path` takes the gathered path (few
    assignments, "xla"), each assignment's three expert matrices [D, moe_intermediate_size] too, as
    stored and in the compute dtype (counted at the compute dtype's width both times). Where the
    references take the grouped path, `jax.lax.ragged_dot`'s copies per group too, for the larger
    of the experts' products [A, K] x [G, K, N] (G the experts a device holds, at most E /
    row_shards): XLA's CPU backend copies the rows [G, A, K] and the stack [G, K, N] in float32
    (sm_90a: the rows in their dtype, and an FP8 stack dequantized into a copy), counted in float32
    (one full-width V3.2 layer's experts at 96 tokens: 19.3 GiB counted, 2.6 GiB compiled for sm_90a
    in bfloat16 and 9.6 GiB with FP8 experts)."""
    k, dim, inner = config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size
    dense = tokens * config.intermediate_size * 3 if config.first_k_dense_replace > 0 else 0
    if config.n_routed_experts == 0:
        return itemsize * dense
    gathered = tokens if row_shards is None else min(tokens, EP_CHUNK_TOKENS) * row_shards
    combined = 0 if row_shards is None else (tokens + min(tokens, EP_CHUNK_TOKENS)) * k * dim
    shared = tokens * config.n_shared_experts * inner * 3
    routed = gathered * k * (3 * dim + 3 * inner) + gathered * dim + combined + shared
    path = expert_path(gathered * k, config.n_routed_experts, backend)
    if path == "gathered":
        routed += gathered * k * 3 * dim * inner * 2
    copies = 0
    if backend == "xla" and path == "grouped":
        held = -(-config.n_routed_experts // (row_shards or 1))
        copies = 4 * held * (gathered * k * max(dim, inner) + dim * inner)
    return max(itemsize * dense, itemsize * routed + copies)


class MoE(nnx.Module):
    """Routed experts (stacked [E, ...] weights) plus `n_shared_experts` fused into one MLP.

    hash_routing (V4's "hash_moe" layers): experts come from `tid2eid` [V, k] int32 (random distinct
    experts per token until a checkpoint's table is loaded) instead of top-k, and there is no
    `e_score_correction_bias` (None)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, hash_routing: bool = False):
        dim, hidden, num_experts = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts
        self.config = config
        # The router's expert axis is not named "experts": every device routes its own tokens over all E.
        self.gate_weight = param(nnx.initializers.normal(dim ** -0.5)(rngs.params(), (dim, num_experts), jnp.float32),
                                 "embed", None)
        if hash_routing:
            # Every device looks up its own tokens: the table is replicated.
            draw = jax.random.uniform(rngs.params(), (config.vocab_size, num_experts))
            self.tid2eid = param(jnp.argsort(draw, axis=-1)[:, :config.num_experts_per_tok].astype(jnp.int32),
                                 None, None)
            self.e_score_correction_bias = None
        else:
            self.tid2eid = None
            self.e_score_correction_bias = param(jnp.zeros((num_experts,), jnp.float32), None)
        init_in, init_out = nnx.initializers.normal(dim ** -0.5), nnx.initializers.normal(hidden ** -0.5)
        stack_in, stack_out = ("experts", "embed", "expert_mlp"), ("experts", "expert_mlp", "embed")
        # FP8 (dtype float8_e4m3fn): each stack beside its block scales experts_*_proj_scale_inv, else None.
        self.experts_gate_proj, self.experts_gate_proj_scale_inv = weight_params(
            init_in, rngs.params(), (num_experts, dim, hidden), dtype, stack_in, config.scale_fmt)
        self.experts_up_proj, self.experts_up_proj_scale_inv = weight_params(
            init_in, rngs.params(), (num_experts, dim, hidden), dtype, stack_in, config.scale_fmt)
        self.experts_down_proj, self.experts_down_proj_scale_inv = weight_params(
            init_out, rngs.params(), (num_experts, hidden, dim), dtype, stack_out, config.scale_fmt)
        self.shared_experts = (MLP(dim, hidden * config.n_shared_experts, rngs=rngs, dtype=dtype,
                                   hidden_name="expert_mlp", swiglu_limit=config.swiglu_limit,
                                   scale_fmt=config.scale_fmt)
                               if config.n_shared_experts else None)

    def __call__(self, x: jax.Array, *, backend: str = "auto", path: str | None = None,
                 token_ids: jax.Array | None = None) -> jax.Array:
        """x [B, Q, D] -> [B, Q, D]. backend: "xla", "pallas", "mosaic" or "auto", as for the attention ops
        (the grouped matmul's implementation: `pallas_kernels.grouped_matmul_backend`).
        path: None = `expert_path`'s choice; "gathered" or "grouped" forces one (benchmarks/moe.py).
        token_ids [B, Q] int32: the tokens' ids, which a hash-routed layer needs (ignored otherwise)."""
        if path not in (None, *EXPERT_PATHS):
            raise ValueError(f"path={path!r}: must be None or one of {EXPERT_PATHS}")
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        if self.tid2eid is not None:
            if token_ids is None or token_ids.shape != shape[:-1]:
                raise ValueError(f"token_ids={None if token_ids is None else token_ids.shape}: a hash-routed MoE "
                                 f"needs the ids of its tokens, shape {shape[:-1]}")
            weights, experts = route(self.config, tokens, self.gate_weight[...], None,
                                     experts=self.tid2eid[...][token_ids.reshape(-1)])
        else:
            weights, experts = route(self.config, tokens, self.gate_weight[...], self.e_score_correction_bias[...],
                                     backend=backend)
        backend = resolve_backend(backend, "grouped_matmul")
        par = current()
        if par is None:
            per_assignment = self._routed(tokens, experts, None, backend, path)
        else:
            per_assignment = self._expert_parallel(tokens, experts, par, backend, path)
        out = jnp.einsum("tkd,tk->td", per_assignment.astype(jnp.float32), weights).astype(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens, backend=backend)
        return out.reshape(shape)

    def _routed(self, tokens, experts, par: Parallel | None, backend, path):
        """tokens [T, D], experts [T, k] -> per-assignment outputs [T, k, D] in the tokens' dtype.
        Under `par` (expert parallel) the tokens are this device's: every device sees every token
        of the mesh, runs its own experts, and gets its tokens' outputs back (module docstring)."""
        if par is not None:
            tokens = jax.lax.all_gather(tokens, par.row_axes, tiled=True)
            experts = jax.lax.all_gather(experts, par.row_axes, tiled=True)
        if path is None:
            path = expert_path(experts.size, self.config.n_routed_experts, backend)
        if path == "gathered":
            per_assignment = self._gathered(tokens, experts, par)
        else:
            per_assignment = self._grouped(tokens, experts, par, backend)
        return per_assignment if par is None else combine_shards(per_assignment, par)

    def _expert_parallel(self, tokens, experts, par: Parallel, backend, path):
        """`_routed` under `par`, in chunks of at most `EP_CHUNK_TOKENS` of this device's tokens
        (one after another, `jax.lax.map`): the gathered tokens and the per-assignment outputs of
        a chunk are what a device holds at once, which bounds a long prefill's collectives
        (docs/model-interface.md has the figures). Decode windows are far below one chunk. Every device has the same number of tokens, so all take
        the same chunks and their collectives pair up."""
        num_tokens = tokens.shape[0]
        if num_tokens <= EP_CHUNK_TOKENS:
            return self._routed(tokens, experts, par, backend, path)
        chunks = -(-num_tokens // EP_CHUNK_TOKENS)
        pad = ((0, chunks * EP_CHUNK_TOKENS - num_tokens), (0, 0))  # padding tokens: expert 0, dropped after
        split = lambda a: jnp.pad(a, pad).reshape(chunks, EP_CHUNK_TOKENS, a.shape[-1])
        out = jax.lax.map(lambda chunk: self._routed(*chunk, par, backend, path), (split(tokens), split(experts)))
        return out.reshape(chunks * EP_CHUNK_TOKENS, *out.shape[2:])[:num_tokens]

    def _stack(self, proj: str) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """experts_{proj} and its FP8 block scales (or None) as stacks of layers, with this layer's
        row: ([n, E, in, out], [n, E, ceil(in / 128), ceil(out / 128)] or None, row); n = 1 outside
        a layer stack (`models.stack.in_place`: the experts are read where they lie, never sliced)."""
        stack, row = in_place(getattr(self, f"experts_{proj}").get_value())
        scale_inv = getattr(self, f"experts_{proj}_scale_inv")
        return stack, None if scale_inv is None else in_place(scale_inv.get_value())[0], row

    def _first_expert(self, par: Parallel) -> tuple[jax.Array, int]:
        """Under expert parallelism: the global index of this device's first expert, and how many it holds."""
        held = self.experts_gate_proj.shape[0]  # the local block of the stack inside the shard_map
        return jax.lax.axis_index(par.expert_axes) * held, held

    def _gathered(self, tokens, experts, par: Parallel | None):
        """tokens [T, D], experts [T, k] -> per-assignment outputs [T, k, D] in the tokens' dtype
        (zero for the assignments of experts another device holds, under `par`). Each assignment
        multiplies by its own expert's gathered weights (T * k expert matrices); no sort or scatter."""
        if par is not None:
            first, held = self._first_expert(par)
            mine = (experts >= first) & (experts < first + held)
            experts = jnp.clip(experts - first, 0, held - 1)
        def w(proj):  # each assignment's expert matrix [T, k, in, out]; FP8 gathered, then dequantized
            stack, scale_inv, row = self._stack(proj)
            chosen = stack[row, experts]
            if scale_inv is not None:
                chosen = dequantize(chosen, scale_inv[row, experts])
            return chosen.astype(tokens.dtype)

        gate = jnp.einsum("td,tkdh->tkh", tokens, w("gate_proj"))
        up = jnp.einsum("td,tkdh->tkh", tokens, w("up_proj"))
        down = jnp.einsum("tkh,tkhd->tkd", swiglu(gate, up, self.config.swiglu_limit), w("down_proj"))
        return down if par is None else jnp.where(mine[..., None], down, 0)

    def _grouped(self, tokens, experts, par: Parallel | None, backend):
        """Same arguments and result as `_gathered` (plus the resolved backend), as grouped matmuls
        over the assignments sorted by expert: each expert's weights are read once.

        Under expert parallelism this device's experts are one contiguous run of the sorted
        assignments, starting at `start`: the run is rotated to the front, multiplied by the local
        stack (the grouped matmul leaves rows past the local groups zero), and rotated back."""
        num_tokens, topk = experts.shape
        flat_expert = experts.reshape(-1)
        # order: sorted position -> assignment; position: assignment -> sorted position.
        order, position, group_sizes = ranks.sort_by_group(flat_expert, self.config.n_routed_experts)
        run = order
        if par is not None:
            first, held = self._first_expert(par)
            start = jnp.sum(jnp.where(jnp.arange(group_sizes.shape[0]) < first, group_sizes, 0))
            group_sizes = jax.lax.dynamic_slice_in_dim(group_sizes, first, held)
            run = jnp.roll(order, -start)
        sorted_in = tokens[run // topk]
        dtype = tokens.dtype
        def matmul(lhs, proj):  # an FP8 stack goes to the op as it is, with its scales
            stack, scale_inv, row = self._stack(proj)
            return grouped_matmul(lhs, stack if scale_inv is not None else stack.astype(dtype), group_sizes,
                                  scale_inv, rhs_row=row, backend=backend)

        hidden = swiglu(matmul(sorted_in, "gate_proj"), matmul(sorted_in, "up_proj"), self.config.swiglu_limit)
        down = matmul(hidden, "down_proj")
        if par is not None:
            down = jnp.roll(down, start, axis=0)
        return down[position].reshape(num_tokens, topk, -1)


def combine_shards(per_assignment: jax.Array, par: Parallel) -> jax.Array:
    """per_assignment [T, k, D]: every token of the expert group, this device's experts' outputs
    (zero elsewhere) -> [T / row shards, k, D]: this device's rows, each assignment's output from the
    one device that computed it. A reduce-scatter over the row axes, then a sum over the expert
    axes the rows are not split over (tp's "model"); every sum adds exact zeros to one value."""
    out = jax.lax.psum_scatter(per_assignment, par.row_axes, scatter_dimension=0, tiled=True)
    rest = tuple(axis for axis in par.expert_axes if axis not in par.row_axes)
    return jax.lax.psum(out, rest) if rest else out
