"""DeepSeek-V3 mixture of experts: sigmoid router with bias-corrected, group-limited top-k.

Routing (DeepSeek-V3 `Gate`, `topk_method="noaux_tc"`):
  1. scores = sigmoid(x @ gate)                              [T, E], float32
  2. choice = scores + e_score_correction_bias               (the bias only steers selection)
  3. with n_group > 1: a group's score is the sum of its top-2 choice values; keep the best
     `topk_group` groups, mask the rest to -inf
  4. experts = top-k(choice); weights = scores at those experts (no bias)
  5. norm_topk_prob: weights /= sum(weights); then weights *= routed_scaling_factor
Output = sum_k weights_k * expert_k(x) + shared_experts(x).

Two equal ways to run the experts; `expert_path` is the one place that picks (T = tokens in the
call, k = num_experts_per_tok, E = n_routed_experts):

* "grouped": the T * k assignments sorted by expert, then three grouped matmuls
  (`pallas_kernels.grouped_matmul`: rows of one expert times that expert's matrix), each expert's
  weights read once; the results are put back in assignment order and summed over k per token in
  a fixed order (a gather, not a scatter-add, whose order a GPU does not fix). On the "pallas"
  backend this is the only path, at every T: the Pallas kernel reads only the experts that have
  rows, so decode costs what it routes. On "xla" it is `jax.lax.ragged_dot`, for T * k > E.
* "gathered" (xla backend, T * k <= E: CPU decode and verification windows): each assignment
  gathers its expert's weights and multiplies by them; no sort. Measured on the CPU with the
  shipped 12-layer model (`benchmarks/heldout.py` shapes, batch 1), it made a plain decode step
  1.4x faster and a k = 3 speculative step 1.2x faster than ragged_dot, which XLA's CPU backend
  lowers to a matmul over every expert for every token. It materializes the chosen experts'
  weights ([T, k, D, H]), so it is never used on a GPU.

XLA's GPU backend lowers `ragged_dot` to one dense matmul over all E experts (256x the routed
flops at DeepSeek-V3's shapes): hence the Pallas kernel there (`benchmarks/moe.py` times the three).
The xla backend's choice by T means a token's output can depend on how many tokens share the call
(the two paths round differently); the pallas path's kernel keeps a token's bits independent of T.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import ModelConfig
from jaxspec.pallas_kernels import grouped_matmul, resolve_backend

from .layers import MLP


def route(config: ModelConfig, x: jax.Array, gate_weight: jax.Array, bias: jax.Array):
    """x [T, D], gate_weight [D, E], bias [E] -> (weights [T, k] float32, experts [T, k] int32)."""
    scores = jax.nn.sigmoid(x.astype(jnp.float32) @ gate_weight.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    num_tokens, num_experts = scores.shape
    if config.n_group > 1:
        per_group = num_experts // config.n_group
        grouped = choice.reshape(num_tokens, config.n_group, per_group)
        group_score = jnp.sum(jax.lax.top_k(grouped, min(2, per_group))[0], axis=-1)  # [T, G]
        _, best_groups = jax.lax.top_k(group_score, config.topk_group)
        keep = jnp.zeros((num_tokens, config.n_group), bool).at[
            jnp.arange(num_tokens)[:, None], best_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, per_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, config.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if config.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * config.routed_scaling_factor, experts.astype(jnp.int32)


EXPERT_PATHS = ("grouped", "gathered")


def expert_path(num_assignments: int, num_experts: int, backend: str) -> str:
    """"grouped" or "gathered" (module docstring) for a call with `num_assignments` = T * k token-expert
    pairs on a resolved `backend` ("xla" or "pallas"): the only place the choice is made."""
    if backend == "pallas" or num_assignments > num_experts:
        return "grouped"
    return "gathered"


class MoE(nnx.Module):
    """Routed experts (stacked [E, ...] weights) plus `n_shared_experts` fused into one MLP."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        dim, hidden, num_experts = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts
        self.config = config
        self.gate_weight = nnx.Param(nnx.initializers.normal(dim ** -0.5)(rngs.params(), (dim, num_experts), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32))
        init_in, init_out = nnx.initializers.normal(dim ** -0.5), nnx.initializers.normal(hidden ** -0.5)
        self.experts_gate_proj = nnx.Param(init_in(rngs.params(), (num_experts, dim, hidden), dtype))
        self.experts_up_proj = nnx.Param(init_in(rngs.params(), (num_experts, dim, hidden), dtype))
        self.experts_down_proj = nnx.Param(init_out(rngs.params(), (num_experts, hidden, dim), dtype))
        self.shared_experts = (MLP(dim, hidden * config.n_shared_experts, rngs=rngs, dtype=dtype)
                               if config.n_shared_experts else None)

    def __call__(self, x: jax.Array, *, backend: str = "auto", path: str | None = None) -> jax.Array:
        """x [B, Q, D] -> [B, Q, D]. backend: "xla", "pallas" or "auto", as for the attention ops.
        path: None = `expert_path`'s choice; "gathered" or "grouped" forces one (benchmarks/moe.py)."""
        if path not in (None, *EXPERT_PATHS):
            raise ValueError(f"path={path!r}: must be None or one of {EXPERT_PATHS}")
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts = route(self.config, tokens, self.gate_weight[...], self.e_score_correction_bias[...])
        backend = resolve_backend(backend)
        if path is None:
            path = expert_path(experts.size, self.config.n_routed_experts, backend)
        if path == "gathered":
            out = self._gathered(tokens, weights, experts)
        else:
            out = self._grouped(tokens, weights, experts, backend)
        out = out.astype(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.reshape(shape)

    def _gathered(self, tokens, weights, experts):
        """tokens [T, D], weights [T, k] float32, experts [T, k] -> [T, D] float32. Each assignment
        multiplies by its own expert's gathered weights (T * k expert matrices); no sort or scatter."""
        w = lambda p: p[...][experts].astype(tokens.dtype)  # [T, k, ...]
        gate = jnp.einsum("td,tkdh->tkh", tokens, w(self.experts_gate_proj))
        up = jnp.einsum("td,tkdh->tkh", tokens, w(self.experts_up_proj))
        down = jnp.einsum("tkh,tkhd->tkd", jax.nn.silu(gate) * up, w(self.experts_down_proj))
        return jnp.einsum("tkd,tk->td", down.astype(jnp.float32), weights)

    def _grouped(self, tokens, weights, experts, backend):
        """Same arguments and result as `_gathered` (plus the resolved backend), as grouped matmuls
        over the assignments sorted by expert: each expert's weights are read once."""
        num_tokens, topk = experts.shape
        flat_expert = experts.reshape(-1)
        order = jnp.argsort(flat_expert, stable=True)  # sorted position -> assignment
        group_sizes = jnp.bincount(flat_expert, length=self.config.n_routed_experts).astype(jnp.int32)
        sorted_in = tokens[order // topk]
        dtype = tokens.dtype
        matmul = lambda lhs, proj: grouped_matmul(lhs, proj[...].astype(dtype), group_sizes, backend=backend)
        hidden = jax.nn.silu(matmul(sorted_in, self.experts_gate_proj)) * matmul(sorted_in, self.experts_up_proj)
        down = matmul(hidden, self.experts_down_proj)
        position = jnp.argsort(order)  # assignment -> sorted position
        per_assignment = down[position].reshape(num_tokens, topk, -1)
        return jnp.einsum("tkd,tk->td", per_assignment.astype(jnp.float32), weights)
