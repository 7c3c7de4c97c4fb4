"""`grouped_matmul` with FP8 weights on Mosaic GPU, the product transposed: the weights are wgmma's A
operand, dequantized in registers, and the tile's 16 rows are its N. An experiment beside
`grouped_matmul_mosaic` (same work table, column blocks and results within rounding), for a lent
GPU to time; the model does not run it.

Why. `grouped_matmul_mosaic` computes x [16 of 64 rows, K] @ W [K, 128]: the weights are wgmma's B
operand, which wgmma reads from shared memory only, so a dequantized tile goes back there (2 bytes
a weight written, 2 read by the tensor cores, beside the e4m3 tile's 1 in and 1 out: 6 bytes of
shared-memory traffic a byte of HBM, about 0.9 of the H200's shared-memory bandwidth at the HBM
roofline), and the tensor cores compute 64 rows for the tile's 16. Here a program computes
W^T [128, K] @ x^T [K, 16] into a float32 accumulator [128, 16]: wgmma takes its A operand from
registers, so the e4m3 tile is read from shared memory once (in Mosaic GPU's layout for upcasting
8-bit values), dequantized there (`block_fp8.dequantize`'s bits; under `Tiles.integer_upcast` by
`e4m3_upcast`'s routes) and handed to wgmma (m64n16k16: no padded rows); x^T is the activation tile
read through a transposed view (a bit of the wgmma instruction). That needs W^T's rows K-contiguous
in HBM, [G, N, K], as DeepSeek's checkpoints store them ([out, in]) and as jaxspec's model does not
([in, out]): a TMA copy cannot transpose 8-bit data. `swapped_weights` makes that copy for a
benchmark; the model would store it if a GPU says this kernel is worth it.

Output. The accumulator is the transposed tile [128 columns, 16 rows], which Mosaic GPU cannot
store transposed from the WGMMA layout, and a TMA box cannot be one row wide. So each work item
writes its whole [128, 16] tile to its own slice of an [items, N, 16] array, and XLA picks each row
from its item's slice (a gather of M x N values: the output's size, against the weights' GBs).

K splits (`Tiles.split_k`: `k_splits`, the other grouped-matmul kernels' rule, from the weight's
shape alone). At one decoded token a launch has few programs (8 experts' column blocks, or a dense
linear's alone: `kv_a_proj` has 5), each streaming its whole [128, K] column; a split makes each
program stream a range of K instead, writes float32 partial sums, [splits, items, N, 16], and XLA
picks the rows from every split and adds the splits in a fixed order (`summed_splits`).

Bit-exact rows: a row's output is its own column of the accumulator, computed from that row of the
activations only (wgmma's N axis), over its K range in block_k steps into float32, the ranges added
in order, whatever the rows beside it; tiles, stages and splits are static. Results equal
`grouped_matmul_mosaic`'s within rounding, not bit for bit (the tensor cores' sums run over the
other operand's axis).

Allowed (ValueError before tracing): bfloat16 activations; float8_e4m3fn weights [G, N, K] with
scales [G, N / 128, K / 128 padded to SCALE_PAD] (`swapped_weights`); K and N multiples of 128.
Interpreted on the CPU (`mosaic_gpu.interpreting`), where jax's simulator takes wgmma operands
from shared memory only: there the dequantized tile is staged in a buffer, the same values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import block_fp8, e4m3_upcast
from .grouped_matmul_mosaic import BLOCK, BLOCK_KS, TMA_ROWS
from .cost import stating
from .grouped_matmul_pallas import (BLOCK_M, BLOCK_N, DEFAULT_VARIANT, VARIANTS, Tiles, check_tiles,
                                    grouped_matmul_cost, k_splits, summed_splits, window_rows, work_items)
from .mosaic_gpu import UPCAST_8BIT, compiler_params, interpret_params, interpreting, store, swizzled

# A program copies its column block's row of scales, [K / 128] float32, in one TMA box: a multiple
# of 128 bytes (Mosaic GPU's copies are whole bytes of the warpgroup's 128 threads).
SCALE_PAD = 32


def swapped_weights(rhs: jax.Array, rhs_scale_inv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """FP8 weights as the model stores them, rhs [G, K, N] float8_e4m3fn and rhs_scale_inv
    [G, K / 128, N / 128] float32 -> (rhs_t [G, N, K], scales [G, N / 128, K / 128 padded to a
    multiple of SCALE_PAD]): what `grouped_matmul_mosaic_swapped` reads (a copy of the weights)."""
    scales = jnp.swapaxes(rhs_scale_inv, -1, -2)
    scales = jnp.pad(scales, ((0, 0), (0, 0), (0, -scales.shape[-1] % SCALE_PAD)))
    return jnp.swapaxes(rhs, -1, -2), scales


def transposed_operands_problem(lhs, rhs_t, group_sizes, rhs_t_scale_inv) -> str | None:
    """Why a kernel that reads FP8 weights [out, in] (this one, `grouped_matmul_mosaic_w8a8`) cannot
    take these operands, or None. (The op's own check, `contracts.check_grouped_matmul_args`, is
    for weights [G, K, N]; these are transposed.)"""
    if lhs.ndim != 2 or rhs_t.ndim != 3 or rhs_t.shape[2] != lhs.shape[1]:
        return f"lhs {list(lhs.shape)}, rhs_t {list(rhs_t.shape)}: must be [M, K] and [G, N, K]"
    if group_sizes.shape != rhs_t.shape[:1] or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        return (f"group_sizes {group_sizes.dtype}{list(group_sizes.shape)}: must be integer [G] with "
                f"G = {rhs_t.shape[0]}")
    width, depth = rhs_t.shape[-2:]
    if jnp.dtype(lhs.dtype) != jnp.dtype(jnp.bfloat16):
        return f"lhs.dtype={lhs.dtype}: must be bfloat16"
    if jnp.dtype(rhs_t.dtype) != jnp.dtype(block_fp8.FP8):
        return f"rhs_t.dtype={rhs_t.dtype}: must be float8_e4m3fn"
    if depth % BLOCK or width % BLOCK:
        return f"rhs_t [G, {width}, {depth}]: N and K must be multiples of {BLOCK}"
    want = (rhs_t.shape[0], width // BLOCK, -(-depth // BLOCK // SCALE_PAD) * SCALE_PAD)
    if rhs_t_scale_inv is None or tuple(rhs_t_scale_inv.shape) != want:
        shape = None if rhs_t_scale_inv is None else list(rhs_t_scale_inv.shape)
        return f"rhs_t_scale_inv {shape}: must be {list(want)} float32 (swapped_weights)"
    return None


def _kernel(lhs_ref, rhs_ref, group_ref, start_ref, end_ref, scale_ref, out_ref, *, width: int, block_k: int,
            stages: int, steps: int, integer_upcast: bool, interpret: bool):
    """One (K split, column block, row tile) program, over `steps` K steps of its split's.

    lhs_ref [M, K] bfloat16 (M a multiple of TMA_ROWS, >= BLOCK_M), rhs_ref [G * N, K] e4m3 (the
    groups' W^T stacked), group_ref / start_ref / end_ref [W] int32 (the work table), scale_ref
    [G, N / 128, Kp] float32; out_ref [splits, W, N, BLOCK_M]: the item's window of BLOCK_M rows,
    transposed (module docstring), float32 partial sums with splits."""
    item, column_block, split = (jax.lax.axis_index(axis) for axis in ("item", "column", "split"))
    start, end = start_ref[item], end_ref[item]
    first_step = split * steps

    @pl.when(start < end)
    def _():
        group = group_ref[item]
        first = jnp.minimum(start, lhs_ref.shape[0] - BLOCK_M)

        def body(x_smem, w_smem, scales_smem, out_smem, x_barriers, w_barriers, scale_barrier, staging):
            def fetch_activations(i, slot):
                plgpu.copy_gmem_to_smem(lhs_ref.at[pl.ds(first, BLOCK_M), pl.ds((first_step + i) * block_k, block_k)],
                                        x_smem.at[slot], x_barriers.at[slot])

            def fetch_weights(i, slot):
                plgpu.copy_gmem_to_smem(rhs_ref.at[pl.ds(group * width + column_block * BLOCK_N, BLOCK_N),
                                                   pl.ds((first_step + i) * block_k, block_k)], w_smem.at[slot],
                                        w_barriers.at[slot])

            plgpu.copy_gmem_to_smem(scale_ref.at[group, pl.ds(column_block, 1)], scales_smem, scale_barrier)
            for i in range(min(stages, steps)):
                fetch_weights(i, i)
                fetch_activations(i, i)
            plgpu.barrier_wait(scale_barrier)

            def accumulate(acc_ref):
                @pl.loop(0, steps)
                def _(i):
                    slot = jax.lax.rem(i, stages)
                    plgpu.barrier_wait(w_barriers.at[slot])
                    weights = plgpu.layout_cast(w_smem[slot], UPCAST_8BIT)
                    scale = scales_smem[0, jax.lax.div((first_step + i) * block_k, BLOCK)]
                    if integer_upcast:
                        tile = e4m3_upcast.dequantized(functools.partial(e4m3_upcast.upcast_mosaic, weights,
                                                                         UPCAST_8BIT), scale)
                    else:
                        tile = (weights.astype(jnp.float32) * scale).astype(jnp.bfloat16)
                    # The warpgroup's barrier inside: every thread holds its weights in registers,
                    # so the buffer takes step i + stages now.
                    plgpu.commit_smem()

                    @pl.when(i + stages < steps)
                    def _():
                        fetch_weights(i + stages, slot)

                    operand = plgpu.layout_cast(tile, plgpu.Layout.WGMMA)
                    if interpret:  # the simulator reads wgmma operands from shared memory only
                        staging[...] = operand
                        plgpu.commit_smem()
                        operand = staging
                    plgpu.barrier_wait(x_barriers.at[slot])
                    plgpu.wgmma(acc_ref, operand, x_smem.at[slot].transpose((1, 0)))
                    # Done before the registers holding the A operand are written again, and before
                    # the activation buffer takes step i + stages.
                    plgpu.wgmma_wait(0)

                    @pl.when(i + stages < steps)
                    def _():
                        fetch_activations(i + stages, slot)

                return acc_ref[...]

            acc = pl.run_scoped(accumulate, plgpu.ACC((BLOCK_N, BLOCK_M), jnp.float32))
            store(out_smem, acc.astype(out_smem.dtype))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_ref.at[split, item, pl.ds(column_block * BLOCK_N, BLOCK_N)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            body,
            plgpu.SMEM((stages, BLOCK_M, block_k), jnp.bfloat16, transforms=swizzled(jnp.bfloat16, block_k)),
            plgpu.SMEM((stages, BLOCK_N, block_k), block_fp8.FP8, transforms=swizzled(block_fp8.FP8, block_k)),
            plgpu.SMEM((1, scale_ref.shape[-1]), jnp.float32),
            plgpu.SMEM((BLOCK_N, BLOCK_M), out_ref.dtype),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1),
            plgpu.SMEM((BLOCK_N, block_k), jnp.bfloat16, transforms=swizzled(jnp.bfloat16, block_k))
            if interpret else None,
        )


def rows_from_items(out_t: jax.Array, num_rows: int, first: jax.Array, start: jax.Array, end: jax.Array
                    ) -> jax.Array:
    """out_t [splits, W, N, BLOCK_M] (each item's window of rows, transposed, per K split) ->
    [splits, num_rows, N]: row r from the item whose rows [start, end) hold it, at r - first (rows
    no item holds: any item's, for `summed_splits` to zero)."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    starts = jnp.where(start < end, start, num_rows)  # empty items sort last and hold no row
    # Unrolled binary search: log2(W) + 1 vectorized steps, not the default's while loop of one-thread
    # kernels on a GPU, which the benchmark would time as part of this kernel (as the work table's).
    item = jnp.clip(jnp.searchsorted(starts, rows, side="right", method="scan_unrolled") - 1, 0, out_t.shape[1] - 1)
    return jax.vmap(lambda split: split[item, :, jnp.clip(rows - first[item], 0, BLOCK_M - 1)])(out_t)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def _swapped(lhs, rhs_t, group_sizes, scales, *, tiles: Tiles, interpret: bool):
    num_rows, (num_groups, width, depth) = lhs.shape[0], rhs_t.shape
    if num_rows == 0:
        return jnp.zeros((0, width), lhs.dtype)
    group, start, end = work_items(group_sizes, num_rows, num_groups)
    operand = window_rows(lhs)
    operand = jnp.pad(operand, ((0, -operand.shape[0] % TMA_ROWS), (0, 0)))
    first = jnp.minimum(start, operand.shape[0] - BLOCK_M)
    # K splits as the other grouped-matmul kernels take them: from the weight's shape alone.
    splits = k_splits(depth, width, num_groups, tiles)
    kernel = plgpu.kernel(
        functools.partial(_kernel, width=width, block_k=tiles.block_k, stages=tiles.stages,
                          steps=depth // tiles.block_k // splits,
                          integer_upcast=tiles.integer_upcast and not interpret, interpret=interpret),
        kernel_name="grouped_matmul_mosaic_swapped",
        out_type=jax.ShapeDtypeStruct((splits, group.shape[0], width, BLOCK_M),
                                      lhs.dtype if splits == 1 else jnp.float32),
        grid=(splits, width // BLOCK_N, group.shape[0]), grid_names=("split", "column", "item"),
        compiler_params=compiler_params(), interpret=interpret_params() if interpret else None)
    # The cost of the same product with the weights as the model stores them (module docstring).
    rhs = jax.ShapeDtypeStruct((num_groups, depth, width), rhs_t.dtype)
    cost = grouped_matmul_cost(lhs, rhs, lhs.dtype, jax.ShapeDtypeStruct(block_fp8.scale_shape(rhs.shape), jnp.float32),
                               splits)
    with stating(cost, "grouped_matmul"):
        out_t = kernel(operand, rhs_t.reshape(-1, depth), group, start, end, scales)
    return summed_splits(rows_from_items(out_t, num_rows, first, start, end), group_sizes, num_rows, width, lhs.dtype)


def grouped_matmul_mosaic_swapped(lhs: jax.Array, rhs_t: jax.Array, group_sizes: jax.Array,
                                  rhs_t_scale_inv: jax.Array, *, tiles: Tiles = VARIANTS[DEFAULT_VARIANT],
                                  interpret: bool = False) -> jax.Array:
    """`grouped_matmul_reference(lhs, rhs, group_sizes, rhs_scale_inv)` for FP8 weights given
    transposed: lhs [M, K] bfloat16 sorted by group, (rhs_t, rhs_t_scale_inv) =
    `swapped_weights(rhs, rhs_scale_inv)` ([G, N, K] float8_e4m3fn, [G, N / 128, Kp] float32),
    group_sizes [G] (sum <= M) -> [M, N] bfloat16, float32 accumulation; rows past
    sum(group_sizes) are zero. tiles: its K step, stages, K splits and e4m3 unpacking
    (`integer_upcast`). ValueError before tracing for anything else (module docstring)."""
    check_tiles(tiles, BLOCK_KS)
    problem = transposed_operands_problem(lhs, rhs_t, group_sizes, rhs_t_scale_inv)
    if problem is not None:
        raise ValueError(f"grouped_matmul_mosaic_swapped: {problem}")
    call = functools.partial(_swapped, lhs, rhs_t, group_sizes, rhs_t_scale_inv, tiles=tiles, interpret=interpret)
    if not interpret:
        return call()
    with interpreting():
        return call()
