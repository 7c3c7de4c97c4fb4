"""`grouped_matmul` with FP8 weights and FP8 activations (W8A8) on Mosaic GPU: DeepSeek's own FP8
product, an experiment beside `grouped_matmul_mosaic` for a lent GPU to time; the model does not
run it.

Which numerics. jaxspec's FP8 linears multiply bfloat16 activations by the dequantized weights
(`block_fp8.dequantize`: a model dequantized at load computes the same). DeepSeek's reference
inference for V3.2 (`inference/model.py` `linear`), transformers' `FP8Linear` (DeepGEMM or its
Triton fallback), vLLM and SGLang instead quantize the activations too, per token and 128 values
of K (`act_quant`, power-of-two scales under `scale_fmt` "ue8m0"), and multiply e4m3 by e4m3 on
the tensor cores, scaling each 128-deep block's product in float32 (`fp8_gemm`):

    out[m, n] = sum over K blocks b, in order, of (x8[m, b] . w8[b, n]) * sx[m, b] * sw[b, n / 128]

`w8a8_reference` is that definition (with the grouped matmul's groups); this kernel computes it.

Why it may be faster. wgmma takes FP8 operands straight from shared memory, so a weight byte
crosses shared memory twice (the TMA's write, the tensor cores' read) where `grouped_matmul_mosaic`
spends six on dequantizing it into a bfloat16 operand (its docstring): at the HBM roofline that
was about 0.9 of the H200's shared-memory bandwidth. The price is the activations' rounding to
e4m3, which changes the model's outputs within FP8's precision (the same for a plain and a
speculative run: losslessness does not depend on it).

Layout. FP8 wgmma reads both operands K-contiguous (only 16-bit types take the transposed form),
so the weights come as DeepSeek's checkpoints store them, [G, N, K] (`swapped_weights`' copy;
jaxspec's model stores [G, K, N]): a program's [128, 128] block is wgmma's B through a transposed
view. The activations are the A operand as in `grouped_matmul_mosaic`: the same work table, the
same 16-row ring read as 64-row windows (the other 48 rows make accumulator rows never stored),
the same K splits and row stores. The K step is the scale block, 128 (one activation and one
weight scale a step): each step's wgmma runs into a fresh accumulator, and the program adds it,
times the window's 64 row scales and the block's weight scale, to a float32 sum in registers, as
DeepGEMM promotes FP8 products to float32 every 128 values of K.

Bit-exact rows: a row's sum runs over its K blocks from 0 up, in float32, from that row of the
operands alone; its activation scales are its own; tiles, steps and splits are static.

Allowed (ValueError before tracing): bfloat16 activations [M, K]; float8_e4m3fn weights [G, N, K]
with scales [G, N / 128, K / 128 padded to SCALE_PAD] (`swapped_weights`); K and N multiples of
128. Interpreted on the CPU (`mosaic_gpu.interpreting`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import block_fp8
from .cost import stating
from .fp8_cache import quantize_act
from .grouped_matmul_mosaic import BLOCK, TMA_ROWS, WGMMA_M
from .grouped_matmul_mosaic_swapped import transposed_operands_problem
from .grouped_matmul_pallas import (BLOCK_M, BLOCK_N, VARIANTS, Tiles, check_tiles,
                                    grouped_matmul_cost, k_splits, summed_splits, window_rows, work_items)
from .mosaic_gpu import compiler_params, interpret_params, interpreting, store, swizzled, union

# The tile variants the kernel takes: those whose K step is the scale block.
W8A8_VARIANTS = tuple(name for name, tiles in VARIANTS.items() if tiles.block_k == BLOCK)
# The activation scales' rows a program copies are its 64-row window's, from a transposed array
# [K / 128, M'] whose rows are padded to whole 16 bytes (a TMA box's rows) past the last window.
SCALE_ALIGN = 4


def quantized_activations(lhs: jax.Array, *, pow2_scales: bool) -> tuple[jax.Array, jax.Array]:
    """lhs [M, K] -> (e4m3 [M, K], scales [M, K / 128] float32): DeepSeek's `act_quant` over each
    row's 128-value blocks (`fp8_cache.quantize_act`; pow2_scales: `scale_fmt` "ue8m0")."""
    values, scales = quantize_act(lhs.reshape(lhs.shape[0], -1, BLOCK), pow2_scales=pow2_scales)
    return values.reshape(lhs.shape), scales[..., 0]


