"""Pallas Mosaic GPU kernel (`plgpu.kernel`: TMA, wgmma, mbarriers, three warpgroups) for `mla_attention`.

Work layout. The Q window tokens x H heads of a sequence row fold into M = Q * H query rows (row
m = q * H + h), padded to whole blocks of BLOCK_M = 64 (wgmma's M). A thread block owns one block
of 64 rows, one part of the row's slots and one sequence row; grid `(B, parts, row blocks)`, its
last axis fastest (Mosaic GPU launches a Pallas grid reversed), so the row blocks that read the
same pages run side by side and the pages come from HBM once, the other reads from L2. It
streams the part's cache past its rows in tiles of BLOCK_N = 64 slots, two TMA copies of a page
slice per tile (its [64, Dl] latent and [64, Dr] RoPE parts), double-buffered so the next tile
lands while this one is multiplied. Three warpgroups share the work as in the gathering kernels
(`gathered_softmax_mosaic.scorer` and `follower`): warpgroup 0 computes the tile's scores
`[64, 64] = q [64, Dl + Dr] @ tile^T` (two wgmmas into one accumulator, latent then RoPE:
K = 512 + 64, the K steps of one K = 576 wgmma in the same order) and the online softmax, and
hands P and the rescale to two followers through shared memory; each follower accumulates its
half of the 512-wide output, `[64, 256]` float32 (128 registers a thread, in place): a 64 x 512
float32 accumulator would not fit one warpgroup's registers, which is what serialized the Triton
kernel's wgmma. The scorer carries no accumulator, so its scores and softmax of tile t + 1
overlap the followers' `P V` of tile t (FlashMLA's consumers split the output the same way; the
scorer apart is FlashAttention-3's overlap of softmax and GEMMs), and `setmaxnreg` gives it 184
registers, the followers 160 (`gathered_softmax_mosaic.SCORER_REGISTERS`: what the launch's 168 a
thread of three warpgroups allow). The scores are computed once a tile: the SM's tensor cores do
64 x 64 x (576 + 512) multiply-adds a tile, where scoring in both of two warpgroups did
64 x 64 x (2 x 576 + 512), 1.53x as many; at 128 heads the op is compute-bound from Q = 2 on and
near the ridge at Q = 1. P takes no shared memory of its own: it goes into the tile's RoPE buffer,
which only the scores read, and the rescale into the log-sum-exp buffer, unused until the end.

FP8 caches (`fp8_cache.Fp8Pool`, FlashMLA's token). A tile arrives as its e4m3 values [64, Dl],
their float32 scales [64, Dl / 128] and the bfloat16 RoPE part, double-buffered as above; each
follower dequantizes its own output columns, one 128-value scale block at a time, from shared
memory through registers into one bfloat16 latent tile (`mosaic_gpu.dequantize_rows`: the bits of
`fp8_cache.entries`), and all three wait at a barrier until the whole tile is there, since
warpgroup 0 scores all of it. So the kernel on an FP8 pool equals itself on the pool's dequantized entries, bit for
bit, and no dequantized copy of the cache exists in HBM. Dl must be 512 with FP8: a TMA copy's
rows are whole 16 bytes, four float32 scales.

Shared memory (DeepSeek widths, by Mosaic GPU's count, of the 232,448 bytes (227 KiB) a block
may claim on sm_90): query block 72 KiB + two KV tiles 144 KiB + its part's page table and the
rows' visibility; with FP8, two staged tiles of 41 KiB (values 32, scales 1, RoPE 8) + the
bfloat16 latent tile 64 KiB in place of the KV tiles. The float32 output staging (128 KiB) reuses
the tiles' memory once both warpgroups are done with them (`plgpu.RefUnion`). It is tiled and
swizzled like the tiles: untiled, each store of a warp's WGMMA-layout accumulator put its 8 rows
(1 KiB apart) on the same 8 banks; swizzled, Mosaic GPU finds a conflict-free transfer (jax 0.12
refuses to lower the untiled one without `optimized=False`) and the TMA unswizzles on the way
out. A block holds only its part's pages (`part_tables`), so the count does not grow with the
context: DeepSeek-V3.2's 128k slots take what 4096 do.

Split-KV: a row's capacity (max_pages * page_size slots) is cut into
`split_kv.num_parts(capacity, part_slots)` contiguous parts of whole tiles, fixed by the capacity
alone; each part stores a normalised float32 partial and its log-sum-exp, and
`split_kv.combine_parts` merges them.

Invariant by construction: a query row's bits depend only on its own query, its visible slots and
the capacity. The tiles start at slot 0 and the parts at fixed slots; a tile past the token's
bound is all masked, and its online-softmax step is an exact no-op (max unchanged, rescale
exp(0) = 1, zero probabilities); wgmma computes an output row from that row of its operands only;
the combine is elementwise per row, in a fixed part order. So the bits do not depend on B, Q, the
other rows of the block, or the row's span (the largest bound among the window's tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .cost import attention_cost, stating
from .fp8_cache import SCALE_BLOCK, Fp8Pool, cache_token_bytes
from .gathered_softmax_mosaic import (FOLLOWERS, OUT_BLOCK, accumulate_tile, follower, kernel_warpgroups, normalised,
                                      part_lse, scorer, start_followers)
from .mosaic_gpu import (check_fp8_pool, compiler_params, dequantize_rows, interpret_params, interpreting, store, union,
                         swizzled)
from .split_kv import check_part_slots, combine_parts, num_parts
from .visibility import Visibility, kv_bound

BLOCK_M = 64  # query rows per thread block: wgmma's M
BLOCK_N = 64  # cache slots per tile: a whole number of tiles per page
STAGES = 2  # KV tiles in flight
# Slots per split-KV part: long enough that the float32 partial a part writes and the merge reads
# stay small next to the part's cache (576 x 2 bytes a slot against 512 x 4 bytes per query row),
# short enough that B 32 at 4096 slots fills an H100's 132 SMs (2 row blocks x 4 parts x 32 rows).
PART_SLOTS = 1024
# The query row's window-visibility bits are packed 32 to an int32 word.
WORD = 32
SUPPORTED_DTYPES = (jnp.bfloat16,)
# With an FP8 cache Dl must be a multiple of this: a tile's [64, Dl / 128] float32 scales arrive in
# one TMA copy, whose rows must be whole 16 bytes.
FP8_LATENT_MULTIPLE = 4 * SCALE_BLOCK
# A copy into shared memory moves a multiple of 128 bytes (one per thread of the warpgroup that
# issues it): small int32 operands are padded to a multiple of this many words.
COPY_WORDS = 32


def part_tables(page_table: jax.Array, num_pages: int, page_size: int, parts: int, tiles_per_part: int):
    """The pages each split-KV part reads, for a block to hold only its own: page_table [B, max_pages]
    -> [B, parts, K / COPY_WORDS, COPY_WORDS] int32, entry k of part p the row's page
    `part_first_page(p) + k`; K covers the pages a part's slots span (one more where parts start
    mid-page), padded to whole copies. Entries past the row's table, and any page number out of
    [0, num_pages), are clipped into range: the kernel never reads a slot its row does not own."""
    part_span = tiles_per_part * BLOCK_N
    count = pl.cdiv(part_span, page_size) + (part_span % page_size != 0)
    index = part_first_page(jnp.arange(parts), tiles_per_part, page_size)[:, None] + jnp.arange(count)
    index = jnp.pad(index, [(0, 0), (0, -count % COPY_WORDS)], mode="edge")
    table = jnp.take(page_table.astype(jnp.int32), index, axis=1, mode="clip")  # [B, parts, K]
    return jnp.clip(table, 0, num_pages - 1).reshape(page_table.shape[0], parts, -1, COPY_WORDS)


def part_first_page(part, tiles_per_part: int, page_size: int):
    """The row's page that holds a part's first slot (part: an int or an int32 array)."""
    return part * (tiles_per_part * BLOCK_N) // page_size


def check_operands(q_nope, q_rope, latent_cache, page_table, part_slots: int):
    """ValueError, naming the argument and what is allowed, for operands the kernel cannot take."""
    latent, rope = q_nope.shape[-1], q_rope.shape[-1]
    fp8 = isinstance(latent_cache, Fp8Pool)
    if fp8:
        check_fp8_pool("mla_attention_mosaic", latent_cache)
        if latent % FP8_LATENT_MULTIPLE:
            raise ValueError(f"q_nope last dim (Dl) = {latent}: with an FP8 cache it must be a multiple of "
                             f"{FP8_LATENT_MULTIPLE} (a tile's scales arrive by TMA, whose rows are at least "
                             "16 bytes: four float32 scales)")
    entries = ("latent_cache.rope", latent_cache.rope) if fp8 else ("latent_cache", latent_cache)
    for name, array in (("q_nope", q_nope), ("q_rope", q_rope), entries):
        if jnp.dtype(array.dtype) not in map(jnp.dtype, SUPPORTED_DTYPES):
            raise ValueError(f"{name}.dtype={array.dtype}: the Mosaic GPU mla_attention takes bfloat16 only "
                             "(wgmma; float32 would run as TF32): use backend='pallas' or 'xla' for float32")
    if latent % (FOLLOWERS * 64):
        raise ValueError(f"q_nope last dim (Dl) = {latent}: must be a multiple of {FOLLOWERS * 64}")
    if rope % 64:
        raise ValueError(f"q_rope last dim (Dr) = {rope}: must be a multiple of 64")
    if latent_cache.shape[-1] != latent + rope:
        raise ValueError(f"latent_cache last dim {latent_cache.shape[-1]} != Dl + Dr = {latent} + {rope}")
    if latent_cache.shape[1] % BLOCK_N:
        raise ValueError(f"latent_cache page size {latent_cache.shape[1]}: must be a multiple of {BLOCK_N}")
    if latent // FOLLOWERS > OUT_BLOCK:
        raise ValueError(f"q_nope last dim (Dl) = {latent}: at most {FOLLOWERS * OUT_BLOCK} (a follower's "
                         f"{OUT_BLOCK} columns)")
    check_part_slots("mla_attention_mosaic", part_slots, BLOCK_N)
    if page_table.ndim != 2 or page_table.shape[0] != q_nope.shape[0]:
        raise ValueError(f"page_table shape {page_table.shape}: must be [B, max_pages] with B = {q_nope.shape[0]}")
    if part_slots // latent_cache.shape[1] + 1 > 256 * COPY_WORDS:
        raise ValueError(f"part_slots={part_slots}: a part's pages ({part_slots // latent_cache.shape[1]} and one) "
                         f"must come in one copy of at most {256 * COPY_WORDS}")


def accepts(q_nope, q_rope, latent_cache, page_table, part_slots: int = PART_SLOTS) -> bool:
    """Whether the kernel takes these operands (arrays or `jax.ShapeDtypeStruct`s; `check_operands`
    finds nothing to refuse)."""
    try:
        check_operands(q_nope, q_rope, latent_cache, page_table, part_slots)
    except ValueError:
        return False
    return True


def _row_operands(vis: Visibility, num_queries: int, heads: int, rows_padded: int):
    """Per query row (m = q * H + h, padded to rows_padded): bound [B, Mp] int32 (exclusive slot
    bound, 0 for padding) and, for a tree, its token's ancestor bits over the window, words
    [B, W, Mp] int32 (bit j of word k: window token 32 k + j is an ancestor). meta [B, COPY_WORDS]
    int32 = (span: the row's largest bound, prefix_len, zeros)."""
    batch = vis.prefix_len.shape[0]
    pad = rows_padded - num_queries * heads
    per_row = lambda x: jnp.pad(jnp.repeat(x, heads, axis=1), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    bound = kv_bound(vis, num_queries)
    meta = jnp.pad(jnp.stack([jnp.max(bound, axis=1), vis.prefix_len.astype(jnp.int32)], axis=1),
                   [(0, 0), (0, COPY_WORDS - 2)])
    if vis.tree_mask is None:
        return per_row(bound), None, meta
    words = pl.cdiv(num_queries, WORD)
    mask = jnp.pad(vis.tree_mask, [(0, 0), (0, 0), (0, words * WORD - num_queries)]).reshape(batch, num_queries, words,
                                                                                             WORD)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(WORD, dtype=jnp.uint32))
    bits = jnp.sum(jnp.where(mask, weights, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)  # distinct bits: sum = or
    bits = jax.lax.bitcast_convert_type(bits, jnp.int32)  # [B, Q, W]
    return per_row(bound), jnp.swapaxes(per_row(bits), 1, 2), meta


def _kernel(q_ref, *refs, latent: int, page_size: int, tiles_per_part: int, softmax_scale: float, warpgroups: int,
            interpret: bool, fp8: bool):
    """One (row block, part, sequence row) thread block, run by `warpgroups` warpgroups (1 +
    FOLLOWERS on a GPU; interpreted, `gathered_softmax_mosaic.kernel_warpgroups`, by default 1):
    warpgroup 0 scores each tile and hands P and the rescale to the followers, each owning Dl /
    FOLLOWERS output columns (`gathered_softmax_mosaic.scorer` / `follower`); alone, warpgroup 0
    owns every column. Output columns are numbered by owner:
    follower f (warpgroup 1 + f), or warpgroup 0 alone as owner 0.

    q_ref [B, Mp, Dl + Dr] (queries, the rope part after the latent one); the cache: cache_ref
    [P, page, Dl + Dr], or for an FP8 cache values_ref [P, page, Dl] e4m3, scales_ref
    [P, page, Dl / 128] float32 and rope_ref [P, page, Dr] bfloat16; page_table_ref
    [B, parts, K / COPY_WORDS, COPY_WORDS] (`part_tables`), meta_ref [B, COPY_WORDS], bound_ref
    [B, Mp], then for a tree bits_ref [B, W, Mp]; outputs out_ref [B, parts, Mp, Dl] float32,
    lse_ref [B, parts, Mp].
    """
    cache_refs, (page_table_ref, meta_ref, bound_ref, *refs) = refs[:3 if fp8 else 1], refs[3 if fp8 else 1:]
    *bits_ref, out_ref, lse_ref = refs
    bits_ref = bits_ref[0] if bits_ref else None
    rope = q_ref.shape[-1] - latent
    handshake = warpgroups > 1
    own = latent // (FOLLOWERS if handshake else 1)  # the output columns an owner accumulates
    row_block, part, seq = (jax.lax.axis_index(name) for name in ("rows", "parts", "batch"))
    rows = pl.ds(row_block * BLOCK_M, BLOCK_M)

    def body(q_smem, q_rope_smem, table_smem, meta_smem, bound_smem, bits_smem, buffers, lse_smem, load_barriers,
             kv_barriers, p_ready, consumed, done_barrier):
        tiles, out_smem = buffers
        wg = jax.lax.axis_index("wg")
        sources = [(q_ref.at[seq, rows, pl.ds(0, latent)], q_smem),
                   (q_ref.at[seq, rows, pl.ds(latent, rope)], q_rope_smem), (page_table_ref.at[seq, part], table_smem),
                   (meta_ref.at[seq], meta_smem), (bound_ref.at[seq, rows], bound_smem)]
        if bits_ref is not None:
            sources.append((bits_ref.at[seq, :, rows], bits_smem))

        @pl.when(wg == 0)
        def _load_block():
            for i, (src, dst) in enumerate(sources):
                plgpu.copy_gmem_to_smem(src, dst, load_barriers.at[i])

        for i in range(len(sources)):
            plgpu.barrier_wait(load_barriers.at[i])
        span, prefix = meta_smem[0], meta_smem[1]
        lo = part * tiles_per_part
        hi = jnp.minimum(lo + tiles_per_part, jax.lax.div(span + BLOCK_N - 1, BLOCK_N))
        num_tiles = jnp.maximum(hi - lo, 0)
        first_page = part_first_page(part, tiles_per_part, page_size)

        def issue(i):  # tile lo + i into buffer i % STAGES: its latent (or e4m3 values and scales) and RoPE parts
            first = (lo + i) * BLOCK_N
            page_index = jax.lax.div(first, page_size) - first_page  # in the part's table
            page = table_smem[jax.lax.div(page_index, COPY_WORDS), jax.lax.rem(page_index, COPY_WORDS)]
            slots = pl.ds(jax.lax.rem(first, page_size), BLOCK_N)
            if fp8:
                sources = [ref.at[page, slots] for ref in cache_refs]
            else:
                sources = [cache_refs[0].at[page, slots, pl.ds(0, latent)],
                           cache_refs[0].at[page, slots, pl.ds(latent, rope)]]
            for src, dst in zip(sources, tiles["staged"]):
                plgpu.copy_gmem_to_smem(src, dst.at[i % STAGES], kv_barriers.at[i % STAGES])

        pl.when((wg == 0) & (num_tiles > 0))(functools.partial(issue, 0))

        def wait_tile(i):
            plgpu.barrier_wait(kv_barriers.at[jax.lax.rem(i, STAGES)])

        def latent_tile(i):
            """Tile i's latent part as the tensor cores read it: its buffer, or for an FP8 cache the
            bfloat16 tile it is dequantized into (`prepare`)."""
            return tiles["operand"] if fp8 else tiles["staged"][0].at[jax.lax.rem(i, STAGES)]

        def p_at(i):
            """Where warpgroup 0 hands tile i's P over: the first BLOCK_N columns of the tile's RoPE
            buffer, which only the scores read, so P takes no shared memory of its own."""
            return tiles["staged"][-1].at[jax.lax.rem(i, STAGES), :, pl.ds(0, BLOCK_N)]

        def prepare(i):
            """The scorer's readying of tile i: an FP8 tile's e4m3 values dequantized
            (`mosaic_gpu.dequantize_rows`) into the bfloat16 operand, one 128-value scale block at a
            time. The scorer does it all: it carries no accumulator, where a follower's 64 x 256
            float32 one left too few registers for a block's 64 values a thread (sm_90a: 432 bytes
            of spills a thread, most in the followers' loops). The followers read the operand only
            after `p_ready`, and the scorer writes it only after `consumed`. Nothing to do for a
            bfloat16 cache."""
            if not fp8:
                return None
            buffer = jax.lax.rem(i, STAGES)
            values, scales = tiles["staged"][0].at[buffer], tiles["staged"][1].at[buffer]
            for first in range(0, latent, SCALE_BLOCK):
                block = plgpu.layout_cast(values[:, pl.ds(first, SCALE_BLOCK)], plgpu.Layout.WGMMA)
                block_scales = plgpu.layout_cast(scales[:, first // SCALE_BLOCK], plgpu.Layout.WGMMA.reduce(1))
                tiles["operand"][:, pl.ds(first, SCALE_BLOCK)] = dequantize_rows(block, block_scales,
                                                                                 tiles["operand"].dtype)
            return None

        row_layout = plgpu.Layout.WGMMA.reduce(1)
        # A plain read whose layout cast tells the lowering to load it straight into wgmma's row layout.
        bound = plgpu.layout_cast(bound_smem[...], row_layout)
        words = [] if bits_smem is None else [plgpu.layout_cast(bits_smem[k], row_layout)
                                               for k in range(bits_smem.shape[0])]

        def visible(first_slot):
            """[64 rows, 64 slots] bool: the row's token sees slot first_slot + column."""
            slots = first_slot + plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M, BLOCK_N), 1),
                                                   plgpu.Layout.WGMMA)
            sees = slots < jax.lax.broadcast_in_dim(bound, (BLOCK_M, BLOCK_N), [0])
            if not words:
                return sees
            window = slots - prefix  # window index of each slot, negative in the prefix
            ancestor = window < 0
            for k, word in enumerate(words):
                offset = window - k * WORD
                in_word = (offset >= 0) & (offset < WORD)
                shifted = jax.lax.shift_right_logical(jax.lax.broadcast_in_dim(word, (BLOCK_M, BLOCK_N), [0]),
                                                      jnp.clip(offset, 0, WORD - 1))
                ancestor = ancestor | (in_word & ((shifted & 1) != 0))
            return sees & ancestor

        def scores(i, _):
            """Tile i's scores [64, 64] float32: q [64, Dl + Dr] . tile^T as two wgmmas into one
            accumulator (latent, then RoPE: the K steps of one K = Dl + Dr wgmma in the same
            order), scaled, -inf where a row's token does not see the slot."""
            def product(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, latent_tile(i).transpose((1, 0)))
                plgpu.wgmma(acc_ref, q_rope_smem, tiles["staged"][-1].at[jax.lax.rem(i, STAGES)].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(product, plgpu.ACC((BLOCK_M, BLOCK_N), jnp.float32))
            return jnp.where(visible((lo + i) * BLOCK_N), s * softmax_scale, -jnp.inf)

        def accumulate(owner):
            """The owner's `P V` step (owner None: the scorer beside its followers, which owns no column)."""
            if owner is None:
                return lambda acc, alpha, i: acc
            return lambda acc, alpha, i: accumulate_tile(acc, alpha, p_at(i),
                                                         latent_tile(i).at[:, pl.ds(owner * own, own)], interpret)

        def finish(owner, row_max, denom, acc):
            """The owner's normalised columns (none for owner None) and, from the scorer (row_max
            given), the log-sum-exp, to this part's outputs."""
            # Every warpgroup must be done with the tiles before the output staging reuses their
            # memory, and the followers with the denominator in lse_smem before the lse goes there.
            plgpu.barrier_arrive(done_barrier)
            plgpu.barrier_wait(done_barrier)
            if owner is not None:
                out_smem.at[owner][...] = normalised(acc, denom)
            if row_max is not None:
                store(lse_smem, part_lse(row_max, denom))
            plgpu.commit_smem()
            if owner is not None:
                plgpu.copy_smem_to_gmem(out_smem.at[owner], out_ref.at[seq, part, rows, pl.ds(owner * own, own)])
            if row_max is not None:
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[seq, part, rows])
            plgpu.wait_smem_to_gmem(0)

        acc0 = plgpu.layout_cast(jnp.zeros((BLOCK_M, own), jnp.float32), plgpu.Layout.WGMMA)
        # The rescale (then the denominator) goes to the followers through lse_smem, free until the end.
        handshake_barriers = dict(alpha_smem=lse_smem, p_ready=p_ready, consumed=consumed)

        @pl.when(wg == 0)
        def _scorer():
            owner = None if handshake else 0
            init = (plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), row_layout),
                    plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), row_layout), () if handshake else acc0)
            row_max, denom, acc = scorer(num_tiles=num_tiles, init=init, wait=wait_tile,
                                         prepare=prepare, prefetch=issue, scores=scores,
                                         p_at=p_at, accumulate=accumulate(owner), handshake=handshake,
                                         **handshake_barriers)
            finish(owner, row_max, denom, acc)

        def follow(owner):

            acc, denom = follower(num_tiles=num_tiles, acc0=acc0, accumulate=accumulate(owner), row_layout=row_layout,
                                  prepare=wait_tile, **handshake_barriers)
            finish(owner, None, denom, acc)

        if handshake:
            start_followers(wg, follow)

    bits_scratch = None if bits_ref is None else plgpu.SMEM((bits_ref.shape[1], BLOCK_M), jnp.int32)
    num_loads = 5 + (bits_ref is not None)
    entry_dtype = q_ref.dtype  # what the tensor cores read: the cache's dtype, or an FP8 cache's entries'
    # Each stage's parts as they arrive: the latent (or its e4m3 values and their scales) and the RoPE part.
    if fp8:
        values_ref, scales_ref, rope_ref = cache_refs
        staged = [plgpu.SMEM((STAGES, BLOCK_N, latent), values_ref.dtype,
                             transforms=swizzled(values_ref.dtype, latent)),
                  plgpu.SMEM((STAGES, BLOCK_N, scales_ref.shape[-1]), jnp.float32),
                  plgpu.SMEM((STAGES, BLOCK_N, rope), rope_ref.dtype, transforms=swizzled(rope_ref.dtype, rope))]
    else:
        staged = [plgpu.SMEM((STAGES, BLOCK_N, width), entry_dtype, transforms=swizzled(entry_dtype, width))
                  for width in (latent, rope)]
    tiles = dict(staged=staged,
                 operand=plgpu.SMEM((BLOCK_N, latent), entry_dtype, transforms=swizzled(entry_dtype, latent)) if fp8
                 else None)
    pl.run_scoped(
        body,
        plgpu.SMEM((BLOCK_M, latent), entry_dtype, transforms=swizzled(entry_dtype, latent)),
        plgpu.SMEM((BLOCK_M, rope), entry_dtype, transforms=swizzled(entry_dtype, rope)),
        plgpu.SMEM(page_table_ref.shape[2:], jnp.int32),
        plgpu.SMEM((COPY_WORDS,), jnp.int32),
        plgpu.SMEM((BLOCK_M,), jnp.int32),
        bits_scratch,
        union(tiles, plgpu.SMEM((latent // own, BLOCK_M, own), jnp.float32, transforms=swizzled(jnp.float32, own)),
               interpret=interpret),
        plgpu.SMEM((BLOCK_M,), jnp.float32),
        plgpu.Barrier(num_barriers=num_loads),
        plgpu.Barrier(num_arrivals=len(staged), num_barriers=STAGES),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=max(1, warpgroups - 1)),
        plgpu.Barrier(num_arrivals=warpgroups),
        collective_axes="wg",
    )


@functools.partial(jax.jit, static_argnames=("softmax_scale", "part_slots", "interpret"))
def _mla_attention_mosaic(q_nope, q_rope, latent_cache, page_table, vis: Visibility, *, softmax_scale: float,
                          part_slots: int, interpret: bool):
    batch, num_queries, heads, latent = q_nope.shape
    num_pages, page_size, width = latent_cache.shape
    rows = num_queries * heads
    rows_padded = pl.cdiv(rows, BLOCK_M) * BLOCK_M
    capacity = page_table.shape[1] * page_size
    tiles = capacity // BLOCK_N
    parts = num_parts(capacity, part_slots)
    tiles_per_part = pl.cdiv(tiles, parts)
    warpgroups = kernel_warpgroups(interpret)
    fp8 = isinstance(latent_cache, Fp8Pool)
    cache_operands = (latent_cache.values, latent_cache.scales, latent_cache.rope) if fp8 else (latent_cache,)
    queries = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1).reshape(batch, rows, width)
    queries = jnp.pad(queries, [(0, 0), (0, rows_padded - rows), (0, 0)])
    table = part_tables(page_table, num_pages, page_size, parts, tiles_per_part)
    bound, bits, meta = _row_operands(vis, num_queries, heads, rows_padded)
    out_type = (jax.ShapeDtypeStruct((batch, parts, rows_padded, latent), jnp.float32),
                jax.ShapeDtypeStruct((batch, parts, rows_padded), jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(_kernel, latent=latent, page_size=page_size, tiles_per_part=tiles_per_part,
                          softmax_scale=softmax_scale, warpgroups=warpgroups, interpret=interpret, fp8=fp8),
        kernel_name="mla_attention_mosaic",
        out_type=out_type, grid=(batch, parts, rows_padded // BLOCK_M), grid_names=("batch", "parts", "rows"),
        num_threads=warpgroups, thread_name="wg", compiler_params=compiler_params(),
        interpret=interpret_params() if interpret else None)
    small = (table, meta, bound) + (() if bits is None else (bits,))
    # As the Triton kernel states it: a batch row's slots read once, by all its rows and parts.
    cost = attention_cost(batch, rows, capacity, latent + width, cache_token_bytes(latent_cache), queries, *small,
                          *out_type)
    with stating(cost, "mla_attention"):
        out, lse = kernel(queries, *cache_operands, *small)
    out, lse = combine_parts(out, lse, q_nope.dtype)
    return (out[:, :rows].reshape(batch, num_queries, heads, latent),
            lse[:, :rows].reshape(batch, num_queries, heads))


def mla_attention_mosaic(q_nope: jax.Array, q_rope: jax.Array, latent_cache, page_table: jax.Array,
                         vis: Visibility, *, softmax_scale: float, part_slots: int = PART_SLOTS,
                         interpret: bool = False):
    """`mla_attention` as a Mosaic GPU kernel; same arguments and results as `mla_attention_reference`.

    q_nope [B, Q, H, Dl], q_rope [B, Q, H, Dr], latent_cache [P, page, Dl + Dr] bfloat16 or an
    `fp8_cache.Fp8Pool` of that shape (values [P, page, Dl] e4m3, scales [P, page, Dl / 128]
    float32, rope [P, page, Dr] bfloat16: dequantized in shared memory as `fp8_cache.entries` reads
    it), page_table [B, max_pages] int32 -> out [B, Q, H, Dl] bfloat16, lse [B, Q, H] float32.
    Allowed: bfloat16; Dl a multiple of 128 and at most 512 (with an FP8 cache, 512), Dr a multiple
    of 64, a page size that is a multiple of 64 (ValueError otherwise, before tracing).
    part_slots: slots per split-KV part (a multiple of 64); the parts are ceil(capacity / part_slots).
    interpret: run on the CPU simulator (`mosaic_gpu.interpreting`) instead of lowering for a GPU.
    """
    check_operands(q_nope, q_rope, latent_cache, page_table, part_slots)
    call = functools.partial(_mla_attention_mosaic, q_nope, q_rope, latent_cache, page_table, vis,
                             softmax_scale=softmax_scale, part_slots=part_slots, interpret=interpret)
    if not interpret:
        return call()
    with interpreting():
        return call()
