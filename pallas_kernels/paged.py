"""Slot addressing in the paged cache.

A cache array is `[num_pages, page_size, D]`; row b's slot s lives at page
`page_table[b, s // page_size]`, offset `s % page_size`. Slot -1 (padding) and slots past the row's
pages address nothing: reads return zeros, writes are dropped (never wrapped onto another page).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def slot_address(page_table: jax.Array, slots: jax.Array, page_size: int, num_pages: int):
    """page_table [B, M], slots [B, ...] -> (page [B, ...], offset [B, ...], valid [B, ...]).

    Invalid slots get page `num_pages` (out of range, so scatters with mode="drop" skip them).
    """
    max_pages = page_table.shape[1]
    valid = (slots >= 0) & (slots < max_pages * page_size)
    safe = jnp.where(valid, slots, 0)
    flat = safe.reshape(slots.shape[0], -1)
    page = jnp.take_along_axis(page_table, flat // page_size, axis=1).reshape(slots.shape)
    page = jnp.where(valid, page, num_pages)
    return page, safe % page_size, valid


def flat_rows(page_table: jax.Array, slots: jax.Array, page_size: int, num_pages: int):
    """page_table [B, M], slots [B, ...] -> (each slot's row in the pool flattened to
    [P * page, ...], 0 where invalid; valid [B, ...]: the slot is in the row's pages)."""
    page, offset, valid = slot_address(page_table, slots, page_size, num_pages)
    return jnp.where(valid, page * page_size + offset, 0), valid


def selected_rows(page_table: jax.Array, slots: jax.Array, page_size: int, num_pages: int):
    """page_table [B, M], slots [B, ...] -> [B, ...] int32: each slot's row in the pool flattened
    to [P * page, ...] (a page entry past the pool is clamped into it, so a kernel reading the row
    stays in bounds), -1 for a slot that addresses nothing. What the gathering kernels take."""
    rows, valid = flat_rows(page_table, slots, page_size, num_pages)
    return jnp.where(valid, jnp.clip(rows, 0, num_pages * page_size - 1), -1)


def write_slots(cache: jax.Array, page_table: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """cache [P, page, D], slots [B, Q] (-1 = skip), values [B, Q, D] -> updated cache.

    One slot (B = Q = 1, a decode step's token) is written as a dynamic update of its entry with
    the old entry kept where the slot is invalid: the same bits as the scatter, which XLA lowers
    to that update plus two kernels of its own (the scatter's bounds predicate, a read of the old
    entry) where this one fuses into the update."""
    num_pages, page_size, width = cache.shape
    page, offset, valid = slot_address(page_table, slots, page_size, num_pages)
    if slots.size != 1:
        return cache.at[page, offset].set(values.astype(cache.dtype), mode="drop")
    # An invalid slot's page (num_pages) is clamped into the pool: its entry is read and written back.
    start = (jnp.minimum(page, num_pages - 1).reshape(()), offset.reshape(()), 0)
    old = jax.lax.dynamic_slice(cache, start, (1, 1, width))
    new = jnp.where(valid.reshape(()), values.reshape(1, 1, width).astype(cache.dtype), old)
    return jax.lax.dynamic_update_slice(cache, new, start)


def read_slots(cache: jax.Array, page_table: jax.Array, slots: jax.Array) -> jax.Array:
    """cache [P, page, D], slots [B, ...] -> [B, ..., D]; zeros where the slot is invalid."""
    num_pages, page_size, _ = cache.shape
    page, offset, valid = slot_address(page_table, slots, page_size, num_pages)
    values = cache[jnp.minimum(page, num_pages - 1), offset]
    return jnp.where(valid[..., None], values, jnp.zeros((), cache.dtype))


def gather_rows(cache: jax.Array, page_table: jax.Array) -> jax.Array:
    """cache [P, page, D], page_table [B, M] -> every row's slots in order, [B, M * page, D]."""
    rows = cache[page_table]  # [B, M, page, D]
    return rows.reshape(page_table.shape[0], -1, cache.shape[-1])
