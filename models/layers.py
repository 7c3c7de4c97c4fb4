"""Small building blocks: linear layers, RMSNorm, LayerNorm and the SwiGLU MLP.

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
