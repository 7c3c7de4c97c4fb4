"""Per-token visibility over the paged cache: the data model every kernel shares.

A model call sees a window of `Q` tokens per row. The window is laid out in the row's cache right
after its committed prefix: window token q of row b is written to slot `prefix_len[b] + q`. Token
(b, q) with q < query_len[b] sees

  * every prefix slot `[0, prefix_len[b])`, and
  * the window slots of its ancestors, itself included: for a chain (tree_mask None) the ancestors
    of q are {0..q}; for a tree, `tree_mask[b, q, j]` says whether window token j is an ancestor of q.

Tokens q >= query_len[b] are padding: they see nothing and write nothing. Trees must list parents
before children (so every ancestor j of q has j <= q, and `prefix_len + q + 1` bounds what any token
can see); `tree_mask[b, q, q]` must be True for valid tokens.

Slot counts. A pool the window does not write to, such as DeepSeek-V4's compressed entries (entry j
is visible to position p iff (j + 1) m - 1 <= p), is seen through per-token counts instead:
counts [B, Q] int32, token (b, q) sees slots [0, counts[b, q]), 0 for padding. `kv_bound` and
`visible_mask` take either form (`VisibleSlots`); `indexer_topk` scores over both.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Visibility(NamedTuple):
    """prefix_len [B] int32, query_len [B] int32, tree_mask [B, Q, Q] bool or None (= chain)."""

    prefix_len: jax.Array
    query_len: jax.Array
    tree_mask: jax.Array | None = None


# What a scoring op may be told about the slots each token sees: the window's `Visibility`, or
# per-token slot counts [B, Q] int32 (the module docstring).
VisibleSlots = Visibility | jax.Array


def slot_counts(vis: VisibleSlots) -> bool:
    """Whether `vis` is slot counts [B, Q] rather than a window's `Visibility` (static)."""
    return not isinstance(vis, Visibility)


def tree_mask_of(vis: VisibleSlots) -> jax.Array | None:
    """The tree mask [B, Q, Q] of a tree's `Visibility`; None for a chain and for slot counts."""
    return None if slot_counts(vis) else vis.tree_mask


def query_valid(vis: Visibility, num_queries: int) -> jax.Array:
    """[B, Q] bool: the window token is real (not padding)."""
    q = jnp.arange(num_queries, dtype=jnp.int32)
    return q[None, :] < vis.query_len[:, None]


def window_slots(vis: Visibility, num_queries: int) -> jax.Array:
    """[B, Q] int32: the cache slot each window token writes (`prefix_len + q`), -1 for padding."""
    q = jnp.arange(num_queries, dtype=jnp.int32)
    return jnp.where(query_valid(vis, num_queries), vis.prefix_len[:, None] + q[None, :], -1)


def kv_bound(vis: VisibleSlots, num_queries: int) -> jax.Array:
    """[B, Q] int32: exclusive upper bound of the slots a token may see (0 for padding).

    For a chain this is the whole visibility (`prefix_len + q + 1`); for a tree it is a bound the
    kernels use to skip pages, refined by the mask inside the window. Slot counts are their own
    bound (negative counts read as 0).
    """
    if slot_counts(vis):
        return jnp.maximum(vis.astype(jnp.int32), 0)
    q = jnp.arange(num_queries, dtype=jnp.int32)
    return slot_bound(vis.prefix_len[:, None], vis.query_len[:, None], q[None, :])


def slot_bound(prefix_len, query_len, q):
    """Window token q's exclusive slot bound, elementwise over broadcastable int32 arrays:
    prefix_len + q + 1 for a real token (q < query_len), 0 for padding. The one definition that
    `kv_bound` and the kernels computing their tokens' bounds (`tiling.token_bounds`) share."""
    return jnp.where(q < query_len, jnp.maximum(prefix_len + q + 1, 0), 0)