def w8a8_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rhs_scale_inv: jax.Array, *,
                   pow2_scales: bool) -> jax.Array:
    """The definition (module docstring): lhs [M, K] bfloat16 sorted by group, rhs [G, K, N]
    float8_e4m3fn with rhs_scale_inv [G, K / 128, N / 128] float32 (the model's layout),
    group_sizes [G] -> [M, N] bfloat16. Each block's product is `jax.lax.ragged_dot` of the e4m3
    values in float32 (exact products); the blocks' scaled sums are added from the first block on.
    Rows past sum(group_sizes) are zero."""
    values, scales = quantized_activations(lhs, pow2_scales=pow2_scales)
    sizes = group_sizes.astype(jnp.int32)
    # each row's group, for its weight scales (rows past the groups take the last: zeroed below)
    row_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(lhs.shape[0]), side="right"),
                            rhs.shape[0] - 1)
    weight_scales = jnp.repeat(rhs_scale_inv[row_group], BLOCK, axis=-1)  # [M, K / 128, N]
    total = jnp.zeros((lhs.shape[0], rhs.shape[-1]), jnp.float32)
    for block in range(lhs.shape[1] // BLOCK):
        ks = slice(block * BLOCK, (block + 1) * BLOCK)
        product = jax.lax.ragged_dot(values[:, ks].astype(jnp.float32), rhs[:, ks].astype(jnp.float32), sizes,
                                     precision=jax.lax.Precision.HIGHEST)
        total = total + product * scales[:, block, None] * weight_scales[:, block]
    covered = jnp.arange(lhs.shape[0]) < jnp.sum(jnp.maximum(sizes, 0))
    return jnp.where(covered[:, None], total, 0).astype(lhs.dtype)


def _kernel(lhs_ref, rhs_ref, group_ref, start_ref, end_ref, lhs_scale_ref, scale_ref, out_ref, *, width: int,
            stages: int, steps: int, interpret: bool):
    """One (K split, column block, row tile) program, over `steps` K blocks of its split's.

    lhs_ref [M, K] e4m3 (M a multiple of TMA_ROWS, >= BLOCK_M), rhs_ref [G * N, K] e4m3 (the groups'
    W^T stacked), group_ref / start_ref / end_ref [W] int32 (the work table), lhs_scale_ref
    [K / 128, M'] float32 (the activations' scales transposed, M' >= M + 48), scale_ref
    [G, N / 128, Kp] float32; out_ref [splits, M, N] (float32 partial sums with splits)."""
    item, column_block, split = (jax.lax.axis_index(axis) for axis in ("item", "column", "split"))
    start, end = start_ref[item], end_ref[item]
    num_rows = lhs_ref.shape[0]
    first_step = split * steps

    @pl.when(start < end)
    def _():
        group = group_ref[item]
        first = jnp.minimum(start, num_rows - BLOCK_M)
        columns = pl.ds(column_block * BLOCK_N, BLOCK_N)

        def body(buffers, row_scales, weight_scales, x_barriers, w_barriers, scale_barriers):
            (x_smem, w_smem), out_smem = buffers

            def fetch(i, slot):
                """Start the TMA copies of K block i's activation rows and weight block into `slot`."""
                ks = pl.ds((first_step + i) * BLOCK, BLOCK)
                plgpu.copy_gmem_to_smem(lhs_ref.at[pl.ds(first, BLOCK_M), ks], x_smem.at[pl.ds(slot * BLOCK_M, BLOCK_M)],
                                        x_barriers.at[slot])
                plgpu.copy_gmem_to_smem(rhs_ref.at[pl.ds(group * width + column_block * BLOCK_N, BLOCK_N), ks],
                                        w_smem.at[slot], w_barriers.at[slot])

            plgpu.copy_gmem_to_smem(scale_ref.at[group, pl.ds(column_block, 1)], weight_scales, scale_barriers.at[0])
            plgpu.copy_gmem_to_smem(lhs_scale_ref.at[pl.ds(first_step, steps), pl.ds(first, WGMMA_M)], row_scales,
                                    scale_barriers.at[1])
            for i in range(min(stages, steps)):
                fetch(i, i)
            plgpu.barrier_wait(scale_barriers.at[0])
            plgpu.barrier_wait(scale_barriers.at[1])

            def step(i, total):
                slot = jax.lax.rem(i, stages)
                plgpu.barrier_wait(w_barriers.at[slot])
                plgpu.barrier_wait(x_barriers.at[slot])

                def block_product(acc_ref):
                    plgpu.wgmma(acc_ref, x_smem.at[pl.ds(slot * BLOCK_M, WGMMA_M)],
                                w_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return acc_ref[...]

                product = pl.run_scoped(block_product, plgpu.ACC((WGMMA_M, BLOCK_N), jnp.float32))

                # The wgmma is done with the slot's buffers: they take block i + stages.
                @pl.when(i + stages < steps)
                def _():
                    fetch(i + stages, slot)

                rows = plgpu.layout_cast(row_scales[i], plgpu.Layout.WGMMA.reduce(1))
                scaled = product * jax.lax.broadcast_in_dim(rows, product.shape, [0])
                return total + scaled * weight_scales[0, first_step + i]

            zero = plgpu.layout_cast(jnp.zeros((WGMMA_M, BLOCK_N), jnp.float32), plgpu.Layout.WGMMA)
            total = jax.lax.fori_loop(0, steps, step, zero)
            store(out_smem, total.astype(out_smem.dtype))
            plgpu.commit_smem()

            @pl.loop(start - first, end - first)
            def _(row):
                plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(row, 1)], out_ref.at[split, pl.ds(first + row, 1), columns])

            plgpu.wait_smem_to_gmem(0)

        fp8 = block_fp8.FP8
        rings = (plgpu.SMEM((stages * BLOCK_M + WGMMA_M - BLOCK_M, BLOCK), fp8, transforms=swizzled(fp8, BLOCK)),
                 plgpu.SMEM((stages, BLOCK_N, BLOCK), fp8, transforms=swizzled(fp8, BLOCK)))
        pl.run_scoped(
            body,
            union(rings, plgpu.SMEM((WGMMA_M, BLOCK_N), out_ref.dtype), interpret=interpret),
            plgpu.SMEM((steps, WGMMA_M), jnp.float32),
            plgpu.SMEM((1, scale_ref.shape[-1]), jnp.float32),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=2),
        )


