"""DeepSeek-V4's caches: sliding-window rings, compressor projection rings and compressed entries.

A V4 layer keeps no per-slot history beyond its sliding window; what it keeps is (per layer, by
`config.layer_types`):

  window         every layer: the K=V entries [head_dim] (after kv_norm and RoPE) of the last
                 slots, slot s at ring index `s % R` of the row's "window" pages;
  csa_state, hca_state   the compressor's per-token projections, `kv` and `gate + position_bias`
                 side by side ([2 * coff * head_dim] float32, coff = 2 for CSA's two series Ca/Cb,
                 1 for HCA), slot s at ring index `s % Rc` of the row's "csa_state" / "hca_state"
                 pages: what transformers calls the compressor's buffer and overlap, held per
                 position so it is a function of the committed tokens;
  csa_entries, hca_entries   compressed entry j [head_dim] at slot j of the "csa_entries" /
                 "hca_entries" pages (entry j pools the tokens ending at `(j + 1) * m - 1`);
  csa_index_state, csa_index_entries   CSA only: the lightning indexer's own compressor, the same
                 two structures at width index_head_dim (sharing the CSA page tables).

Ring capacities leave room for a whole call (W = `max_window`, the largest Q of any call: the
prefill chunk, k + 1, or a tree's size), so a call never overwrites a slot that one of its own
tokens, or a committed token after a rejection, still reads:

  R  >= sliding_window - 1 + W   (the attention op's rule)
  Rc >= 2m - 1 + 2W (CSA: entry j reads slots [(j - 1) m, (j + 1) m))
        m' - 1 + 2W (HCA: entry j reads slots [j m', (j + 1) m'))

(2W: a call first re-closes the blocks that ended in the `lookback` <= W slots before it, which a
tree call committed without writing, `models.compressor`), each rounded up to whole pages.
`lookback` only has to cover the widest tree call (`generate` passes the verification window):
with rings sized for a long one-call prefill, re-closing W = prompt-length slots back would pool
a whole prompt's blocks in every decode step. Nothing is ever
erased: whatever a rejected draft wrote (a ring
slot, an entry closed by a draft) is either out of every later query's view or rewritten by the
call that processes that position again before anyone reads it (`models.v4_attention`).

FP8 (`init_v4_cache(cache_dtype="fp8")`): the window ring and the CSA / HCA entries are
`fp8_cache.Fp8Pool`s in FlashMLA's MODEL1 token (head_dim - 64 values in e4m3 with a power-of-two
scale per 64, the 64 RoPE values in bfloat16; `fp8_cache.V4_RULE`), quantized per token as they
are written, as vLLM and SGLang serve V4. The projection rings stay float32 and the indexer's keys
stay in the compute dtype (docs/fp8-caches.md says why). Rings move between slots as their stored
bytes, never requantized.

All pools of one structure are stacked over the layers that have it, `[n, num_pages, page_size,
width]`: `window` over every layer, the CSA structures over the CSA layers, the HCA ones over the HCA
layers, a layer's row being its rank among the layers of its kind (`row`). Why stacked: the decoder
runs its layers as `jax.lax.scan`s (`models.stack`) with the cache in the carry, so a layer's index
may be traced, and a per-layer tuple cannot be indexed by it. A layer addresses its pages as
`jaxspec.cache.stacked_pages` does: the stack flattened to `[n * P, page, width]` (a free
reshape) with the row's page table offset by `row * P`, so reads and writes touch the carry in place
(slicing a layer out would copy its pages at every call). Pages are laid out per row as
`jaxspec.cache.init_cache` lays out its pages (row after row, or per row shard), so
`jaxspec.sharding` splits every pool by rows on its page axis (axis 1, after the stacked one).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxspec.cache import check_geometry, pages_per_row, row_page_table, stacked_pages, unstacked_pages
from jaxspec.model_config import CSA, HCA, SLIDING, ModelConfig
from jaxspec.pallas_kernels.fp8_cache import (V4_RULE, Fp8Pool, check_cache_dtype, check_v4_fp8_widths, copy_slots,
                                               init_pool, write_entries)
from jaxspec.pallas_kernels.paged import read_slots

# The pools by layer kind (a field of `V4Cache` each), and the page table each pool's rows use.
STATE = {CSA: "csa_state", HCA: "hca_state"}
ENTRIES = {CSA: "csa_entries", HCA: "hca_entries"}
INDEX_STATE, INDEX_ENTRIES = "csa_index_state", "csa_index_entries"
POOL_TABLE = {"window": "window", "csa_state": "csa_state", "hca_state": "hca_state", "csa_entries": "csa_entries",
              "hca_entries": "hca_entries", INDEX_STATE: "csa_state", INDEX_ENTRIES: "csa_entries"}
# The layer kinds that hold each pool.
POOL_KINDS = {"window": (SLIDING, CSA, HCA), "csa_state": (CSA,), "csa_entries": (CSA,), INDEX_STATE: (CSA,),
              INDEX_ENTRIES: (CSA,), "hca_state": (HCA,), "hca_entries": (HCA,)}
# The rings a tree's accepted path is moved in, per layer kind (entries are closed from them).
RINGS = {SLIDING: ("window",), CSA: ("window", "csa_state", INDEX_STATE), HCA: ("window", "hca_state")}


def ring_slots(slots: jax.Array, pages: jax.Array, page_size: int) -> jax.Array:
    """Slots [B, ...] (-1 = none) -> their ring indices `s % R` (R = the row's ring capacity), -1 kept."""
    ring = pages.shape[1] * page_size
    return jnp.where(slots >= 0, slots % ring, -1)


def kind_rows(layer_types: tuple[str, ...]) -> tuple[int, ...]:
    """Each layer's row in the stacks of its kind: its rank among the layers of that kind."""
    seen = {SLIDING: 0, CSA: 0, HCA: 0}
    rows = []
    for kind in layer_types:
        rows.append(seen[kind])
        seen[kind] += 1
    return tuple(rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class V4Cache:
    """Pools stacked over the layers of their kind (None where no layer has that kind; with FP8
    caches the window and both entry pools are `Fp8Pool`s of these shapes):
    window [L, Pw, page, head_dim]; csa_state [n_csa, Ps, page, 4 * head_dim] float32;
    csa_entries [n_csa, Pe, page, head_dim]; csa_index_state [n_csa, Ps, page, 4 * index_head_dim]
    float32; csa_index_entries [n_csa, Pe, page, index_head_dim]; hca_state [n_hca, Ps', page,
    2 * head_dim] float32; hca_entries [n_hca, Pe', page, head_dim]. page_table: {"window":
    [B, R / page], "csa_state" / "hca_state": [B, Rc / page], "csa_entries" / "hca_entries":
    [B, E / page]} int32 (only the kinds present; shared by a structure's layers); lengths [B] int32
    committed tokens per row; capacity: the positions a row can hold, max_window: the most tokens
    of one call, lookback: the slots before a call whose blocks it re-closes, layer_types: each
    layer's attention kind (static)."""

    window: jax.Array | Fp8Pool
    csa_state: jax.Array | None
    csa_entries: jax.Array | Fp8Pool | None
    csa_index_state: jax.Array | None
    csa_index_entries: jax.Array | None
    hca_state: jax.Array | None
    hca_entries: jax.Array | Fp8Pool | None
    page_table: dict
    lengths: jax.Array
    capacity: int = dataclasses.field(metadata=dict(static=True))
    max_window: int = dataclasses.field(metadata=dict(static=True))
    lookback: int = dataclasses.field(metadata=dict(static=True))
    layer_types: tuple = dataclasses.field(metadata=dict(static=True))

    @property
    def page_size(self) -> int:
        return self.window.shape[2]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def replace(self, **changes) -> "V4Cache":
        return dataclasses.replace(self, **changes)

    def commit(self, lengths: jax.Array) -> "V4Cache":
        """This cache with committed lengths [B] set: positions below them become visible."""
        return self.replace(lengths=lengths)

    def partition_specs(self, rows):
        """A `PartitionSpec` per leaf: every pool split by pages (its axis 1, after the stacked
        layers) like `rows`, the spec of an array whose leading axis is rows; the per-structure page
        tables and lengths by rows (an `Fp8Pool`'s every part alike). None stays None (a kind no layer
        has)."""
        pools = PartitionSpec(None, *rows)
        return self.replace(**{name: jax.tree.map(lambda _: pools, getattr(self, name)) for name in POOL_TABLE},
                            page_table={name: rows for name in self.page_table}, lengths=rows)

    def row(self, name: str, layer) -> jax.Array | int:
        """Layer `layer`'s row in pool `name`: the layer itself for "window", else its rank among the
        layers of its kind. layer: an int, or a traced int32 (a scan's layer index)."""
        if name == "window":
            return layer
        if isinstance(layer, int):
            if self.layer_types[layer] not in POOL_KINDS[name]:
                raise ValueError(f"layer={layer}: a {self.layer_types[layer]} layer has no {name}")
            return kind_rows(self.layer_types)[layer]
        return jnp.asarray(kind_rows(self.layer_types), jnp.int32)[layer]

    def layer_pages(self, name: str, layer) -> tuple[jax.Array, jax.Array]:
        """Layer `layer`'s view of pool `name` as the kernels take it: `stacked_pages` of its row of
        the stack, with its structure's page table."""
        return stacked_pages(getattr(self, name), self.page_table[POOL_TABLE[name]], self.row(name, layer))

    def write_pages(self, name: str, layer, slots: jax.Array, values: jax.Array) -> "V4Cache":
        """Write values [B, Q, W] at page slots [B, Q] (-1 = skip) of layer `layer`'s pool `name`
        (an FP8 pool quantizes them per token: `fp8_cache.write_entries`)."""
        flat, pages = self.layer_pages(name, layer)
        return self._unflatten(name, write_entries(flat, pages, slots, values))

    def write_ring(self, name: str, layer, slots: jax.Array, values: jax.Array) -> "V4Cache":
        """Write values [B, Q, W] at ring slots [B, Q] (-1 = skip) of layer `layer`'s ring `name`."""
        return self.write_pages(name, layer, self._ring(name, slots), values)

    def read_ring(self, name: str, layer, slots: jax.Array) -> jax.Array:
        """Layer `layer`'s ring `name` (a plain pool: the projection rings) at slots [B, ...] (-1 =
        none: zeros) -> [B, ..., W]."""
        return read_slots(*self.layer_pages(name, layer), self._ring(name, slots))

    def _ring(self, name: str, slots: jax.Array) -> jax.Array:
        return ring_slots(slots, self.page_table[POOL_TABLE[name]], self.page_size)

    def _unflatten(self, name: str, flat) -> "V4Cache":
        """This cache with pool `name` set from its flattened form (`layer_pages`' first result)."""
        return self.replace(**{name: unstacked_pages(flat, getattr(self, name))})

    def move(self, src_slots: jax.Array, dst_slots: jax.Array) -> "V4Cache":
        """Copy every layer's ring entries (window, compressor and indexer projections) from
        src_slots to dst_slots, both [B, L] int32 (-1 = skip the pair): a tree's accepted path made
        contiguous. All sources are read before anything is written. Compressed entries are not
        moved: a tree call writes none (they are closed from the moved rings)."""
        dst_slots = jnp.where(src_slots >= 0, dst_slots, -1)
        changes = {}
        for name in dict.fromkeys(ring for rings in RINGS.values() for ring in rings):
            if getattr(self, name) is None:
                continue
            pages = self.page_table[POOL_TABLE[name]]
            src, dst = self._ring(name, src_slots), self._ring(name, dst_slots)
            changes[name] = jax.vmap(lambda pool: copy_slots(pool, pages, src, dst))(getattr(self, name))
        return self.replace(**changes)

    def move_layer(self, src_slots: jax.Array, dst_slots: jax.Array, layer, kind: str) -> "V4Cache":
        """`move` for one layer of attention kind `kind` (layer: an int or a traced int32)."""
        dst_slots = jnp.where(src_slots >= 0, dst_slots, -1)
        cache = self
        for name in RINGS[kind]:
            flat, pages = self.layer_pages(name, layer)
            cache = cache._unflatten(name, copy_slots(flat, pages, self._ring(name, src_slots),
                                                      self._ring(name, dst_slots)))
        return cache


def ring_capacities(config: ModelConfig, capacity: int, max_window: int, page_size: int) -> dict[str, int]:
    """Pages per row of every structure: {"window", "csa_state", "hca_state", "csa_entries",
    "hca_entries"} -> M (the module docstring gives the ring rules)."""
    rates = dict(config.compress_rates)
    return {
        "window": pages_per_row(config.sliding_window - 1 + max_window, page_size),
        "csa_state": pages_per_row(2 * rates[CSA] - 1 + 2 * max_window, page_size),
        "hca_state": pages_per_row(rates[HCA] - 1 + 2 * max_window, page_size),
        "csa_entries": pages_per_row(max(capacity // rates[CSA], 1), page_size),
        "hca_entries": pages_per_row(max(capacity // rates[HCA], 1), page_size),
    }


def init_v4_cache(config: ModelConfig, batch_size: int, capacity: int, *, max_window: int,
                  lookback: int | None = None, page_size: int = 64, mtp: bool = False, layer_types: tuple[str, ...] | None = None,
                  page_table: Mapping[str, jax.Array] | None = None, row_shards: int = 1,
                  dtype=jnp.float32, cache_dtype: str | None = None) -> V4Cache:
    """An empty V4 cache for `batch_size` rows of up to `capacity` positions.

    max_window: the largest number of tokens Q of any call (prefill chunk, k + 1, tree size): the
    rings leave room for it. lookback: how many slots before each call it re-closes blocks in, at
    least the widest tree call (None: max_window, always enough). Layer kinds: `layer_types` if given, else the MTP block's kind
    (`config.layer_type(num_hidden_layers)`: one layer) with mtp=True, else `config.layer_types`.
    page_table: optional {name: [batch_size, M] int32} for some of the structures
    (`ring_capacities` gives each M); the others get rows' consecutive pages. row_shards: as in
    `jaxspec.cache.init_cache` (pages numbered within each block of rows; no page_table then).
    dtype: of the window and entry pages (the projection rings are float32, as DeepSeek's
    compressor state). cache_dtype: None, or "fp8": the window and the CSA / HCA entries as
    `Fp8Pool`s in FlashMLA's MODEL1 token (the module docstring; `check_v4_fp8_widths` says which
    widths fit); the indexer's keys stay in `dtype`.
    """
    if not config.is_v4:
        raise ValueError(f"config.model_type={config.model_type!r}: init_v4_cache needs deepseek_v4")
    check_cache_dtype(cache_dtype)
    if cache_dtype == "fp8":
        check_v4_fp8_widths(head_dim=config.head_dim, rope_dim=config.qk_rope_head_dim)
    check_geometry(batch_size, capacity, row_shards, page_table)
    if max_window < 1:
        raise ValueError(f"max_window={max_window}: must be >= 1 (the largest Q of a call)")
    lookback = max_window if lookback is None else lookback
    if not 0 <= lookback <= max_window:
        raise ValueError(f"lookback={lookback}: must be in [0, max_window={max_window}] (the widest tree call)")
    if layer_types is None:
        layer_types = (config.layer_type(config.num_hidden_layers),) if mtp else tuple(config.layer_types)
    if any(kind not in (SLIDING, CSA, HCA) for kind in layer_types):
        raise ValueError(f"layer_types={layer_types}: entries must be in {(SLIDING, CSA, HCA)}")
    if page_table is not None and not isinstance(page_table, Mapping):
        raise ValueError(f"page_table: must be a mapping from structure name to a [batch_size, M] table "
                         f"(got {type(page_table).__name__})")
    counts = ring_capacities(config, capacity, max_window, page_size)
    needed = {"window"} | {STATE[k] for k in layer_types if k != SLIDING} | {ENTRIES[k] for k in layer_types if k != SLIDING}
    tables = {}
    for name in sorted(needed):
        given = (page_table or {}).get(name)
        if given is None:
            tables[name] = row_page_table(batch_size, counts[name], row_shards)
        elif given.shape != (batch_size, counts[name]):
            raise ValueError(f"page_table[{name!r}] shape {given.shape}: expected {(batch_size, counts[name])}")
        else:
            tables[name] = jnp.asarray(given, jnp.int32)
    unknown = sorted(set(page_table or {}) - needed)
    if unknown:
        raise ValueError(f"page_table has {unknown}: this cache's structures are {sorted(needed)}")

    def stack(name: str, width: int, pool_dtype) -> jax.Array | Fp8Pool | None:
        count = sum(kind in POOL_KINDS[name] for kind in layer_types)
        if not count:
            return None
        pages = batch_size * counts[POOL_TABLE[name]]
        if pool_dtype == "fp8":
            rope = config.qk_rope_head_dim
            return init_pool(pages, page_size, width - rope, rope, rule=V4_RULE, stack=(count,))
        return jnp.zeros((count, pages, page_size, width), pool_dtype)

    d, di = config.head_dim, config.index_head_dim
    kv_dtype = dtype if cache_dtype is None else cache_dtype
    return V4Cache(window=stack("window", d, kv_dtype),
                   csa_state=stack("csa_state", 4 * d, jnp.float32), csa_entries=stack("csa_entries", d, kv_dtype),
                   csa_index_state=stack(INDEX_STATE, 4 * di, jnp.float32),
                   csa_index_entries=stack(INDEX_ENTRIES, di, dtype),
                   hca_state=stack("hca_state", 2 * d, jnp.float32), hca_entries=stack("hca_entries", d, kv_dtype),
                   page_table=tables, lengths=jnp.zeros((batch_size,), jnp.int32), capacity=capacity,
                   max_window=max_window, lookback=lookback, layer_types=tuple(layer_types))
