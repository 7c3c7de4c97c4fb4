"""What the Mosaic GPU kernels that gather their keys share: the copies and register moves that
fill a key tile, and the online softmax split between a scoring warpgroup and its followers.

`sparse_mla_attention_mosaic` (a token's top-k slots) and `sliding_compressed_attention_mosaic`
(DeepSeek-V4's ring, compressed entries and extra keys) both run a program as one token's 64 heads
over a list of gathered key tiles, and split the output's columns between warpgroups as
FlashMLA does: warpgroup 0 (`scorer`) waits for a tile's copies, moves the tile into the wgmma's
operand, issues the next tile's copies, computes `S = Q K^T` and the float32 online softmax, and
hands P and the rescale to the followers (`follower`) through SMEM; each accumulates `P V` over
its own columns. On a GPU the scorer owns no columns and two followers own 256 columns each,
accumulated in place (`accumulate_tile`); interpreted, by default the scorer alone owns them
all. The kernels differ in where a tile's keys come from (their callbacks) and in where the softmax
starts (a sink, or nothing); the rest is this module's, once. Dense
`mla_attention_mosaic` runs the same loop and handshake over its paged tiles (TMA copies straight
into two alternating operand buffers, its scores masked per row), so a tile's scores are computed
once, not once per warpgroup.

Gathering a tile. Hopper has no TMA gather, and a wgmma operand sits in SMEM as 8-row swizzled
tiles, which a copy per key cannot fill (a copy's SMEM destination is whole tiles). So each key's
row arrives by one bulk copy per part (`copy_key`: the entry, or an FP8 entry's e4m3 values and
its RoPE values) into a row-major staging tile, and `to_operand` moves the staging tile through
registers into the swizzled tile the wgmma reads, zeroing unseen keys' rows and dequantizing FP8
values on the way.

The handshake, per tile t (`p_ready` takes one arrival, `consumed` one per follower):

    warpgroup 0: wait for tile t's copies; t > 0: wait `consumed` (the followers are done with tile
                 t - 1's keys and P); operand, copies of t + 1, S, softmax; P and rescale to
                 SMEM; arrive `p_ready`
    followers:   (dense MLA: wait for tile t's copies); wait `p_ready`; P V with the rescale;
                 arrive `consumed`

and after the last tile warpgroup 0 waits for `consumed` once more, writes the denominator where the
rescale was and arrives `p_ready`, which the followers wait for before their stores.

Interpreted on the CPU the kernels run one warpgroup by default, which owns every column and makes
no handshake (`handshake=False`); `kernel_warpgroups` gives the GPU's three where asked
(`mosaic_gpu.interpreted_warpgroups`: it needs a larger XLA CPU thread pool and is 3 to 10 times
slower), as `tests/test_mosaic_warpgroups.py` runs every kernel here.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .contracts import EMPTY_LSE
from .mosaic_gpu import dequantize_rows, interpreted_warpgroups, warp_map_interpretable

WARPS = 4  # warps in a warpgroup
# Warpgroups accumulating P V beside the scoring one, and the output columns each owns (at most): a
# 64 x 256 float32 accumulator, in place (`accumulate_tile`), 128 registers a thread.
FOLLOWERS = 2
OUT_BLOCK = 256
# The registers of an SM, and the steps in which a launch gives them to each thread.
SM_REGISTERS, REGISTER_STEP = 65536, 8


def launch_registers(warpgroups: int) -> int:
    """The registers a thread of a block of `warpgroups` warpgroups is launched with at most, as
    ptxas assigns them to a kernel that moves them with `setmaxnreg` (168 at three warpgroups):
    the block's pool, which `setmaxnreg` redistributes and never grows."""
    return SM_REGISTERS // (warpgroups * 128) // REGISTER_STEP * REGISTER_STEP


# Registers a thread (`plgpu.set_max_registers`) of the following and the scoring warpgroups. They
# must fit the launch's pool, (1 + FOLLOWERS) x 168 a thread of a warpgroup: `setmaxnreg.inc` waits
# until the pool has what it asks for, so a split past it never returns (192 / 160 / 160 kept the
# dense and sparse MLA kernels from returning on an H200; the CPU simulator, which has no register
# pool, ran them). The followers need their accumulator and little else, and ptxas ignores a cut
# to 152 (C7507): 160. The scorer takes the rest: 184.
FOLLOWER_REGISTERS = 160
SCORER_REGISTERS = (1 + FOLLOWERS) * launch_registers(1 + FOLLOWERS) - FOLLOWERS * FOLLOWER_REGISTERS
# Columns a register move handles: one 128-byte swizzle row of bfloat16.
CHUNK = 64
# A copy's bytes are a multiple of this (see `copy_key`).
COPY_BYTES = 128
# Staging rows are padded by 16 bytes so that the warpgroup's reads of a 64-column chunk hit
# different banks (a 1152-byte row stride would put 8 rows on the same 4 banks); every row still
# starts 16-byte aligned, as the bulk copies need.
STAGING_PAD_BYTES = 16


