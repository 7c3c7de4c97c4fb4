"""Small building blocks: linear layers, RMSNorm, LayerNorm, the SwiGLU MLP, and `per_position`.

Parameter names follow the Hugging Face DeepSeek checkpoints (`weight`, `bias`), with linear
weights stored `[in, out]` (the checkpoint loader transposes), so a loaded tree reads like the file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    """y = x @ weight (+ bias); weight [in, out]."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 use_bias: bool = False):
        init = nnx.initializers.normal(stddev=in_features ** -0.5)
        self.weight = nnx.Param(init(rngs.params(), (in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.weight[...].astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in float32 (as DeepSeek and transformers do)."""

    def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """Standard LayerNorm with weight and bias, in float32 (the V3.2 indexer's `k_norm`)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate_proj = Linear(dim, hidden, rngs=rngs, dtype=dtype)
        self.up_proj = Linear(dim, hidden, rngs=rngs, dtype=dtype)
        self.down_proj = Linear(hidden, dim, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def per_position(fn, *window_args, enabled: bool = True):
    """Apply `fn` to each window position of `window_args` separately: a window-invariant call.

    window_args: pytrees of [B, Q, ...] arrays (None leaves allowed); fn takes them as [B, 1, ...]
    and returns a pytree of [B, 1, ...] arrays; the result is fn's outputs stacked back to [B, Q, ...].
    With `enabled=False`, simply fn(*window_args).

    Why: XLA's CPU backend picks a matmul or reduction algorithm by the operand shapes (a one-row
    matmul is an Eigen matrix-vector product, four rows go to YNNPACK with other blocking), so a
    token computed with Q - 1 others can round differently from the same token alone, and a greedy
    near-tie can then flip. Here the window's Q positions run one after another through a
    `jax.lax.map` (a rolled loop, so XLA neither unrolls nor merges the Q copies), each with the
    [B, 1] shapes of a plain decode step: every token meets exactly the algorithms it would meet
    alone. An optimization barrier around fn's inputs and outputs, at every Q (1 included), fixes
    where values are rounded to the model's dtype: without it XLA may keep a bfloat16 result in
    float32 into the next op (excess precision) in one program and not in the other.
    """
    if not enabled:
        return fn(*window_args)
    isolated = lambda *args: jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(args)))
    if jax.tree.leaves(window_args)[0].shape[1] == 1:
        return isolated(*window_args)
    stacked = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0)[:, :, None], window_args)  # [Q, B, 1, ...]
    out = jax.lax.map(lambda args: isolated(*args), stacked)
    return jax.tree.map(lambda y: jnp.moveaxis(y[:, :, 0], 0, 1), out)