@functools.partial(jax.jit, static_argnames=("tiles", "pow2_scales", "interpret"))
def _w8a8(lhs, rhs_t, group_sizes, scales, *, tiles: Tiles, pow2_scales: bool, interpret: bool):
    num_rows, (num_groups, width, depth) = lhs.shape[0], rhs_t.shape
    if num_rows == 0:
        return jnp.zeros((0, width), lhs.dtype)
    group, start, end = work_items(group_sizes, num_rows, num_groups)
    values, row_scales = quantized_activations(lhs, pow2_scales=pow2_scales)
    operand = window_rows(values)
    operand = jnp.pad(operand, ((0, -operand.shape[0] % TMA_ROWS), (0, 0)))
    # transposed, and wide enough for the last window's 64 rows (the ones past M scale rows never stored)
    scale_columns = operand.shape[0] + WGMMA_M - BLOCK_M
    row_scales = jnp.pad(row_scales.T, ((0, 0), (0, -(-scale_columns // SCALE_ALIGN) * SCALE_ALIGN - num_rows)))
    splits = k_splits(depth, width, num_groups, tiles)
    kernel = plgpu.kernel(
        functools.partial(_kernel, width=width, stages=tiles.stages, steps=depth // BLOCK // splits,
                          interpret=interpret),
        kernel_name="grouped_matmul_mosaic_w8a8",
        out_type=jax.ShapeDtypeStruct((splits, operand.shape[0], width), lhs.dtype if splits == 1 else jnp.float32),
        grid=(splits, width // BLOCK_N, group.shape[0]), grid_names=("split", "column", "item"),
        compiler_params=compiler_params(), interpret=interpret_params() if interpret else None)
    # The cost of the weights' product as the model stores them, with one-byte activations.
    rhs = jax.ShapeDtypeStruct((num_groups, depth, width), rhs_t.dtype)
    cost = grouped_matmul_cost(values, rhs, lhs.dtype,
                               jax.ShapeDtypeStruct(block_fp8.scale_shape(rhs.shape), jnp.float32), splits)
    with stating(cost, "grouped_matmul"):
        out = kernel(operand, rhs_t.reshape(-1, depth), group, start, end, row_scales, scales)
    return summed_splits(out, group_sizes, num_rows, width, lhs.dtype)


def grouped_matmul_mosaic_w8a8(lhs: jax.Array, rhs_t: jax.Array, group_sizes: jax.Array, rhs_t_scale_inv: jax.Array,
                               *, pow2_scales: bool, tiles: Tiles = VARIANTS["k128"],
                               interpret: bool = False) -> jax.Array:
    """`w8a8_reference(lhs, rhs, group_sizes, rhs_scale_inv, pow2_scales=...)` for weights given
    transposed: lhs [M, K] bfloat16 sorted by group, (rhs_t, rhs_t_scale_inv) =
    `swapped_weights(rhs, rhs_scale_inv)` ([G, N, K] float8_e4m3fn, [G, N / 128, Kp] float32),
    group_sizes [G] (sum <= M) -> [M, N] bfloat16; rows past sum(group_sizes) are zero.
    pow2_scales: the activations' scales rounded up to powers of two (`scale_fmt` "ue8m0").
    tiles: its stages and K splits, with block_k the scale block, 128 (one scale each a step).
    ValueError before tracing for anything else (module docstring)."""
    check_tiles(tiles, (BLOCK,))
    problem = transposed_operands_problem(lhs, rhs_t, group_sizes, rhs_t_scale_inv)
    if problem is not None:
        raise ValueError(f"grouped_matmul_mosaic_w8a8: {problem}")
    call = functools.partial(_w8a8, lhs, rhs_t, group_sizes, rhs_t_scale_inv, tiles=tiles,
                             pow2_scales=bool(pow2_scales), interpret=interpret)
    if not interpret:
        return call()
    with interpreting():
        return call()
