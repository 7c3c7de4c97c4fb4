"""DeepSeek's block-scaled FP8 weights: the definition of their values, for kernels, model and loader.

A weight [..., rows, cols] is stored as `float8_e4m3fn` plus one float32 scale per `block` of
rows x columns, `scale_inv [..., ceil(rows / br), ceil(cols / bc)]` (128 x 128 in DeepSeek's
checkpoints; the last block of a dimension that is not a multiple is partial). Despite its name the
scale multiplies (DeepSeek's `weight_dequant`): value = float32(fp8) * scale_inv, computed in
float32. A model that computes in bfloat16 rounds that product to bfloat16, so an FP8-resident
model multiplies by exactly the weights a model dequantized at load (`jaxspec.fp8`) holds.
`jaxspec.fp8` documents which weights of a checkpoint are quantized.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
BLOCK = (128, 128)  # DeepSeek's `weight_block_size`: the only block an FP8-resident model uses
_FP8_MAX = float(jnp.finfo(FP8).max)


def scale_shape(weight_shape, block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The `scale_inv` shape of a weight [..., rows, cols]: [..., ceil(rows / br), ceil(cols / bc)]."""
    *lead, rows, cols = weight_shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def dequantize(weight: jax.Array, scale_inv: jax.Array, dtype=jnp.bfloat16,
               block: tuple[int, int] = BLOCK) -> jax.Array:
    """weight [..., rows, cols] float8_e4m3fn, scale_inv `scale_shape(weight.shape, block)` float32
    -> [..., rows, cols] in `dtype`: float32(weight) * scale, each scale repeated over its block and
    cropped to the weight (partial edge blocks take their own scale), then rounded to `dtype`.
    Unchecked (callers check shapes before tracing)."""
    rows, cols = weight.shape[-2:]
    scale = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), block[0], axis=-2), block[1], axis=-1)
    return (weight.astype(jnp.float32) * scale[..., :rows, :cols]).astype(dtype)


@functools.partial(jax.jit, static_argnames=("block", "power_of_two"))
def quantize(weight: jax.Array, block: tuple[int, int] = BLOCK, power_of_two: bool = False
             ) -> tuple[jax.Array, jax.Array]:
    """weight [..., rows, cols] (any float dtype) -> (float8_e4m3fn [..., rows, cols], scale_inv
    float32 `scale_shape`), DeepSeek's recipe: per block, scale = amax / 448 and fp8 = weight / scale
    (an all-zero block gets a tiny scale, never a division by zero). power_of_two: the scale
    rounded up to a power of two, as DeepSeek's releases since V3.1 scale theirs (`scale_fmt`
    "ue8m0"; the grouped matmuls' integer unpacking multiplies those in bfloat16, `e4m3_upcast`).
    Random FP8 models use it."""
    *lead, rows, cols = weight.shape
    br, bc = block
    num_r, num_c = -(-rows // br), -(-cols // bc)
    padded = jnp.pad(weight.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, num_r * br - rows), (0, num_c * bc - cols)])
    blocks = padded.reshape(*lead, num_r, br, num_c, bc)
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(-3, -1)), 1e-12) / _FP8_MAX  # [..., num_r, num_c]
    if power_of_two:  # scale = m * 2^e with m in [0.5, 1): 2^e, or scale itself when m is 0.5
        mantissa, exponent = jnp.frexp(scale)
        scale = jnp.where(mantissa == 0.5, scale, jnp.ldexp(jnp.float32(1), exponent))
    quantized = (blocks / scale[..., :, None, :, None]).astype(FP8).reshape(padded.shape)[..., :rows, :cols]
    return quantized, scale
