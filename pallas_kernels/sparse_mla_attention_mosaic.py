"""Pallas Mosaic GPU kernel (`plgpu.kernel`: TMA, wgmma) for `sparse_mla_attention`: absorbed MLA of
each query token over its own selected slots.

Work unit. Every window token (b, q) has its own index list `indices[b, q, :]` (2048 slots for
DeepSeek-V3.2) shared by its H heads, so tokens share no KV reads: a program holds one token's
block of BLOCK_M (64) heads as the wgmma's M rows and FOLLOWERS * OUT_BLOCK (512) latent columns,
all of DeepSeek's, in three warpgroups, over one part of the token's list. Grid:

    (latent column blocks, B * Q * parts * head blocks)   `gathered_softmax_mosaic.work_grid`

(one column block up to 512 columns), so a token's rows are gathered and its scores computed once
per head block, and a token part's two head blocks (DeepSeek's 128 heads) launch side by side:
the second reads the part's rows from L2. A program walks its part of the index list in tiles of TILE (64) slots with an
online softmax in float32 and writes a normalised float32 partial and its log-sum-exp, which
`split_kv.combine_parts` merges. Split-KV: the list is cut into `split_kv.num_parts(K,
part_slots)` parts of whole tiles (K the list's length: 4 parts of PART_SLOTS at DeepSeek-V3.2's
2048), so at B 1 a token's two head blocks run on 8 SMs, not 2, each walking 8 tiles, not 32 (the
H200 measured 0.39 ms at B 1 and at B 32 without the split: one SM's tile rate, whatever B). The
parts are set by K alone, so a token's output bits depend on its own queries, indices and cache
rows only, never on B or Q: invariant by construction.

Warpgroups (FlashMLA's split of the 512-wide output, with the scoring warpgroup apart).
Warpgroup 0 gathers, computes `S`, runs the softmax and hands P and the rescale to warpgroups 1
and 2 through SMEM (barriers `p_ready` / `consumed`, the latter with one arrival per follower);
each follower accumulates `P V` over its own OUT_BLOCK columns in place (`accumulate_tile`: a
64 x 256 float32 accumulator, 128 registers a thread), so the scorer carries no accumulator and
its gather and softmax overlap the followers' GEMMs. The loop and its handshake are
`gathered_softmax_mosaic`'s, which DeepSeek-V4's kernel shares. Registers are rebalanced between
them (`setmaxnreg`: SCORER_REGISTERS / FOLLOWER_REGISTERS). Before, two warpgroups of 128
columns each, with fresh accumulators, made two column programs per head block, each gathering
the same rows and computing the same `S`: twice the gathers and 1.53x the tensor work of this
layout, and 240 bytes of spills a thread at 255 registers.

Reading scattered slots (`gathered_softmax_mosaic`). Hopper has no TMA gather, and a wgmma operand
must sit in SMEM as 8-row swizzled tiles, which a copy per slot cannot fill. XLA resolves every
selected slot to its row of the flattened cache before the launch (-1 for `-1` and slots past the
row's pages, which are then not read), a tile's rows reach SMEM with the tile before it, and each
selected slot's row (576 bf16, contiguous in its page) arrives in one bulk copy (`copy_key`,
issued from SMEM: `issue_keys`) into a row-major staging tile; the warpgroup then moves the staging tile through registers into the
swizzled tile the wgmma reads, zeroing the rows of unselected slots on the way (stale cache memory
never meets a zero probability), and issues the next tile's copies before this tile's GEMMs: the
gather of tile t + 1 overlaps the tensor cores' work on tile t. Staging rows are padded by 16
bytes so that those register reads are free of bank conflicts. FlashMLA's sparse decode gathers
with per-thread 16-byte loads instead; Pallas Mosaic GPU has no gathering register load, and
whole-row copies use every HBM sector they fetch.

Per tile: `S = Q K^T` ([64, 576] x [576, 64], the tile read transposed: a bit of the wgmma on the
GPU), the scale, the mask and the online softmax in registers, P to SMEM in the cache's dtype, then
`P V` into each follower's accumulator. Interpreted, warpgroup 0 does all of it by default
(`gathered_softmax_mosaic.kernel_warpgroups`), with fresh accumulators (`accumulate_tile`): jax
0.10.2's interpreter runs no in-place accumulation.

FP8 caches (`fp8_cache.Fp8Pool`, FlashMLA's token). A selected slot arrives as its 512 e4m3 values
and its 64 bfloat16 RoPE values (a copy each) into two staging tiles, and the move to the swizzled
tile dequantizes each value with its block's scale in registers (`mosaic_gpu.dequantize_rows`: the
bits of `fp8_cache.entries`), so the kernel on an FP8 pool equals itself on the pool's dequantized
entries bit for bit. The selected slots' scales (16 bytes a slot) are gathered in XLA before the
call, `[B * Q * parts, Dl / 128, K / parts]`, and arrive one copy per tile: a copy moves a multiple of 128 bytes,
so a slot's 16 cannot come on their own. That is 2.5%
beside the 640 bytes a slot the kernel reads; no dequantized copy of the cache exists in HBM.

Shared memory at DeepSeek's widths: queries, staging and swizzled tiles of 64 x 576 bf16
(72 KiB each, the staging 1 KiB more for its padding), P (8 KiB), two tiles' rows and the
rescale (one 1 KiB-aligned buffer): 231,456 of the 232,448 bytes a block may use, so the cross-warp reduction
scratch is turned off (every reduction here stays inside a warp). With FP8 the staging holds e4m3
rows (33 KiB) and RoPE rows (9 KiB), plus the tile's scales: 200,736 bytes.

Interpreted on the CPU, warpgroup 0 does every warpgroup's work unless the GPU's warpgroups are
asked for (`mosaic_gpu.interpreted_warpgroups`).

Constraints (ValueError): bfloat16 / float16 operands (an FP8 pool: e4m3 values, float32 scales,
a bfloat16 RoPE part); Dl a multiple of 128 (of FOLLOWERS * OUT_BLOCK when wider), Dr of 64; at most
MAX_ROWS slots in the cache. Any page size. Heads are padded to a multiple of 64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .cost import attention_cost, stating
from .fp8_cache import Fp8Pool, cache_token_bytes, entry_dtype, flat_pool
from .gathered_softmax_mosaic import (FOLLOWERS, GRID_NAMES, OUT_BLOCK, accumulate_tile, check_copies_by_warp,
                                      copies_per_key, fetch_rows, follower, gathered_tiles, issue_keys,
                                      kernel_warpgroups, normalised, part_lse, prepare_tile, program_work, rows_buffer,
                                      scorer, staging, start_followers, work_grid)
from .indexer_mosaic import SWIZZLED, check_mosaic_operands, pad_to
from .mosaic_gpu import check_fp8_pool, compiler_params, interpreting, store
from .paged import read_slots, selected_rows
from .split_kv import check_part_slots, combine_parts, num_parts
from .thread_copies_mosaic import ThreadCopies, check_copies_by_thread

BLOCK_M = 64  # head rows per program: one warpgroup's wgmma M
TILE = 64  # selected slots per tile
# Slots the cache may hold: the kernel takes slot rows as float32, whose integers are exact to here.
MAX_ROWS = 2 ** 24
# Selected slots per split-KV part. Shorter parts fill more SMs at small B (a token's program walks
# its part at one SM's tile rate) but add a program's start (its query block and first tile, not
# overlapped) and its float32 partial (64 x 512 x 4 bytes, written and merged) per part: 8 tiles
# keep those near a tenth of a part's own work, and at B 32, Q 4 the 1024 programs fill the SMs
# in 8 waves where 256 took 2, the second short. The GPU report times 256 and 2048 beside it.
PART_SLOTS = 512


def _sparse_mla_kernel(q_ref, rows_ref, *refs, softmax_scale: float, out_block: int, splits: int, fp8: bool,
                       warpgroups: int, copies_by_warp: bool, copies_by_thread: bool, interpret: bool):
    """One (column block, head block, token part) program of 1 + FOLLOWERS warpgroups: the scorer
    and the followers, each owning out_block of the program's columns (interpreted, by default one
    warpgroup, scoring and owning them all: `gathered_softmax_mosaic.kernel_warpgroups`). Program
    `unit` (`program_work`) is split-KV part `unit % splits` of token `unit // splits`.

    q_ref [B * Q, Hp, Dl + Dr]; rows_ref [B * Q * splits, K / splits] float32 (each selected slot's
    row in the flattened cache as an exact float32 integer, -1 for none); for an FP8 cache
    scales_ref [B * Q * splits, Dl / 128, K / splits] float32 (each selected slot's block scales);
    then the cache, flattened: cache_ref [P * page, Dl + Dr], or for an FP8 cache values_ref
    [P * page, Dl] e4m3 and rope_ref [P * page, Dr] bfloat16; out_ref [B * Q * splits, Hp, Dl]
    float32 (the part's normalised partial, 0 where it saw nothing), lse_ref [B * Q * splits, Hp]
    (EMPTY_LSE where it saw nothing). Follower warpgroup 1 + f owns the output columns
    [(FOLLOWERS * column block + f) * out_block, + out_block).

    A tile's rows sit in SMEM before its slots are gathered (`issue_keys`, or with copies_by_thread
    `ThreadCopies` on an mbarrier of its own in the vectors buffer's fourth row): tile t's arrive
    with tile t - 1's slots (the first before the loop), in two alternating buffers."""
    scales_ref = refs[0] if fp8 else None
    *parts, out_ref, lse_ref = refs[1:] if fp8 else refs
    copies = copies_per_key(parts)
    column_block, head_block, unit = program_work(q_ref.shape[1] // BLOCK_M)
    wg = jax.lax.axis_index("wg")
    width = q_ref.shape[-1]
    num_tiles = rows_ref.shape[1] // TILE
    heads = pl.ds(head_block * BLOCK_M, BLOCK_M)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    by_thread = ThreadCopies(TILE) if copies_by_thread else None

    def rows_at(tile):
        return rows_ref.at[unit, pl.ds(tile * TILE, TILE)]

    def gather(tile, stagings, rows_smem, scales, barrier):
        """Issue tile `tile`'s copies (its rows already in SMEM), its scales' and the next tile's rows',
        all arriving on `barrier` (the next rows without bytes after the last tile)."""
        if scales_ref is not None:
            plgpu.copy_gmem_to_smem(scales_ref.at[unit, :, pl.ds(tile * TILE, TILE)], scales, barrier)
        if by_thread is not None:  # the slots' copies on its own barrier
            by_thread.issue(rows_buffer(rows_smem, tile), parts, stagings)
        else:
            issue_keys(rows_buffer(rows_smem, tile), lambda row: [part.at[row] for part in parts], stagings, copies,
                       barrier, by_warp=copies_by_warp)
        fetch_rows(rows_at, tile + 1, num_tiles, rows_smem, barrier)

    def body(q_smem, kv_smem, p_smem, vectors, scales, q_barrier, gathered, p_ready, consumed, *stagings):
        # Two tiles' rows and the rescale handed to the followers share one buffer: every SMEM buffer
        # starts on a 1 KiB boundary, and two would not fit beside the three 72 KiB tiles.
        rows_smem, alpha_smem = vectors.at[0:2], vectors.at[2]
        handshake = warpgroups > 1

        def columns(block):  # the output columns of follower `block`'s share
            return pl.ds((FOLLOWERS * column_block + block) * out_block, out_block)

        def write_out(acc, denom, block):
            store(out_ref.at[unit, heads, columns(block)], normalised(acc, denom))

        # The column blocks warpgroup 0 accumulates: none beside its followers, both when it runs alone.
        owned = () if handshake else range(FOLLOWERS)

        acc0 = plgpu.layout_cast(jnp.zeros((BLOCK_M, out_block), jnp.float32), plgpu.Layout.WGMMA)
        handshake_barriers = dict(alpha_smem=alpha_smem, p_ready=p_ready, consumed=consumed)

        @pl.when(wg == 0)
        def _scorer():
            plgpu.copy_gmem_to_smem(q_ref.at[unit // splits, heads], q_smem, q_barrier)
            fetch_rows(rows_at, 0, num_tiles, rows_smem, q_barrier)
            plgpu.barrier_wait(q_barrier)
            if by_thread is not None:
                by_thread.init(vectors.at[3])
            gather(0, stagings, rows_smem, scales, gathered)

            def accumulate(acc, alpha, _tile):
                return tuple(accumulate_tile(a, alpha, p_smem, kv_smem.at[:, columns(block)], interpret)
                             for a, block in zip(acc, owned))

            tiles = gathered_tiles(q_smem, kv_smem, p_smem, softmax_scale, gathered)
            if by_thread is not None:
                tiles["wait"] = lambda tile: (plgpu.barrier_wait(gathered), by_thread.wait())
            init = (plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), row_layout),
                    plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), row_layout), (acc0,) * len(owned))
            row_max, denom, acc = scorer(
                num_tiles=num_tiles, init=init,
                prepare=functools.partial(prepare_tile, stagings, [part.shape[-1] for part in parts], kv_smem,
                                          rows_smem, scales=scales),
                prefetch=lambda tile: gather(tile, stagings, rows_smem, scales, gathered), accumulate=accumulate,
                **tiles, handshake=handshake, **handshake_barriers)
            for a, block in zip(acc, owned):
                write_out(a, denom, block)
            store(lse_ref.at[unit, heads], part_lse(row_max, denom))

        def follow(block):
            acc, denom = follower(
                num_tiles=num_tiles, acc0=acc0, row_layout=row_layout,
                accumulate=lambda acc, alpha, _tile: accumulate_tile(acc, alpha, p_smem, kv_smem.at[:, columns(block)],
                                                                    interpret),
                **handshake_barriers)
            write_out(acc, denom, block)

        if handshake:
            start_followers(wg, follow)

    operand_dtype = q_ref.dtype  # what the tensor cores read: the cache's dtype, or an FP8 cache's entries'
    pl.run_scoped(
        body,
        plgpu.SMEM((BLOCK_M, width), operand_dtype, transforms=SWIZZLED),
        plgpu.SMEM((TILE, width), operand_dtype, transforms=SWIZZLED),
        plgpu.SMEM((BLOCK_M, TILE), operand_dtype, transforms=SWIZZLED),
        # Two tiles' rows, the rescale, and with copies_by_thread 8 bytes of its mbarrier (within
        # the 1 KiB the buffer takes anyway).
        plgpu.SMEM((3 + copies_by_thread, TILE), jnp.float32),
        None if scales_ref is None else plgpu.SMEM((scales_ref.shape[1], TILE), jnp.float32),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=(0 if copies_by_thread else TILE * copies) + 1 + fp8),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=max(1, warpgroups - 1)),
        *(staging(TILE, part.shape[-1], part.dtype) for part in parts),
        collective_axes="wg",
    )