GRID_NAMES = ("column", "work")


def work_grid(column_blocks: int, head_blocks: int, units: int) -> tuple[int, int]:
    """The launch grid of `units` (a token's split-KV part each) x `head_blocks` x `column_blocks`
    programs, named GRID_NAMES. A unit's head blocks read the same gathered rows, so they are
    adjacent on the last axis, which Mosaic GPU launches as CUDA's x (it reverses a Pallas grid):
    they run side by side and the second reads the rows from L2. The last axis is also the only
    one without CUDA's 65,535 limit, which a prefill's units can pass."""
    return column_blocks, units * head_blocks


def program_work(head_blocks: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """This program's (column block, head block, unit) in a `work_grid` launch."""
    column_block, work = (jax.lax.axis_index(name) for name in GRID_NAMES)
    return column_block, jax.lax.rem(work, head_blocks), jax.lax.div(work, head_blocks)


def kernel_warpgroups(interpret: bool) -> int:
    """The warpgroups a kernel here runs: the scorer and its FOLLOWERS on a GPU; interpreted,
    `mosaic_gpu.interpreted_warpgroups` of those (one, owning every column, unless asked for the
    GPU's)."""
    return interpreted_warpgroups(1 + FOLLOWERS) if interpret else 1 + FOLLOWERS


def staging(rows: int, width: int, dtype) -> plgpu.SMEM:
    """A row-major staging tile [rows, width + 16 bytes] for one part of the gathered keys."""
    return plgpu.SMEM((rows, width + STAGING_PAD_BYTES // jnp.dtype(dtype).itemsize), dtype)


def pieces(width: int, dtype) -> tuple[tuple[int, int], ...]:
    """(start, length) in elements of the copies that bring a key's part `width` wide: one when its
    bytes are a multiple of COPY_BYTES, else the whole COPY_BYTES blocks and a last COPY_BYTES
    ending at the row's end (DeepSeek-V4's 448 e4m3 values: [0, 384) and [320, 448)); the two
    write the same bytes where they overlap, so the staging row is the part's row either way."""
    itemsize = jnp.dtype(dtype).itemsize
    whole = width * itemsize // COPY_BYTES * COPY_BYTES // itemsize
    if whole == width:
        return ((0, width),)
    return (0, whole), (width - COPY_BYTES // itemsize, COPY_BYTES // itemsize)


def check_part_width(name: str, arg: str, width: int, dtype) -> None:
    """ValueError unless `copy_key` can bring a part `width` wide: at least COPY_BYTES, in whole
    16 bytes (a bulk copy's alignment)."""
    size = width * jnp.dtype(dtype).itemsize
    if size < COPY_BYTES or size % 16:
        raise ValueError(f"{name}: {arg} rows of {width} {jnp.dtype(dtype).name} ({size} bytes) must be at least "
                         f"{COPY_BYTES} bytes, in whole 16 bytes (one key's row comes in bulk copies of "
                         f"multiples of {COPY_BYTES} bytes)")


def copy_key(parts, stagings, row, barrier) -> None:
    """Issue one key's copies: each part, a GMEM ref [W] at the key's row, into row `row` of its
    staging tile (`pieces`: one or two copies), arriving on `barrier` with their bytes.

    A contiguous copy into an unswizzled buffer that asks for no out-of-bounds zero fill lowers to
    `cp.async.bulk`, which wants 16-byte aligned addresses and sizes and has no 256-element box
    limit; the tensor copy (`cp.async.bulk.tensor`) that zero fill needs wants its SMEM address
    128-byte aligned, which a padded staging row is not. Pallas' Lane lowering splits a copy's
    expected bytes evenly over the warpgroup's 128 threads, hence COPY_BYTES. Rows are in bounds by
    construction; `OOBFillMode.UNDEFINED` still clamps a copy at its array's end."""
    for part, stage in zip(parts, stagings):
        for start, length in pieces(part.shape[-1], part.dtype):
            plgpu.copy_gmem_to_smem(part.at[pl.ds(start, length)], stage.at[row, pl.ds(start, length)], barrier,
                                    oob_mode=plgpu.OOBFillMode.UNDEFINED)


def copies_per_key(parts) -> int:
    """The copies `copy_key` issues for one key of these parts (refs [..., W])."""
    return sum(len(pieces(part.shape[-1], part.dtype)) for part in parts)


def issue_keys(rows, parts_at, stagings, copies: int, barrier, by_warp: bool = False) -> None:
    """Issue a tile's key copies: rows, an SMEM ref [T] float32, holds each key's row in its
    arrays (an exact float32 integer; -1 for no key); parts_at(row) -> the GMEM refs [W] of the
    key's parts. A key's copies go into its staging rows (`copy_key`); for no key, its `copies`
    arrivals on `barrier` are made without bytes, so nothing is read for it.

    The rows are in SMEM, arrived with the tile before, because a key's copies cannot be issued
    before its row is known: read from global memory, every key would wait a load's latency in
    turn (hundreds of cycles, 64 times a tile).

    by_warp: each of the issuing warpgroup's WARPS warps issues its T / WARPS keys
    (`plgpu.warp_map`), side by side, a copy's arrivals coming from its warp's 32 threads instead
    of the warpgroup's 128 (after a warpgroup barrier, under Pallas' automatic barriers); the
    mbarrier's count is the same. T must be a multiple of WARPS (the kernels' 64 is). A tuning
    to be timed: on a lent H200 each copy issued by the whole warpgroup cost 113 ns, with or
    without the barrier (`benchmarks/gather_copies.py` times both ways). Interpreted only on jax
    0.11 and later (`mosaic_gpu.warp_map_interpretable`)."""
    if by_warp:
        share = rows.shape[0] // WARPS

        @plgpu.warp_map
        def _(warp):
            mine = pl.ds(warp * share, share)
            issue_keys(rows.at[mine], parts_at, [stage.at[mine] for stage in stagings], copies, barrier)
        return

    @pl.loop(0, rows.shape[0])
    def _(i):
        row = rows[i].astype(jnp.int32)
        pl.when(row >= 0)(lambda: copy_key(parts_at(row), stagings, i, barrier))

        @pl.when(row < 0)
        def _():
            for _ in range(copies):
                plgpu.barrier_arrive(barrier)


def check_copies_by_warp(name: str, copies_by_warp: bool, interpret: bool) -> None:
    """ValueError before tracing where `issue_keys(by_warp=True)` would run on an interpreter that
    cannot (jax 0.10.2's has no `core_map`: `mosaic_gpu.warp_map_interpretable`)."""
    if copies_by_warp and interpret and not warp_map_interpretable():
        raise ValueError(f"{name}: copies_by_warp=True interpreted needs jax >= 0.11 (this is {jax.__version__}, "
                         "whose Mosaic GPU interpreter has no core_map); it lowers for a GPU on both")


def rows_buffer(rows_smem, step):
    """Of rows_smem [2, T] float32, the buffer tile `step`'s rows use (they alternate)."""
    return rows_smem.at[jax.lax.rem(step, 2)]


def fetch_rows(rows_at, step, num_tiles, rows_smem, barrier) -> None:
    """Issue the copy of tile `step`'s rows, rows_at(step) (a GMEM ref [T] float32, read only when
    the tile exists), into its buffer, arriving on `barrier`; past the last tile, the arrival
    without bytes, so that the barrier's count does not depend on where the loop stands."""
    pl.when(step < num_tiles)(lambda: plgpu.copy_gmem_to_smem(rows_at(step), rows_buffer(rows_smem, step), barrier))
    pl.when(step >= num_tiles)(lambda: plgpu.barrier_arrive(barrier))


def prepare_tile(stagings, widths, kv_smem, rows_smem, step, scales=None) -> jax.Array:
    """`scorer`'s prepare: tile `step`'s gathered keys into kv_smem (`to_operand`, the rows that got
    no key zeroed) -> its bias [T] float32 in the WGMMA column layout, 0 where a key was gathered,
    -inf where none. The rows are loaded once per layout: a loaded value does not convert between
    the two."""
    rows = rows_buffer(rows_smem, step)
    to_operand(stagings, widths, kv_smem, plgpu.layout_cast(rows[...], plgpu.Layout.WGMMA.reduce(1)) >= 0, scales)
    seen = plgpu.layout_cast(rows[...], plgpu.Layout.WGMMA.reduce(0)) >= 0
    return jnp.where(seen, 0.0, -jnp.inf)


def to_operand(stagings, widths, kv_smem, keep, scales=None) -> None:
    """Move a gathered tile into the wgmma's operand: each part's staging tile (`staging`), `widths`
    its columns, goes through registers in CHUNK-column pieces into its columns of kv_smem
    [T, sum(widths)] (swizzled, in the parts' order), the rows where keep [T] (WGMMA row layout) is
    False zeroed on the way: stale or never-written memory never meets a zero probability.

    scales: for FP8 keys, [widths[0] / block, T] float32, the block scales of the first part, whose
    e4m3 values are dequantized on the way (`mosaic_gpu.dequantize_rows`, the bits of
    `fp8_cache.entries`); block, widths[0] / scales.shape[0], is a multiple of CHUNK."""
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    rows = jax.lax.broadcast_in_dim(keep, (kv_smem.shape[0], CHUNK), [0])
    first = 0
    for part, (stage, width) in enumerate(zip(stagings, widths)):
        for c in range(0, width, CHUNK):
            chunk = plgpu.layout_cast(stage[:, pl.ds(c, CHUNK)], plgpu.Layout.WGMMA)
            if scales is not None and part == 0:
                block = width // scales.shape[0]
                chunk = dequantize_rows(chunk, plgpu.layout_cast(scales[c // block], row_layout), kv_smem.dtype)
            kv_smem[:, pl.ds(first + c, CHUNK)] = jnp.where(rows, chunk, jnp.zeros_like(chunk))
        first += width


def tile_scores(q_smem, kv_smem, shape: tuple[int, int], scale, bias):
    """One key tile's scores in a warpgroup: q_smem [M, D] . kv_smem [T, D]^T on the tensor cores
    (float32 accumulator, shape = (M, T)), times `scale`, plus bias [T] (0 for a seen key, -inf for
    an unseen one) on every row -> [M, T] float32."""
    def scores(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, kv_smem.transpose((1, 0)))
        return acc_ref[...]

    s = pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))
    return s * scale + jax.lax.broadcast_in_dim(bias, s.shape, [1])


def accumulate_values(acc, alpha, p_smem, values_smem):
    """acc [M, C] float32 * alpha [M] + P V: p_smem [M, T] . values_smem [T, C] on the tensor cores.

    A fresh accumulator added in registers, not an in-place one (`pl.run_state` with
    `plgpu.ACC.init`): jax 0.10.2's interpreter runs neither, and every kernel here must run
    interpreted in the tests."""
    def product(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, values_smem)
        return acc_ref[...]

    tile_out = pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))
    return acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0]) + tile_out


def accumulate_tile(acc, alpha, p_smem, values_smem, interpret: bool):
    """acc [64, C] float32 * alpha [64] + P V, p_smem [64, T] . values_smem [T, C] on the tensor
    cores, as the kernels whose warpgroups own 256 columns each run it. On a GPU the wgmma
    accumulates in place into the rescaled accumulator (`pl.run_state`): a second 64 x 256 float32
    accumulator would not fit beside the first in a warpgroup's registers. Interpreted, a fresh
    accumulator added in registers (`accumulate_values`): jax 0.10.2's interpreter has no
    `run_state`."""
    if interpret:
        return accumulate_values(acc, alpha, p_smem, values_smem)
    scaled = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
    return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p_smem, values_smem))(plgpu.ACC.init(scaled))


