"""Pallas GPU kernel (Triton lowering) for `sliding_compressed_attention`: DeepSeek-V4's shared-KV
attention over the sliding-window ring, the compressed entries and per-query extra keys.

Work layout. One KV head serves every head, so the Q window tokens x H heads of a sequence row are
M = Q * H query rows (row m = q * H + h) over the same keys, as in `mla_attention_pallas`: a
program holds `block_m` of them (32 = half a token's heads for V4-Flash: a 32 x 512 float32
accumulator is what fits in registers beside the rest, see ACCUMULATOR) and walks the row's keys
in tiles of `block_n` with an online softmax (`flash_decoding.online_softmax_step`) whose running
max and denominator start at the head's sink (max = sink, denominator = exp(sink - sink) = 1):
that is the sink's whole contribution. Grid:

    (M / block_m, num_parts, B)   axis 0 varies fastest on the GPU

A program's keys are up to three runs of tiles, numbered one after the other:
  * ring tiles: the slots `[start, end)` that the program's tokens may see, start = max(0, the
    least p - sliding_window + 1 among them) (a window slot's position is at most its slot)
    rounded down to a multiple of block_n, end = their largest `kv_bound`: distinct ring indices,
    as R >= sliding_window - 1 + Q and the slots below the least p - sliding_window + 1 are seen
    by no row (their ring index may hold a newer slot). Slot s is read at ring index s % R; each
    query row masks it by its ancestors (`tiling.visible`) and the sliding rule (key position >
    p - sliding_window);
  * compressed tiles: with indices, the top-k list of each token among the program's rows in turn
    (a tile belongs to one token and is masked to that token's rows); with a count, the entries
    [0, the largest count among the rows), masked per row by its own count;
  * extra tiles: each token's extra keys in turn, like the index lists.
For small batches the tiles are cut into `num_parts` parts (flash-decoding split-KV); the sink
goes into part 0 only, and `flash_decoding.combine_parts` merges the parts by log-sum-exp.

FP8 caches (`fp8_cache.Fp8Pool`, FlashMLA's MODEL1 token): the ring and the compressed entries are
read as their e4m3 values, power-of-two scales and bfloat16 RoPE values, and dequantized in
registers as `fp8_cache.entries` defines an entry (`_load_keys`); the extra keys are read as the
entries' pool stores them (`contracts.stored_extra_keys`, before the call).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .cost import attention_cost
from .flash_decoding import (MIN_PART_SLOTS, combine_parts, load_dequantized, online_softmax_step, part_shapes,
                             part_start, store_part)
from .contracts import check_arguments, stored_extra_keys
from .fp8_cache import Fp8Pool, cache_token_bytes, entry_dtype, flat_pool
from .tiling import (block_indices, block_size, column_span, dot_nt, launch, load_block, load_vector, num_parts,
                     slot_rows, tile_range, visible)
from .visibility import Visibility, kv_bound


# Query rows x feature columns of a program's float32 accumulator, at most (32 x 512 for V4). At
# 64 x 512 (as the MLA kernels hold) this kernel's masks and three loops push ptxas past 255
# registers a thread and it spills at V4-Flash shapes (8 warps, sm_90a; 16 warps cap a thread at
# 128 registers and spill more); at 32 x 512 and 8 warps it needs 166-187 (block_n 32 or 64).
ACCUMULATOR = 32 * 512
# With FP8 pools a key tile is dequantized from three [block_n, D] loads (values, each column's
# scale, the RoPE part), which at 32 x 512 spills about 930 bytes (block_n 32 or 16) and at
# 16 x 512 with block_n 32 about 600; 16 x 512 with 16-key tiles fits (254-255 registers, 4 warps,
# 99,392 bytes shared memory, V4-Flash, sm_90a).
FP8_ACCUMULATOR, FP8_BLOCK_N = 16 * 512, 16


class Layout(NamedTuple):
    """Static facts of a launch that the kernel body needs."""

    heads: int  # H
    num_queries: int  # Q
    rows: int  # M = Q * H query rows per sequence row
    rows_padded: int  # M in whole row blocks
    dim: int  # D
    dim_block: int  # D as a power-of-two block (zero-padded columns)
    dtype: jnp.dtype  # both dot operands are cast to it
    window_page: int  # page size and page count of the ring pages
    window_num_pages: int
    compressed_page: int  # the same for the compressed entries (0 without them)
    compressed_num_pages: int
    sliding_window: int
    scale: float
    tree: bool
    compressed: str | None  # "indices", "count" or None
    extra: bool
    block_m: int
    block_n: int
    parts: int


class Block(NamedTuple):
    """What a program knows about its query rows (traced values)."""

    seq: jax.Array  # the sequence row
    tokens: jax.Array  # [BM] window token of each query row
    real: jax.Array  # [BM] bool: the row is a real token's (not padding, not past M)
    first_token: jax.Array  # the first token among the rows
    num_tokens: jax.Array  # how many tokens the rows span


def _kernel(q_ref, sinks_ref, window_ref, window_pages_ref, bound_ref, positions_ref, prefix_ref, *refs,
            layout: Layout):
    """One (row block, part, sequence row) program.

    q_ref [B * M, D], sinks_ref [H] float32, window_ref [P * page, D], window_pages_ref [B, R / page],
    bound_ref [B, Q] (a token's exclusive slot bound, 0 for padding: `visibility.kv_bound`),
    positions_ref [B, Q], prefix_ref [B]; then ancestor_ref
    [B * Q, Q] int32 for a tree; compressed_ref [Pc * page, D], compressed_pages_ref [B, E / page]
    and indices_ref [B * Q, K] or count_ref [B, Q] with compressed entries; extra_ref
    [B * Q * X, D] and extra_valid_ref [B * Q, X] int32 with extra keys; then the outputs
    out_ref [B * parts * Mp, D block], lse_ref [B * parts * Mp].
    """
    refs = list(refs)
    ancestor_ref = refs.pop(0) if layout.tree else None
    compressed_refs = [refs.pop(0) for _ in range(3)] if layout.compressed else None
    extra_refs = [refs.pop(0) for _ in range(2)] if layout.extra else None
    out_ref, lse_ref = refs
    row_block, part, seq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_m, block_n, heads, num_queries = layout.block_m, layout.block_n, layout.heads, layout.num_queries

    first_row = row_block * block_m
    query_rows, row_valid = block_indices(first_row, block_m, layout.rows)
    columns, column_valid = column_span(0, layout.dim, layout.dim_block)
    queries = load_block(q_ref, seq * layout.rows + query_rows, columns, row_valid, column_valid).astype(layout.dtype)
    tokens = jax.lax.div(query_rows, heads)
    bounds = load_block(bound_ref, seq, tokens, column_valid=row_valid)
    first_token = jax.lax.div(first_row, heads)
    block = Block(seq, tokens, bounds > 0, first_token,
                  jax.lax.div(jnp.minimum(first_row + block_m, layout.rows) - 1, heads) - first_token + 1)

    def attend(carry, ref, rows, readable, sees):
        """rows [BN] of ref (zeros where not readable), sees [BM, BN] -> the carry after that tile."""
        keys = _load_keys(ref, rows, readable, columns, column_valid).astype(layout.dtype)
        scores = jnp.where(sees, dot_nt(queries, keys) * layout.scale, -jnp.inf)
        return online_softmax_step(carry, scores, keys)

    # Ring tiles: slots [start, end), each at ring index slot % R.
    prefix, ring = prefix_ref[seq], window_pages_ref.shape[1] * layout.window_page
    oldest = load_block(positions_ref, seq, tokens) - layout.sliding_window  # [BM]: keys must lie above it
    start = jnp.maximum(jnp.min(jnp.where(block.real, oldest + 1, jnp.iinfo(jnp.int32).max)), 0)
    # Tiles start at whole multiples of block_n: a slot meets the same tile companions whichever
    # tokens share the program, and a tile a row sees nothing of leaves its carry bit for bit.
    start = start - jax.lax.rem(start, block_n)
    end = jnp.max(bounds)  # 0 when no row is real

    def ring_tile(t, carry):
        slots = start + t * block_n + jnp.arange(block_n, dtype=jnp.int32)
        readable = slots < end
        window = slots - prefix  # window index; negative for committed slots (key position = slot)
        in_window = readable & (window >= 0)
        window_positions = load_block(positions_ref, seq, jnp.clip(window, 0, num_queries - 1), column_valid=in_window)
        key_position = jnp.where(window < 0, slots, window_positions)
        sees = (visible(slots, bounds, seq, tokens, prefix_ref, ancestor_ref) & readable[None, :]
                & (key_position[None, :] > oldest[:, None]))
        rows = slot_rows(window_pages_ref, seq, jax.lax.rem(slots, ring), layout.window_page, layout.window_num_pages)
        return attend(carry, window_ref, rows, readable, sees)

    runs = [(_num_tiles(end - start, block_n), ring_tile)]
    if layout.compressed == "indices":
        runs.append(_indices_run(*compressed_refs, block, layout, attend))
    elif layout.compressed == "count":
        runs.append(_count_run(*compressed_refs, block, layout, attend))
    if layout.extra:
        runs.append(_extra_run(*extra_refs, block, layout, attend))

    # Part 0 starts from the sink (max = sink, denominator exp(0) = 1); other parts from nothing.
    sink = load_vector(sinks_ref, jax.lax.rem(query_rows, heads), row_valid)
    first_part = jnp.full((block_m,), part == 0)
    carry = (jnp.where(first_part, sink, -jnp.inf), jnp.where(first_part, 1.0, 0.0).astype(jnp.float32),
             jnp.zeros((block_m, layout.dim_block), jnp.float32))
    lo, hi = tile_range(part, layout.parts, sum(num_tiles for num_tiles, _ in runs))
    offset = 0
    for num_tiles, body in runs:  # the run's tiles that fall in [lo, hi)
        carry = jax.lax.fori_loop(jnp.clip(lo - offset, 0, num_tiles), jnp.clip(hi - offset, 0, num_tiles), body,
                                  carry)
        offset = offset + num_tiles
    store_part(out_ref, lse_ref, part_start(seq, part, layout.parts, layout.rows_padded, first_row), *carry)


def _load_keys(ref, rows, readable, columns, column_valid):
    """Key rows [BN] of ref [rows, D] (or an `Fp8Pool` of refs: values [rows, Dq], scales
    [rows, Dq / block], rope [rows, D - Dq]) at `columns` [D block] -> [BN, D block], zeros where
    not readable or not a column. An FP8 row's values are multiplied by their block's scale and
    rounded to bfloat16 (`fp8_cache.entries`); the RoPE columns come from the rope part."""
    if not isinstance(ref, Fp8Pool):
        return load_block(ref, rows, columns, readable, column_valid)
    quant_dim, rope_dim = ref.values.shape[1], ref.rope.shape[1]
    in_quant = columns < quant_dim
    values = load_dequantized(ref, rows, jnp.minimum(columns, quant_dim - 1), readable, in_quant)
    in_rope = ~in_quant if column_valid is None else ~in_quant & column_valid
    rope = load_block(ref.rope, rows, jnp.clip(columns - quant_dim, 0, rope_dim - 1), readable, in_rope)
    return jnp.where(in_quant[None, :], values, rope)


def _num_tiles(keys, block_n: int):
    """Tiles of block_n that hold `keys` keys (traced; 0 when keys <= 0)."""
    return jax.lax.div(jnp.maximum(keys, 0) + block_n - 1, block_n)


def _token_tile(t, block: Block, width: int, block_n: int):
    """Tile t of a per-token run (each token's `width` keys in tiles of block_n, token after token)
    -> (token, key columns [BN] clamped into [0, width), listed [BN], the token's real rows [BM])."""
    tiles_per_token = pl.cdiv(width, block_n)
    token = block.first_token + jax.lax.div(t, tiles_per_token)
    columns, listed = block_indices(jax.lax.rem(t, tiles_per_token) * block_n, block_n, width)
    return token, columns, listed, block.real & (block.tokens == token)


def _indices_run(compressed_ref, pages_ref, indices_ref, block: Block, layout: Layout, attend):
    """CSA: every token's own entry list. -> (number of tiles, tile body)."""
    topk = indices_ref.shape[1]
    capacity = pages_ref.shape[1] * layout.compressed_page

    def tile(t, carry):
        token, columns, listed, rows_of_token = _token_tile(t, block, topk, layout.block_n)
        entries = load_block(indices_ref, block.seq * layout.num_queries + token, columns, column_valid=listed)
        selected = listed & (entries >= 0) & (entries < capacity)  # -1 and entries past the pages: skipped
        rows = slot_rows(pages_ref, block.seq, entries, layout.compressed_page, layout.compressed_num_pages)
        return attend(carry, compressed_ref, rows, selected, rows_of_token[:, None] & selected[None, :])

    return block.num_tokens * pl.cdiv(topk, layout.block_n), tile


def _count_run(compressed_ref, pages_ref, count_ref, block: Block, layout: Layout, attend):
    """HCA: entries [0, count) of each token, read once for all rows. -> (number of tiles, tile body)."""
    capacity = pages_ref.shape[1] * layout.compressed_page
    counts = load_block(count_ref, block.seq, block.tokens, column_valid=block.real)
    counts = jnp.where(block.real, jnp.clip(counts, 0, capacity), 0)  # [BM]
    most = jnp.max(counts)

    def tile(t, carry):
        entries = t * layout.block_n + jnp.arange(layout.block_n, dtype=jnp.int32)
        rows = slot_rows(pages_ref, block.seq, entries, layout.compressed_page, layout.compressed_num_pages)
        return attend(carry, compressed_ref, rows, entries < most, entries[None, :] < counts[:, None])

    return _num_tiles(most, layout.block_n), tile


def _extra_run(extra_ref, extra_valid_ref, block: Block, layout: Layout, attend):
    """Every token's own extra keys. -> (number of tiles, tile body)."""
    width = extra_valid_ref.shape[1]

    def tile(t, carry):
        token, columns, listed, rows_of_token = _token_tile(t, block, width, layout.block_n)
        row = block.seq * layout.num_queries + token
        valid = listed & (load_block(extra_valid_ref, row, columns, column_valid=listed) != 0)
        return attend(carry, extra_ref, row * width + columns, valid, rows_of_token[:, None] & valid[None, :])

    return block.num_tokens * pl.cdiv(width, layout.block_n), tile


@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "block_m", "block_n", "num_splits",
                                             "num_warps", "num_stages", "interpret"))
def sliding_compressed_attention_pallas(q, window_kv, window_pages, positions, vis: Visibility, sinks, *,
                                        sliding_window: int, scale: float, compressed_kv=None, compressed_pages=None,
                                        compressed_indices=None, compressed_count=None, extra_kv=None,
                                        extra_valid=None, block_m: int | None = None, block_n: int | None = None,
                                        num_splits: int | None = None, num_warps: int | None = None,
                                        num_stages: int = 2, interpret: bool | None = None):
    """`sliding_compressed_attention` as a Pallas kernel; same arguments and result as the reference.

    q [B, Q, H, D], window_kv [P, page, D], window_pages [B, R / page], positions [B, Q], sinks [H],
    compressed_kv [Pc, page, D] with compressed_pages [B, E / page] and compressed_indices
    [B, Q, K] or compressed_count [B, Q], extra_kv [B, Q, X, D] with extra_valid [B, Q, X]
    -> [B, Q, H, D] in q's dtype. window_kv and compressed_kv may be `Fp8Pool`s (both or neither).

    Tuning (static): block_m query rows per program and block_n keys per tile (powers of two
    >= 16; default 64 x 32 for 2-byte inputs and 32 x 16 for float32, as `flash_decoding`, but
    block_m at most ACCUMULATOR / D: 32 at D = 512; with FP8 pools at most FP8_ACCUMULATOR / D by
    FP8_BLOCK_N: 16 x 16), num_splits parts of a program's tiles
    (default: enough programs for the GPU, parts of at least MIN_PART_SLOTS keys), num_warps
    (default 8 for a full ACCUMULATOR, else 4), num_stages of the Triton pipeline; interpret None
    = interpret mode off a GPU, False forces the Triton lowering.
    """
    check_arguments(q, window_kv, window_pages, positions, vis, sinks, sliding_window=sliding_window,
                    compressed_kv=compressed_kv, compressed_pages=compressed_pages,
                    compressed_indices=compressed_indices, compressed_count=compressed_count, extra_kv=extra_kv,
                    extra_valid=extra_valid)
    batch, num_queries, heads, dim = q.shape
    rows = num_queries * heads
    if compressed_kv is not None and isinstance(compressed_kv, Fp8Pool) != isinstance(window_kv, Fp8Pool):
        raise ValueError("sliding_compressed_attention_pallas: window_kv and compressed_kv must both be FP8 pools "
                         "or both arrays")
    dtype = jnp.promote_types(q.dtype, entry_dtype(window_kv))
    dim_block = block_size(dim)
    narrow = jnp.dtype(dtype).itemsize <= 2
    fp8 = isinstance(window_kv, Fp8Pool)
    accumulator = FP8_ACCUMULATOR if fp8 else ACCUMULATOR
    block_m = block_m or block_size(rows, min(64 if narrow else 32, accumulator // dim_block))
    block_n = block_n or (FP8_BLOCK_N if fp8 else 32 if narrow else 16)
    num_warps = num_warps or (8 if block_m * dim_block >= ACCUMULATOR else 4)
    row_blocks = pl.cdiv(rows, block_m)
    compressed = None if compressed_kv is None else "indices" if compressed_indices is not None else "count"
    extra = extra_kv is not None

    # The most keys a query row meets (the ring span, its entries, its extra keys), which the stated
    # cost counts in full, and the most tiles a program walks, which sets the number of parts.
    ring_keys = sliding_window - 1 + num_queries
    entries = 0 if compressed is None else (compressed_indices.shape[-1] if compressed == "indices"
                                            else compressed_pages.shape[1] * compressed_kv.shape[1])
    extra_keys = extra_kv.shape[2] if extra else 0
    block_tokens = max((min(start + block_m, rows) - 1) // heads - start // heads + 1
                       for start in range(0, rows, block_m))
    per_token_tiles = (pl.cdiv(entries, block_n) if compressed == "indices" else 0) + pl.cdiv(extra_keys, block_n)
    tiles = (pl.cdiv(ring_keys, block_n) + block_tokens * per_token_tiles
             + (pl.cdiv(entries, block_n) if compressed == "count" else 0))
    parts = num_splits or num_parts(batch * row_blocks, tiles, MIN_PART_SLOTS // block_n)

    layout = Layout(heads=heads, num_queries=num_queries, rows=rows, rows_padded=row_blocks * block_m, dim=dim,
                    dim_block=dim_block, dtype=dtype, window_page=window_kv.shape[1],
                    window_num_pages=window_kv.shape[0],
                    compressed_page=0 if compressed is None else compressed_kv.shape[1],
                    compressed_num_pages=0 if compressed is None else compressed_kv.shape[0],
                    sliding_window=sliding_window, scale=scale, tree=vis.tree_mask is not None, compressed=compressed,
                    extra=extra, block_m=block_m, block_n=block_n, parts=parts)

    window_ops = [window_pages.astype(jnp.int32), kv_bound(vis, num_queries), positions.astype(jnp.int32),
                  vis.prefix_len.astype(jnp.int32)]
    if layout.tree:
        window_ops.append(vis.tree_mask.reshape(batch * num_queries, num_queries).astype(jnp.int32))
    operands = [q.reshape(batch * rows, dim), sinks.astype(jnp.float32), flat_pool(window_kv), *window_ops]
    small = [*operands[:2], *window_ops]  # everything but the keys, which `key_reads` counts
    if compressed:
        selection = (compressed_indices.reshape(batch * num_queries, -1) if compressed == "indices"
                     else compressed_count).astype(jnp.int32)
        operands += [flat_pool(compressed_kv), compressed_pages.astype(jnp.int32), selection]
        small += operands[-2:]
    if extra:
        extra_kv = stored_extra_keys(extra_kv, window_kv, compressed_kv)
        operands += [extra_kv.reshape(-1, dim), extra_valid.reshape(batch * num_queries, -1).astype(jnp.int32)]
        small += operands[-1:]

    out_shape = part_shapes(batch, parts, layout.rows_padded, layout.dim_block, q.dtype)
    # Stated at capacity: every query row scores and averages D features for each key it may meet.
    keys_per_row = ring_keys + entries + extra_keys
    key_reads = (ring_keys + (num_queries * entries if compressed == "indices" else entries)
                 + num_queries * extra_keys)  # per sequence row; its row blocks share them through L2
    cost = attention_cost(batch, rows, keys_per_row, 2 * dim, cache_token_bytes(window_kv), *small, *out_shape,
                          reads=key_reads)
    out, lse = launch(functools.partial(_kernel, layout=layout), out_shape=out_shape,
                      grid=(row_blocks, parts, batch), num_warps=num_warps,
                      num_stages=num_stages, name="sliding_compressed_attention", interpret=interpret,
                      cost=cost)(*operands)
    out, _ = combine_parts(out, lse, batch, parts, layout.rows_padded, rows, q.dtype)
    return out[..., :dim].reshape(batch, num_queries, heads, dim)
