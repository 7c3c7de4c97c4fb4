"""Pallas Mosaic GPU kernel (`plgpu.kernel`: TMA, wgmma) for `sparse_mla_attention`: absorbed MLA of
each query token over its own selected slots.

Work unit. Every window token (b, q) has its own index list `indices[b, q, :]` (2048 slots for
DeepSeek-V3.2) shared by its H heads, so tokens share no KV reads: a program holds one token's
block of BLOCK_M (64) heads as the wgmma's M rows and 2 * OUT_BLOCK (256) of the output's 512
latent columns, in two warpgroups. Grid:

    (latent column blocks, head blocks, B * Q)   axis 0 fastest

so the programs of one token run side by side and share its gathered rows through L2. A program
walks the whole index list in tiles of TILE (64) slots with an online softmax in float32. The list
is never split, so a token's output bits depend on its own queries, indices and cache rows only,
never on B or Q: invariant by construction (B 32, Q 1 already makes 128 programs).

Warpgroups (FlashMLA's split of the 512-wide output). Warpgroup 0 gathers, computes `S`, runs the
softmax and hands P and the rescale to warpgroup 1 through SMEM (barriers `p_ready` / `consumed`);
each then accumulates `P V` over its own OUT_BLOCK columns, so `S` is computed once per program.

Reading scattered slots. Hopper has no TMA gather, and a wgmma operand must sit in SMEM as 8-row
swizzled tiles, which a copy per slot cannot fill (a copy's SMEM destination is whole tiles). So
each selected slot's row (576 bf16, contiguous in its page) arrives by TMA, in three 192-wide
copies (a TMA box spans at most 256 elements), into a row-major staging tile; the warpgroup then
moves the staging tile through registers into the swizzled tile the wgmma reads, zeroing the rows
of unselected slots on the way (stale cache memory never meets a zero probability), and issues the
next tile's copies before this tile's GEMMs: the gather of tile t + 1 overlaps the tensor cores'
work on tile t. Staging rows are padded by 16 bytes so that those register reads are free of bank
conflicts. FlashMLA's sparse decode gathers with per-thread 16-byte loads instead; Pallas Mosaic
GPU has no gathering register load, and whole-row TMA copies use every HBM sector they fetch.

Per tile: `S = Q K^T` ([64, 576] x [576, 64], the tile read transposed: a bit of the wgmma on the
GPU), the scale, the mask and the online softmax in registers, P to SMEM in the cache's dtype, then
`P V` into a fresh accumulator that is added to the running output in registers. Accumulating in
place (`pl.run_state` with `plgpu.ACC.init`) would save those registers, so that four warpgroups
could own all 512 columns; jax 0.10.2's interpreter runs neither `run_state` nor accumulator
stores, and every kernel here must run interpreted in the tests. With fresh accumulators the
register file (64 K a SM) holds two warpgroups' 64 x 128 float32 pairs, so the two column blocks'
programs both compute `S`.

Shared memory at DeepSeek's widths: queries, staging and swizzled tiles of 64 x 576 bf16
(72 KiB each, the staging 1 KiB more for its padding), P (8 KiB), the tile's mask and the rescale
(one 1 KiB-aligned buffer): 231,456 of the 232,448 bytes a block may use, so the cross-warp reduction
scratch is turned off (every reduction here stays inside a warp).

Constraints (ValueError): bfloat16 / float16 operands; Dl a multiple of 128 (of 2 * OUT_BLOCK when
wider), Dr of 64. Any page size. Heads are padded to a multiple of 64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .contracts import EMPTY_LSE
from .indexer_mosaic import SWIZZLED, check_mosaic_operands, pad_to
from .mosaic_gpu import interpreting

BLOCK_M = 64  # head rows per program: one warpgroup's wgmma M
TILE = 64  # selected slots per tile
OUT_BLOCK = 128  # latent output columns per warpgroup (at most)
# Staging rows are padded by 16 bytes so that the warpgroup's reads of a 64-column block hit 32
# different banks (a 1152-byte row stride would put 8 rows on the same 4 banks).
STAGING_PAD = 8


def copy_width(width: int) -> int:
    """Elements per TMA copy of a slot's row: a box spans at most 256 per dimension; 192 divides
    DeepSeek's 576 (three copies a row), 64 every other width the kernel accepts."""
    return 192 if width % 192 == 0 else 64