def sparse_mla_attention_mosaic(q_nope: jax.Array, q_rope: jax.Array, latent_cache, page_table: jax.Array,
                                indices: jax.Array, *, softmax_scale: float, part_slots: int = PART_SLOTS,
                                auto_barriers: bool = True, copies_by_warp: bool = False,
                                copies_by_thread: bool = False, interpret: bool = False):
    """`sparse_mla_attention` as a Mosaic GPU kernel; same arguments and results as the reference.

    q_nope [B, Q, H, Dl], q_rope [B, Q, H, Dr], latent_cache [P, page, Dl + Dr] or an
    `fp8_cache.Fp8Pool` of that shape (values [P, page, Dl] e4m3, scales [P, page, Dl / 128]
    float32, rope [P, page, Dr] bfloat16: dequantized in the kernel as `fp8_cache.entries` reads
    it, so the result equals this kernel's on the dequantized cache bit for bit),
    page_table [B, max_pages] int32, indices [B, Q, K] int32 (-1 and slots past the row's pages are
    skipped) -> out [B, Q, H, Dl] (q_nope.dtype), lse [B, Q, H] float32.
    part_slots: selected slots per split-KV part (a positive multiple of 64); a token's list of K
      runs as ceil(K / part_slots) parts, padded with -1 to whole parts of whole tiles.
    auto_barriers: False lowers with `unsafe_no_auto_barriers`, a tuning to be timed (not yet the
      default): Pallas then drops the warpgroup barrier it puts before each of a tile's 64 slot
      copies and around each shared-memory store. Nothing here needs them: the scorer's
      `commit_smem` after a tile's move into the operand (a warpgroup barrier) orders every
      thread's reads of the staging tile and of the tile's rows before the copies that overwrite
      them; a store's region is written by its own threads only and read by the tensor cores after
      a `commit_smem`, or by the other warpgroup after an mbarrier; and the loads of a tile's rows
      follow the wait on the copies that brought them. The interpreter ignores it.
    copies_by_warp: the scorer's four warps each issue a quarter of a tile's slot copies
      (`gathered_softmax_mosaic.issue_keys`), a tuning to be timed (not yet the default); the same
      bytes land in the same places, so the results do not change. Interpreted, it needs jax 0.11
      or later (a ValueError on 0.10.2, whose interpreter has no `core_map`).
    copies_by_thread: each of the scorer's first 64 threads issues one slot's copies and arrives
      once for them (`thread_copies_mosaic.ThreadCopies`: 64 arrivals a tile where Pallas' copies
      make 128 a copy), a tuning to be timed (not yet the default); the same bytes land in the same
      places. Compiled only (a ValueError interpreted: the simulator does not run inline Mosaic
      GPU code); not with copies_by_warp.
    interpret: run on the CPU simulator (`mosaic_gpu.interpreting`) instead of lowering for a GPU.
    """
    latent, rope = q_nope.shape[-1], q_rope.shape[-1]
    if isinstance(latent_cache, Fp8Pool):
        check_fp8_pool("sparse_mla_attention_mosaic", latent_cache)
        check_mosaic_operands("sparse_mla_attention_mosaic", q_nope, q_rope, latent_cache.rope)
    else:
        check_mosaic_operands("sparse_mla_attention_mosaic", q_nope, q_rope, latent_cache)
    if latent_cache.shape[-1] != latent + rope:
        raise ValueError(f"sparse_mla_attention_mosaic: latent_cache last dim {latent_cache.shape[-1]} != "
                         f"Dl + Dr = {latent} + {rope}")
    if latent % 128 or rope % 64 or (latent > FOLLOWERS * OUT_BLOCK and latent % (FOLLOWERS * OUT_BLOCK)):
        raise ValueError(f"sparse_mla_attention_mosaic: Dl={latent} must be a multiple of 128 (of "
                         f"{FOLLOWERS * OUT_BLOCK} when wider) and Dr={rope} of 64")
    check_copies_by_thread("sparse_mla_attention_mosaic", copies_by_thread, copies_by_warp, interpret)
    check_copies_by_warp("sparse_mla_attention_mosaic", copies_by_warp, interpret)
    check_part_slots("sparse_mla_attention_mosaic", part_slots, TILE)
    slots = latent_cache.shape[0] * latent_cache.shape[1]
    if slots > MAX_ROWS:
        raise ValueError(f"sparse_mla_attention_mosaic: latent_cache holds {slots} slots: at most {MAX_ROWS} (slot "
                         "rows reach the kernel as float32, exact integers to 2**24)")
    run = functools.partial(_sparse_mla, q_nope, q_rope, latent_cache, page_table, indices,
                            softmax_scale=softmax_scale, part_slots=part_slots, auto_barriers=auto_barriers,
                            copies_by_warp=copies_by_warp, copies_by_thread=copies_by_thread, interpret=interpret)
    if not interpret:
        return run()
    with interpreting():
        return run()


