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
import numpy as np
from jax.sharding import PartitionSpec

from jaxspec.pallas_kernels.fp8_cache import (INDEX_RULES, LATENT_RULE, Fp8Pool, check_cache_dtype, copy_slots,
                                              init_pool, write_entries)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """latent: [L, num_pages, page_size, kv_lora_rank + qk_rope_head_dim], the L layers' page pools
    stacked; index_keys: [L, num_pages, page_size, index_head_dim] (None without DSA);
    page_table: [B, max_pages_per_row] int32, the same for every layer; lengths: [B] int32
    committed tokens per row.

    Why one stacked array per structure: the decoder runs its layers as a `jax.lax.scan`
    (`models.stack`) with the cache in the carry, and a layer addresses its pages by offsetting the
    page table (`layer_pages`), so the kernels read the carry itself: slicing layer l out
    (`latent[l]`) would copy its pages for every kernel call, and a per-layer tuple cannot be
    indexed by the scan's traced layer index. With FP8 caches (`init_cache(cache_dtype="fp8")`)
    latent and index_keys are `Fp8Pool`s whose every part is stacked the same way, [L, P, page, ...]
    (`jaxspec.pallas_kernels.fp8_cache`)."""

    latent: jax.Array | Fp8Pool
    index_keys: jax.Array | Fp8Pool | None
    page_table: jax.Array
    lengths: jax.Array

    @property
    def num_layers(self) -> int:
        return self.latent.shape[0]

    @property
    def page_size(self) -> int:
        return self.latent.shape[2]

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
        """A `PartitionSpec` per leaf: every page pool split by pages (its axis 1, after the layers)
        like `rows`, the spec of an array whose leading axis is rows (each device holds its own rows'
        pages, `init_cache(row_shards=)`), the page table and lengths by rows."""
        pools = lambda pool: jax.tree.map(lambda _: PartitionSpec(None, *rows), pool)
        return PagedCache(latent=pools(self.latent), index_keys=pools(self.index_keys), page_table=rows, lengths=rows)

    def layer_pages(self, pool, layer):
        """Layer `layer`'s view of a stacked pool (`latent` or `index_keys`) as the kernels take it:
        `stacked_pages` with the shared page table. layer: an int or a traced int32."""
        return stacked_pages(pool, self.page_table, layer)

    def write(self, layer, slots: jax.Array, latent: jax.Array, index_key: jax.Array | None = None):
        """Write one layer's window entries: slots [B, Q] (-1 = skip), latent [B, Q, Dc], index_key
        [B, Q, Di] (an FP8 pool quantizes them per token: `fp8_cache.write_entries`)."""
        def written(pool, values):
            flat, table = self.layer_pages(pool, layer)
            return unstacked_pages(write_entries(flat, table, slots, values), pool)

        keys = self.index_keys if index_key is None else written(self.index_keys, index_key)
        return self.replace(latent=written(self.latent, latent), index_keys=keys)

    def move(self, src_slots: jax.Array, dst_slots: jax.Array) -> "PagedCache":
        """Copy every layer's entries (latents and indexer keys) from src_slots to dst_slots, both
        [B, L] int32 (-1 = skip the pair). All sources are read before anything is written, so a
        destination may be another pair's source (compacting a tree path in place). FP8 entries
        move as their stored bytes (every part of the pool), never requantized."""
        dst_slots = jnp.where(src_slots >= 0, dst_slots, -1)

        each_layer = lambda pool: jax.tree.map(jax.vmap(  # noqa: E731
            lambda layer_pool: copy_slots(layer_pool, self.page_table, src_slots, dst_slots)), pool)
        return self.replace(latent=each_layer(self.latent), index_keys=each_layer(self.index_keys))


def stacked_pages(pool, page_table: jax.Array, row):
    """Row `row` of a stacked pool [n, P, page, D] (a plain array or an `Fp8Pool`) as the kernels
    take it: (the pool flattened to [n * P, page, D], each part a free reshape, and the row's page
    table [B, M], `page_table` offset by row * P). row: an int or a traced int32."""
    num_rows, num_pages = pool.shape[:2]
    flat = jax.tree.map(lambda a: a.reshape(num_rows * num_pages, *a.shape[2:]), pool)
    return flat, page_table + row * num_pages


def unstacked_pages(flat, pool):
    """The inverse of `stacked_pages`' flattening: `flat` (every part [n * P, page, ...]) in the
    stacked shape of `pool` [n, P, page, ...], each part a free reshape."""
    return jax.tree.map(lambda new, old: new.reshape(old.shape), flat, pool)


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


