"""The paged cache: MLA latents (and DSA indexer keys) per layer, a page table and row lengths.

One `PagedCache` serves the target model and another (one layer) the MTP module. Rows own pages
through `page_table`; the slot arithmetic lives in `jaxspec.pallas_kernels.paged`. Rejected draft
entries are never erased: `lengths` decides what is committed, and later writes overwrite the rest.
A tree's accepted path is made contiguous with `PagedCache.move`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.pallas_kernels.fp8_cache import (INDEX_RULE, LATENT_RULE, Fp8Pool, check_cache_dtype, init_pool,
                                              write_entries)
from jaxspec.pallas_kernels.paged import read_slots, write_slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """latent: per layer [num_pages, page_size, kv_lora_rank + qk_rope_head_dim];
    index_keys: per layer [num_pages, page_size, index_head_dim] (empty tuple without DSA);
    page_table: [B, max_pages_per_row] int32; lengths: [B] int32 committed tokens per row.
    With FP8 caches (`init_cache(cache_dtype="fp8")`) each layer's latent and keys are an
    `Fp8Pool` of the same logical shape (`jaxspec.pallas_kernels.fp8_cache`)."""

    latent: tuple[jax.Array | Fp8Pool, ...]
    index_keys: tuple[jax.Array | Fp8Pool, ...]
    page_table: jax.Array
    lengths: jax.Array

    @property
    def page_size(self) -> int:
        return self.latent[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]

    @property
    def capacity(self) -> int:
        """Slots per row: the longest sequence (committed plus window) a row can hold."""
        return self.page_table.shape[1] * self.page_size

    def replace(self, **changes) -> "PagedCache":
        return dataclasses.replace(self, **changes)

    def commit(self, lengths: jax.Array) -> "PagedCache":
        """This cache with committed lengths [B] set: entries below them become visible."""
        return self.replace(lengths=lengths)

    def partition_specs(self, rows):
        """A `PartitionSpec` per leaf: every page pool split by pages like `rows`, the spec of an
        array whose leading axis is rows (each device holds its own rows' pages, `init_cache(row_shards=)`),
        the page table and lengths by rows."""
        return jax.tree.map(lambda _: rows, self)

    def write(self, layer: int, slots: jax.Array, latent: jax.Array, index_key: jax.Array | None = None):
        """Write one layer's window entries: slots [B, Q] (-1 = skip), latent [B, Q, Dc], index_key [B, Q, Di]
        (an FP8 pool quantizes them per token: `fp8_cache.write_entries`)."""
        latents = list(self.latent)
        latents[layer] = write_entries(latents[layer], self.page_table, slots, latent)
        keys = list(self.index_keys)
        if index_key is not None:
            keys[layer] = write_entries(keys[layer], self.page_table, slots, index_key)
        return self.replace(latent=tuple(latents), index_keys=tuple(keys))

    def move(self, src_slots: jax.Array, dst_slots: jax.Array) -> "PagedCache":
        """Copy every layer's entries (latents and indexer keys) from src_slots to dst_slots, both
        [B, L] int32 (-1 = skip the pair). All sources are read before anything is written, so a
        destination may be another pair's source (compacting a tree path in place). FP8 entries
        move as their stored bytes (every part of the pool), never requantized."""
        dst_slots = jnp.where(src_slots >= 0, dst_slots, -1)

        def moved(layer_cache):
            return write_slots(layer_cache, self.page_table, dst_slots,
                               read_slots(layer_cache, self.page_table, src_slots))

        return self.replace(latent=jax.tree.map(moved, self.latent), index_keys=jax.tree.map(moved, self.index_keys))


def pages_per_row(capacity: int, page_size: int) -> int:
    return -(-capacity // page_size)


def check_geometry(batch_size: int, capacity: int, row_shards: int, page_table) -> None:
    """The checks every cache layout makes of its arguments (ValueError naming the argument)."""
    if capacity < 1:
        raise ValueError(f"capacity={capacity}: must be >= 1")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    if row_shards < 1 or batch_size % row_shards:
        raise ValueError(f"row_shards={row_shards}: must be >= 1 and divide batch_size={batch_size}")
    if row_shards > 1 and page_table is not None:
        raise ValueError("page_table: a cache split into row shards numbers its pages itself; pass None")


def row_page_table(batch_size: int, num_row_pages: int, row_shards: int = 1) -> jax.Array:
    """[batch_size, num_row_pages] int32: row b owns pages [b * M, (b + 1) * M), numbered within its
    block of batch_size / row_shards rows (each row shard's pages are its own pool)."""
    num_pages = batch_size * num_row_pages
    return jnp.arange(num_pages, dtype=jnp.int32).reshape(batch_size, num_row_pages) % (num_pages // row_shards)


def init_cache(*, num_layers: int, batch_size: int, capacity: int, latent_dim: int, index_dim: int = 0,
               page_size: int = 64, dtype=jnp.float32, page_table: jax.Array | None = None,
               row_shards: int = 1, rope_dim: int = 0, cache_dtype: str | None = None) -> PagedCache:
    """An empty cache giving each of `batch_size` rows room for `capacity` slots.

    num_layers: layers with a cache (the target's, or 1 for the MTP module); latent_dim: width of
    one MLA entry (kv_lora_rank + qk_rope_head_dim); index_dim > 0 adds DSA indexer-key pages of
    that width for every layer; page_size: slots per page (capacity is rounded up to whole pages);
    dtype: the entries' dtype. Pages are handed out row after row (row b owns pages
    [b*M, (b+1)*M)); pass `page_table` ([batch_size, M] int32, entries a permutation of
    range(num_pages)) to lay them out otherwise. row_shards > 1 lays the cache out for a mesh
    that splits the rows into that many blocks (`jaxspec.sharding`): the page pool is split the same
    way, each block's rows own the block's pages, and the page table numbers pages within the block
    (every device's page table addresses its own pages only). Returns a `PagedCache`: latent, L
    arrays [num_pages, page_size, latent_dim]; index_keys, L arrays [num_pages, page_size,
    index_dim] (an empty tuple when index_dim = 0); page_table [batch_size, M]; lengths [batch_size] = 0.
    rope_dim: the trailing RoPE width of a latent entry (qk_rope_head_dim; read only with FP8).
    cache_dtype: None stores entries in `dtype`; "fp8" stores each layer's latent as an `Fp8Pool`
    in FlashMLA's token (its last rope_dim values, the RoPE key, in bfloat16; the rest in e4m3 with
    float32 scales) and its indexer keys as e4m3 with power-of-two scales (`fp8_cache`).
    """
    check_geometry(batch_size, capacity, row_shards, page_table)
    check_cache_dtype(cache_dtype)
    num_row_pages = pages_per_row(capacity, page_size)
    num_pages = batch_size * num_row_pages
    if page_table is None:
        page_table = row_page_table(batch_size, num_row_pages, row_shards)
    elif page_table.shape != (batch_size, num_row_pages):
        raise ValueError(f"page_table shape {page_table.shape}: expected {(batch_size, num_row_pages)}")
    if cache_dtype == "fp8":
        latent_pool = lambda: init_pool(num_pages, page_size, latent_dim - rope_dim, rope_dim, rule=LATENT_RULE)
        key_pool = lambda: init_pool(num_pages, page_size, index_dim, rule=INDEX_RULE)
    else:
        latent_pool = lambda: jnp.zeros((num_pages, page_size, latent_dim), dtype)
        key_pool = lambda: jnp.zeros((num_pages, page_size, index_dim), dtype)
    latent = tuple(latent_pool() for _ in range(num_layers))
    keys = tuple(key_pool() for _ in range(num_layers)) if index_dim else ()
    return PagedCache(latent=latent, index_keys=keys, page_table=jnp.asarray(page_table, jnp.int32),
                      lengths=jnp.zeros((batch_size,), jnp.int32))