@functools.partial(jax.jit, static_argnames=("softmax_scale", "part_slots", "auto_barriers", "copies_by_warp",
                                             "copies_by_thread", "interpret"))
def _sparse_mla(q_nope, q_rope, latent_cache, page_table, indices, *, softmax_scale: float, part_slots: int,
                auto_barriers: bool, copies_by_warp: bool, copies_by_thread: bool, interpret: bool):
    warpgroups = kernel_warpgroups(interpret)
    batch, num_queries, heads, latent = q_nope.shape
    page_size = latent_cache.shape[1]
    tokens = batch * num_queries
    fp8 = isinstance(latent_cache, Fp8Pool)
    q = pad_to(jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1), 2, BLOCK_M)
    q = q.reshape(tokens, -1, q.shape[-1]).astype(entry_dtype(latent_cache))
    topk = indices.shape[-1]
    parts = num_parts(topk, part_slots)
    part_len = pl.cdiv(pl.cdiv(topk, TILE), parts) * TILE  # whole tiles a part
    indices = pad_to(indices.astype(jnp.int32) + 1, 2, parts * part_len) - 1  # pad with -1
    # -1 and slots past the row's pages address nothing: row -1
    rows = selected_rows(page_table, indices.reshape(batch, -1), page_size, latent_cache.shape[0])
    rows = rows.reshape(tokens * parts, part_len)
    if fp8:
        # Each selected slot's block scales, [B * Q, Dl / 128, K]: 16 bytes a slot beside its 640 in
        # the kernel. Gathered here because a copy moves a multiple of 128 bytes, so the kernel
        # cannot fetch one slot's 16; a tile's scales then arrive in one copy, a block's as a row.
        scales = read_slots(latent_cache.scales, page_table, indices.reshape(batch, -1))
        scale_operands = (jnp.swapaxes(scales.reshape(tokens * parts, part_len, -1), 1, 2),)
        cache_operands = (latent_cache.values, latent_cache.rope)
    else:
        cache_operands, scale_operands = (latent_cache,), ()
    out_block = min(latent // FOLLOWERS, OUT_BLOCK)  # columns per follower
    heads_padded = q.shape[1]
    out_type = (jax.ShapeDtypeStruct((tokens * parts, heads_padded, latent), jnp.float32),
                jax.ShapeDtypeStruct((tokens * parts, heads_padded), jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(_sparse_mla_kernel, softmax_scale=softmax_scale, out_block=out_block, splits=parts, fp8=fp8,
                          warpgroups=warpgroups, copies_by_warp=copies_by_warp, copies_by_thread=copies_by_thread,
                          interpret=interpret),
        kernel_name="sparse_mla_attention_mosaic",
        out_type=out_type,
        grid=work_grid(latent // (FOLLOWERS * out_block), heads_padded // BLOCK_M, tokens * parts),
        grid_names=GRID_NAMES,
        num_threads=warpgroups, thread_name="wg",
        # The row reductions stay inside each warp (WGMMA layout): no cross-warp scratch, whose
        # default 2 KiB would push the three 72 KiB tiles past the 227 KiB a block may use.
        compiler_params=compiler_params(reduction_scratch_bytes=0, unsafe_no_auto_barriers=not auto_barriers))
    # Rows travel as float32 (exact below MAX_ROWS) to share the SMEM buffer of the rescale.
    rows = rows.astype(jnp.float32)
    # As the Triton kernel states it: a token's listed slots (-1 entries included) read once, by all
    # its heads; an FP8 slot's bytes hold its scales, so the gathered scales are not added.
    cost = attention_cost(tokens, heads, topk, 2 * latent + q_rope.shape[-1], cache_token_bytes(latent_cache), q,
                          rows, *out_type)
    with stating(cost, "sparse_mla_attention"):
        out, lse = kernel(q, rows, *scale_operands, *(flat_pool(part) for part in cache_operands))
    out, lse = combine_parts(out.reshape(tokens, parts, heads_padded, latent), lse.reshape(tokens, parts, heads_padded),
                             q_nope.dtype)
    out = out[:, :heads].reshape(batch, num_queries, heads, latent)
    return out, lse[:, :heads].reshape(batch, num_queries, heads)
