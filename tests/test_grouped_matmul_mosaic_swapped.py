"""The transposed-product Mosaic GPU grouped matmul (`grouped_matmul_mosaic_swapped`: FP8 weights
as wgmma's A operand from registers): interpreted on the CPU against the reference, a row's bits
alone and among other rows, what it refuses; compiled for an H100 without a GPU at
DeepSeek-V3.2's expert widths (no dequantized tile stored to shared memory in the loop, wgmma at
N 16). On a GPU host these tests run it natively (`conftest.MOSAIC_INTERPRET`), and the `gpu`
test at the expert width.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas_kernels import block_fp8, grouped_matmul_reference
from jaxspec.pallas_kernels.grouped_matmul_mosaic_swapped import grouped_matmul_mosaic_swapped, swapped_weights
from jaxspec.pallas_kernels.grouped_matmul_pallas import BLOCK_N, VARIANTS, Tiles, k_splits, num_work_items
from conftest import MOSAIC_INTERPRET
from cuda_lowering import mosaic_gpu_dump
from test_grouped_matmul import V32_WEIGHTS, device_fp8_experts, random_sizes
from test_grouped_matmul_mosaic import check_rows_alone_and_in_a_crowd

call = functools.partial(grouped_matmul_mosaic_swapped, interpret=MOSAIC_INTERPRET)


def fp8_case(rng, rows, depth, width, groups, total, empty, power_of_two):
    """Activations, group sizes and FP8 weights (scales over three decades per column), both as the
    model stores them and transposed."""
    sizes = jnp.asarray(random_sizes(rng, groups, total, empty))
    lhs = jnp.asarray(rng.normal(size=(rows, depth)), jnp.bfloat16)
    weights = rng.normal(size=(groups, depth, width)) * rng.uniform(0.01, 10, (groups, 1, width)) * depth ** -0.5
    quantized, scale_inv = block_fp8.quantize(jnp.asarray(weights, jnp.float32), power_of_two=power_of_two)
    return lhs, sizes, quantized, scale_inv, swapped_weights(quantized, scale_inv)


@pytest.mark.parametrize("variant,power_of_two", [("k64", True), ("k64", False), ("k128", True)],
                         ids=["k64-ue8m0", "k64-amax", "k128-ue8m0"])
def test_matches_reference(variant, power_of_two):
    """Groups of several 16-row tiles, empty groups, rows past the total (zero), three column
    blocks: within bfloat16 rounding of the reference on the weights as the model stores them."""
    rng = np.random.default_rng(3)
    lhs, sizes, quantized, scale_inv, (rhs_t, scales) = fp8_case(rng, 60, 256, 384, 5, 52, 0.3, power_of_two)
    got = call(lhs, rhs_t, sizes, scales, tiles=VARIANTS[variant])
    want = grouped_matmul_reference(lhs, quantized, sizes, scale_inv)
    assert got.dtype == jnp.bfloat16 and got.shape == (60, 384)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    assert np.all(np.asarray(got)[52:] == 0)


def test_k_splits_match_the_reference_and_keep_a_rows_bits():
    """Under `k64-split` a launch of K 1024 and one column block splits K in two (`k_splits`: 8
    steps a range): within bfloat16 rounding of the reference, rows past the total zero, and a
    row's bits the same alone as among the others."""
    rng = np.random.default_rng(5)
    lhs, sizes, quantized, scale_inv, (rhs_t, scales) = fp8_case(rng, 20, 1024, 128, 3, 18, 0.0, True)
    tiles = VARIANTS["k64-split"]
    assert k_splits(1024, 128, 3, tiles) == 2
    got = call(lhs, rhs_t, sizes, scales, tiles=tiles)
    want = grouped_matmul_reference(lhs, quantized, sizes, scale_inv)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    assert np.all(np.asarray(got)[18:] == 0)
    first = int(np.flatnonzero(np.asarray(sizes))[0])
    alone = call(lhs[:1], rhs_t, jnp.zeros_like(sizes).at[first].set(1), scales, tiles=tiles)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(got[:1]))


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """The same rows give the same bits alone and among more rows of their groups and after other
    groups: a row is its own column of the accumulator (wgmma's N)."""
    rng = np.random.default_rng(7)
    _, _, quantized, scale_inv, (rhs_t, scales) = fp8_case(rng, 4, 512, 128, 4, 4, 0.0, True)
    check_rows_alone_and_in_a_crowd(rng, lambda lhs, sizes: call(lhs, rhs_t, sizes, scales), (quantized, scale_inv))


def test_operands_it_does_not_take_are_refused_before_tracing():
    rng = np.random.default_rng(0)
    lhs, sizes, quantized, scale_inv, (rhs_t, scales) = fp8_case(rng, 8, 256, 128, 2, 8, 0.0, True)
    cases = [((lhs.astype(jnp.float16), rhs_t, sizes, scales), "lhs.dtype=float16: must be bfloat16"),
             ((lhs, rhs_t.astype(jnp.bfloat16), sizes, scales), "must be float8_e4m3fn"),
             ((lhs, rhs_t, sizes, scale_inv), r"rhs_t_scale_inv \[2, 2, 1\]: must be \[2, 1, 32\]"),
             ((lhs, rhs_t, sizes, None), "rhs_t_scale_inv None"),
             ((lhs, quantized, sizes, scales), r"must be \[M, K\] and \[G, N, K\]"),
             ((lhs, rhs_t, sizes[:1], scales), "group_sizes int32"),
             ((lhs[:, :192], rhs_t[:, :, :192], sizes, scales), "N and K must be multiples of 128")]
    for args, message in cases:
        with pytest.raises(ValueError, match="grouped_matmul_mosaic_swapped: .*" + message):
            call(*args)
    with pytest.raises(ValueError, match="must be a Tiles with block_k in"):
        call(lhs, rhs_t, sizes, scales, tiles=Tiles(block_k=32))