def _sparse_mla_kernel(q_ref, cache_ref, page_table_ref, indices_ref, bias_ref, out_ref, lse_ref, *,
                       softmax_scale: float, out_block: int, num_queries: int, page_size: int):
    """One (column block, head block, token) program of two warpgroups. q_ref [B * Q, Hp, Dl + Dr],
    cache_ref [P, page, Dl + Dr], page_table_ref [B, M], indices_ref [B * Q, K] (clamped, in range),
    bias_ref [B * Q, K] float32 (0 selected, -inf not); out_ref [B * Q, Hp, Dl] (q_nope's dtype),
    lse_ref [B * Q, Hp]. Warpgroup w owns the output columns [block + w * out_block, + out_block)."""
    column_block, head_block, token = (jax.lax.axis_index(a) for a in ("column", "heads", "token"))
    wg = jax.lax.axis_index("wg")
    row = jax.lax.div(token, num_queries)
    width = q_ref.shape[-1]
    copy = copy_width(width)
    num_tiles = indices_ref.shape[1] // TILE
    heads = pl.ds(head_block * BLOCK_M, BLOCK_M)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    column_layout = plgpu.Layout.WGMMA.reduce(0)

    def gather(tile, staging, bias, barrier):
        plgpu.copy_gmem_to_smem(bias_ref.at[token, pl.ds(tile * TILE, TILE)], bias, barrier)

        @pl.loop(0, TILE)
        def _(i):
            slot = indices_ref[token, tile * TILE + i]
            page = page_table_ref[row, jax.lax.div(slot, page_size)]
            offset = jax.lax.rem(slot, page_size)
            for piece in range(0, width, copy):
                plgpu.copy_gmem_to_smem(cache_ref.at[page, offset, pl.ds(piece, copy)],
                                        staging.at[i, pl.ds(piece, copy)], barrier)

    def body(q_smem, staging, kv_smem, p_smem, vectors, q_barrier, gathered, p_ready, consumed):
        # The tile's mask and the rescale handed to warpgroup 1 share one buffer: every SMEM buffer
        # starts on a 1 KiB boundary, and two would not fit beside the three 72 KiB tiles.
        bias_smem, alpha_smem = vectors.at[0], vectors.at[1]
        columns = pl.ds((2 * column_block + wg) * out_block, out_block)

        def accumulate(acc, alpha):
            """acc * alpha + P V over this warpgroup's columns of the tile (a fresh accumulator:
            jax 0.10.2's interpreter runs neither `pl.run_state` nor accumulator stores)."""
            def values(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, kv_smem.at[:, columns])
                return acc_ref[...]

            tile_out = pl.run_scoped(values, plgpu.ACC((BLOCK_M, out_block), jnp.float32))
            return acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0]) + tile_out

        def store(acc, denom):
            safe = jnp.where(denom > 0, denom, 1.0)
            out = acc / jax.lax.broadcast_in_dim(safe, acc.shape, [0])
            out_ref[token, heads, columns] = out.astype(out_ref.dtype)

        acc0 = plgpu.layout_cast(jnp.zeros((BLOCK_M, out_block), jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(wg == 0)
        def _scorer():
            """Gathers, scores, runs the softmax and shares P and its rescale with warpgroup 1."""
            plgpu.copy_gmem_to_smem(q_ref.at[token, heads], q_smem, q_barrier)
            gather(0, staging, bias_smem, gathered)
            plgpu.barrier_wait(q_barrier)

            def step(tile, carry):
                row_max, denom, acc = carry
                plgpu.barrier_wait(gathered)

                @pl.when(tile > 0)  # warpgroup 1 is done with the last tile's kv and P
                def _():
                    plgpu.barrier_wait(consumed)

                keep = plgpu.layout_cast(bias_smem[...], row_layout) == 0.0
                for c in range(width // 64):  # staging -> registers -> swizzled tile, unselected rows zeroed
                    chunk = plgpu.layout_cast(staging[:, pl.ds(c * 64, 64)], plgpu.Layout.WGMMA)
                    kv_smem[:, pl.ds(c * 64, 64)] = jnp.where(
                        jax.lax.broadcast_in_dim(keep, (TILE, 64), [0]), chunk, jnp.zeros_like(chunk))
                bias = plgpu.layout_cast(bias_smem[...], column_layout)
                plgpu.commit_smem()

                @pl.when(tile + 1 < num_tiles)
                def _():
                    gather(tile + 1, staging, bias_smem, gathered)

                def scores(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(kv_smem, (1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((BLOCK_M, TILE), jnp.float32))
                s = s * softmax_scale + jax.lax.broadcast_in_dim(bias, s.shape, [1])
                new_max = jnp.maximum(row_max, jnp.max(s, axis=1))
                safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
                alpha = jnp.exp(row_max - safe_max)
                p = jnp.exp(s - jax.lax.broadcast_in_dim(safe_max, s.shape, [0]))
                p_smem[...] = p.astype(p_smem.dtype)
                alpha_smem[...] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready)
                return new_max, denom * alpha + jnp.sum(p, axis=1), accumulate(acc, alpha)

            init = (plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), row_layout),
                    plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), row_layout), acc0)
            row_max, denom, acc = jax.lax.fori_loop(0, num_tiles, step, init)
            plgpu.barrier_wait(consumed)  # warpgroup 1 has read the last rescale: hand it the denominator
            alpha_smem[...] = denom
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready)
            store(acc, denom)
            seen = denom > 0
            lse_ref[token, heads] = jnp.where(seen, row_max + jnp.log(jnp.where(seen, denom, 1.0)), EMPTY_LSE)

        @pl.when(wg == 1)
        def _second_columns():
            def step(tile, acc):
                plgpu.barrier_wait(p_ready)
                acc = accumulate(acc, plgpu.layout_cast(alpha_smem[...], row_layout))
                plgpu.barrier_arrive(consumed)
                return acc

            acc = jax.lax.fori_loop(0, num_tiles, step, acc0)
            plgpu.barrier_wait(p_ready)
            store(acc, plgpu.layout_cast(alpha_smem[...], row_layout))

    pl.run_scoped(
        body,
        plgpu.SMEM((BLOCK_M, width), q_ref.dtype, transforms=SWIZZLED),
        plgpu.SMEM((TILE, width + STAGING_PAD), cache_ref.dtype),
        plgpu.SMEM((TILE, width), cache_ref.dtype, transforms=SWIZZLED),
        plgpu.SMEM((BLOCK_M, TILE), cache_ref.dtype, transforms=SWIZZLED),
        plgpu.SMEM((2, TILE), jnp.float32),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=TILE * (width // copy) + 1),
        plgpu.Barrier(),
        plgpu.Barrier(),
        collective_axes="wg",
    )


def sparse_mla_attention_mosaic(q_nope: jax.Array, q_rope: jax.Array, latent_cache: jax.Array, page_table: jax.Array,
                                indices: jax.Array, *, softmax_scale: float, interpret: bool = False):
    """`sparse_mla_attention` as a Mosaic GPU kernel; same arguments and results as the reference.

    q_nope [B, Q, H, Dl], q_rope [B, Q, H, Dr], latent_cache [P, page, Dl + Dr],
    page_table [B, max_pages] int32, indices [B, Q, K] int32 (-1 and slots past the row's pages are
    skipped) -> out [B, Q, H, Dl] (q_nope.dtype), lse [B, Q, H] float32.
    interpret: run on the CPU simulator (`mosaic_gpu.interpreting`) instead of lowering for a GPU.
    """
    latent, rope = q_nope.shape[-1], q_rope.shape[-1]
    check_mosaic_operands("sparse_mla_attention_mosaic", q_nope, q_rope, latent_cache)
    if latent_cache.shape[-1] != latent + rope:
        raise ValueError(f"sparse_mla_attention_mosaic: latent_cache last dim {latent_cache.shape[-1]} != "
                         f"Dl + Dr = {latent} + {rope}")
    if latent % 128 or rope % 64 or (latent > 2 * OUT_BLOCK and latent % (2 * OUT_BLOCK)):
        raise ValueError(f"sparse_mla_attention_mosaic: Dl={latent} must be a multiple of 128 (of "
                         f"{2 * OUT_BLOCK} when wider) and Dr={rope} of 64")
    run = functools.partial(_sparse_mla, q_nope, q_rope, latent_cache, page_table, indices,
                            softmax_scale=softmax_scale, interpret=interpret)
    if not interpret:
        return run()
    with interpreting():
        return run()


# `interpret` only keys the jit cache: a kernel traced for the simulator is never reused for a GPU.
@functools.partial(jax.jit, static_argnames=("softmax_scale", "interpret"))
def _sparse_mla(q_nope, q_rope, latent_cache, page_table, indices, *, softmax_scale: float, interpret: bool):
    del interpret
    batch, num_queries, heads, latent = q_nope.shape
    page_size = latent_cache.shape[1]
    capacity = page_table.shape[1] * page_size
    tokens = batch * num_queries
    q = pad_to(jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1), 2, BLOCK_M)
    q = q.reshape(tokens, -1, q.shape[-1]).astype(latent_cache.dtype)
    indices = pad_to(indices.reshape(tokens, -1).astype(jnp.int32) + 1, 1, TILE) - 1  # pad with -1
    selected = (indices >= 0) & (indices < capacity)
    bias = jnp.where(selected, 0.0, -jnp.inf).astype(jnp.float32)
    out_block = min(latent // 2, OUT_BLOCK)  # columns per warpgroup
    heads_padded = q.shape[1]
    kernel = plgpu.kernel(
        functools.partial(_sparse_mla_kernel, softmax_scale=softmax_scale, out_block=out_block,
                          num_queries=num_queries, page_size=page_size),
        out_type=(jax.ShapeDtypeStruct((tokens, heads_padded, latent), q_nope.dtype),
                  jax.ShapeDtypeStruct((tokens, heads_padded), jnp.float32)),
        grid=(latent // (2 * out_block), heads_padded // BLOCK_M, tokens), grid_names=("column", "heads", "token"),
        num_threads=2, thread_name="wg",
        # The row reductions stay inside each warp (WGMMA layout): no cross-warp scratch, whose
        # default 2 KiB would push the three 72 KiB tiles past the 227 KiB a block may use.
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0))
    out, lse = kernel(q, latent_cache, page_table.astype(jnp.int32), jnp.where(selected, indices, 0), bias)
    out = out[:, :heads].reshape(batch, num_queries, heads, latent)
    return out, lse[:, :heads].reshape(batch, num_queries, heads)
