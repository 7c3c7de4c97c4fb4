"""DeepSeek's block-scaled FP8 weights, dequantized.

DeepSeek-V3/V3.2 ship most linear weights as `float8_e4m3fn` with one float32 scale per 128 x 128
block (`quantization_config.weight_block_size`), stored beside the weight as
`<name>_scale_inv` [ceil(rows / 128), ceil(cols / 128)]. Despite the name, it multiplies:
`weight = fp8_weight * weight_scale_inv` blockwise (DeepSeek's `weight_dequant`). When a dimension
is not a multiple of the block, the last block is partial and its scale covers only the rows or
columns that exist.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3",)  # safetensors dtype names of block-scaled weights
DEFAULT_BLOCK = (128, 128)


def block_size(hf_config: Mapping[str, Any]) -> tuple[int, int]:
    """The (rows, cols) scale block of a config.json's `quantization_config` (128 x 128 by default).

    Raises ValueError for a quantization scheme other than DeepSeek's block FP8.
    """
    quant = hf_config.get("quantization_config")
    if not quant:
        return DEFAULT_BLOCK
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"config.json quantization_config quant_method={method!r}: only DeepSeek's block "
                         "FP8 ('fp8' with weight_block_size) is supported")
    rows, cols = quant.get("weight_block_size", DEFAULT_BLOCK)
    return int(rows), int(cols)


def scale_shape(weight_shape: Sequence[int], block: tuple[int, int]) -> tuple[int, ...]:
    """The `_scale_inv` shape for a weight [..., rows, cols]: [..., ceil(rows / br), ceil(cols / bc)]."""
    *lead, rows, cols = weight_shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def dequantize(weight: jax.Array, scale_inv: jax.Array, block: tuple[int, int]) -> jax.Array:
    """weight [..., rows, cols] float8, scale_inv [..., ceil(rows / br), ceil(cols / bc)] -> float32.

    Each scale is repeated over its block and the repetition cropped to the weight, so partial edge
    blocks take their own scale. Runs where the arrays live (the accelerator, for the loader).
    Raises ValueError when the scale does not fit the weight.
    """
    if weight.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"expected a float8_e4m3fn weight, got {weight.dtype}")
    expected = scale_shape(weight.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale shape {list(scale_inv.shape)} does not fit weight {list(weight.shape)} "
                         f"with {block[0]}x{block[1]} blocks (expected {list(expected)})")
    rows, cols = weight.shape[-2:]
    scale = jnp.repeat(jnp.repeat(jnp.asarray(scale_inv, jnp.float32), block[0], axis=-2), block[1], axis=-1)
    return jnp.asarray(weight).astype(jnp.float32) * scale[..., :rows, :cols]