def visible_mask(vis: VisibleSlots, num_queries: int, num_slots: int) -> jax.Array:
    """[B, Q, S] bool: token (b, q) sees slot s. The dense definition the kernels must equal."""
    s = jnp.arange(num_slots, dtype=jnp.int32)[None, None, :]
    if slot_counts(vis):
        return s < kv_bound(vis, num_queries)[:, :, None]
    prefix = vis.prefix_len[:, None, None]
    bound = kv_bound(vis, num_queries)[:, :, None]
    mask = (s < bound) & query_valid(vis, num_queries)[:, :, None]
    if vis.tree_mask is None:
        return mask
    in_window = s - prefix  # window index of slot s (negative in the prefix)
    idx = jnp.clip(in_window, 0, num_queries - 1)
    ancestor = jnp.take_along_axis(vis.tree_mask, jnp.broadcast_to(idx, vis.tree_mask.shape[:2] + (num_slots,)), axis=2)
    return mask & ((in_window < 0) | ancestor)


def ancestor_slots(vis: Visibility, num_queries: int, num_slots: int) -> jax.Array:
    """[B, Q, S] int32: for token (b, q), the cache slot of each entry it sees, in the order plain
    decoding would have stored them: the prefix slots `0 .. prefix_len - 1`, then its window
    ancestors in window (= depth) order, itself last; -1 after that, and everywhere for padding.

    It is the layout the same token would see if its ancestors had been decoded one by one, which
    is what window-invariant attention reads (`jaxspec.models.mla`): a tree node's ancestors sit at
    scattered window slots, and a reduction that met them at other positions than plain decoding
    does could round differently. For a chain it is the identity on `[0, prefix_len + q]`.
    """
    s = jnp.arange(num_slots, dtype=jnp.int32)
    valid = query_valid(vis, num_queries)[:, :, None]
    prefix = vis.prefix_len[:, None, None]
    if vis.tree_mask is None:
        return jnp.where(valid & (s < kv_bound(vis, num_queries)[:, :, None]), s, -1)
    in_prefix = jnp.where(valid & (s < prefix), s, -1)
    ancestor = vis.tree_mask & valid
    rank = jnp.cumsum(ancestor, axis=-1, dtype=jnp.int32) - 1  # j's place among q's ancestors
    target = jnp.where(ancestor, prefix + rank, num_slots)  # dropped where j is no ancestor
    window = prefix + jnp.arange(num_queries, dtype=jnp.int32)[None, None, :]
    batch, queries = jnp.indices(ancestor.shape[:2])
    return in_prefix.at[batch[..., None], queries[..., None], target].set(window, mode="drop")


def ring_visible(positions: jax.Array, vis: Visibility, ring: int, *, sliding_window: int) -> jax.Array:
    """[B, Q, R] bool: token (b, q) sees the entry at ring index r of a sliding-window ring
    (`sliding_compressed_attention`'s contract: slot s at ring index s % R, seen when committed or
    an ancestor's window slot, and its key position within `sliding_window` of the token's).

    Ring index r holds the newest slot `s_r = r (mod R)` below `prefix_len + Q` (the call's writes
    end there); R >= sliding_window - 1 + Q makes every slot a token may see one of those.
    """
    num_queries = positions.shape[1]
    r = jnp.arange(ring, dtype=jnp.int32)[None, None, :]
    prefix = vis.prefix_len[:, None, None]
    end = prefix + num_queries
    slot = r + ring * jnp.floor_divide(end - 1 - r, ring)  # [B, 1, R], may be < 0 (never written)
    window = slot - prefix  # window index of the slot; negative for committed slots
    j = jnp.clip(window, 0, num_queries - 1)
    ancestor = window <= jnp.arange(num_queries, dtype=jnp.int32)[None, :, None]  # trees list parents first
    if vis.tree_mask is not None:
        ancestor &= jnp.take_along_axis(vis.tree_mask, jnp.broadcast_to(j, vis.tree_mask.shape[:2] + (ring,)), axis=2)
    in_window = ancestor & (window < vis.query_len[:, None, None])
    key_position = jnp.where(window < 0, slot, jnp.take_along_axis(positions, j[:, 0], axis=1)[:, None, :])
    recent = key_position > positions[:, :, None] - sliding_window
    return (slot >= 0) & jnp.where(window < 0, True, in_window) & recent & query_valid(vis, num_queries)[:, :, None]
