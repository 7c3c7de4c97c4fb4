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

DeepSeek-V4 (deepseek-ai/DeepSeek-V4-Flash and -Pro; V4's `inference/model.py` builds every
`Linear` without a dtype in FP8 and names the others' dtype explicitly; the released headers agree):
  * FP8 + scale: attn.{wq_a, wq_b, wkv, wo_a, wo_b} (transformers: self_attn.{q_a_proj, q_b_proj,
    kv_proj, o_a_proj, o_b_proj}), the indexer's wq_b, ffn.shared_experts.w{1,2,3}, and the MTP
    module's e_proj and h_proj (V3's eh_proj was bf16), its block included. The scale is named
    `<module>.scale` (renamed `<module>.weight_scale_inv` by `jaxspec.checkpoint_v4`) and stored as
    `float8_e8m0fnu` (powers of two; `quantization_config.scale_fmt` "ue8m0"), 128 x 128 blocks;
    V4-Flash-Base stores float32 scales.
  * MXFP4 (`expert_dtype` "fp4", both released models): every routed expert's w1, w2, w3, stored
    int8 [out, in / 2], two e2m1 values per byte (low nibble = even column), with a
    `float8_e8m0fnu` scale [out, in / 32] (one per 32 consecutive inputs); `dequantize` expands
    them. They cannot fill an FP8-layout model (no lossless 128 x 128 form).
  * not quantized: the compressors' wkv and wgate and the indexer's weights_proj (bf16), the router
    weight (bf16), embed and head (bf16), every norm (bf16); ape, attn_sink, the hyper-connection
    and hyper-head parameters and the router bias (float32); tid2eid (int64).

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
FP4_DTYPES = ("I8",)  # MXFP4 weights (DeepSeek-V4's routed experts): two e2m1 values per byte
QUANTIZED_DTYPES = FP8_DTYPES + FP4_DTYPES  # weights stored beside a scale
FP4_BLOCK = 32  # inputs per MXFP4 scale
DEFAULT_BLOCK = block_fp8.BLOCK
# e2m1 codes 0..15 (sign bit 3, exponent bits 2..1, mantissa bit 0).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


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


def scale_shape(weight_shape: Sequence[int], block: tuple[int, int], dtype: str = "F8_E4M3") -> tuple[int, ...]:
    """The scale shape for a stored weight [..., rows, cols] of safetensors `dtype`: FP8
    [..., ceil(rows / br), ceil(cols / bc)]; MXFP4 (cols bytes = 2 * cols values) [..., rows, 2 * cols / 32]."""
    if dtype in FP4_DTYPES:
        *lead, rows, cols = weight_shape
        return (*lead, rows, -(-2 * cols // FP4_BLOCK))
    return block_fp8.scale_shape(weight_shape, block)


def logical_shape(weight_shape: Sequence[int], dtype: str) -> tuple[int, ...]:
    """The shape a stored weight of safetensors `dtype` has once dequantized (MXFP4: twice the columns)."""
    if dtype in FP4_DTYPES:
        *lead, cols = weight_shape
        return (*lead, 2 * cols)
    return tuple(weight_shape)


def dequantize(weight: jax.Array, scale_inv: jax.Array, block: tuple[int, int]) -> jax.Array:
    """A quantized weight and its scale (float32, or DeepSeek-V4's float8_e8m0fnu) -> float32.

    float8_e4m3fn weight [..., rows, cols], scale [..., ceil(rows / br), ceil(cols / bc)]: each scale
    is repeated over its block and the repetition cropped to the weight, so partial edge blocks take
    their own scale. int8 (MXFP4) weight [..., rows, cols / 2], scale [..., rows, cols / 32]
    -> [..., rows, cols]. Runs where the arrays live (the accelerator, for the loader). Raises
    ValueError when the scale does not fit the weight.
    """
    kind = {jnp.dtype(jnp.float8_e4m3fn): "F8_E4M3", jnp.dtype(jnp.int8): "I8"}.get(jnp.dtype(weight.dtype))
    if kind is None:
        raise ValueError(f"expected a float8_e4m3fn or int8 (MXFP4) weight, got {weight.dtype}")
    expected = scale_shape(weight.shape, block, kind)
    if tuple(scale_inv.shape) != expected:
        granularity = f"1x{FP4_BLOCK}" if kind in FP4_DTYPES else f"{block[0]}x{block[1]}"
        raise ValueError(f"scale shape {list(scale_inv.shape)} does not fit weight {list(weight.shape)} {kind} "
                         f"with {granularity} blocks (expected {list(expected)})")
    if kind in FP4_DTYPES:
        return _dequantize_fp4(jnp.asarray(weight), jnp.asarray(scale_inv))
    return block_fp8.dequantize(jnp.asarray(weight), jnp.asarray(scale_inv), jnp.float32, block)


@jax.jit  # a checkpoint's experts share three shapes: compiled once each, not dispatched op by op
def _dequantize_fp4(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """packed int8 [..., rows, cols / 2] (low nibble = even column), scale [..., rows, cols / 32]
    -> float32 [..., rows, cols]: e2m1 value times its block's scale."""
    codes = packed.view(jnp.uint8)
    values = jnp.asarray(_E2M1, jnp.float32)
    unpacked = jnp.stack([values[codes & 0xF], values[codes >> 4]], axis=-1).reshape(*packed.shape[:-1], -1)
    return unpacked * jnp.repeat(scale.astype(jnp.float32), FP4_BLOCK, axis=-1)[..., : unpacked.shape[-1]]
