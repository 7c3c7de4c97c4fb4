"""DeepSeek's block-scaled FP8 checkpoints: which weights are FP8, their block size, dequantization.

DeepSeek-V3/V3.2 ship most linear weights as `float8_e4m3fn` with one float32 scale per 128 x 128
block (`quantization_config.weight_block_size`), stored beside the weight as
`<name>_scale_inv` [ceil(rows / 128), ceil(cols / 128)] (`jaxspec.pallas_kernels.block_fp8`
defines the values: fp8 * scale_inv, blockwise, in float32).

Which weights are FP8 (the one statement of the rule; the model builds its FP8 parameters by it and
the loader checks a checkpoint against the model): every `Linear` of a decoder block, the MTP
layer's block included, and nothing else.
  * FP8 + `_scale_inv`: self_attn.{q_a_proj, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_b_proj,
    o_proj}, the V3.2 indexer's self_attn.indexer.{wq_b, wk}, the dense mlp.{gate,up,down}_proj,
    mlp.shared_experts.{gate,up,down}_proj and every routed expert's {gate,up,down}_proj.
  * not quantized: model.embed_tokens and lm_head (bf16), every norm (RMSNorm, the indexer's
    k_norm LayerNorm), the router mlp.gate.weight (bf16) and its e_score_correction_bias (f32), the
    indexer's weights_proj (bf16), and the MTP layer's own enorm, hnorm, eh_proj (bf16),
    shared_head.norm, embed_tokens and shared_head.head.
Sources: DeepSeek's inference code (deepseek-ai/DeepSeek-V3.2-Exp `inference/model.py`, as
deepseek-ai/DeepSeek-V3's): `Transformer` sets `Linear.dtype = float8_e4m3fn` for an fp8 model, so
every `Linear` / `ColumnParallelLinear` / `RowParallelLinear` built without a dtype (MLA's wq_a,
wq_b, wkv_a, wkv_b, wo; the indexer's wq_b, wk; MLP and Expert w1, w2, w3) is FP8 with a `scale`;
the indexer's `weights_proj` is built with `dtype=torch.get_default_dtype()` (bf16), the head
with `dtype=torch.float32` (its comment: "lm_head in the checkpoint is stored in bf16"), and
`ParallelEmbedding`, `RMSNorm`, `LayerNorm` and `Gate` hold plain parameters. The inference code has
no MTP layer; the released deepseek-ai/DeepSeek-V3 safetensors headers list
`model.layers.61.eh_proj.weight` [7168, 14336] BF16 without a scale (and its embed_tokens,
shared_head.head and norms BF16), while the layer's decoder block is FP8 like any other.

A model keeps these weights FP8 on device when built with `dtype=jnp.float8_e4m3fn`
(`jaxspec.models.layers`), and the loader keeps them when asked for that dtype
(`jaxspec.checkpoint`); with a float dtype the loader dequantizes them here.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxspec.pallas_kernels import block_fp8

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3",)  # safetensors dtype names of block-scaled weights
DEFAULT_BLOCK = block_fp8.BLOCK


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
    return block_fp8.scale_shape(weight_shape, block)


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
    return block_fp8.dequantize(jnp.asarray(weight), jnp.asarray(scale_inv), jnp.float32, block)