@pytest.mark.parametrize("variant", ["k64", "k64-int", "k64-split"])
def test_compiled_for_h100_at_v32_expert_shapes(h100, variant):
    """256 experts' up projection with 256 rows (decode at batch 32, top-8), compiled for sm_90a: one
    launch of a warpgroup a (work item, column block, K split: two under k64-split), its grid items
    fastest, within the shared memory that leaves four programs an SM, the stated cost of the
    same product with the weights as the model stores them, and no loop around it (the rows'
    gather finds their items without a while loop)."""
    from jaxspec import aot
    from jaxspec.aot.hlo_loops import parse_module

    depth, width, groups = V32_WEIGHTS["expert_up"]
    rhs_t, scales = jax.eval_shape(swapped_weights, jax.ShapeDtypeStruct((groups, depth, width), jnp.float8_e4m3fn),
                                   jax.ShapeDtypeStruct((groups, depth // 128, width // 128), jnp.float32))
    args = (jax.ShapeDtypeStruct((256, depth), jnp.bfloat16), rhs_t, jax.ShapeDtypeStruct((groups,), jnp.int32),
            scales)
    compiled = aot.compile_gpu(functools.partial(grouped_matmul_mosaic_swapped, tiles=VARIANTS[variant]), *args,
                               devices=h100)
    (launch,) = aot.mosaic_launches(compiled)
    assert launch.kernel == "grouped_matmul_mosaic_swapped_mosaic_gpu_kernel"
    splits = k_splits(depth, width, groups, VARIANTS[variant])
    assert splits == (2 if variant == "k64-split" else 1)
    assert launch.grid == (num_work_items(256, groups), width // BLOCK_N, splits) and launch.threads == (128, 1, 1)
    assert 4 * (launch.shared_memory + 1024) <= 228 * 1024
    (call_,) = aot.pallas_calls(compiled)
    assert call_.name == "grouped_matmul" and call_.flops == 2 * 256 * depth * width
    assert call_.bytes_accessed > min(groups, 256) * depth * width
    assert parse_module(compiled.as_text()).loops == []


def test_loop_keeps_the_dequantized_weights_in_registers(h100, tmp_path):
    """Compiled for sm_90a (the PTX and ptxas report in Mosaic GPU's dump, its own process): every
    wgmma is m64n16k16 with its A operand in registers (the tile's 16 rows are N: no padded rows),
    the only shared-memory stores are the output tile's (128 x 16 bfloat16: 32 bytes a thread, in
    at most 8 stores), and no register spills, with 4 programs an SM's registers to spare."""
    ptx, report = mosaic_gpu_dump(tmp_path, PROBE, "grouped_matmul_mosaic_swapped")
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+)\.f32\.bf16\.bf16\s+\{[^}]*\},\s*\{", ptx)
    assert mmas and set(mmas) == {"m64n16k16"}  # "{acc}, {a registers}": A not a descriptor
    assert len(re.findall(r"\bst\.shared", ptx)) <= 8
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    assert "0 bytes spill stores" in report and registers <= 65536 // (4 * 128)


# A probe's operands for a kernel that reads FP8 weights [out, in]: 16 rows, 2 groups of [128, 256].
PROBE_OPERANDS = """
import functools, jax, jax.numpy as jnp
from jaxspec import aot
spec = jax.ShapeDtypeStruct
args = (spec((16, 256), jnp.bfloat16), spec((2, 128, 256), jnp.float8_e4m3fn), spec((2,), jnp.int32),
        spec((2, 1, 32), jnp.float32))
"""
PROBE = PROBE_OPERANDS + """
from jaxspec.pallas_kernels.grouped_matmul_mosaic_swapped import grouped_matmul_mosaic_swapped
aot.compile_gpu(grouped_matmul_mosaic_swapped, *args, devices=aot.gpu_devices("h100"))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["k64", "k64-int"])
def test_swapped_compiled_on_gpu(variant):
    """Natively on a GPU, 16 FP8 experts of DeepSeek-V3.2's up-projection shape (power-of-two
    scales, as its release): within bfloat16 rounding of the reference, and a row's bits the same
    alone as among the others."""
    rng = np.random.default_rng(11)
    depth, width, _ = V32_WEIGHTS["expert_up"]
    groups = 16
    sizes = jnp.asarray(random_sizes(rng, groups, 256, 0.0))
    lhs = jnp.asarray(rng.normal(size=(256, depth)), jnp.bfloat16)
    quantized, scale_inv = device_fp8_experts(11, groups, depth, width, power_of_two=True)
    rhs_t, scales = swapped_weights(quantized, scale_inv)
    tiles = VARIANTS[variant]
    got = jax.jit(functools.partial(grouped_matmul_mosaic_swapped, tiles=tiles))(lhs, rhs_t, sizes, scales)
    want = grouped_matmul_reference(lhs, quantized, sizes, scale_inv)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    first = int(np.flatnonzero(np.asarray(sizes))[0])
    alone = grouped_matmul_mosaic_swapped(lhs[:1], rhs_t, jnp.zeros_like(sizes).at[first].set(1), scales, tiles=tiles)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(got[:1]))
