"""Absorbed MLA attention over the paged latent cache.

Each cache entry is `[latent (Dl) | rope key (Dr)]` (512 + 64 for DeepSeek), shared by all heads.
With the key up-projection absorbed into the query, head h of token (b, q) scores slot s as

    score = softmax_scale * (q_nope_absorbed[b,q,h] . latent[s] + q_rope[b,q,h] . rope_key[s])

and its output is the softmax-weighted sum of `latent[s]` over the visible slots (see
`visibility.py`). The caller projects that `[Dl]` output through the value up-projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .backend import interpret_mode, resolve_backend
from .contracts import EMPTY_LSE
from .fp8_cache import as_entries, gather_parts
from .visibility import Visibility, visible_mask


def attend_latent(q_nope: jax.Array, q_rope: jax.Array, kv: jax.Array, mask: jax.Array,
                  softmax_scale: float) -> tuple[jax.Array, jax.Array]:
    """Masked softmax attention of absorbed queries over gathered latent entries.

    q_nope [B, Q, H, Dl], q_rope [B, Q, H, Dr], kv [B, Q|1, S, Dl + Dr], mask [B, Q, S] bool
    -> out [B, Q, H, Dl] (q_nope.dtype), lse [B, Q, H] float32. Computed in float32.
    """
    dl = q_nope.shape[-1]
    kv = kv.astype(jnp.float32)
    scores = (jnp.einsum("bqhd,bqsd->bqhs", q_nope.astype(jnp.float32), kv[..., :dl])
              + jnp.einsum("bqhd,bqsd->bqhs", q_rope.astype(jnp.float32), kv[..., dl:])) * softmax_scale
    mask = mask[:, :, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(probs, axis=-1)
    out = jnp.einsum("bqhs,bqsd->bqhd", probs, kv[..., :dl]) / jnp.where(denom > 0, denom, 1.0)[..., None]
    lse = jnp.where(denom > 0, row_max[..., 0] + jnp.log(jnp.where(denom > 0, denom, 1.0)), EMPTY_LSE)
    return out.astype(q_nope.dtype), lse


def mla_attention_reference(q_nope: jax.Array, q_rope: jax.Array, latent_cache: jax.Array,
                            page_table: jax.Array, vis: Visibility, *, softmax_scale: float):
    """The definition of `mla_attention` (pure jnp). Same arguments and results."""
    kv = as_entries(gather_parts(latent_cache, page_table))[:, None]  # [B, 1, S, Dl + Dr]
    mask = visible_mask(vis, q_nope.shape[1], kv.shape[2])
    return attend_latent(q_nope, q_rope, kv, mask, softmax_scale)


def mla_attention_backend(backend: str, q_nope, q_rope, latent_cache, page_table) -> str:
    """The implementation `mla_attention` runs for these operands (arrays or `jax.ShapeDtypeStruct`s
    of its arguments): `resolve_backend`'s, except that where "auto" names the Mosaic kernel
    (`AUTO_KERNELS`) but that kernel does not take the operands (float32, a latent not a multiple
    of 128, pages not a multiple of 64), "auto" runs the Triton kernel: the measurement that chose
    Mosaic was of DeepSeek's widths in bfloat16, and a model outside them should still run. An
    explicit "mosaic" raises for such operands instead (`mla_attention_mosaic.check_operands`)."""
    implementation = resolve_backend(backend, "mla_attention")
    if backend == "auto" and implementation == "mosaic":
        from .mla_attention_mosaic import accepts
        if not accepts(q_nope, q_rope, latent_cache, page_table):
            return "pallas"
    return implementation


def mla_attention(q_nope: jax.Array, q_rope: jax.Array, latent_cache: jax.Array, page_table: jax.Array,
                  vis: Visibility, *, softmax_scale: float, backend: str = "auto"):
    """Absorbed MLA attention of a `[B, Q]` window over the paged latent cache.

    Args:
      q_nope: [B, Q, H, Dl] queries with the key up-projection absorbed (Dl = kv_lora_rank).
      q_rope: [B, Q, H, Dr] rotated RoPE part of the queries.
      latent_cache: [num_pages, page_size, Dl + Dr] one layer's cache (window already written), or
        an `fp8_cache.Fp8Pool` of that shape (FlashMLA's FP8 token), dequantized as it is read
        (on "mosaic", Dl must then be 512).
      page_table: [B, max_pages] int32.
      vis: per-token visibility (prefix, window length, optional tree mask).
      softmax_scale: multiplies the scores before the softmax.
      backend: "xla" (reference), "pallas" (Triton), "mosaic" (Mosaic GPU: bfloat16, Dl a multiple
        of 128, Dr of 64, pages of a multiple of 64 slots) or "auto" (`backend.resolve_backend`).

    Returns:
      out [B, Q, H, Dl] in q_nope's dtype (zeros for padding tokens) and lse [B, Q, H] float32
      (`EMPTY_LSE` for padding tokens).
    """
    implementation = mla_attention_backend(backend, q_nope, q_rope, latent_cache, page_table)
    if implementation == "pallas":
        from .mla_attention_pallas import mla_attention_pallas
        return mla_attention_pallas(q_nope, q_rope, latent_cache, page_table, vis, softmax_scale=softmax_scale,
                                    interpret=interpret_mode())
    if implementation == "mosaic":
        from .mla_attention_mosaic import mla_attention_mosaic
        return mla_attention_mosaic(q_nope, q_rope, latent_cache, page_table, vis, softmax_scale=softmax_scale,
                                    interpret=interpret_mode())
    return mla_attention_reference(q_nope, q_rope, latent_cache, page_table, vis, softmax_scale=softmax_scale)
