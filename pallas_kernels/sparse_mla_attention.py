"""MLA attention over a selected set of slots per query token (DSA sparse attention).

Same math as `mla_attention`, but token (b, q) attends only to the slots `indices[b, q, :]`
chosen by the indexer (`-1` entries skipped); all heads of a token share its index set. Visibility
is already folded into the indices: the indexer only selects visible slots.
"""

from __future__ import annotations

import jax

from .backend import interpret_mode, resolve_backend
from .fp8_cache import as_entries, read_parts
from .mla_attention import attend_latent


def sparse_mla_attention_reference(q_nope: jax.Array, q_rope: jax.Array, latent_cache: jax.Array,
                                   page_table: jax.Array, indices: jax.Array, *, softmax_scale: float):
    """The definition of `sparse_mla_attention` (pure jnp). Same arguments and results."""
    batch, num_queries, topk = indices.shape
    kv = as_entries(read_parts(latent_cache, page_table, indices.reshape(batch, num_queries * topk)))
    kv = kv.reshape(batch, num_queries, topk, latent_cache.shape[-1])  # [B, Q, K, Dl + Dr]
    capacity = page_table.shape[1] * latent_cache.shape[1]
    return attend_latent(q_nope, q_rope, kv, (indices >= 0) & (indices < capacity), softmax_scale)


def sparse_mla_attention(q_nope: jax.Array, q_rope: jax.Array, latent_cache: jax.Array, page_table: jax.Array,
                         indices: jax.Array, *, softmax_scale: float, backend: str = "auto"):
    """Absorbed MLA attention of each query token over its own selected slots.

    Args:
      q_nope: [B, Q, H, Dl] absorbed queries; q_rope: [B, Q, H, Dr].
      latent_cache: [num_pages, page_size, Dl + Dr] or an `fp8_cache.Fp8Pool` of that shape
        (dequantized as it is read); page_table: [B, max_pages] int32.
      indices: [B, Q, K] int32 slots to attend (row-local slot numbers); -1, and any slot past the
        row's pages, is skipped.
      softmax_scale: multiplies the scores; backend: "xla", "pallas", "mosaic" or "auto"
        (`backend.resolve_backend`).

    Returns:
      out [B, Q, H, Dl] (zeros where a token selects nothing) and lse [B, Q, H] float32.
    """
    implementation = resolve_backend(backend, "sparse_mla_attention")
    if implementation == "mosaic":
        from .sparse_mla_attention_mosaic import sparse_mla_attention_mosaic
        return sparse_mla_attention_mosaic(q_nope, q_rope, latent_cache, page_table, indices,
                                           softmax_scale=softmax_scale, interpret=interpret_mode())
    if implementation == "pallas":
        from .sparse_mla_attention_pallas import sparse_mla_attention_pallas
        return sparse_mla_attention_pallas(q_nope, q_rope, latent_cache, page_table, indices,
                                           softmax_scale=softmax_scale, interpret=interpret_mode())
    return sparse_mla_attention_reference(q_nope, q_rope, latent_cache, page_table, indices,
                                          softmax_scale=softmax_scale)