def normalised(acc, denom):
    """acc [M, N] float32 / denom [M]: a row that saw nothing (denominator 0, acc 0) stays 0."""
    return acc / jax.lax.broadcast_in_dim(jnp.where(denom > 0, denom, 1.0), acc.shape, [0])


def part_lse(row_max, denom):
    """The log-sum-exp [M] of a softmax ending at row_max [M], denom [M]: EMPTY_LSE for a row that
    saw nothing (denominator 0), which the split-KV merge weighs 0."""
    seen = denom > 0
    return jnp.where(seen, row_max + jnp.log(jnp.where(seen, denom, 1.0)), EMPTY_LSE)


def gathered_tiles(q_smem, kv_smem, p_smem, scale: float, gathered) -> dict:
    """`scorer`'s tile callbacks for the kernels that gather into one operand tile: wait for
    `gathered`, scores `tile_scores` of q_smem [M, D] and kv_smem [T, D] plus `prepare`'s bias,
    P into p_smem [M, T]."""
    return dict(wait=lambda tile: plgpu.barrier_wait(gathered),
                scores=lambda tile, bias: tile_scores(q_smem, kv_smem, p_smem.shape, scale, bias),
                p_at=lambda tile: p_smem)


def scorer(*, num_tiles, init, wait: Callable, prepare: Callable, prefetch: Callable, scores: Callable,
           p_at: Callable, accumulate: Callable, alpha_smem, p_ready, consumed, handshake: bool):
    """Warpgroup 0's loop over a program's key tiles -> (row_max [M], denom [M], acc).

    num_tiles: the tiles to walk (a Python int or a traced int32; tile 0's copies are issued, when
      there is one, before the call); init: (row_max [M], denom [M], acc) float32 in the WGMMA row
      layout, acc any pytree `accumulate` carries: -inf, 0 and zeros for no keys seen yet, or a
      sink's (max = sink, denominator 1);
    wait(t): returns once tile t's copies landed;
    prepare(t) -> what `scores` takes beside t: the gathering kernels move the tile into their
      operand and return its bias [T] (`prepare_tile`), dense MLA dequantizes an FP8 tile;
    prefetch(t): issues tile t's copies (called once tile t - 2's keys and P are done with);
    scores(t, prepared) -> s [M, T] float32: the tile's scaled scores, -inf where a row does not see
      a key (`tile_scores` for the gathering kernels: `gathered_tiles`);
    p_at(t) -> the SMEM ref [M, T] (the keys' dtype) that takes tile t's P;
    accumulate(acc, alpha [M], t) -> acc: `accumulate_values` or `accumulate_tile` of tile t over
      warpgroup 0's columns (acc may be empty: beside followers the scorer owns none);
    alpha_smem [M] float32: the rescale, then the denominator, handed to the followers; handshake:
      followers run beside it (False: warpgroup 0 alone, owning every column); it then starts by
      taking the registers the followers hand over (SCORER_REGISTERS).

    A row that has seen no key yet keeps max -inf and denominator 0, and its rescale is exp(-inf) =
    0 rather than NaN, so an empty row ends with denominator 0 for the caller to handle. A tile a
    row sees nothing of is an exact no-op on that row (max unchanged, rescale exp(0) = 1, P = 0)."""
    if handshake:
        plgpu.set_max_registers(SCORER_REGISTERS, action="increase")

    def step(tile, carry):
        row_max, denom, acc = carry
        wait(tile)
        if handshake:  # the followers are done with the last tile's keys and P
            pl.when(tile > 0)(lambda: plgpu.barrier_wait(consumed))
        prepared = prepare(tile)
        plgpu.commit_smem()
        pl.when(tile + 1 < num_tiles)(lambda: prefetch(tile + 1))

        s = scores(tile, prepared)
        new_max = jnp.maximum(row_max, jnp.max(s, axis=1))
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        alpha = jnp.exp(row_max - safe_max)
        p = jnp.exp(s - jax.lax.broadcast_in_dim(safe_max, s.shape, [0]))
        p_smem = p_at(tile)
        p_smem[...] = p.astype(p_smem.dtype)
        if handshake:
            alpha_smem[...] = alpha
        plgpu.commit_smem()
        if handshake:
            plgpu.barrier_arrive(p_ready)
        return new_max, denom * alpha + jnp.sum(p, axis=1), accumulate(acc, alpha, tile)

    row_max, denom, acc = jax.lax.fori_loop(0, num_tiles, step, init)
    if handshake:  # the followers have read the last rescale: hand them the denominator
        pl.when(num_tiles > 0)(lambda: plgpu.barrier_wait(consumed))
        alpha_smem[...] = denom
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready)
    return row_max, denom, acc


