"""The W8A8 Mosaic GPU grouped matmul (`grouped_matmul_mosaic_w8a8`: e4m3 activations times e4m3
weights [out, in], as DeepSeek's inference multiplies them): its reference against a float64
numpy reading of DeepSeek's `act_quant` / `fp8_gemm`; the kernel interpreted on the CPU against
the reference, a row's bits alone and among other rows, K splits, what it refuses; compiled for an
H100 without a GPU at DeepSeek-V3.2's expert widths (e4m3 wgmma, no shared-memory stores in the
loop, no spills). On a GPU host these tests run it natively (`conftest.MOSAIC_INTERPRET`), and the
`gpu` test at the expert width.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas_kernels import block_fp8, grouped_matmul_reference
from jaxspec.pallas_kernels.grouped_matmul_mosaic_swapped import swapped_weights
from jaxspec.pallas_kernels.grouped_matmul_mosaic_w8a8 import grouped_matmul_mosaic_w8a8, w8a8_reference
from jaxspec.pallas_kernels.grouped_matmul_pallas import BLOCK_N, VARIANTS, Tiles, k_splits, num_work_items
from conftest import MOSAIC_INTERPRET
from cuda_lowering import mosaic_gpu_dump
from test_fp8_cache import numpy_act_quant
from test_grouped_matmul import V32_WEIGHTS, device_fp8_experts, random_sizes
from test_grouped_matmul_mosaic import check_rows_alone_and_in_a_crowd
from test_grouped_matmul_mosaic_swapped import PROBE_OPERANDS

call = functools.partial(grouped_matmul_mosaic_w8a8, interpret=MOSAIC_INTERPRET)


def fp8_case(rng, rows, depth, width, groups, total, empty, power_of_two):
    """Activations (magnitudes over two decades a row, so rows' scales differ), group sizes and FP8
    weights (scales over three decades per column), as the model stores them and transposed."""
    sizes = jnp.asarray(random_sizes(rng, groups, total, empty))
    lhs = jnp.asarray(rng.normal(size=(rows, depth)) * rng.uniform(0.1, 10, (rows, 1)), jnp.bfloat16)
    weights = rng.normal(size=(groups, depth, width)) * rng.uniform(0.01, 10, (groups, 1, width)) * depth ** -0.5
    quantized, scale_inv = block_fp8.quantize(jnp.asarray(weights, jnp.float32), power_of_two=power_of_two)
    return lhs, sizes, quantized, scale_inv, swapped_weights(quantized, scale_inv)


def numpy_fp8_gemm(lhs, rhs, sizes, scale_inv, pow2: bool) -> np.ndarray:
    """DeepSeek's FP8 linear (V3.2-Exp `inference/model.py` `linear`: `act_quant`, then `fp8_gemm`,
    whose loop adds dot(a, b) * a_s * b_s a 128-deep block at a time), written from its semantics in
    float64 numpy, one group at a time: rows past the groups zero."""
    lhs, rhs, scale_inv = (np.asarray(a, np.float32) for a in (lhs, rhs, scale_inv))
    rows, depth = lhs.shape
    values, scales = numpy_act_quant(lhs.reshape(rows, depth // 128, 128), pow2)
    values = values.astype(np.float64)
    out = np.zeros((rows, rhs.shape[2]))
    offset = 0
    for group, size in enumerate(np.asarray(sizes)):
        for block in range(depth // 128):
            ks = slice(block * 128, (block + 1) * 128)
            product = values[offset:offset + size, block] @ rhs[group, ks].astype(np.float64)
            out[offset:offset + size] += (product * scales[offset:offset + size, block, None]
                                          * np.repeat(scale_inv[group, block], 128))
        offset += size
    return out


@pytest.mark.parametrize("power_of_two", [True, False], ids=["ue8m0", "amax"])
def test_reference_is_deepseeks_fp8_product(power_of_two):
    """The reference equals a float64 reading of DeepSeek's act_quant and fp8_gemm within bfloat16
    rounding, and differs from the op's bfloat16-activation product by FP8's rounding of the
    activations: more than bfloat16's, at most a few percent of the output's scale."""
    rng = np.random.default_rng(1)
    lhs, sizes, quantized, scale_inv, _ = fp8_case(rng, 40, 384, 256, 4, 37, 0.25, power_of_two)
    got = np.asarray(w8a8_reference(lhs, quantized, sizes, scale_inv, pow2_scales=power_of_two), np.float32)
    want = numpy_fp8_gemm(lhs, quantized, sizes, scale_inv, power_of_two)
    np.testing.assert_allclose(got, want, rtol=8e-3, atol=1e-6 * np.abs(want).max())
    assert np.all(got[37:] == 0)
    w8a16 = np.asarray(grouped_matmul_reference(lhs, quantized, sizes, scale_inv), np.float32)
    error = np.abs(got - w8a16).max() / np.abs(w8a16).max()
    assert 1e-3 < error < 5e-2


@pytest.mark.parametrize("power_of_two", [True, False], ids=["ue8m0", "amax"])
def test_matches_reference(power_of_two):
    """Groups of several 16-row tiles, empty groups, rows past the total (zero), three column
    blocks, four K blocks: within float32 summation order of the reference (the tensor cores add a
    block's 128 products in their own order), rounded to bfloat16."""
    rng = np.random.default_rng(3)
    lhs, sizes, quantized, scale_inv, (rhs_t, scales) = fp8_case(rng, 60, 512, 384, 5, 52, 0.3, power_of_two)
    got = call(lhs, rhs_t, sizes, scales, pow2_scales=power_of_two)
    want = w8a8_reference(lhs, quantized, sizes, scale_inv, pow2_scales=power_of_two)
    assert got.dtype == jnp.bfloat16 and got.shape == (60, 384)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=8e-3,
                               atol=1e-6 * float(jnp.abs(want.astype(jnp.float32)).max()))
    assert np.all(np.asarray(got)[52:] == 0)


