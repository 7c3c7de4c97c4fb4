"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): `hc_mult` residual streams.

The residual of a V4 model is N = `hc_mult` streams [B, Q, N, D]. Around each block (attention, then
MoE) a `HyperConnection` computes three per-token weights from the streams (transformers 5.23
`DeepseekV4HyperConnection`, parameter names and layouts as there):

  mixes        = rms(flatten(streams)) @ fn.T              fn [(2 + N) * N, N * D], float32
  pre  [N]     = sigmoid(mixes[:N] * scale[0] + base[:N]) + hc_eps
  post [N]     = 2 * sigmoid(mixes[N:2N] * scale[1] + base[N:2N])
  comb [N, N]  = Sinkhorn(softmax(mixes[2N:] * scale[2] + base[2N:]) + hc_eps)   (doubly stochastic)

The block sees the collapsed stream sum_n pre[n] * streams[n]; its output y goes back as
streams'[n] = post[n] * y + sum_j comb[j, n] * streams[j] (`merge`). After the last layer a
`HyperHead` (transformers' `DeepseekV4HyperHead`) collapses the streams into one with its own
sigmoid weights, before the final norm.

All of it is per token (no mixing across positions), in float32 up to the casts transformers does:
the collapsed input and the merged streams are in the streams' dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model_config import ModelConfig
from jaxspec.pallas_kernels import sinkhorn

from .layers import param, unit_rms_norm


def _collapse(weights: jax.Array, streams: jax.Array) -> jax.Array:
    """weights [B, Q, N] float32, streams [B, Q, N, D] -> sum_n weights[n] * streams[n] [B, Q, D],
    in float32 then cast to the streams' dtype (as transformers' float32 weights promote it)."""
    return jnp.sum(weights[..., None] * streams.astype(jnp.float32), axis=2).astype(streams.dtype)


def _mixes(streams: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    """streams [B, Q, N, D] -> rms(flatten(streams)) @ fn.T [B, Q, M], float32."""
    flat = streams.reshape(*streams.shape[:2], -1).astype(jnp.float32)
    return unit_rms_norm(flat, eps) @ fn.astype(jnp.float32).T


class HyperConnection(nnx.Module):
    """One mHC site (`attn_hc` or `ffn_hc` of a layer). Parameters, float32 (transformers keeps
    them so): fn [(2 + N) * N, N * D], base [(2 + N) * N], scale [3]; replicated (no axis is
    sharded: 24 x 28672 numbers per site at V4-Pro)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        n, dim = config.hc_mult, config.hidden_size
        mix = (2 + n) * n
        self.fn = param(nnx.initializers.normal((n * dim) ** -0.5)(rngs.params(), (mix, n * dim), jnp.float32),
                        None, None)
        self.base = param(jnp.zeros((mix,), jnp.float32), None)
        self.scale = param(jnp.ones((3,), jnp.float32), None)
        self.hc_mult, self.iters, self.hc_eps, self.norm_eps = n, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps

    def __call__(self, streams: jax.Array, *, backend: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
        """streams [B, Q, N, D] -> (post [B, Q, N] float32, comb [B, Q, N, N] float32, the collapsed
        block input [B, Q, D] in the streams' dtype). backend: the Sinkhorn rounds' (`sinkhorn`)."""
        n = self.hc_mult
        mixes = _mixes(streams, self.fn[...], self.norm_eps)
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + self.hc_eps
        post = 2 * jax.nn.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
        logits = mixes[..., 2 * n:] * scale[2] + base[2 * n:]
        comb = jax.nn.softmax(logits.reshape(*logits.shape[:-1], n, n), axis=-1) + self.hc_eps
        return post, sinkhorn(comb, self.iters, self.hc_eps, backend=backend), _collapse(pre, streams)

    @staticmethod
    def merge(post: jax.Array, comb: jax.Array, block_out: jax.Array, streams: jax.Array) -> jax.Array:
        """post [B, Q, N], comb [B, Q, N, N], block_out [B, Q, D], streams [B, Q, N, D] -> the new
        streams [B, Q, N, D]: post[n] * block_out + sum_j comb[j, n] * streams[j], in the streams'
        dtype (transformers casts post and comb to it first)."""
        dtype = streams.dtype
        mixed = jnp.einsum("bqjn,bqjd->bqnd", comb.astype(dtype), streams)
        return post.astype(dtype)[..., None] * block_out.astype(dtype)[..., None, :] + mixed


class HyperHead(nnx.Module):
    """The final collapse of the streams (`hc_head`): hc_fn [N, N * D], hc_base [N], hc_scale [1],
    float32, replicated."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        n, dim = config.hc_mult, config.hidden_size
        self.hc_fn = param(nnx.initializers.normal((n * dim) ** -0.5)(rngs.params(), (n, n * dim), jnp.float32),
                           None, None)
        self.hc_base = param(jnp.zeros((n,), jnp.float32), None)
        self.hc_scale = param(jnp.ones((1,), jnp.float32), None)
        self.hc_eps, self.norm_eps = config.hc_eps, config.rms_norm_eps

    def __call__(self, streams: jax.Array) -> jax.Array:
        """streams [B, Q, N, D] -> [B, Q, D] in the streams' dtype."""
        mixes = _mixes(streams, self.hc_fn[...], self.norm_eps)
        pre = jax.nn.sigmoid(mixes * self.hc_scale[...] + self.hc_base[...]) + self.hc_eps
        return _collapse(pre, streams)