def check_page_table(page_table, num_pages: int) -> None:
    """A caller's page table [B, M]: every entry a page of the pool, [0, num_pages), and no page
    twice, since two slots on one page overwrite each other's entries (another row's, or the same
    row's). A traced table is not read (ValueError naming the first bad entries otherwise)."""
    if isinstance(page_table, jax.core.Tracer):
        return
    pages = np.asarray(page_table).reshape(-1)
    outside = pages[(pages < 0) | (pages >= num_pages)]
    if outside.size:
        raise ValueError(f"page_table: entries must be pages in [0, {num_pages}), got {outside[:5].tolist()}")
    repeated = np.flatnonzero(np.bincount(pages, minlength=num_pages) > 1)
    if repeated.size:
        raise ValueError(f"page_table: page(s) {repeated[:5].tolist()} appear more than once; each slot needs a "
                         "page of its own (a permutation of range(num_pages))")


def row_page_table(batch_size: int, num_row_pages: int, row_shards: int = 1) -> jax.Array:
    """[batch_size, num_row_pages] int32: row b owns pages [b * M, (b + 1) * M), numbered within its
    block of batch_size / row_shards rows (each row shard's pages are its own pool)."""
    num_pages = batch_size * num_row_pages
    return jnp.arange(num_pages, dtype=jnp.int32).reshape(batch_size, num_row_pages) % (num_pages // row_shards)


def init_cache(*, num_layers: int, batch_size: int, capacity: int, latent_dim: int, index_dim: int = 0,
               page_size: int = 64, dtype=jnp.float32, page_table: jax.Array | None = None,
               row_shards: int = 1, rope_dim: int = 0, cache_dtype: str | None = None,
               scale_fmt: str | None = None) -> PagedCache:
    """An empty cache giving each of `batch_size` rows room for `capacity` slots.

    num_layers: layers with a cache (the target's, or 1 for the MTP module); latent_dim: width of
    one MLA entry (kv_lora_rank + qk_rope_head_dim); index_dim > 0 adds DSA indexer-key pages of
    that width for every layer; page_size: slots per page (capacity is rounded up to whole pages);
    dtype: the entries' dtype. Pages are handed out row after row (row b owns pages
    [b*M, (b+1)*M)); pass `page_table` ([batch_size, M] int32, entries a permutation of
    range(num_pages), `check_page_table`) to lay them out otherwise. row_shards > 1 lays the cache
    out for a mesh that splits the rows into that many blocks (`jaxspec.sharding`): the page pool
    is split the same way, each block's rows own the block's pages, and the page table numbers
    pages within the block (every device's page table addresses its own pages only). Returns a `PagedCache`: latent
    [L, num_pages, page_size, latent_dim]; index_keys [L, num_pages, page_size, index_dim] (None
    when index_dim = 0); page_table [batch_size, M]; lengths [batch_size] = 0.
    rope_dim: the trailing RoPE width of a latent entry (qk_rope_head_dim; read only with FP8).
    cache_dtype: None stores entries in `dtype`; "fp8" stores the latent as an `Fp8Pool` in
    FlashMLA's token (its last rope_dim values, the RoPE key, in bfloat16; the rest in e4m3 with
    float32 scales) and the indexer keys as e4m3 with one scale per key (`fp8_cache`), each part
    stacked [L, num_pages, page_size, ...]. scale_fmt: the model's `ModelConfig.scale_fmt`, the
    indexer keys' scale rule ("ue8m0": powers of two, as V3.2's release; None: amax / 448).
    """
    check_geometry(batch_size, capacity, row_shards, page_table)
    check_cache_dtype(cache_dtype)
    num_row_pages = pages_per_row(capacity, page_size)
    num_pages = batch_size * num_row_pages
    if page_table is None:
        page_table = row_page_table(batch_size, num_row_pages, row_shards)
    elif page_table.shape != (batch_size, num_row_pages):
        raise ValueError(f"page_table shape {page_table.shape}: expected {(batch_size, num_row_pages)}")
    else:
        check_page_table(page_table, num_pages)

    def one_layer():
        if cache_dtype == "fp8":
            return (init_pool(num_pages, page_size, latent_dim - rope_dim, rope_dim, rule=LATENT_RULE),
                    init_pool(num_pages, page_size, index_dim, rule=INDEX_RULES[scale_fmt]) if index_dim else None)
        return (jnp.zeros((num_pages, page_size, latent_dim), dtype),
                jnp.zeros((num_pages, page_size, index_dim), dtype) if index_dim else None)

    # One layer's pools by shape only (nothing allocated), then every part stacked [L, ...].
    stacked = lambda pool: jax.tree.map(lambda a: jnp.zeros((num_layers, *a.shape), a.dtype), pool)
    latent, keys = stacked(jax.eval_shape(one_layer))
    return PagedCache(latent=latent, index_keys=keys, page_table=jnp.asarray(page_table, jnp.int32),
                      lengths=jnp.zeros((batch_size,), jnp.int32))