def test_k_splits_match_the_reference_and_keep_a_rows_bits():
    """Under `k128-split` a launch of K 2048 and one column block splits K (`k_splits`): within
    rounding of the reference, and each row's bits the same alone as among 30 others of its and
    other groups."""
    rng = np.random.default_rng(5)
    lhs, sizes, quantized, scale_inv, (rhs_t, scales) = fp8_case(rng, 4, 2048, 128, 4, 4, 0.0, True)
    tiles = VARIANTS["k128-split"]
    assert k_splits(2048, 128, 4, tiles) > 1
    reference = functools.partial(w8a8_reference, pow2_scales=True)
    check_rows_alone_and_in_a_crowd(rng, lambda lhs, sizes: call(lhs, rhs_t, sizes, scales, pow2_scales=True,
                                                                 tiles=tiles),
                                    (quantized, scale_inv), reference=reference)


def test_operands_it_does_not_take_are_refused_before_tracing():
    rng = np.random.default_rng(0)
    lhs, sizes, quantized, scale_inv, (rhs_t, scales) = fp8_case(rng, 8, 256, 128, 2, 8, 0.0, True)
    cases = [((lhs.astype(jnp.float16), rhs_t, sizes, scales), "lhs.dtype=float16: must be bfloat16"),
             ((lhs, rhs_t.astype(jnp.bfloat16), sizes, scales), "must be float8_e4m3fn"),
             ((lhs, rhs_t, sizes, scale_inv), r"rhs_t_scale_inv \[2, 2, 1\]: must be \[2, 1, 32\]"),
             ((lhs, quantized, sizes, scales), r"must be \[M, K\] and \[G, N, K\]"),
             ((lhs, rhs_t, sizes[:1], scales), "group_sizes int32"),
             ((lhs[:, :192], rhs_t[:, :, :192], sizes, scales), "N and K must be multiples of 128")]
    for args, message in cases:
        with pytest.raises(ValueError, match="grouped_matmul_mosaic_w8a8: .*" + message):
            call(*args, pow2_scales=True)
    with pytest.raises(ValueError, match=r"must be a Tiles with block_k in \(128,\)"):
        call(lhs, rhs_t, sizes, scales, pow2_scales=True, tiles=Tiles(block_k=64))


