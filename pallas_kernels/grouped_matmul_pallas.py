"""Pallas GPU kernel (Triton lowering) for `grouped_matmul`: only groups with rows cost anything.

Work items. Each group's rows are cut into row tiles of BLOCK_M rows starting at the group's first
row (a group of 0 rows has no tile, one of 17 rows has two), and the tiles of all groups are
numbered in group order. XLA computes the table (tile -> group, first row, end row) from
`group_sizes` before the launch and passes it as ordinary inputs (GPU Pallas has no scalar
prefetch). The grid is

    (work items, N / BLOCK_N, K splits)     axis 0 varies fastest on the GPU

with a static number of work items, `M // BLOCK_M + min(G, M)`, enough for any group sizes (each
group with rows adds at most one partial tile); items past the real count return at once. A
program multiplies a window of BLOCK_M consecutive rows holding its tile's rows by the [K, BLOCK_N]
column block of its group's matrix, looping over K in block_k steps, and stores only its own rows
(a masked store: the window's other rows belong to neighbouring groups). So every group with rows
has its matrix read once per row tile, and an empty group costs nothing. At decode and
verification sizes (a few hundred token-expert rows over up to 256 experts) a group has one
tile, so each hit expert's weights are read once; in prefill a group's tiles are adjacent work
items, so its weight blocks are re-read from L2 rather than HBM.

Why BLOCK_M = 16: decode is memory-bound, and 16 is the smallest tile Triton's dot takes, so the
tensor-core work spent on a group's unused tile rows stays small (a 1-row group computes 16 rows).
Prefill pays for it with more, smaller tiles; it stays memory- or L2-bound, never 256x.

Bit-exact rows (speculative decoding needs a token's output not to depend on how many tokens share
the call): the tile configuration is fixed by the variant and the static weight shape, never
chosen from the row count, and every row's K reduction runs in the same fixed order (block_k steps
from 0 up, float32 accumulator), so a row's result is the same bits whatever other rows, groups and
M come with it.

FP8 weights (`rhs_scale_inv` given): a program loads its [block_k, BLOCK_N] tile as FP8 bytes and
the one float32 scale that covers it (a tile never straddles two 128 x 128 scale blocks: BLOCK_N is
the block and block_k divides it), and dequantizes it in registers exactly as
`block_fp8.dequantize` does (float32 product, rounded to bfloat16) before the dot. So the weights
cross memory as 1 byte each plus a scale per 16 Ki weights, and every product is the one a
bfloat16 rhs holding the dequantized values would give, bit for bit.

Tile variants (`Tiles`, `VARIANTS`). What the K loop streams per step and how many programs share
a launch are open questions on a GPU: the FP8 loop issues 3.8x the PTX instructions of the
bfloat16 one per step (its dequantization: 128 conversions and 64 multiplies a thread, and a trip
through shared memory into the dot's layout) for half the bytes, and a dense layer
of few column blocks (o_proj: 56 at N 7168) leaves most SMs idle at decode. So the launch takes a
`Tiles` static argument, and `benchmarks/matmuls.py`, `moe.py` and `e2e_step.py` time the named
variants side by side on a lent GPU; `DEFAULT_VARIANT` is the one the library runs until a
measurement names a faster one. Every variant keeps the bit-exactness below, since a variant is a
function of the static shapes alone:
  * block_k: the K step (64 or 128; it divides the FP8 scale block, so a step still has one scale);
  * split_k: split K into `k_splits(...)` ranges, each its own program writing float32 partial
    sums [splits, M, N], which XLA then adds in a fixed order (split 0 first). The count comes from
    K, N and the number of groups, never from M: enough programs to fill the GPU when one token is
    decoded (its rows hit at most DECODE_GROUPS groups), the latency-bound case. A dense linear
    splits (o_proj 4 ways), so do the experts' gate and up projections (2 ways: 8 hit experts x 16
    column blocks), not their down projection (8 x 56 blocks already fill it). A larger launch
    has programs to spare and pays only the partial sums' traffic (16 MB against 3.75 GB of
    weights for the experts' gate projection at 1024 rows);
  * stages: K steps in flight per program. An FP8 step moves half a bfloat16 step's bytes, so at
    the same stages the FP8 loop keeps half the bytes in flight; more stages claim more shared
    memory, and so may leave fewer programs an SM (docs/performance.md times both ways).

Cost (`pl.CostEstimate`, counted by `jaxspec.aot` through `tiling.launch`), from the static shapes:
  * flops = 2 * M * K * N, the useful work of every row. The tensor cores also execute the unused
    rows of partial tiles (at most `work items * BLOCK_M` rows in all, 17x the useful rows for
    single-row groups); that padding is hidden under the weight reads in the memory-bound regime
    and is not counted.
  * bytes = lhs once + the matrices of min(G, M) groups once (the most groups that can have rows;
    FP8: 1 byte per weight plus their scales) + the output once + the work table (+ with K splits
    the float32 partial sums, written and read once): HBM traffic, with re-reads of lhs rows and
    of a group's weight blocks served by L2.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import block_fp8, e4m3_upcast
from .contracts import check_grouped_matmul_args
from .tiling import TARGET_PROGRAMS, block_indices, dot_nn, launch, load_block

# The row and column tiles of every variant (see the module docstring: never chosen from the row count).
BLOCK_M = 16  # rows per tile: the smallest Triton dot
BLOCK_N = 128  # output columns per program
NUM_WARPS = 4
# Weight blocks in flight per program (`Tiles.stages`): streaming HBM needs several, and the Mosaic
# kernel's ring needs two (a step's buffer is refilled once the next step's wgmma is issued).
STAGES_RANGE = (2, 8)
# A K split keeps at least this many steps: fewer and the pipeline's fill and drain would dominate.
MIN_SPLIT_STEPS = 8
MAX_SPLITS = 16
# The most groups one token's rows hit (DeepSeek-V3's top-8 experts): `k_splits` sizes a launch's
# programs for that case, the one that leaves SMs idle.
DECODE_GROUPS = 8


class Tiles(NamedTuple):
    """How a launch cuts its K loop (the module docstring's tile variants); static, hashable.

    block_k: the K step, a divisor of the FP8 scale block (128) and a multiple of 16 (Triton's dot).
    split_k: whether K splits so that one decoded token's launch fills the GPU (`k_splits`).
    stages: K steps in flight per program (Triton's `num_stages`, the Mosaic kernel's TMA ring), in
      STAGES_RANGE. With the K step it sets a program's shared memory, so how many programs share
      an SM: the bytes in flight and the warps that dequantize FP8 weights there.
    integer_upcast: FP8 weights leave e4m3 by integer operations instead of a conversion
      instruction, straight to bfloat16 where a block's scale is a power of two (`e4m3_upcast`:
      the same bits; compiled only, interpreted the kernels convert)."""

    block_k: int = 64
    split_k: bool = False
    stages: int = 4
    integer_upcast: bool = False


# The variants the benchmarks time side by side, by name; "k64" is the kernel as first measured.
# "k64-s7" and "k64-s3" ask what bounds the FP8 loop (docs/performance.md): on the Mosaic kernel
# the first keeps two programs an SM with 7 steps in flight each (112 KiB of FP8 weights an SM,
# against 64 at 4 stages), the second fits three programs (12 warps dequantizing, against 8);
# "k64-int" unpacks e4m3 by integer operations, not conversions.
VARIANTS = {"k64": Tiles(), "k128": Tiles(block_k=128), "k64-split": Tiles(split_k=True),
            "k128-split": Tiles(block_k=128, split_k=True), "k64-s7": Tiles(stages=7), "k64-s3": Tiles(stages=3),
            "k64-int": Tiles(integer_upcast=True)}
DEFAULT_VARIANT = "k64"
# The K steps a tile may take: multiples of Triton's smallest dot that divide the FP8 scale block,
# so a weight tile has one scale (see the module docstring).
BLOCK_KS = (16, 32, 64, 128)
assert BLOCK_N == block_fp8.BLOCK[1] and all(block_fp8.BLOCK[0] % k == 0 for k in BLOCK_KS)
assert all(tiles.block_k in BLOCK_KS and STAGES_RANGE[0] <= tiles.stages <= STAGES_RANGE[1]
           for tiles in VARIANTS.values())

_variant = DEFAULT_VARIANT


def current_tiles() -> Tiles:
    """The tiles `pallas_kernels.grouped_matmul` launches with: `DEFAULT_VARIANT`, or the variant
    of an enclosing `tile_variant`."""
    return VARIANTS[_variant]


@contextlib.contextmanager
def tile_variant(name: str):
    """Inside this context the op's kernel launches with `VARIANTS[name]`: what a benchmark uses to
    time a whole layer or step per variant. The variant is read while tracing, and JAX keys its
    traces by function and arguments, not by this setting (even a new `jax.jit` of the same
    function reuses the trace), so entering and leaving clear JAX's caches (`jax.clear_caches`):
    a program traced outside is traced again inside, and one traced inside is not reused outside.
    A program compiled inside keeps its tiles."""
    global _variant
    if name not in VARIANTS:
        raise ValueError(f"tile variant {name!r}: must be one of {sorted(VARIANTS)}")
    previous, _variant = _variant, name
    jax.clear_caches()
    try:
        yield
    finally:
        _variant = previous
        jax.clear_caches()


def check_tiles(tiles, block_ks: tuple[int, ...]) -> None:
    """ValueError unless `tiles` is a `Tiles` with block_k in `block_ks` (the kernel's K steps) and
    stages in STAGES_RANGE."""
    if (not isinstance(tiles, Tiles) or tiles.block_k not in block_ks
            or not STAGES_RANGE[0] <= tiles.stages <= STAGES_RANGE[1]):
        raise ValueError(f"tiles={tiles!r}: must be a Tiles with block_k in {block_ks} and stages in "
                         f"[{STAGES_RANGE[0]}, {STAGES_RANGE[1]}]")


def k_splits(depth: int, width: int, num_groups: int, tiles: Tiles) -> int:
    """How many K ranges a launch of rhs [num_groups, depth, width] splits into: 1 without
    `tiles.split_k`; otherwise the largest power of two s <= MAX_SPLITS that divides the K steps,
    keeps >= MIN_SPLIT_STEPS steps a range, and keeps s * column blocks * min(num_groups,
    DECODE_GROUPS) (the programs of one decoded token) within `TARGET_PROGRAMS`. A function of
    the static weight shape only: a row's bits never depend on the rows beside it."""
    if not tiles.split_k:
        return 1
    steps = pl.cdiv(depth, tiles.block_k)
    programs = pl.cdiv(width, BLOCK_N) * min(num_groups, DECODE_GROUPS)
    splits = 1
    while (2 * splits <= MAX_SPLITS and steps % (2 * splits) == 0 and steps // (2 * splits) >= MIN_SPLIT_STEPS
           and 2 * splits * programs <= TARGET_PROGRAMS):
        splits *= 2
    return splits


def num_work_items(num_rows: int, num_groups: int) -> int:
    """Row tiles any `group_sizes` summing to <= num_rows can need: sum_g ceil(size_g / BLOCK_M)
    <= num_rows // BLOCK_M + (groups with rows)."""
    return num_rows // BLOCK_M + min(num_groups, num_rows)


def work_items(group_sizes: jax.Array, num_rows: int, groups_with_rows: int | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """group_sizes [G] -> (group [W], first row [W], end row [W]) int32 of the row tiles, in group
    order; items past the real tile count (and anything `group_sizes` summing past num_rows would
    put out of bounds) have first row == end row: no rows. groups_with_rows: the most groups that
    can have rows (default G; a stack's row r: the G of one row), which sizes W."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    num_groups = sizes.shape[0]
    groups_with_rows = num_groups if groups_with_rows is None else groups_with_rows
    row_end = jnp.cumsum(sizes)
    tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    tile_end = jnp.cumsum(tiles)
    item = jnp.arange(num_work_items(num_rows, groups_with_rows), dtype=jnp.int32)
    # Every item against every group's end (W x G integer compares, one fused reduction) rather
    # than searchsorted's default binary search, a while loop of log2(G) + 1 trips whose body is
    # four one-thread kernels on a GPU and which splits a decode step's CUDA graph around it at
    # every MoE layer and FP8 linear. Integer counts: the same groups either way. The compares
    # grow as W x G (58 stacked layers' experts at decode: 320 x 14,848); a one-call prefill of a
    # million rows pays that too, under 1% of its MoE's flops.
    group = jnp.minimum(jnp.searchsorted(tile_end, item, side="right", method="compare_all"),
                        num_groups - 1).astype(jnp.int32)
    first_tile = tile_end[group] - tiles[group]
    start = row_end[group] - sizes[group] + (item - first_tile) * BLOCK_M
    end = jnp.minimum(start + BLOCK_M, row_end[group])
    real = item < tile_end[-1]
    start = jnp.where(real, jnp.clip(start, 0, num_rows), 0)
    end = jnp.where(real, jnp.clip(end, start, num_rows), 0)
    return group, start, end


def _tile(start, block: int, extent: int):
    """Indices [start, start + block) of an axis of `extent` -> (clamped indices, valid or None when
    the axis is a whole number of blocks, so Triton gets unmasked, contiguous loads)."""
    index, valid = block_indices(start, block, extent)
    return index, (None if extent % block == 0 else valid)


def _shifts_last_block(width: int) -> bool:
    """Whether the last column block of `width` columns is loaded shifted (`_column_start`): the
    width is not a whole number of blocks but holds one."""
    return width % BLOCK_N != 0 and width > BLOCK_N


def _column_start(column_block, width: int):
    """The first of the BLOCK_N columns a program loads for its column block: the block's own first
    column, except that a shifted last block (`_shifts_last_block`) ends at the width instead, so
    its load stays a plain in-bounds slice (kv_a_proj's 576 columns: 448 to 575 for the block of
    512 to 575); the program stores only its own columns."""
    if not _shifts_last_block(width):
        return column_block * BLOCK_N
    return jnp.minimum(column_block * BLOCK_N, width - BLOCK_N)


def _weight_block(rhs_ref, group, step, column_start, depth: int, width: int, block_k: int):
    """The [block_k, BLOCK_N] block at K step `step` and columns [column_start, column_start +
    BLOCK_N) of `group`'s matrix in rhs_ref [G * K, N].

    When K is a whole number of steps (DeepSeek's are) and N holds a block, the block is a plain
    slice, which Triton pipelines with asynchronous copies (`Tiles.stages` blocks in flight, measured
    in the PTX: the index-array gather below gets none, and streaming the weights is all the time
    at decode); otherwise a clamped, masked gather reads zeros past the edges (a slice there would
    be clamped as a whole, shifting the block, in interpret mode). FP8 weights are gathered
    unmasked (Triton cannot fill a masked FP8 load: it has no integer -> FP8 cast): the clamped
    rows past K meet the zero columns of the masked lhs tile, and the columns past N land in
    output columns that are cropped, so they change nothing.
    """
    if depth % block_k == 0 and width >= BLOCK_N:
        return rhs_ref[pl.ds(group * depth + step * block_k, block_k), pl.ds(column_start, BLOCK_N)]
    inner, inner_valid = _tile(step * block_k, block_k, depth)
    columns, column_valid = _tile(column_start, BLOCK_N, width)
    if rhs_ref.dtype == block_fp8.FP8:
        return load_block(rhs_ref, group * depth + inner, columns)
    return load_block(rhs_ref, group * depth + inner, columns, inner_valid, column_valid)


def _grouped_matmul_kernel(lhs_ref, rhs_ref, group_ref, start_ref, end_ref, *refs, depth: int, width: int,
                           block_k: int, split_steps: int, integer_upcast: bool):
    """One (row tile, column block, K range) program.

    lhs_ref [M, K], rhs_ref [G * K, N] (the groups' matrices stacked),
    group_ref / start_ref / end_ref [W] int32 (the work table); refs: (out_ref,) or, for FP8
    weights, (scale_ref, out_ref) with scale_ref [G * ceil(K / 128) * ceil(N / 128)] float32 (the
    scales flattened); out_ref [splits, max(M, BLOCK_M), N padded to BLOCK_N]: the program's K
    range's sum, in the output dtype without a split, float32 partial sums with one.

    The program computes the BLOCK_M rows from `first = min(start, max(M - BLOCK_M, 0))`, a window
    that holds its tile's rows [start, end) and never runs past M (with M < BLOCK_M the rows past
    M read zeros: `_activation_block`), and stores only its tile's rows. Loading
    that window as a plain slice is what lets Triton prefetch the activations with asynchronous
    copies like the weights: an index-array gather of the rows is a synchronous global load in
    every K step, and its latency, not HBM bandwidth, then sets the pace of the weight stream.
    Its K range is steps [split * split_steps, (split + 1) * split_steps), in order from the first;
    its columns start at `_column_start`, and it stores those of its own column block.
    """
    *scale_ref, out_ref = refs
    item, column_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = start_ref[item], end_ref[item]

    @pl.when(start < end)
    def _():
        first = jnp.minimum(start, max(lhs_ref.shape[0] - BLOCK_M, 0))
        group = group_ref[item]
        column_start = _column_start(column_block, width)

        def accumulate(i, acc):
            step = split * split_steps + i
            a = _activation_block(lhs_ref, first, step, depth, block_k)
            b = _weight_block(rhs_ref, group, step, column_start, depth, width, block_k)
            if scale_ref:
                b = _dequantized(b, scale_ref[0], group, step, column_block, depth, width, block_k, integer_upcast)
            dtype = jnp.promote_types(a.dtype, b.dtype)
            return acc + dot_nn(a.astype(dtype), b.astype(dtype))

        acc = jax.lax.fori_loop(0, split_steps, accumulate, jnp.zeros((BLOCK_M, BLOCK_N), jnp.float32))
        row = first + jnp.arange(BLOCK_M, dtype=jnp.int32)
        mine = ((row >= start) & (row < end))[:, None]
        if _shifts_last_block(width):  # the previous block's columns are not ours
            mine = mine & (column_start + jnp.arange(BLOCK_N, dtype=jnp.int32) >= column_block * BLOCK_N)[None, :]
        plgpu.store(out_ref.at[split, pl.ds(first, BLOCK_M), pl.ds(column_start, BLOCK_N)],
                    acc.astype(out_ref.dtype), mask=mine)


def _activation_block(lhs_ref, first, step, depth: int, block_k: int):
    """Rows [first, first + BLOCK_M) of lhs_ref [M, K] at K step `step`: [BLOCK_M, block_k].

    A plain slice when K is a whole number of steps (DeepSeek's are), so Triton pipelines it;
    otherwise a gather whose columns past K read zeros (they meet the weight rows past K). With
    fewer rows than a window (M < BLOCK_M: decode at a small batch, first = 0) the slice is a
    masked load whose rows past M read zeros: still contiguous along K, so Triton still copies it
    asynchronously (a masked copy fills zeros), and the caller needs no padded copy of lhs, which
    XLA would make in a kernel of its own before every linear.
    """
    num_rows = lhs_ref.shape[0]
    row_valid = None if num_rows >= BLOCK_M else jnp.arange(BLOCK_M, dtype=jnp.int32) < num_rows
    if depth % block_k == 0:
        window = lhs_ref.at[pl.ds(first, BLOCK_M), pl.ds(step * block_k, block_k)]
        return window[...] if row_valid is None else plgpu.load(window, mask=row_valid[:, None], other=0.0)
    inner, inner_valid = _tile(step * block_k, block_k, depth)
    rows = jnp.minimum(first + jnp.arange(BLOCK_M, dtype=jnp.int32), num_rows - 1)
    return load_block(lhs_ref, rows, inner, row_valid, inner_valid)


def _dequantized(tile, scale_ref, group, step, column_block, depth: int, width: int, block_k: int,
                 integer_upcast: bool):
    """An FP8 weight tile [block_k, BLOCK_N] of `group` -> bfloat16, times the scale that covers
    its column block's columns (a shifted last block's other columns are not stored); with
    `integer_upcast` the e4m3 bytes leave by integer operations (`e4m3_upcast.dequantized`: the
    same bits, by the route the block's scale allows)."""
    k_blocks, n_blocks = block_fp8.scale_shape((depth, width))
    scale = scale_ref[(group * k_blocks + step // (block_fp8.BLOCK[0] // block_k)) * n_blocks + column_block]
    if integer_upcast:  # by integer operations, the route the scale allows: the same bits
        return e4m3_upcast.dequantized(functools.partial(e4m3_upcast.upcast_triton, tile), scale)
    return (tile.astype(jnp.float32) * scale).astype(jnp.bfloat16)


def grouped_matmul_cost(lhs, rhs, out_dtype, rhs_scale_inv=None, splits: int = 1) -> pl.CostEstimate:
    """The launch's cost from the static shapes (what it counts: the module docstring). rhs:
    [G, K, N], or a stack [n, G, K, N] of which one call multiplies by one row (likewise its scales).
    splits: the launch's K splits (`k_splits`), whose float32 partial sums cross memory twice."""
    (num_rows, depth), (num_groups, _, width) = lhs.shape, rhs.shape[-3:]
    table_bytes = 3 * 4 * num_work_items(num_rows, num_groups)
    per_group = depth * width * rhs.dtype.itemsize
    if rhs_scale_inv is not None:
        per_group += math.prod(rhs_scale_inv.shape[-2:]) * rhs_scale_inv.dtype.itemsize
    partial_bytes = 0 if splits == 1 else 2 * splits * num_rows * width * 4
    return pl.CostEstimate(
        flops=2 * num_rows * depth * width, transcendentals=0,
        bytes_accessed=(lhs.size * lhs.dtype.itemsize + min(num_groups, num_rows) * per_group
                        + num_rows * width * jnp.dtype(out_dtype).itemsize + table_bytes + partial_bytes))


@functools.partial(jax.jit, static_argnames=("interpret", "tiles"))
def grouped_matmul_pallas(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                          rhs_scale_inv: jax.Array | None = None, rhs_row: jax.Array | None = None, *,
                          interpret: bool | None = None, tiles: Tiles = VARIANTS[DEFAULT_VARIANT]) -> jax.Array:
    """`grouped_matmul_reference` as a Pallas kernel.

    lhs [M, K] sorted by group, rhs [G, K, N] (float, or float8_e4m3fn with rhs_scale_inv
    [G, ceil(K / 128), ceil(N / 128)] float32), group_sizes [G] (sum <= M) -> [M, N] in the
    promoted dtype (lhs's for FP8), float32 accumulation; rows past sum(group_sizes) are zero.
    rhs_row: None, or r with rhs a stack [n, G, K, N] (rhs_scale_inv [n, G, ...]) whose row r
    holds the groups: the kernel sees the stack as n * G groups, of which its work items name
    groups r * G .. r * G + G - 1 (the table built from the G sizes, offset), so it reads only row
    r, where it lies, and its grid stays that of G groups. interpret None = interpret mode off a GPU.
    tiles: the launch's K step and split (`Tiles`; the module docstring's tile variants).
    """
    check_tiles(tiles, BLOCK_KS)
    num_groups = group_sizes.shape[0]
    out_dtype = lhs.dtype if rhs_scale_inv is not None else jnp.promote_types(lhs.dtype, rhs.dtype)
    depth, width = rhs.shape[-2:]
    splits = k_splits(depth, width, num_groups, tiles)
    cost = grouped_matmul_cost(lhs, rhs, out_dtype, rhs_scale_inv, splits)
    row_of = lambda a: a if rhs_row is None or a is None else jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
    check_grouped_matmul_args(lhs, row_of(rhs), group_sizes, row_of(rhs_scale_inv))
    if rhs_row is not None:  # the stack as n * G groups, of which row r's are the work items'
        rhs = rhs.reshape(-1, *rhs.shape[2:])
        rhs_scale_inv = None if rhs_scale_inv is None else rhs_scale_inv.reshape(-1, *rhs_scale_inv.shape[2:])
    num_rows, stacked_groups = lhs.shape[0], rhs.shape[0]
    if num_rows == 0:  # no work items: CUDA refuses a launch of an empty grid, and there is nothing to compute
        return jnp.zeros((0, width), out_dtype)
    # The table of the G groups, then offset to row r's: built over the whole stack it would
    # search n * G group ends (every layer's) at every layer.
    group, start, end = work_items(group_sizes, num_rows, num_groups)
    if rhs_row is not None:
        group = group + rhs_row.astype(jnp.int32) * num_groups
    column_blocks = pl.cdiv(width, BLOCK_N)
    steps = pl.cdiv(depth, tiles.block_k)
    kernel = functools.partial(_grouped_matmul_kernel, depth=depth, width=width, block_k=tiles.block_k,
                               split_steps=steps // splits,
                               integer_upcast=rhs_scale_inv is not None and tiles.integer_upcast and not interpret)
    partial_dtype = out_dtype if splits == 1 else jnp.float32
    out_rows = max(num_rows, BLOCK_M)  # a window's rows are stored from row 0 at the least
    out = launch(kernel, out_shape=jax.ShapeDtypeStruct((splits, out_rows, column_blocks * BLOCK_N), partial_dtype),
                 grid=(group.shape[0], column_blocks, splits), num_warps=NUM_WARPS, num_stages=tiles.stages,
                 name="grouped_matmul", interpret=interpret, cost=cost)(
        lhs, rhs.reshape(stacked_groups * depth, width), group, start, end,
        *([] if rhs_scale_inv is None else [rhs_scale_inv.reshape(-1)]))
    return summed_splits(out, group_sizes, num_rows, width, out_dtype)


def window_rows(lhs: jax.Array) -> jax.Array:
    """lhs [M, K] as the kernels read it: whole BLOCK_M-row windows, so fewer rows than one (decode
    at a small batch) are padded with zero rows, which no work item covers -> [max(M, BLOCK_M), K].
    Shared by the Mosaic GPU kernels, whose TMA copies move whole windows (the Triton kernel masks
    its loads instead: `_activation_block`)."""
    pad = BLOCK_M - lhs.shape[0]
    return jnp.pad(lhs, ((0, pad), (0, 0))) if pad > 0 else lhs


def summed_splits(out: jax.Array, group_sizes: jax.Array, num_rows: int, width: int, out_dtype) -> jax.Array:
    """A launch's output [splits, >= M, >= N] (each K split's sums) -> the op's [M, N] in out_dtype:
    the splits added one after another, so each element's order is fixed (a reduce over the split
    axis would leave the order to XLA), and the rows past sum(group_sizes), which no program
    writes, set to zero as the op defines them. Shared by the Triton and Mosaic GPU kernels."""
    total = functools.reduce(jnp.add, (out[i] for i in range(1, out.shape[0])), out[0])
    covered = jnp.arange(num_rows) < jnp.sum(jnp.maximum(group_sizes, 0))
    return jnp.where(covered[:, None], total[:num_rows, :width], 0).astype(out_dtype)
