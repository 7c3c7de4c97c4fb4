"""DeepSeek-V4 attention: a sliding window over a ring of recent K=V entries, plus compressed entries
(CSA's top-k or HCA's dense prefix) and per-query extra keys, with per-head attention sinks.

Shared-KV multi-query attention: one `[D]` entry per key serves as key and value for all H heads
(D = 512 for V4). Head h of token (b, q) at position p = positions[b, q] scores key k as
`scale * q[b, q, h] . k` over its visible keys:

  * ring slots (the sliding window). Slot s of row b lives at ring index `s % R` of the row's ring
    pages, R = window_pages.shape[1] * page. The token sees a slot s whose key position is in
    `(p - sliding_window, p]` and that is either committed (`s < prefix_len`, key position s) or the
    window slot `prefix_len + j` of one of its ancestors j (chain: j <= q; tree: tree_mask[b, q, j];
    key position positions[b, j]). This is transformers' sliding mask `kv_pos > q_pos - window`.
    The ring needs `R >= sliding_window - 1 + Q` so that the window's own writes never overwrite a
    slot some token of the call can still see (checked, ValueError otherwise);
  * compressed entries: entry numbers `compressed_indices[b, q, :]` (-1 skipped: CSA's indexer
    top-k, already restricted to the entries the token may see) or entries `[0,
    compressed_count[b, q])` (HCA), read through `compressed_pages`; numbers past the row's entry
    pages are skipped;
  * extra keys `extra_kv[b, q, x]` where `extra_valid[b, q, x]` (entries a tree branch closed in the
    window, computed by the caller). With FP8 pools they are read as the entries' pool would store
    them (`contracts.stored_extra_keys`), as FlashMLA takes a call's extra keys in the cache's
    token: a branch then sees the bits a chain call reads back from the pool.

The softmax runs in float32 over those keys plus the head's sink logit, which adds `exp(sink_h)` to
the denominator only (transformers' `eager_attention_forward` for DeepSeek-V4), so a token that
sees no key at all returns 0, as do padding tokens (q >= query_len). The output keeps the rope
dims rotated: the model applies the inverse rotation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .backend import interpret_mode, resolve_backend
from .contracts import check_arguments, stored_extra_keys
from .fp8_cache import as_entries, gather_parts, read_parts
from .visibility import Visibility, query_valid, ring_visible


def _zero_unseen(kv: jax.Array, mask: jax.Array) -> jax.Array:
    """kv [B, Q|1, S, D] with zeros at the keys no token sees (mask [B, Q, S]): those may be stale
    or never-written memory, and a NaN there must not meet a zero probability."""
    seen = jnp.any(mask, axis=1, keepdims=True) if kv.shape[1] == 1 else mask
    return jnp.where(seen[..., None], kv, jnp.zeros((), kv.dtype))


def _scores(q: jax.Array, keys: jax.Array, scale: float) -> jax.Array:
    """q [B, Q, H, D] float32, keys [B, Q|1, S, D] -> scale * q . k, [B, Q, H, S] float32."""
    return jnp.einsum("bqhd,bqsd->bqhs", q, keys.astype(jnp.float32)) * scale


def sliding_compressed_attention_reference(q, window_kv, window_pages, positions, vis: Visibility, sinks, *,
                                           sliding_window: int, scale: float, compressed_kv=None,
                                           compressed_pages=None, compressed_indices=None, compressed_count=None,
                                           extra_kv=None, extra_valid=None):
    """The definition of `sliding_compressed_attention` (pure jnp). Same arguments and result."""
    check_arguments(q, window_kv, window_pages, positions, vis, sinks, sliding_window=sliding_window,
                    compressed_kv=compressed_kv, compressed_pages=compressed_pages,
                    compressed_indices=compressed_indices, compressed_count=compressed_count, extra_kv=extra_kv,
                    extra_valid=extra_valid)
    batch, num_queries = q.shape[:2]
    valid = query_valid(vis, num_queries)[:, :, None]  # [B, Q, 1]
    ring_kv = as_entries(gather_parts(window_kv, window_pages))[:, None]  # [B, 1, R, D]
    keys = [(ring_kv, ring_visible(positions, vis, ring_kv.shape[2], sliding_window=sliding_window))]
    if compressed_indices is not None:
        capacity = compressed_pages.shape[1] * compressed_kv.shape[1]
        entries = as_entries(read_parts(compressed_kv, compressed_pages, compressed_indices.reshape(batch, -1)))
        entries = entries.reshape(*compressed_indices.shape, -1)  # [B, Q, K, D]
        keys.append((entries, (compressed_indices >= 0) & (compressed_indices < capacity) & valid))
    elif compressed_count is not None:
        entries = as_entries(gather_parts(compressed_kv, compressed_pages))[:, None]  # [B, 1, E, D]
        number = jnp.arange(entries.shape[2], dtype=jnp.int32)[None, None, :]
        keys.append((entries, (number < compressed_count[:, :, None]) & valid))
    if extra_kv is not None:
        keys.append((stored_extra_keys(extra_kv, window_kv, compressed_kv), extra_valid & valid))

    keys = [(_zero_unseen(kv, mask), mask) for kv, mask in keys]
    qf = q.astype(jnp.float32)
    scores = jnp.concatenate([_scores(qf, kv, scale) for kv, _ in keys], axis=-1)  # [B, Q, H, S]
    mask = jnp.concatenate([m for _, m in keys], axis=-1)[:, :, None, :]  # [B, Q, 1, S]
    sink = sinks.astype(jnp.float32)[None, None, :, None]  # [1, 1, H, 1]
    row_max = jnp.maximum(jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True), sink)
    probs = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(probs, axis=-1) + jnp.exp(sink - row_max)[..., 0]  # the sink: denominator only
    values = [jnp.einsum("bqhs,bqsd->bqhd", p, kv.astype(jnp.float32))
              for p, (kv, _) in zip(jnp.split(probs, _offsets(keys), axis=-1), keys)]
    return (sum(values) / denom[..., None]).astype(q.dtype)


def _offsets(keys) -> list[int]:
    """Split points of the concatenated key axis between the key sets."""
    sizes = [kv.shape[2] for kv, _ in keys]
    return [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]


def sliding_compressed_attention(q, window_kv, window_pages, positions, vis: Visibility, sinks, *,
                                 sliding_window: int, scale: float, compressed_kv=None, compressed_pages=None,
                                 compressed_indices=None, compressed_count=None, extra_kv=None, extra_valid=None,
                                 backend: str = "auto"):
    """DeepSeek-V4 shared-KV attention over the sliding-window ring, compressed entries and extra keys.

    Args:
      q: [B, Q, H, D] queries (after q_b_norm and RoPE on their last rope dims).
      window_kv: [P, page, D] the ring pages (K = V, after kv_norm and RoPE), or an
        `fp8_cache.Fp8Pool` of that shape (FlashMLA's MODEL1 token, read as `fp8_cache.entries`;
        compressed_kv alike).
      window_pages: [B, R // page] int32, the ring's page table; R >= sliding_window - 1 + Q.
      positions: [B, Q] int32, each token's position (slot = position for committed tokens and a
        chain; prefix_len + depth in a tree).
      vis: Visibility(prefix_len [B], query_len [B], tree_mask [B, Q, Q] or None).
      sinks: [H] per-head attention-sink logits.
      sliding_window: keys at positions in (p - sliding_window, p] are in the window.
      scale: multiplies the scores.
      compressed_kv: [Pc, page, D] compressed entries (K = V), or None for a sliding-only layer;
        compressed_pages: [B, E // page] int32; exactly one of compressed_indices [B, Q, K] int32
        (entry numbers, -1 = skip: CSA) and compressed_count [B, Q] int32 (entries [0, count): HCA).
      extra_kv: [B, Q, X, D] per-query extra keys with extra_valid [B, Q, X] bool (trees), or None;
        with FP8 pools read as stored (`contracts.stored_extra_keys`).
      backend: "xla" (reference), "pallas" (Triton), "mosaic" (Mosaic GPU: bfloat16 / float16, D a
        multiple of 128, the ring and entries both FP8 pools or neither) or "auto"
        (`backend.resolve_backend`).

    Returns:
      [B, Q, H, D] in q's dtype; 0 for padding tokens and tokens that see no key.
    """
    kwargs = dict(sliding_window=sliding_window, scale=scale, compressed_kv=compressed_kv,
                  compressed_pages=compressed_pages, compressed_indices=compressed_indices,
                  compressed_count=compressed_count, extra_kv=extra_kv, extra_valid=extra_valid)
    check_arguments(q, window_kv, window_pages, positions, vis, sinks,
                    **{k: v for k, v in kwargs.items() if k != "scale"})
    implementation = resolve_backend(backend, "sliding_compressed_attention")
    if implementation == "mosaic":
        from .sliding_compressed_attention_mosaic import sliding_compressed_attention_mosaic
        return sliding_compressed_attention_mosaic(q, window_kv, window_pages, positions, vis, sinks,
                                                   interpret=interpret_mode(), **kwargs)
    if implementation == "pallas":
        from .sliding_compressed_attention_pallas import sliding_compressed_attention_pallas
        return sliding_compressed_attention_pallas(q, window_kv, window_pages, positions, vis, sinks,
                                                   interpret=interpret_mode(), **kwargs)
    return sliding_compressed_attention_reference(q, window_kv, window_pages, positions, vis, sinks, **kwargs)