@pytest.mark.parametrize("variant", ["k128", "k128-split"])
def test_compiled_for_h100_at_v32_expert_shapes(h100, variant):
    """256 experts' up projection with 256 rows (decode at batch 32, top-8), compiled for sm_90a:
    one launch of a warpgroup a (work item, column block, K split), within the shared memory that
    leaves two programs an SM, the stated cost of the product with one-byte activations, and no
    loop around it (the activations' quantization is one pass)."""
    from jaxspec import aot
    from jaxspec.aot.hlo_loops import parse_module

    depth, width, groups = V32_WEIGHTS["expert_up"]
    rhs_t, scales = jax.eval_shape(swapped_weights, jax.ShapeDtypeStruct((groups, depth, width), jnp.float8_e4m3fn),
                                   jax.ShapeDtypeStruct((groups, depth // 128, width // 128), jnp.float32))
    args = (jax.ShapeDtypeStruct((256, depth), jnp.bfloat16), rhs_t, jax.ShapeDtypeStruct((groups,), jnp.int32),
            scales)
    tiles = VARIANTS[variant]
    compiled = aot.compile_gpu(functools.partial(grouped_matmul_mosaic_w8a8, pow2_scales=True, tiles=tiles), *args,
                               devices=h100)
    (launch,) = aot.mosaic_launches(compiled)
    assert launch.kernel == "grouped_matmul_mosaic_w8a8_mosaic_gpu_kernel"
    splits = k_splits(depth, width, groups, tiles)
    assert (splits > 1) == (variant == "k128-split")
    assert launch.grid == (num_work_items(256, groups), width // BLOCK_N, splits) and launch.threads == (128, 1, 1)
    assert 2 * (launch.shared_memory + 1024) <= 228 * 1024
    (call_,) = aot.pallas_calls(compiled)
    assert call_.name == "grouped_matmul" and call_.flops == 2 * 256 * depth * width
    assert call_.bytes_accessed > min(groups, 256) * depth * width
    assert parse_module(compiled.as_text()).loops == []


def test_loop_multiplies_e4m3_straight_from_shared_memory(h100, tmp_path):
    """Compiled for sm_90a (the PTX and ptxas report in Mosaic GPU's dump, its own process): every
    wgmma is e4m3 x e4m3 into float32, the only shared-memory stores are the output tile's (64 x 128
    bfloat16: 128 bytes a thread, 32 stores), and no register spills, with two programs an SM's
    registers to spare."""
    ptx, report = mosaic_gpu_dump(tmp_path, PROBE, "grouped_matmul_mosaic_w8a8")
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.(\w+\.\w+\.\w+)", ptx)
    assert mmas and set(mmas) == {"f32.e4m3.e4m3"}
    assert len(re.findall(r"\bst\.shared", ptx)) <= 32
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    assert "0 bytes spill stores" in report and registers <= 65536 // (2 * 128)


PROBE = PROBE_OPERANDS + """
from jaxspec.pallas_kernels.grouped_matmul_mosaic_w8a8 import grouped_matmul_mosaic_w8a8
aot.compile_gpu(functools.partial(grouped_matmul_mosaic_w8a8, pow2_scales=True), *args,
                devices=aot.gpu_devices("h100"))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["k128", "k128-split"])
def test_w8a8_compiled_on_gpu(variant):
    """Natively on a GPU, 16 FP8 experts of DeepSeek-V3.2's up-projection shape (power-of-two
    scales, as its release): within rounding of the reference (the tensor cores' own sums of a
    block's e4m3 products), and a row's bits the same alone as among the others."""
    rng = np.random.default_rng(11)
    depth, width, _ = V32_WEIGHTS["expert_up"]
    groups = 16
    sizes = jnp.asarray(random_sizes(rng, groups, 256, 0.0))
    lhs = jnp.asarray(rng.normal(size=(256, depth)), jnp.bfloat16)
    quantized, scale_inv = device_fp8_experts(11, groups, depth, width, power_of_two=True)
    rhs_t, scales = swapped_weights(quantized, scale_inv)
    run = jax.jit(functools.partial(grouped_matmul_mosaic_w8a8, pow2_scales=True, tiles=VARIANTS[variant]))
    got = np.asarray(run(lhs, rhs_t, sizes, scales), np.float32)
    want = np.asarray(w8a8_reference(lhs, quantized, sizes, scale_inv, pow2_scales=True), np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-3 * np.abs(want).max())
    first = int(np.flatnonzero(np.asarray(sizes))[0])
    alone = run(lhs[:1], rhs_t, jnp.zeros_like(sizes).at[first].set(1), scales)
    np.testing.assert_array_equal(np.asarray(alone, np.float32), got[:1])