def start_followers(wg, follow: Callable) -> None:
    """Run follow(f) on follower warpgroup 1 + f, for each of the FOLLOWERS."""
    for block in range(FOLLOWERS):
        pl.when(wg == 1 + block)(functools.partial(follow, block))


def follower(*, num_tiles, acc0, accumulate: Callable, alpha_smem, row_layout, p_ready, consumed,
             prepare: Callable | None = None):
    """A follower warpgroup's loop: `P V` over its columns with warpgroup 0's P and rescales ->
    (acc, denom [M]). acc0: its zero accumulator; accumulate(acc, alpha, t) -> acc over its columns;
    prepare(t): what it does for tile t before it waits for P (dense MLA: wait for the tile's
    copies); the rest as in `scorer`. Starts by handing registers
    to the scorer (FOLLOWER_REGISTERS)."""
    plgpu.set_max_registers(FOLLOWER_REGISTERS, action="decrease")

    def step(tile, acc):
        if prepare is not None:
            prepare(tile)
        plgpu.barrier_wait(p_ready)
        acc = accumulate(acc, plgpu.layout_cast(alpha_smem[...], row_layout), tile)
        plgpu.barrier_arrive(consumed)
        return acc

    acc = jax.lax.fori_loop(0, num_tiles, step, acc0)
    plgpu.barrier_wait(p_ready)
    return acc, plgpu.layout_cast(alpha_smem[...], row_layout)
