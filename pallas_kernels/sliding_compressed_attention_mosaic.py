"""Pallas Mosaic GPU kernel (`plgpu.kernel`: TMA, wgmma, two warpgroups) for DeepSeek-V4's
`sliding_compressed_attention`: shared-KV attention over the sliding-window ring, the compressed
entries and the extra keys, with per-head sinks.

Key lists. Every window token (b, q) attends over its own list of keys, in three runs of whole
tiles of TILE (64) keys, each run read from its own array:

  * the ring: all R ring indices in order (`ring_visible` masks them: the sliding rule, the chain
    or the tree's ancestors, committed slots);
  * the compressed entries: the token's index list (CSA; -1 and numbers past the row's pages
    masked) or every entry of the row's pages (HCA; those at or past the token's count masked);
  * the extra keys `extra_kv[b, q, :]` (masked by `extra_valid`).

XLA builds them before the launch as one small array per token: the row of each key in its array
(`[P * page, D]` flattened), -1 for a key the token does not see, `[B * Q, T * TILE]`. The kernel
then needs no visibility logic at all: the ring, a top-k list, a count and the extra keys are all
"gather these rows; -1 scores -inf". Padding tokens' lists are all -1. A tile's rows reach SMEM
with the tile before it, so the copies of its keys are issued from SMEM (`issue_keys`).

Work unit and invariance. As in `sparse_mla_attention_mosaic` (whose structure this kernel
shares): a program holds one token's block of BLOCK_M (64) heads as the wgmma's M rows and
FOLLOWERS * out_block of the D output columns (all 512 of V4's) in three warpgroups; grid

    (column blocks, B * Q * parts * head blocks)   `gathered_softmax_mosaic.work_grid`

and walks one split-KV part of the token's seen tiles (parts of PART_SLOTS / 64 tiles, in order),
tile by tile, with a float32 online softmax; part 0's starts at the head's sink (max = sink,
denominator exp(0) = 1: the sink adds to the denominator only), the others at nothing. Each part
writes a normalised float32 partial and its log-sum-exp, merged by `split_kv.combine_parts`.
Without the split a V4 token (64 heads: one head block) was one program, and B 32, Q 1 left most
SMs idle. A token's list is a function of its own inputs and the ring's size: ring index r sits
at the same place whichever tokens share the call, a key the token does not see contributes an
exact zero, a tile it sees nothing of leaves the carry unchanged bit for bit, and a part with no
seen tile weighs exactly 0 in the merge. So a token's output bits do not depend on B, Q, the chain
or tree around it: invariant by construction. The ring is read once per
token rather than once per sequence row (up to Q times the ring's bytes in a verify step, from L2
after the first token); that buys the invariance and the kernel's simplicity.

Reading the keys (`gathered_softmax_mosaic`). Each seen key's row arrives in bulk copies
(`copy_key`) into a row-major staging tile, is moved through registers into the swizzled tile the
wgmma reads with unseen rows zeroed on the way (stale or never-written memory never meets a zero
probability), and the next tile's copies are issued before this tile's GEMMs. An unseen key is not
read (its copies' barrier arrivals are made without bytes), and a tile with no seen key is skipped
(XLA lists each token's seen tiles first, in order): padding tokens, ring tiles outside the window
and entries past an HCA count cost nothing. Hopper has no TMA gather, and a wgmma operand's 8-row
swizzled tiles cannot take one row per copy. Ring and HCA keys are contiguous within a page and
could arrive as page slices; one gather path for all three runs keeps the kernel small.

FP8 pools (`fp8_cache.Fp8Pool`, FlashMLA's MODEL1 token: 448 e4m3 values with a float32 scale per
64, 64 bfloat16 RoPE values). A key arrives as its e4m3 values, in two copies (a copy moves a
multiple of 128 bytes: [0, 384) and [320, 448), which overlap), and its RoPE values, into two
staging tiles; the move to the swizzled tile dequantizes each value with its block's scale
(`mosaic_gpu.dequantize_rows`, the bits of `fp8_cache.entries`), so the kernel on FP8 pools equals
itself on their entries bit for bit. The listed keys' scales are gathered before the call
(`listed_scales`, 28 bytes a key) and arrive one copy per tile. Both pools must be FP8, or
neither; the extra keys are quantized by the entries' pool's rule before the call, which is how
the op reads them beside FP8 pools (`contracts.stored_extra_keys`), so every run has one format.

Warpgroups: warpgroup 0 gathers, computes `S = Q K^T` and the softmax, and hands P (in the keys'
dtype) and the rescale to the two followers through SMEM; each follower accumulates `P V` over
its own out_block (256) columns in place (`gathered_softmax_mosaic`, the loop, handshake and
register split sparse MLA's kernel runs too, here starting at the sink). So a token's keys are
gathered and `S` computed once per head block; two column-block programs of two warpgroups each
did both twice. Interpreted, by default one warpgroup owns all the program's columns and the
handshake is left out (`gathered_softmax_mosaic.kernel_warpgroups`).

Shared memory at DeepSeek-V4-Flash's widths (D = 512): queries, staging and swizzled tiles of
64 x 512 bf16 (64 KiB each, staging 0.5 KiB more for its padding), P (8 KiB), two tiles' rows,
the rescale and the sinks (1 KiB): 208,928 bytes by Mosaic GPU's count, of the 232,448 (227 KiB)
a block may claim on sm_90. With FP8 pools the staging holds e4m3 rows (29 KiB) and RoPE rows
(9 KiB), plus the tile's scales (2 KiB): 183,328 bytes.

Constraints (ValueError, before tracing): q and every key array bfloat16 or float16, the key
arrays of one dtype; D a multiple of 128, and of 512 when wider than 512. FP8 pools: both of them,
float32 scales per 64 values, bfloat16 RoPE values, RoPE width a multiple of 64 and the values at
least 128 (a copy's bytes). Any page size, any H (padded to a multiple of 64 with zero queries).
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .contracts import check_arguments, extra_key_pool
from .cost import attention_cost, stating
from .fp8_cache import Fp8Pool, cache_token_bytes, entry_dtype, flat_pool, quantize_entries
from .gathered_softmax_mosaic import (CHUNK, FOLLOWERS, GRID_NAMES, OUT_BLOCK, accumulate_tile, check_copies_by_warp,
                                      check_part_width, copies_per_key, fetch_rows, follower, gathered_tiles,
                                      issue_keys, kernel_warpgroups, normalised, part_lse, prepare_tile, program_work,
                                      rows_buffer, scorer, staging, start_followers, work_grid)
from .indexer_mosaic import SWIZZLED, check_mosaic_operands, pad_to
from .mosaic_gpu import check_fp8_pool, compiler_params, interpret_params, interpreting, store
from .paged import flat_rows
from .split_kv import check_part_slots, combine_parts, num_parts
from .thread_copies_mosaic import ThreadCopies, check_copies_by_thread
from .visibility import Visibility, query_valid, ring_visible

BLOCK_M = 64  # head rows per program: one warpgroup's wgmma M
TILE = 64  # keys per tile
# Rows one key array may hold: the kernel takes key rows as float32, whose integers are exact to here.
MAX_ROWS = 2 ** 24
# Seen keys per split-KV part. V4's lists are short (V4-Flash's CSA: a 128-key ring, 512 selected
# entries and the extra keys, 11 tiles), and at 64 heads a token is one head block, so without a
# split B 32, Q 1 ran 32 programs on 132 SMs, each at one SM's tile rate (the H200 measured about
# the same time at B 8 and B 32). Parts of 4 tiles make that 96; each costs a program's start and a
# 128 KiB float32 partial, which the gathers' issue rate, not HBM, has room for.
PART_SLOTS = 256


def _kernel(q_ref, sinks_ref, rows_ref, tiles_ref, count_ref, *refs, runs: tuple[int, ...], fp8: bool,
            scale: float, out_block: int, splits: int, part_tiles: int, warpgroups: int, copies_by_warp: bool,
            copies_by_thread: bool, interpret: bool):
    """One (column block, head block, token part) program of 1 + FOLLOWERS warpgroups: the scorer
    and the followers, each owning out_block of the program's columns (interpreted, by default one
    warpgroup, scoring and owning them all: `gathered_softmax_mosaic.kernel_warpgroups`). Program
    `unit` on grid axis 2 is split-KV part `split = unit % splits` of token `unit // splits`: the
    token's seen tiles [split * part_tiles, + part_tiles), in order.

    q_ref [B * Q, Hp, D] (the keys' dtype), sinks_ref [splits, Hp] float32 (row 0 the heads'
    sinks, the others -inf: no sink), rows_ref [B * Q, T * TILE] float32 (each key's row in its
    array as an exact float32 integer, -1 unseen: `key_rows`), tiles_ref [B * Q, T] int32 (the
    tiles holding a seen key, in order, then anything), count_ref [B * Q] int32 (how many of
    them); with FP8 keys scales_ref [Dq / 64, B * Q, T * TILE] float32 (each listed key's block
    scales, `listed_scales`); then per run its keys [rows, D], or with FP8 keys their e4m3 values
    [rows, Dq] and bfloat16 RoPE values [rows, D - Dq] (tiles [runs[i - 1], runs[i]) of the list
    read run i); out_ref [B * Q * splits, Hp, D] float32 (the part's normalised partial, 0 where
    it saw nothing), lse_ref [B * Q * splits, Hp] (EMPTY_LSE where it saw nothing, not even a
    sink). Follower warpgroup 1 + f owns the output columns
    [(FOLLOWERS * column block + f) * out_block, + out_block).

    A tile's rows sit in SMEM before its keys are gathered: tile s's arrive with tile s - 1's keys
    (the first before the loop), in two alternating buffers, so that issuing a key's copies reads
    its row from SMEM rather than waiting on a global load, key after key. With copies_by_thread
    the keys' copies are `ThreadCopies`', on an mbarrier in the vectors buffer's fifth row.
    """
    scales_ref = refs[0] if fp8 else None
    *arrays, out_ref, lse_ref = refs[1:] if fp8 else refs
    parts = 2 if fp8 else 1
    sources = [arrays[i:i + parts] for i in range(0, len(arrays), parts)]
    widths = [array.shape[-1] for array in sources[0]]
    copies = copies_per_key(sources[0])
    by_thread = ThreadCopies(TILE) if copies_by_thread else None
    column_block, head_block, unit = program_work(q_ref.shape[1] // BLOCK_M)
    token, split = jax.lax.div(unit, splits), jax.lax.rem(unit, splits)
    first = split * part_tiles  # the split-KV part's first seen tile
    wg = jax.lax.axis_index("wg")
    width = q_ref.shape[-1]
    # Tiles with no seen key are skipped (an exact no-op anyway); the part takes its share of the rest.
    num_tiles = jnp.minimum(jnp.maximum(count_ref[token] - first, 0), part_tiles)
    heads = pl.ds(head_block * BLOCK_M, BLOCK_M)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def rows_at(step):  # the rows of the part's `step`-th seen tile
        return rows_ref.at[token, pl.ds(tiles_ref[token, first + step] * TILE, TILE)]

    def gather(step, stagings, rows_smem, scales, barrier):
        """Issue the copies of the part's `step`-th seen tile (its rows already in SMEM) into
        `stagings` and its keys' scales into `scales`, and of the next tile's rows, all arriving
        on `barrier` (the next tile's rows without bytes after the last tile)."""
        tile = tiles_ref[token, first + step]
        rows = rows_buffer(rows_smem, step)
        if fp8:
            plgpu.copy_gmem_to_smem(scales_ref.at[:, token, pl.ds(tile * TILE, TILE)], scales, barrier)
        for run, source in enumerate(sources):
            if by_thread is not None:  # the keys' copies on its own barrier
                issue = functools.partial(by_thread.issue, rows, source, stagings)
            else:
                keys_at = functools.partial(lambda row, source: [array.at[row] for array in source], source=source)
                issue = functools.partial(issue_keys, rows, keys_at, stagings, copies, barrier, by_warp=copies_by_warp)
            pl.when((tile >= (runs[run - 1] if run else 0)) & (tile < runs[run]))(issue)
        fetch_rows(rows_at, step + 1, num_tiles, rows_smem, barrier)

    def body(q_smem, kv_smem, p_smem, vectors, scales, q_barrier, gathered, p_ready, consumed, *stagings):
        # Two tiles' rows, the rescale handed to the followers and the sinks share one buffer: every
        # SMEM buffer starts on a 1 KiB boundary.
        rows_smem, alpha_smem, sinks_smem = vectors.at[0:2], vectors.at[2], vectors.at[3]
        handshake = warpgroups > 1
        handshake_barriers = dict(alpha_smem=alpha_smem, p_ready=p_ready, consumed=consumed)

        def columns(block, count=1):  # follower `block`'s output columns (`count` blocks from there)
            return pl.ds((FOLLOWERS * column_block + block) * out_block, count * out_block)

        # The scorer's columns: none beside the followers, all the program's when it runs alone.
        scored = () if handshake else (columns(0, FOLLOWERS),)

        def accumulate(acc, alpha, cols):
            return accumulate_tile(acc, alpha, p_smem, kv_smem.at[:, cols], interpret)

        def write_out(acc, denom, cols):
            # denom >= exp(sink - max) > 0 in part 0; a later part that saw nothing has 0 and acc 0
            store(out_ref.at[unit, heads, cols], normalised(acc, denom))

        def acc0(cols):
            return plgpu.layout_cast(jnp.zeros((BLOCK_M, cols.size), jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(wg == 0)
        def _scorer():
            plgpu.copy_gmem_to_smem(q_ref.at[token, heads], q_smem, q_barrier)
            plgpu.copy_gmem_to_smem(sinks_ref.at[split, heads], sinks_smem, q_barrier)
            fetch_rows(rows_at, 0, num_tiles, rows_smem, q_barrier)
            plgpu.barrier_wait(q_barrier)
            if by_thread is not None:
                by_thread.init(vectors.at[4])
            pl.when(num_tiles > 0)(lambda: gather(0, stagings, rows_smem, scales, gathered))

            # The sink: max = sink, denominator exp(sink - sink) = 1, no value; past part 0 the sink
            # row is -inf: max -inf and denominator 0, what a part that has seen nothing holds.
            sinks = plgpu.layout_cast(sinks_smem[...], row_layout)
            init = (sinks, jnp.where(sinks > -jnp.inf, 1.0, 0.0), tuple(map(acc0, scored)))
            tiles = gathered_tiles(q_smem, kv_smem, p_smem, scale, gathered)
            if by_thread is not None:
                tiles["wait"] = lambda step: (plgpu.barrier_wait(gathered), by_thread.wait())
            row_max, denom, acc = scorer(
                num_tiles=num_tiles, init=init,
                prepare=functools.partial(prepare_tile, stagings, widths, kv_smem, rows_smem, scales=scales),
                prefetch=lambda step: gather(step, stagings, rows_smem, scales, gathered),
                accumulate=lambda acc, alpha, _step: tuple(accumulate(a, alpha, cols) for a, cols in zip(acc, scored)),
                **tiles, handshake=handshake, **handshake_barriers)
            for a, cols in zip(acc, scored):
                write_out(a, denom, cols)
            store(lse_ref.at[unit, heads], part_lse(row_max, denom))

        def follow(block):
            acc, denom = follower(num_tiles=num_tiles, acc0=acc0(columns(block)), row_layout=row_layout,
                                  accumulate=lambda acc, alpha, _step: accumulate(acc, alpha, columns(block)),
                                  **handshake_barriers)
            write_out(acc, denom, columns(block))

        if handshake:
            start_followers(wg, follow)

    pl.run_scoped(
        body,
        plgpu.SMEM((BLOCK_M, width), q_ref.dtype, transforms=SWIZZLED),
        plgpu.SMEM((TILE, width), q_ref.dtype, transforms=SWIZZLED),
        plgpu.SMEM((BLOCK_M, TILE), q_ref.dtype, transforms=SWIZZLED),
        plgpu.SMEM((4 + copies_by_thread, TILE), jnp.float32),  # + ThreadCopies' mbarrier
        plgpu.SMEM((scales_ref.shape[0], TILE), jnp.float32) if fp8 else None,
        plgpu.Barrier(num_arrivals=3),
        plgpu.Barrier(num_arrivals=(0 if copies_by_thread else TILE * copies) + 1 + fp8),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=max(1, warpgroups - 1)),
        *(staging(TILE, w, array.dtype) for w, array in zip(widths, sources[0])),
        collective_axes="wg",
    )


def _run(rows: jax.Array, seen: jax.Array) -> jax.Array:
    """rows [B, Q, N] int32, seen [B, Q, N] bool -> rows, -1 where unseen, padded to whole tiles
    with unseen keys."""
    return jnp.pad(jnp.where(seen, rows, -1).astype(jnp.int32), [(0, 0), (0, 0), (0, -rows.shape[2] % TILE)],
                   constant_values=-1)


def key_lists(window_kv, window_pages, positions, vis: Visibility, *, sliding_window: int, compressed_kv=None,
              compressed_pages=None, compressed_indices=None, compressed_count=None, extra_kv=None, extra_valid=None):
    """Every token's key list (the module docstring): rows [B, Q, T * TILE] int32 (-1 unseen), the
    runs' ends in tiles, and one key array per run (ring,
    compressed, extra) with its rows flattened: [rows, D], or an `Fp8Pool` of [rows, ...] parts
    (FP8 pools; the extra keys are then quantized as the entries' pool stores them,
    `extra_key_pool`)."""
    batch, num_queries = positions.shape
    valid = query_valid(vis, num_queries)[:, :, None]
    num_pages, page_size = window_kv.shape[:2]
    ring = window_pages.shape[1] * page_size
    ring_rows, _ = flat_rows(window_pages, jnp.broadcast_to(jnp.arange(ring, dtype=jnp.int32), (batch, ring)),
                                  page_size, num_pages)
    runs = [_run(jnp.broadcast_to(ring_rows[:, None], (batch, num_queries, ring)),
                 ring_visible(positions, vis, ring, sliding_window=sliding_window))]
    sources = [flat_pool(window_kv)]
    if compressed_kv is not None:
        entry_pages, entry_page_size = compressed_pages.shape[1], compressed_kv.shape[1]
        if compressed_indices is not None:
            entries = compressed_indices.astype(jnp.int32)
            rows, listed = flat_rows(compressed_pages, entries, entry_page_size, compressed_kv.shape[0])
        else:
            capacity = entry_pages * entry_page_size
            entries = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (batch, num_queries, capacity))
            rows, _ = flat_rows(compressed_pages, entries, entry_page_size, compressed_kv.shape[0])
            listed = entries < compressed_count[:, :, None]
        runs.append(_run(rows, listed & valid))
        sources.append(flat_pool(compressed_kv))
    if extra_kv is not None:
        width = extra_kv.shape[2]
        rows = jnp.arange(batch * num_queries * width, dtype=jnp.int32).reshape(batch, num_queries, width)
        runs.append(_run(rows, extra_valid & valid))
        pool = extra_key_pool(window_kv, compressed_kv)
        if isinstance(pool, Fp8Pool):
            extra_kv = quantize_entries(extra_kv, pool.rule, pool.values.shape[-1])
        sources.append(flat_pool(extra_kv))
    ends = tuple(itertools.accumulate(r.shape[2] // TILE for r in runs))
    return jnp.concatenate(runs, axis=2), ends, sources


def listed_scales(rows: jax.Array, ends: tuple[int, ...], sources) -> jax.Array:
    """rows [B * Q, T * TILE] (`key_lists`), FP8 sources -> each listed key's block scales,
    [Dq / 64, B * Q, T * TILE] float32 (0 for unseen keys), 28 bytes a key beside the 576 the
    kernel reads. Gathered before the call because a copy moves whole 128 bytes (`copy_key`), so
    the kernel cannot fetch one key's 28; a tile's then arrive in one copy. Block-major so that the
    runs' gathers land in place: a token-major layout costs XLA a transpose and a second copy."""
    starts = (0, *ends[:-1])
    per_run = [jnp.take(source.scales.T, jnp.maximum(rows[:, start * TILE:end * TILE], 0), axis=1)
               for start, end, source in zip(starts, ends, sources)]
    return jnp.where(rows >= 0, jnp.concatenate(per_run, axis=2), 0.0)


def check_operands(q, window_kv, compressed_kv=None, extra_kv=None) -> None:
    """ValueError, naming the argument and what is allowed, for operands the kernel cannot take."""
    name = "sliding_compressed_attention_mosaic"
    pools = {arg: array for arg, array in (("window_kv", window_kv), ("compressed_kv", compressed_kv))
             if array is not None}
    fp8 = [isinstance(pool, Fp8Pool) for pool in pools.values()]
    if any(fp8) and not all(fp8):
        raise ValueError(f"{name}: window_kv and compressed_kv must both be FP8 pools or both plain arrays "
                         f"(one staging layout), got {', '.join(type(pool).__name__ for pool in pools.values())}")
    if all(fp8):
        for arg, pool in pools.items():
            check_fp8_pool(name, pool, what=arg, block=CHUNK)
            if pool.rope.shape[-1] % CHUNK:
                raise ValueError(f"{name}: {arg}.rope width {pool.rope.shape[-1]} must be a multiple of {CHUNK}")
            check_part_width(name, f"{arg}.values", pool.values.shape[-1], pool.values.dtype)
        if compressed_kv is not None and compressed_kv.values.shape[-1] != window_kv.values.shape[-1]:
            raise ValueError(f"{name}: compressed_kv's FP8 width {compressed_kv.values.shape[-1]} must equal "
                             f"window_kv's {window_kv.values.shape[-1]} (one staging layout)")
        keys = {"q": q, **{f"{arg}.rope": pool.rope for arg, pool in pools.items()}}
    else:
        keys = {"q": q, **pools, **({} if extra_kv is None else {"extra_kv": extra_kv})}
    check_mosaic_operands(name, *keys.values())
    if not all(fp8):
        for arg, array in keys.items():
            if arg != "q" and array.dtype != window_kv.dtype:
                raise ValueError(f"{name}: {arg}.dtype={array.dtype} must equal window_kv.dtype={window_kv.dtype} "
                                 "(one wgmma operand type)")
    dim = q.shape[-1]
    if dim % 128 or (dim > FOLLOWERS * OUT_BLOCK and dim % (FOLLOWERS * OUT_BLOCK)):
        raise ValueError(f"{name}: q last dim D={dim} must be a multiple of 128 (of {FOLLOWERS * OUT_BLOCK} when "
                         "wider)")
    for arg, array in (*pools.items(), ("extra_kv", extra_kv)):
        if array is not None and math.prod(array.shape[:-1]) > MAX_ROWS:
            raise ValueError(f"{name}: {arg} holds {math.prod(array.shape[:-1])} keys: at most {MAX_ROWS} (key rows "
                             "reach the kernel as float32, exact integers to 2**24)")


def sliding_compressed_attention_mosaic(q, window_kv, window_pages, positions, vis: Visibility, sinks, *,
                                        sliding_window: int, scale: float, compressed_kv=None,
                                        compressed_pages=None, compressed_indices=None, compressed_count=None,
                                        extra_kv=None, extra_valid=None, part_slots: int = PART_SLOTS,
                                        copies_by_warp: bool = False, copies_by_thread: bool = False,
                                        interpret: bool = False):
    """`sliding_compressed_attention` as a Mosaic GPU kernel; same arguments and result as the
    reference: q [B, Q, H, D], window_kv [P, page, D], window_pages [B, R / page], positions
    [B, Q], sinks [H], compressed_kv [Pc, page, D] with compressed_pages [B, E / page] and
    compressed_indices [B, Q, K] or compressed_count [B, Q], extra_kv [B, Q, X, D] with
    extra_valid [B, Q, X] -> [B, Q, H, D] in q's dtype.

    window_kv and compressed_kv may be `fp8_cache.Fp8Pool`s (FlashMLA's MODEL1 token: e4m3 values
    with one float32 scale per 64, bfloat16 RoPE values), both or neither; the kernel dequantizes
    in registers as `fp8_cache.entries` does, so it equals itself on the pools' entries bit for
    bit (and on the extra keys as those pools store them, as the op defines).

    Allowed (ValueError otherwise, before tracing): bfloat16 / float16 q and keys, the key arrays
    of one dtype (FP8 pools: a bfloat16 RoPE part and e4m3 values each a multiple of 64 wide, the
    values at least 128); D a multiple of 128 (of 512 when wider); part_slots a positive multiple
    of 64.
    part_slots: keys per split-KV part: a token's seen tiles, in order, run as parts of
      part_slots / 64 tiles, ceil(T / (part_slots / 64)) of them for a list of T tiles, merged by
      log-sum-exp; the sink goes into part 0. The parts come from the token's own list, so its bits
      do not depend on B or Q; a part that sees nothing weighs exactly 0 in the merge.
    copies_by_warp: the scorer's four warps each issue a quarter of a tile's key copies
      (`gathered_softmax_mosaic.issue_keys`), as sparse MLA's tuning of that name: to be timed, not
      yet the default; the same bytes land in the same places. Interpreted, it needs jax 0.11 or
      later (a ValueError on 0.10.2, whose interpreter has no `core_map`).
    copies_by_thread: each of the scorer's first 64 threads issues one key's copies and arrives
      once for them (`thread_copies_mosaic.ThreadCopies`), as sparse MLA's tuning of that name: to
      be timed, not yet the default; the same bytes land in the same places. Compiled only (a
      ValueError interpreted); not with copies_by_warp.
    interpret: run on the CPU simulator (`mosaic_gpu.interpreting`) instead of lowering for a GPU.
    """
    kwargs = dict(sliding_window=sliding_window, compressed_kv=compressed_kv, compressed_pages=compressed_pages,
                  compressed_indices=compressed_indices, compressed_count=compressed_count, extra_kv=extra_kv,
                  extra_valid=extra_valid)
    check_arguments(q, window_kv, window_pages, positions, vis, sinks, **kwargs)
    check_operands(q, window_kv, compressed_kv, extra_kv)
    check_part_slots("sliding_compressed_attention_mosaic", part_slots, TILE)
    check_copies_by_thread("sliding_compressed_attention_mosaic", copies_by_thread, copies_by_warp, interpret)
    check_copies_by_warp("sliding_compressed_attention_mosaic", copies_by_warp, interpret)
    run = functools.partial(_sliding_compressed, q, window_kv, window_pages, positions, vis, sinks, scale=scale,
                            part_slots=part_slots, copies_by_warp=copies_by_warp, copies_by_thread=copies_by_thread,
                            interpret=interpret, **kwargs)
    if not interpret:
        return run()
    with interpreting():
        return run()


@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "part_slots", "copies_by_warp",
                                             "copies_by_thread", "interpret"))
def _sliding_compressed(q, window_kv, window_pages, positions, vis, sinks, *, sliding_window: int, scale: float,
                        compressed_kv, compressed_pages, compressed_indices, compressed_count, extra_kv,
                        extra_valid, part_slots: int, copies_by_warp: bool, copies_by_thread: bool,
                        interpret: bool):
    warpgroups = kernel_warpgroups(interpret)
    batch, num_queries, heads, dim = q.shape
    tokens = batch * num_queries
    fp8 = isinstance(window_kv, Fp8Pool)
    rows, runs, sources = key_lists(
        window_kv, window_pages, positions, vis, sliding_window=sliding_window, compressed_kv=compressed_kv,
        compressed_pages=compressed_pages, compressed_indices=compressed_indices, compressed_count=compressed_count,
        extra_kv=extra_kv, extra_valid=extra_valid)
    rows = rows.reshape(tokens, -1)
    queries = pad_to(q, 2, BLOCK_M).reshape(tokens, -1, dim).astype(entry_dtype(window_kv))
    heads_padded = queries.shape[1]
    out_block = min(dim // FOLLOWERS, OUT_BLOCK)  # columns per follower
    arrays = [part for source in sources for part in ((source.values, source.rope) if fp8 else (source,))]
    part_tiles = part_slots // TILE
    splits = num_parts(runs[-1], part_tiles)  # runs[-1]: the list's tiles
    out_type = (jax.ShapeDtypeStruct((tokens * splits, heads_padded, dim), jnp.float32),
                jax.ShapeDtypeStruct((tokens * splits, heads_padded), jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(_kernel, runs=runs, fp8=fp8, scale=scale, out_block=out_block, splits=splits,
                          part_tiles=part_tiles, warpgroups=warpgroups, copies_by_warp=copies_by_warp,
                          copies_by_thread=copies_by_thread, interpret=interpret),
        kernel_name="sliding_compressed_attention_mosaic",
        out_type=out_type,
        grid=work_grid(dim // (FOLLOWERS * out_block), heads_padded // BLOCK_M, tokens * splits),
        grid_names=GRID_NAMES,
        num_threads=warpgroups, thread_name="wg", compiler_params=compiler_params(),
        interpret=interpret_params() if interpret else None)
    seen = jnp.any(rows.reshape(tokens, -1, TILE) >= 0, axis=2)  # [B * Q, T]
    tiles = jnp.argsort(~seen, axis=1, stable=True).astype(jnp.int32)  # the seen tiles first, in order
    scales = (listed_scales(rows, runs, sources),) if fp8 else ()
    # Rows travel as float32 (exact below MAX_ROWS) to share the SMEM buffer of the float32 vectors.
    sinks = pad_to(sinks.astype(jnp.float32), 0, BLOCK_M)
    part_sinks = jnp.concatenate([sinks[None], jnp.full((splits - 1, heads_padded), -jnp.inf, jnp.float32)])
    small = (queries, part_sinks, rows.astype(jnp.float32), tiles, jnp.sum(seen, axis=1, dtype=jnp.int32))
    # Every listed key (tile padding included, as the tensor cores run it) read once per token
    # (tokens gather their own keys), by all its heads; an FP8 key's bytes hold its scales.
    cost = attention_cost(tokens, heads, rows.shape[-1], 2 * dim, cache_token_bytes(window_kv), *small, *out_type)
    with stating(cost, "sliding_compressed_attention"):
        out, lse = kernel(*small, *scales, *arrays)
    out, _ = combine_parts(out.reshape(tokens, splits, heads_padded, dim), lse.reshape(tokens, splits, heads_padded),
                           q.dtype)
    return out[:, :heads].reshape(batch, num_queries, heads, dim)
