"""DeepSeek-V4's caches: sliding-window rings, compressor projection rings and compressed entries.

A V4 layer keeps no per-slot history beyond its sliding window; what it keeps is (per layer, by
`config.layer_types`):

  window         every layer: the K=V entries [head_dim] (after kv_norm and RoPE) of the last
                 slots, slot s at ring index `s % R` of the row's "window" pages;
  state          CSA / HCA: the compressor's per-token projections, `kv` and `gate + position_bias`
                 side by side ([2 * coff * head_dim] float32, coff = 2 for CSA's two series Ca/Cb,
                 1 for HCA), slot s at ring index `s % Rc` of the row's "csa_state" / "hca_state"
                 pages: what transformers calls the compressor's buffer and overlap, held per
                 position so it is a function of the committed tokens;
  entries        CSA / HCA: compressed entry j [head_dim] at slot j of the "csa_entries" /
                 "hca_entries" pages (entry j pools the tokens ending at `(j + 1) * m - 1`);
  index_state, index_entries   CSA only: the lightning indexer's own compressor, the same two
                 structures at width index_head_dim (sharing the CSA page tables).

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

All arrays are paged `[num_pages, page_size, width]` with per-row page tables in `page_table`
(a dict by structure name), laid out as `jaxspec.cache.init_cache` lays out its pages (row after
row, or per row shard), so `jaxspec.sharding` can split them by rows.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxspec.cache import check_geometry, pages_per_row, row_page_table
from jaxspec.model_config import CSA, HCA, SLIDING, ModelConfig
from jaxspec.pallas_kernels.paged import read_slots, write_slots

# Page-table names per structure, by layer type.
STATE_TABLE = {CSA: "csa_state", HCA: "hca_state"}
ENTRY_TABLE = {CSA: "csa_entries", HCA: "hca_entries"}


def ring_slots(slots: jax.Array, pages: jax.Array, page_size: int) -> jax.Array:
    """Slots [B, ...] (-1 = none) -> their ring indices `s % R` (R = the row's ring capacity), -1 kept."""
    ring = pages.shape[1] * page_size
    return jnp.where(slots >= 0, slots % ring, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class V4Cache:
    """Per layer (tuples of length num_layers; None where a layer has no such structure):
    window [Pw, page, head_dim]; state [Ps, page, 2 * coff * head_dim] float32; entries
    [Pe, page, head_dim]; index_state [Ps, page, 4 * index_head_dim] float32; index_entries
    [Pe, page, index_head_dim]. page_table: {"window": [B, R / page], "csa_state" / "hca_state":
    [B, Rc / page], "csa_entries" / "hca_entries": [B, E / page]} int32 (only the kinds present);
    lengths [B] int32 committed tokens per row; capacity: the positions a row can hold,
    max_window: the most tokens of one call, lookback: the slots before a call whose blocks it
    re-closes, layer_types: each layer's attention kind (static)."""

    window: tuple
    state: tuple
    entries: tuple
    index_state: tuple
    index_entries: tuple
    page_table: dict
    lengths: jax.Array
    capacity: int = dataclasses.field(metadata=dict(static=True))
    max_window: int = dataclasses.field(metadata=dict(static=True))
    lookback: int = dataclasses.field(metadata=dict(static=True))
    layer_types: tuple = dataclasses.field(metadata=dict(static=True))

    @property
    def page_size(self) -> int:
        return self.window[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def replace(self, **changes) -> "V4Cache":
        return dataclasses.replace(self, **changes)

    def commit(self, lengths: jax.Array) -> "V4Cache":
        """This cache with committed lengths [B] set: positions below them become visible."""
        return self.replace(lengths=lengths)

    def partition_specs(self, rows):
        """A `PartitionSpec` per leaf: every ring, compressor state and entry pool (each layer's)
        split by pages like `rows`, the spec of an array whose leading axis is rows; the per-structure
        page tables and lengths by rows. None stays None (a structure a layer lacks)."""
        return jax.tree.map(lambda _: rows, self)

    def set_layer(self, name: str, layer: int, value: jax.Array) -> "V4Cache":
        """This cache with `name[layer]` (name: "window", "state", ...) replaced by `value`."""
        arrays = list(getattr(self, name))
        arrays[layer] = value
        return self.replace(**{name: tuple(arrays)})

    def write_ring(self, name: str, table: str, layer: int, slots: jax.Array, values: jax.Array) -> "V4Cache":
        """Write values [B, Q, W] at ring slots [B, Q] (-1 = skip) of ring `name[layer]` (pages `table`)."""
        pages = self.page_table[table]
        ring = getattr(self, name)[layer]
        return self.set_layer(name, layer, write_slots(ring, pages, ring_slots(slots, pages, self.page_size), values))

    def read_ring(self, name: str, table: str, layer: int, slots: jax.Array) -> jax.Array:
        """Ring `name[layer]` at slots [B, ...] (-1 = none: zeros) -> [B, ..., W]."""
        pages = self.page_table[table]
        return read_slots(getattr(self, name)[layer], pages, ring_slots(slots, pages, self.page_size))

    def move(self, src_slots: jax.Array, dst_slots: jax.Array, layers: Sequence[int] | None = None) -> "V4Cache":
        """Copy every ring's entries (window, compressor and indexer projections; of every layer, or
        of `layers`) from src_slots to dst_slots, both [B, L] int32 (-1 = skip the pair): a tree's
        accepted path made contiguous. All sources are read before anything is written. Compressed
        entries are not moved: a tree call writes none (they are closed from the moved rings)."""
        dst_slots = jnp.where(src_slots >= 0, dst_slots, -1)
        cache = self
        for layer, kind in enumerate(self.layer_types):
            if layers is not None and layer not in layers:
                continue
            rings = [("window", "window")]
            if kind != SLIDING:
                rings.append(("state", STATE_TABLE[kind]))
            if kind == CSA:
                rings.append(("index_state", STATE_TABLE[kind]))
            for name, table in rings:
                values = self.read_ring(name, table, layer, src_slots)
                cache = cache.write_ring(name, table, layer, dst_slots, values)
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
                  dtype=jnp.float32) -> V4Cache:
    """An empty V4 cache for `batch_size` rows of up to `capacity` positions.

    max_window: the largest number of tokens Q of any call (prefill chunk, k + 1, tree size): the
    rings leave room for it. lookback: how many slots before each call it re-closes blocks in, at
    least the widest tree call (None: max_window, always enough). Layer kinds: `layer_types` if given, else the MTP block's kind
    (`config.layer_type(num_hidden_layers)`: one layer) with mtp=True, else `config.layer_types`.
    page_table: optional {name: [batch_size, M] int32} for some of the structures
    (`ring_capacities` gives each M); the others get rows' consecutive pages. row_shards: as in
    `jaxspec.cache.init_cache` (pages numbered within each block of rows; no page_table then).
    dtype: of the window and entry pages (the projection rings are float32, as DeepSeek's
    compressor state).
    """
    if not config.is_v4:
        raise ValueError(f"config.model_type={config.model_type!r}: init_v4_cache needs deepseek_v4")
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
    needed = {"window"} | {STATE_TABLE[k] for k in layer_types if k != SLIDING} | {
        ENTRY_TABLE[k] for k in layer_types if k != SLIDING}
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

    def pool(table: str, width: int, pool_dtype) -> jax.Array:
        return jnp.zeros((batch_size * counts[table], page_size, width), pool_dtype)

    d, di = config.head_dim, config.index_head_dim
    window, state, entries, index_state, index_entries = [], [], [], [], []
    for kind in layer_types:
        window.append(pool("window", d, dtype))
        coff = 2 if kind == CSA else 1
        state.append(None if kind == SLIDING else pool(STATE_TABLE[kind], 2 * coff * d, jnp.float32))
        entries.append(None if kind == SLIDING else pool(ENTRY_TABLE[kind], d, dtype))
        index_state.append(pool("csa_state", 4 * di, jnp.float32) if kind == CSA else None)
        index_entries.append(pool("csa_entries", di, dtype) if kind == CSA else None)
    return V4Cache(window=tuple(window), state=tuple(state), entries=tuple(entries), index_state=tuple(index_state),
                   index_entries=tuple(index_entries), page_table=tables,
                   lengths=jnp.zeros((batch_size,), jnp.int32), capacity=capacity,
                   max_window=max_window, lookback=lookback, layer_types=tuple(layer_types))
