"""The DeepSeek-V3.2 lightning indexer (DSA): picks, per query token, the slots MLA attends.

  q_idx   = wq_b(q_latent)                      [B, Q, Hi, Di], first Dr dims rotated (half-split)
  key     = k_norm(wk(x))                       [B, Q, Di], first Dr dims rotated, cached per slot
  weights = weights_proj(x) * Hi^-0.5 * Di^-0.5  [B, Q, Hi]
  score(s) = sum_h weights[h] * relu(q_idx[h] . key[s]);  indices = top-`index_topk` visible slots

DeepSeek's release also applies a Hadamard rotation to q_idx and key before quantizing them to FP8.
An orthogonal rotation of both sides leaves every dot product unchanged, so with a compute-dtype key
cache it is omitted. With an FP8 key cache (`cache_dtype="fp8"`) selection is DeepSeek's
(V3.2-Exp `inference/model.py`, `Indexer.forward`): keys and queries rotated
(`fp8_cache.rotate`), quantized per 128 values (`fp8_cache.quantize_act`: power-of-two scales
where the config sets `scale_fmt` "ue8m0", as V3.2's does), the query scales folded into the weights
(`fp8_cache.fp8_index_queries`), and the scores taken from the FP8 values (`indexer.score_keys`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model_config import ModelConfig
from jaxspec.pallas_kernels import Visibility, indexer_topk
from jaxspec.pallas_kernels.fp8_cache import INDEX_RULE, fp8_index_queries, key_rule, rotate

from .layers import LayerNorm, Linear, compute_dtype
from .rope import apply_rope


class Indexer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        heads, head_dim = config.index_n_heads, config.index_head_dim
        linear = functools.partial(Linear, rngs=rngs, dtype=dtype, scale_fmt=config.scale_fmt)
        self.wq_b = linear(config.q_lora_rank, heads * head_dim, names=("q_lora", "index_heads"))
        self.wk = linear(config.hidden_size, head_dim, names=("embed", None))
        self.k_norm = LayerNorm(head_dim, dtype=dtype)
        # Not quantized in DeepSeek's FP8 checkpoints (jaxspec.fp8).
        self.weights_proj = Linear(config.hidden_size, heads, rngs=rngs, dtype=compute_dtype(dtype),
                                   names=("embed", "index_heads"))

    def _rotate(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        rope_dim = self.config.qk_rope_head_dim
        return jnp.concatenate([apply_rope(x[..., :rope_dim], cos, sin, interleaved=False), x[..., rope_dim:]], axis=-1)

    def keys(self, x: jax.Array, cos: jax.Array, sin: jax.Array, *, backend: str, fp8: bool = False) -> jax.Array:
        """x [B, Q, D] -> the window's indexer keys [B, Q, Di] (to be written to the cache;
        fp8: Hadamard-rotated for an FP8 key cache, which quantizes them as it stores them).
        backend: the model call's, for `wk` (`Linear`)."""
        keys = self._rotate(self.k_norm(self.wk(x, backend=backend)), cos, sin)
        return rotate(keys) if fp8 else keys

    def queries(self, x: jax.Array, q_latent: jax.Array, cos: jax.Array, sin: jax.Array, *, backend: str,
                key_rule: str | None = None):
        """The token-local part of selection: x [B, Q, D], q_latent [B, Q, q_lora_rank]
        -> (q_idx [B, Q, Hi, Di] rotated, weights [B, Q, Hi] float32, scaled). key_rule: the FP8 key
        cache's `Fp8Pool.rule` (None: keys in the compute dtype); with one, q_idx is
        Hadamard-rotated and quantized to e4m3 by the keys' scale rule (powers of two or not), its
        scale folded into the weights: queries and keys then always share the rule. backend: the
        model call's, for `wq_b`; `weights_proj` multiplies float32 inputs, which only XLA's dot takes."""
        batch, num_queries, _ = x.shape
        heads, head_dim = self.config.index_n_heads, self.config.index_head_dim
        q_idx = self.wq_b(q_latent, backend=backend).reshape(batch, num_queries, heads, head_dim)
        q_idx = self._rotate(q_idx, cos, sin)
        weights = self.weights_proj(x.astype(jnp.float32), backend="xla")
        if key_rule is None:
            return q_idx, weights * (heads ** -0.5 * head_dim ** -0.5)
        return fp8_index_queries(q_idx, weights, pow2_scales=key_rule == INDEX_RULE)

    def select(self, x: jax.Array, q_latent: jax.Array, cos: jax.Array, sin: jax.Array, key_cache: jax.Array,
               page_table: jax.Array, vis: Visibility, *, backend: str) -> jax.Array:
        """x [B, Q, D], q_latent [B, Q, q_lora_rank], key_cache holding the window's keys
        -> indices [B, Q, index_topk] int32 (-1 padded). An FP8 key cache selects as DeepSeek's release does."""
        q_idx, weights = self.queries(x, q_latent, cos, sin, backend=backend, key_rule=key_rule(key_cache))
        return indexer_topk(q_idx, weights, key_cache, page_table, vis, topk=self.config.index_topk, backend=backend)
