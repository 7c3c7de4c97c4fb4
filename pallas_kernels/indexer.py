"""The DeepSeek-V3.2 lightning indexer: per-token scores over visible slots, then top-k.

    I[b, q, s] = sum_h weights[b, q, h] * relu(q_idx[b, q, h] . key[s])

for every slot s that token (b, q) sees; the `topk` best slots feed sparse MLA. The query and key
rotations, the weight scaling (`index_n_heads**-0.5 * index_head_dim**-0.5`) and the key cache
writes belong to the model; this op only scores and selects.

With FP8 indexer keys (an `fp8_cache.Fp8Pool`: e4m3 keys, one float32 scale each) the queries are
e4m3 too and the weights carry their scales; the score is DeepSeek's `fp8_index`
(V3.2-Exp `inference/kernel.py`): float32 dots of the e4m3 values, ReLU, times the weights, summed
over heads, times the key's scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .backend import interpret_mode, resolve_backend
from .contracts import select_topk
from .fp8_cache import Fp8Pool, gather_parts
from .visibility import VisibleSlots, visible_mask


def indexer_scores_reference(q_idx: jax.Array, weights: jax.Array, key_cache: jax.Array,
                             page_table: jax.Array, vis: VisibleSlots) -> jax.Array:
    """q_idx [B, Q, Hi, Di], weights [B, Q, Hi], key_cache [P, page, Di] (or an FP8 pool of it),
    vis a `Visibility` or slot counts [B, Q] -> scores [B, Q, S] float32.

    S = max_pages * page_size; invisible slots score -inf. Computed in float32.
    """
    keys = gather_parts(key_cache, page_table)  # [B, S, Di]
    return score_keys(q_idx, weights, keys, visible_mask(vis, q_idx.shape[1], keys.shape[1]))


def score_keys(q_idx: jax.Array, weights: jax.Array, keys, mask: jax.Array) -> jax.Array:
    """The score itself, over gathered keys: q_idx [B, Q, Hi, Di], weights [B, Q, Hi], keys [B, S, Di]
    (or an `Fp8Pool` of e4m3 keys [B, S, Di] and their scales [B, S, 1], scored as `fp8_index`),
    mask [B, Q, S] bool -> scores [B, Q, S] float32, -inf where mask is False."""
    values = keys.values if isinstance(keys, Fp8Pool) else keys
    logits = jnp.einsum("bqhd,bsd->bqhs", q_idx.astype(jnp.float32), values.astype(jnp.float32))
    scores = jnp.einsum("bqhs,bqh->bqs", jax.nn.relu(logits), weights.astype(jnp.float32))
    if isinstance(keys, Fp8Pool):
        scores = scores * keys.scales[:, None, :, 0]
    return jnp.where(mask, scores, -jnp.inf)


def indexer_topk_reference(q_idx, weights, key_cache, page_table, vis, *, topk: int) -> jax.Array:
    """The definition of `indexer_topk` (pure jnp). Same arguments and result."""
    return select_topk(indexer_scores_reference(q_idx, weights, key_cache, page_table, vis), topk)


def indexer_topk(q_idx: jax.Array, weights: jax.Array, key_cache: jax.Array, page_table: jax.Array,
                 vis: VisibleSlots, *, topk: int, backend: str = "auto") -> jax.Array:
    """Select the `topk` visible slots with the highest indexer score, per query token.

    Args:
      q_idx: [B, Q, Hi, Di] indexer queries (rotated); weights: [B, Q, Hi] per-head weights.
      key_cache: [num_pages, page_size, Di] one layer's indexer keys, or an `fp8_cache.Fp8Pool` of
        them (then q_idx is e4m3 and weights carry the query scales: `models.indexer`);
        page_table: [B, max_pages].
      vis: per-token visibility, or slot counts [B, Q] int32 (token (b, q) sees slots
        [0, counts[b, q]): DeepSeek-V4's compressed entries; `visibility.VisibleSlots`);
      topk: slots to keep; backend: "xla", "pallas", "mosaic" or "auto" (`backend.resolve_backend`).

    Returns:
      indices [B, Q, topk] int32 row-local slots, best first; -1 where fewer than topk are visible.
    """
    return select_topk(indexer_scores(q_idx, weights, key_cache, page_table, vis, backend=backend), topk)


def indexer_scores(q_idx: jax.Array, weights: jax.Array, key_cache: jax.Array, page_table: jax.Array,
                   vis: VisibleSlots, *, backend: str = "auto") -> jax.Array:
    """The scores `indexer_topk` selects from: same arguments -> [B, Q, S] float32, -inf where not
    visible (`indexer_scores_reference`). Every implementation computes the whole score matrix and
    selects with `select_topk`, so a caller that ranks further keys beside the cached ones (V4's
    tree windows) takes the scores themselves. backend: as `indexer_topk`'s, the same op."""
    implementation = resolve_backend(backend, "indexer_topk")
    if implementation == "mosaic":
        from .indexer_mosaic import indexer_scores_mosaic
        return indexer_scores_mosaic(q_idx, weights, key_cache, page_table, vis, interpret=interpret_mode())
    if implementation == "pallas":
        from .indexer_pallas import indexer_scores_pallas
        return indexer_scores_pallas(q_idx, weights, key_cache, page_table, vis, interpret=interpret_mode())
    return indexer_scores_reference(q_idx, weights, key_cache, page_table, vis)
