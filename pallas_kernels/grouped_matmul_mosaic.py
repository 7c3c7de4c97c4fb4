"""Pallas Mosaic GPU kernel (`plgpu.kernel`: TMA, wgmma, mbarriers) for `grouped_matmul`.

The same work as the Triton kernel (`grouped_matmul_pallas.py`), cut the same way: its work table
(row tiles of BLOCK_M = 16 rows, one group each, in group order), its column blocks of BLOCK_N = 128
and its K splits (`k_splits`, from the weight's shape alone). The grid is

    (K splits, N / BLOCK_N, work items)     the last axis varies fastest

(Mosaic GPU launches a Pallas grid reversed: its last axis is CUDA's x), as the Triton kernel's
work items vary fastest: a group's row tiles are adjacent, so in prefill its weight blocks come
from L2 after the first tile's read, and CUDA's x has no 65,535 limit for a long prefill's items.
A program multiplies the 16-row window of its tile by the [K, 128] column block of its group's
matrix, then stores only its tile's rows. What changes is how the K loop runs on Hopper:

* **Weights by TMA, `Tiles.stages` steps ahead.** Each K step's [block_k, 128] weight block and
  [16, block_k] activation block arrive by TMA into rings of `stages` buffers (a barrier each), so
  weights are in flight while the tensor cores work (Triton's loop kept its activation rows a
  synchronous load until they became a plain slice; here every byte of the loop comes by TMA). A
  buffer is refilled as soon as what reads it is done. An FP8 weight buffer is read only by the
  step's dequantization (the wgmma reads the dequantized copy), so it takes step i + stages right
  after that, and `stages` steps of weights stay in flight; activation buffers, and bfloat16
  weights, wait for the wgmma that read them, which leaves `stages - 1`. The K step and the stages
  are the tile variant's (`grouped_matmul_pallas.Tiles`): with FP8 weights and 4 stages a K step of
  128 claims 157 KiB of shared memory, one program an SM with 64 KiB of weights in flight; one of
  64 claims 79 KiB, two programs an SM with 32 KiB each, whose dequantization and wgmma interleave
  (`VARIANTS` also has 7 stages, still two programs an SM, and 3, three an SM).
* **wgmma, 64 rows of which 16 are the tile's.** wgmma's M is 64 and the tile has 16 rows (a decode
  step puts a handful of rows on each expert). The activation ring holds 16 rows a step, back to
  back, plus 48 rows past its end: a step's wgmma reads the 64 rows from its own 16 on, and the 48
  after them (the next steps' rows, or the unused tail) only make accumulator rows that are never
  stored, since wgmma computes an output row from that row of its operands alone. So the ring
  costs 2 KiB a step at a K step of 64, not the 8 KiB of 64-row buffers, which is what leaves room
  for more steps in flight. The tensor cores spend 4x the useful flops, which at decode costs 128
  flops a weight byte, below the H100's ridge (about 295), so the loop stays bound by the weights'
  bytes. Cutting the rows at 64 instead would load 4x the activations every step.
* **FP8 weights, dequantized once a step.** An e4m3 block goes from its TMA buffer through registers
  (in `mosaic_gpu.UPCAST_8BIT`; float32 times the block's scale, rounded to bfloat16:
  `block_fp8.dequantize` exactly) into a bfloat16 operand buffer that the wgmma reads. Under
  `Tiles.integer_upcast` (variant `k64-int`) the e4m3 bytes leave by integer operations rather
  than a conversion instruction, the same bits (`e4m3_upcast`; compiled only: interpreted, the
  kernel converts): a block whose scale is a power of two (DeepSeek's "ue8m0" releases) straight
  to bfloat16 and one bfloat16 multiply, any other through float16 and the float32 product, one
  branch a step on the block's scale. wgmma takes
  FP8 only with both operands FP8, and quantizing the activations would change the numerics
  (DeepSeek's `gemm_impl="fp8"`). The operand buffer is double-buffered, so a step's
  dequantization overlaps the previous step's wgmma. The block's scale is one float32 (block_k
  divides the 128 x 128 scale block, BLOCK_N is its width): a program copies its column block's
  scales into SMEM once, so the loop reads no scale from global memory. They are read where they
  lie, [G, K / 128, N / 128], as a [K / 128, 4] box (a TMA box's rows are at least 16 bytes) of
  the four column blocks around its own: a program's column of scales is strided, and a copy
  transposed to make it contiguous would be one more XLA op a call, before every launch (most
  likely the H200 profile's 0.3 ms of pad fusions a full-width step, 3% of it at B 1).
* **Stores.** The accumulator goes to SMEM (into the rings' memory, free once the loop is done:
  `mosaic_gpu.union`), and one TMA copy a row writes the tile's rows (a window's other rows belong
  to neighbouring groups, which their own programs write).

Bit-exact rows (speculative decoding needs a token's output not to depend on how many tokens share
the call): tiles, K step, stages and splits are constants or functions of the static weight shape,
a row's K reduction runs in the same order whatever the rows beside it (block_k steps from 0 up,
one wgmma each into a float32 accumulator; wgmma computes an output row from that row of its
operands only), and split partial sums are added in a fixed order by XLA as for the Triton kernel.

Allowed (`check_operands`, ValueError before tracing): bfloat16 or float16 activations; weights of
the same dtype, or float8_e4m3fn with DeepSeek's 128 x 128 block scales and bfloat16 activations;
K and N multiples of 128 (every DeepSeek-V3 weight but kv_a_proj's 576 columns), and with FP8
weights K at most 32768.
`accepts` says whether operands fit, so the op can keep the Triton kernel for those that do not.

Interpreted on the CPU through `mosaic_gpu.interpreting` (a private JAX API, `mosaic_gpu.JAX_RANGE`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import block_fp8, e4m3_upcast
from .contracts import check_grouped_matmul_args
from .cost import stating
from .grouped_matmul_pallas import (BLOCK_M, BLOCK_N, DEFAULT_VARIANT, VARIANTS, Tiles, check_tiles,
                                    grouped_matmul_cost, k_splits, summed_splits, window_rows, work_items)
from .mosaic_gpu import UPCAST_8BIT, compiler_params, interpret_params, interpreting, store, swizzled, union

# The K steps a launch may take (`Tiles.block_k`): divisors of the FP8 scale block's depth, so a
# step's weight block has one scale, and at least a 128-byte swizzled row of bfloat16 activations.
BLOCK_KS = (64, 128)
# K and N must be whole multiples of this: the scale block, and the largest K step.
BLOCK = 128
# wgmma's M: the rows the tensor cores compute for a tile of BLOCK_M.
WGMMA_M = 64
# Scales copied per program: its column block's and its neighbours', SCALE_COLUMNS float32 (a TMA
# box's rows are whole 16 bytes, as are the rows of the array it reads), in rows padded to a
# multiple of SCALE_ROWS (Mosaic GPU takes a copy of whole 128 bytes: one per thread of the
# warpgroup that waits for it), at most a TMA box's 256 (K up to 32768: DeepSeek's widest is
# 18432). The array is padded only where its shape needs it: of DeepSeek-V3.2's FP8 weights, the
# 12 scale rows of q_b_proj and the indexer's wq_b, and the one column of its wk (128 wide).
SCALE_COLUMNS = 4
SCALE_ROWS = 8
MAX_SCALES = 256
# A TMA copy into a swizzled buffer moves whole tiles of this many rows, and Mosaic GPU lowers one
# from global memory only if the array's rows are a whole number of them: the activations are
# padded to one (21 rows failed to lower on an H200), the padding read by no work item.
TMA_ROWS = 8
_ACTIVATION_DTYPES = (jnp.bfloat16, jnp.float16)
assert BLOCK_N == BLOCK == block_fp8.BLOCK[1] == block_fp8.BLOCK[0] and WGMMA_M % BLOCK_M == 0
assert all(BLOCK % block_k == 0 for block_k in BLOCK_KS)


def _problem(lhs, rhs, rhs_scale_inv) -> str | None:
    """Why the kernel cannot take these operands (arrays or `jax.ShapeDtypeStruct`s), or None.
    rhs: [G, K, N] or a stack [n, G, K, N]."""
    depth, width = rhs.shape[-2:]
    if jnp.dtype(lhs.dtype) not in map(jnp.dtype, _ACTIVATION_DTYPES):
        return f"lhs.dtype={lhs.dtype}: must be bfloat16 or float16 (a wgmma operand)"
    if rhs_scale_inv is not None:
        if jnp.dtype(lhs.dtype) != jnp.dtype(jnp.bfloat16):
            return f"lhs.dtype={lhs.dtype}: with FP8 weights must be bfloat16 (the dequantized weights' dtype)"
    elif jnp.dtype(rhs.dtype) != jnp.dtype(lhs.dtype):
        return f"rhs.dtype={rhs.dtype}: must be lhs's dtype {lhs.dtype}, or float8_e4m3fn with scales"
    if rhs_scale_inv is not None and depth > MAX_SCALES * BLOCK:
        return (f"rhs [..., {depth}, {width}]: FP8 weights with K over {MAX_SCALES * BLOCK} are not taken (a "
                f"program copies its {depth // BLOCK} scales in one TMA box of at most {MAX_SCALES})")
    if depth % BLOCK or width % BLOCK:
        return (f"rhs [..., {depth}, {width}]: K must be a multiple of {BLOCK} and N of {BLOCK} "
                "(whole TMA blocks and whole FP8 scale blocks)")
    return None


def accepts(lhs, rhs, rhs_scale_inv=None) -> bool:
    """Whether the kernel takes these operands (`check_operands` would pass)."""
    return _problem(lhs, rhs, rhs_scale_inv) is None


def check_operands(lhs, rhs, rhs_scale_inv=None) -> None:
    """ValueError naming the argument unless the kernel takes these operands (module docstring)."""
    problem = _problem(lhs, rhs, rhs_scale_inv)
    if problem is not None:
        raise ValueError(f"grouped_matmul_mosaic: {problem}; use backend='pallas' or 'xla' for these operands")


def _kernel(lhs_ref, rhs_ref, group_ref, start_ref, end_ref, *refs, depth: int, block_k: int, stages: int,
            split_steps: int, fp8: bool, integer_upcast: bool, interpret: bool):
    """One (row tile, column block, K split) program.

    lhs_ref [M, K] with M >= BLOCK_M, rhs_ref [Gs * K, N] (the groups' matrices stacked),
    group_ref / start_ref / end_ref [W] int32 (the work table); refs: (out_ref,) or, with FP8
    weights, (scale_ref, out_ref) with scale_ref [Gs, kb, nb] float32 (the scales [Gs, K / 128,
    N / 128] padded to multiples of SCALE_ROWS and SCALE_COLUMNS); out_ref [splits, M, N] (float32
    partial sums with splits)."""
    *scale_ref, out_ref = refs
    item, column_block, split = (jax.lax.axis_index(axis) for axis in ("item", "column", "split"))
    start, end = start_ref[item], end_ref[item]
    num_rows = lhs_ref.shape[0]

    @pl.when(start < end)
    def _():
        group = group_ref[item]
        first = jnp.minimum(start, num_rows - BLOCK_M)  # the window of BLOCK_M rows holding [start, end)
        columns = pl.ds(column_block * BLOCK_N, BLOCK_N)
        first_step = split * split_steps

        def body(buffers, operand_smem, scales_smem, x_barriers, w_barriers, scale_barrier):
            (x_smem, w_smem), out_smem = buffers  # the rings' memory holds the output rows after the loop

            def fetch_activations(i, slot):
                """Start the TMA copy of step i's activation block into ring buffer `slot`."""
                plgpu.copy_gmem_to_smem(lhs_ref.at[pl.ds(first, BLOCK_M), pl.ds((first_step + i) * block_k, block_k)],
                                        x_smem.at[pl.ds(slot * BLOCK_M, BLOCK_M)], x_barriers.at[slot])

            def fetch_weights(i, slot):
                """Start the TMA copy of step i's weight block into ring buffer `slot`."""
                plgpu.copy_gmem_to_smem(rhs_ref.at[pl.ds(group * depth + (first_step + i) * block_k, block_k),
                                                   columns], w_smem.at[slot], w_barriers.at[slot])

            if fp8:
                neighbours = pl.ds(column_block // SCALE_COLUMNS * SCALE_COLUMNS, SCALE_COLUMNS)
                plgpu.copy_gmem_to_smem(scale_ref[0].at[group, :, neighbours], scales_smem, scale_barrier)
            for i in range(min(stages, split_steps)):
                fetch_weights(i, i)
                fetch_activations(i, i)
            if fp8:
                plgpu.barrier_wait(scale_barrier)

            def accumulate(acc_ref):
                @pl.loop(0, split_steps)
                def _(i):
                    slot = jax.lax.rem(i, stages)
                    plgpu.barrier_wait(w_barriers.at[slot])
                    operand = w_smem.at[slot]
                    if fp8:
                        buffer = jax.lax.rem(i, 2)
                        weights = plgpu.layout_cast(w_smem[slot], UPCAST_8BIT)
                        # e4m3 -> float32 (exact), times the block's scale, rounded: block_fp8.dequantize.
                        scale = scales_smem[jax.lax.div((first_step + i) * block_k, BLOCK),
                                            jax.lax.rem(column_block, SCALE_COLUMNS)]
                        if integer_upcast:  # by integer operations, the route the scale allows: the same bits
                            operand_smem[buffer] = e4m3_upcast.dequantized(
                                functools.partial(e4m3_upcast.upcast_mosaic, weights, UPCAST_8BIT), scale)
                        else:
                            operand_smem[buffer] = (weights.astype(jnp.float32) * scale).astype(operand_smem.dtype)
                        # The warpgroup's barrier inside: every thread has read the weight buffer
                        # (the wgmma reads the dequantized copy), so it takes step i + stages now.
                        plgpu.commit_smem()
                        operand = operand_smem.at[buffer]

                        @pl.when(i + stages < split_steps)
                        def _():
                            fetch_weights(i + stages, slot)

                    plgpu.barrier_wait(x_barriers.at[slot])
                    plgpu.wgmma(acc_ref, x_smem.at[pl.ds(slot * BLOCK_M, WGMMA_M)], operand)
                    # Step i - 1's wgmma has finished: the buffers it read take step i - 1 + stages.
                    plgpu.wgmma_wait(1)

                    @pl.when((i > 0) & (i - 1 + stages < split_steps))
                    def _():
                        fetch_activations(i - 1 + stages, jax.lax.rem(i - 1, stages))
                        if not fp8:
                            fetch_weights(i - 1 + stages, jax.lax.rem(i - 1, stages))

                plgpu.wgmma_wait(0)
                return acc_ref[...]

            acc = pl.run_scoped(accumulate, plgpu.ACC((WGMMA_M, BLOCK_N), jnp.float32))
            store(out_smem, acc.astype(out_smem.dtype))
            plgpu.commit_smem()

            @pl.loop(start - first, end - first)
            def _(row):
                plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(row, 1)],
                                        out_ref.at[split, pl.ds(first + row, 1), columns])

            plgpu.wait_smem_to_gmem(0)

        weight_dtype = rhs_ref.dtype
        operand_dtype = lhs_ref.dtype
        # The activation ring: `stages` slots of BLOCK_M rows, then the rows the last slot's 64-row
        # window reads past them (the module docstring).
        rings = (plgpu.SMEM((stages * BLOCK_M + WGMMA_M - BLOCK_M, block_k), operand_dtype,
                            transforms=swizzled(operand_dtype, block_k)),
                 plgpu.SMEM((stages, block_k, BLOCK_N), weight_dtype, transforms=swizzled(weight_dtype, BLOCK_N)))
        pl.run_scoped(
            body,
            union(rings, plgpu.SMEM((WGMMA_M, BLOCK_N), out_ref.dtype), interpret=interpret),
            plgpu.SMEM((2, block_k, BLOCK_N), operand_dtype, transforms=swizzled(operand_dtype, BLOCK_N))
            if fp8 else None,
            plgpu.SMEM((scale_ref[0].shape[1], SCALE_COLUMNS), jnp.float32) if fp8 else None,
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1) if fp8 else None,
        )


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def _grouped_matmul_mosaic(lhs, rhs, group_sizes, rhs_scale_inv, rhs_row, *, tiles: Tiles, interpret: bool):
    num_rows, depth, width = lhs.shape[0], *rhs.shape[-2:]
    num_groups = group_sizes.shape[0]
    fp8 = rhs_scale_inv is not None
    out_dtype = lhs.dtype
    if num_rows == 0:  # no work items: CUDA refuses a launch of an empty grid, and there is nothing to compute
        return jnp.zeros((0, width), out_dtype)
    splits = k_splits(depth, width, num_groups, tiles)
    steps = depth // tiles.block_k
    cost = grouped_matmul_cost(lhs, rhs, out_dtype, rhs_scale_inv, splits)
    stacked = rhs.reshape(-1, depth, width)
    group, start, end = work_items(group_sizes, num_rows, num_groups)
    if rhs_row is not None:  # the stack's row r holds groups r * G .. r * G + G - 1
        group = group + rhs_row.astype(jnp.int32) * num_groups
    operand = window_rows(lhs)
    operand = jnp.pad(operand, ((0, -operand.shape[0] % TMA_ROWS), (0, 0)))
    scales = ()
    if fp8:  # [Gs, K / 128, N / 128] as stored (a stack's rows as groups), padded where it must be
        stacked_scales = rhs_scale_inv.reshape(stacked.shape[0], *rhs_scale_inv.shape[-2:])
        pads = ((0, 0), (0, -stacked_scales.shape[1] % SCALE_ROWS), (0, -stacked_scales.shape[2] % SCALE_COLUMNS))
        scales = (jnp.pad(stacked_scales, pads),)  # XLA drops a pad of nothing
    partial_dtype = out_dtype if splits == 1 else jnp.float32
    out_type = jax.ShapeDtypeStruct((splits, operand.shape[0], width), partial_dtype)
    kernel = plgpu.kernel(
        functools.partial(_kernel, depth=depth, block_k=tiles.block_k, stages=tiles.stages,
                          split_steps=steps // splits, fp8=fp8,
                          integer_upcast=fp8 and tiles.integer_upcast and not interpret, interpret=interpret),
        kernel_name="grouped_matmul_mosaic",
        out_type=out_type, grid=(splits, width // BLOCK_N, group.shape[0]), grid_names=("split", "column", "item"),
        compiler_params=compiler_params(), interpret=interpret_params() if interpret else None)
    with stating(cost, "grouped_matmul"):
        out = kernel(operand, stacked.reshape(-1, width), group, start, end, *scales)
    return summed_splits(out, group_sizes, num_rows, width, out_dtype)


def grouped_matmul_mosaic(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                          rhs_scale_inv: jax.Array | None = None, rhs_row: jax.Array | None = None, *,
                          tiles: Tiles = VARIANTS[DEFAULT_VARIANT], interpret: bool = False) -> jax.Array:
    """`grouped_matmul_reference` as a Mosaic GPU kernel; same arguments and result as
    `grouped_matmul_pallas`.

    lhs [M, K] bfloat16 or float16 sorted by group, rhs [G, K, N] of lhs's dtype or float8_e4m3fn
    with rhs_scale_inv [G, K / 128, N / 128] float32, group_sizes [G] (sum <= M) -> [M, N] in lhs's
    dtype, float32 accumulation; rows past sum(group_sizes) are zero. K and N multiples of 128
    (ValueError before tracing otherwise). rhs_row: None, or r with rhs a stack [n, G, K,
    N] (rhs_scale_inv [n, G, ...]) whose row r holds the groups, read where it lies.
    tiles: the tile variant (`grouped_matmul_pallas.Tiles`): its K step (one of BLOCK_KS), its
      stages (the TMA ring's depth), whether K splits as the Triton kernel's split variants do
      (`k_splits`, float32 partial sums), and how FP8 weights leave e4m3 (`integer_upcast`).
    interpret: run on the CPU simulator (`mosaic_gpu.interpreting`) instead of lowering for a GPU.
    """
    check_grouped_matmul_args(lhs, rhs if rhs_row is None else rhs[0], group_sizes,
                              rhs_scale_inv if rhs_row is None or rhs_scale_inv is None else rhs_scale_inv[0])
    check_operands(lhs, rhs, rhs_scale_inv)
    check_tiles(tiles, BLOCK_KS)
    call = functools.partial(_grouped_matmul_mosaic, lhs, rhs, group_sizes, rhs_scale_inv, rhs_row, tiles=tiles,
                             interpret=interpret)
    if not interpret:
        return call()
    with interpreting():
        return call()
