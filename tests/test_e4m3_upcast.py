"""`jaxspec.pallas_kernels.e4m3_upcast`: FP8 (e4m3) bytes to float16 by integer operations, the
recipe the grouped matmuls' `k64-int` variant runs in inline PTX, against the conversion
(`block_fp8.dequantize`). Its PTX in the compiled kernels is checked beside each kernel's
compile test (tests/test_grouped_matmul.py, tests/test_grouped_matmul_mosaic.py)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

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
    halves = e4m3_upcast.scaled_float16(codes).astype(np.float32)
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
