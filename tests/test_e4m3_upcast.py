"""`jaxspec.pallas_kernels.e4m3_upcast`: FP8 (e4m3) bytes to float16 or bfloat16 by integer
operations, the recipe the grouped matmuls' `k64-int` variant runs in inline PTX, against the
conversion (`block_fp8.dequantize`). Its PTX in the compiled kernels is checked beside each kernel's
compile test (tests/test_grouped_matmul.py, tests/test_grouped_matmul_mosaic.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxspec.pallas_kernels import block_fp8, e4m3_upcast


def test_integer_upcast_gives_the_conversions_values():
    """The recipe of the grouped matmuls' `k64-int` variant (the byte as the float16 w / 256 by
    integer operations, then float32 times the block's scale times 256) gives
    `block_fp8.dequantize`'s bfloat16 bits for every finite e4m3 byte, at scales up to the largest
    a quantization of float32 weights gives (3.4e38 / 448) and down to where the smallest product
    is still a normal float32 (XLA's CPU flushes subnormal float32 to zero, numpy does not); the
    two NaN bytes read as +-480. The kernels run the recipe compiled only, so this is where its
    values are held to the conversion's off a GPU (on one, the grouped matmuls' tests run the
    variant natively: the Triton kernel's FP8 bits against its dequantized weights', the Mosaic
    kernel's against k64's)."""
    rng = np.random.default_rng(0)
    codes = rng.permutation(256).astype(np.uint8)  # a word's four bytes of mixed signs
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = ~np.isnan(values)
    halves = e4m3_upcast.unpacked(codes, np.float16).astype(np.float32)
    np.testing.assert_array_equal(halves[finite] * e4m3_upcast.FACTOR, values[finite])
    np.testing.assert_array_equal(np.sort(halves[~finite] * e4m3_upcast.FACTOR), [-480, 480])
    smallest = np.finfo(np.float32).tiny / 2.0 ** -9  # e4m3's smallest subnormal is 2^-9
    largest = np.finfo(np.float32).max / 448
    scales = np.concatenate([2.0 ** rng.uniform(np.log2(smallest), 119, 400), [largest, smallest]])
    scales = scales.astype(np.float32)
    weights = np.broadcast_to(codes[finite].view(ml_dtypes.float8_e4m3fn), (len(scales), 1, finite.sum()))
    want = block_fp8.dequantize(jnp.asarray(weights), jnp.asarray(scales[:, None, None].repeat(2, -1)))
    got = halves[finite] * (scales * np.float32(e4m3_upcast.FACTOR))[:, None, None]
    np.testing.assert_array_equal(np.asarray(want).view(np.uint16), got.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_bfloat16_route_gives_the_conversions_bits_at_power_of_two_scales():
    """At a power-of-two scale 2^e with e in BFLOAT16_EXPONENTS (DeepSeek's "ue8m0" weights), the
    byte as the bfloat16 w / 2^120 by integer operations, times the scale times 2^120 in one
    bfloat16 multiply (exact, as mul.rn.bf16x2 computes it: the exact product, rounded once), gives
    `block_fp8.dequantize`'s bits for every finite e4m3 byte at every such exponent; the NaN bytes
    read as +-480 times the scale, as on the float16 route."""
    codes = np.random.default_rng(1).permutation(256).astype(np.uint8)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = ~np.isnan(values)
    unpacked = e4m3_upcast.unpacked(codes, ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(unpacked[finite] * e4m3_upcast.BFLOAT16_FACTOR, values[finite])
    low, high = e4m3_upcast.BFLOAT16_EXPONENTS
    scales = np.ldexp(np.float32(1), np.arange(low, high + 1)).astype(np.float32)
    assert np.asarray(e4m3_upcast.bfloat16_exact(jnp.asarray(scales))).all()
    factors = np.asarray(e4m3_upcast.bfloat16_scale(jnp.asarray(scales))).astype(np.float64)
    np.testing.assert_array_equal(factors, scales.astype(np.float64) * e4m3_upcast.BFLOAT16_FACTOR)
    got = (unpacked[None, :] * factors[:, None]).astype(ml_dtypes.bfloat16)  # exact: one rounding, of nothing
    weights = np.broadcast_to(codes[finite].view(ml_dtypes.float8_e4m3fn), (len(scales), 1, finite.sum()))
    want = block_fp8.dequantize(jnp.asarray(weights), jnp.asarray(scales[:, None, None].repeat(2, -1)))
    np.testing.assert_array_equal(np.asarray(want)[:, 0].view(np.uint16), got[:, finite].view(np.uint16))
    np.testing.assert_array_equal(np.sort(got[:, ~finite].astype(np.float64) / scales[:, None], axis=1),
                                  np.broadcast_to([-480, 480], (len(scales), 2)))


def test_bfloat16_route_only_where_it_is_exact():
    """`bfloat16_exact` holds for powers of two in the exponent range and for nothing else: not
    past either end (a product below float32's normal range, a scale times 2^120 past bfloat16's),
    not for other mantissas, zero, negative, subnormal, infinite or NaN scales."""
    low, high = e4m3_upcast.BFLOAT16_EXPONENTS
    inside = [2.0 ** low, 2.0 ** -12, 1.0, 2.0 ** high]
    outside = [2.0 ** (low - 1), 2.0 ** (high + 1), 1.5 * 2.0 ** -12, np.nextafter(np.float32(1), np.float32(2)),
               0.0, -0.0, -(2.0 ** -12), 2.0 ** -140, np.inf, np.nan, np.finfo(np.float32).max]
    exact = np.asarray(e4m3_upcast.bfloat16_exact(jnp.asarray(inside + outside, jnp.float32)))
    np.testing.assert_array_equal(exact, [True] * len(inside) + [False] * len(outside))


@pytest.mark.parametrize("power_of_two", [True, False], ids=["ue8m0", "amax"])
def test_dequantized_takes_the_route_its_scale_allows(power_of_two):
    """`dequantized`, the kernels' one call under `integer_upcast`, with the recipe in numpy as its
    upcast (the kernels pass the inline PTX): a block's bits equal `block_fp8.dequantize`'s, scale
    by scale, on weights quantized with power-of-two scales or amax / 448 ones, and the route run
    is the one the scale allows (the other route's upcast gives NaN here, which would show). No
    weight is below a sixteenth of its block's largest, so no code is an e4m3 subnormal: their
    bfloat16 w / 2^120 is subnormal, which XLA's CPU flushes in the multiply (the numpy tests
    above hold them, and the GPU tests the kernels' own multiply)."""
    rng = np.random.default_rng(2)
    magnitudes = rng.uniform(1 / 16, 1, (4, 128, 128)) * 10.0 ** rng.uniform(-4, 1, (4, 1, 1))
    weights = jnp.asarray(rng.choice([-1, 1], (4, 128, 128)) * magnitudes, jnp.float32)
    quantized, scales = block_fp8.quantize(weights, power_of_two=power_of_two)
    assert np.asarray(e4m3_upcast.bfloat16_exact(scales)).all() == power_of_two
    route = jnp.dtype(jnp.bfloat16 if power_of_two else jnp.float16)
    for block, scale in zip(quantized, scales[:, 0, 0]):
        codes = np.asarray(block).view(np.uint8).reshape(-1)

        def upcast(dtype, codes=codes):
            values = e4m3_upcast.unpacked(codes, dtype).reshape(128, 128)
            return jnp.asarray(values if jnp.dtype(dtype) == route else np.full_like(values, np.nan))

        got = jax.jit(lambda scale: e4m3_upcast.dequantized(upcast, scale))(scale)
        want = block_fp8.dequantize(block, scale.reshape(1, 1))
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
