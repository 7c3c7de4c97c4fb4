"""DeepSeek-V4 checkpoints in DeepSeek's own layout: the names (against transformers 5.23's renames),
V4's FP8 (e8m0 scales) and MXFP4 experts (against an independent decoding of the formats).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jaxspec import fp8
from jaxspec.checkpoint_v4 import to_transformers


def _deepseek_names(layer_kinds: list[tuple[str, bool]], num_experts: int, mtp: bool) -> list[str]:
    """Every tensor name of a V4 checkpoint in DeepSeek's layout, per (attention kind, hash routing)
    layer, as deepseek-ai/DeepSeek-V4-Pro's safetensors headers list them (FP8 Linear weights with
    a `.scale`; compressors, norms, router, sinks, hyper-connections without)."""
    names = ["embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"]

    def block(prefix: str, kind: str, hashed: bool) -> list[str]:
        out = [prefix + n for n in ("attn_norm.weight", "ffn_norm.weight", "attn.attn_sink", "attn.q_norm.weight",
                                    "attn.kv_norm.weight", "ffn.gate.weight")]
        out += [f"{prefix}hc_{k}_{p}" for k in ("attn", "ffn") for p in ("fn", "base", "scale")]
        out += [f"{prefix}attn.{w}.{leaf}" for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b") for leaf in ("weight", "scale")]
        out += [f"{prefix}ffn.shared_experts.{w}.{leaf}" for w in ("w1", "w2", "w3") for leaf in ("weight", "scale")]
        out += [f"{prefix}ffn.experts.{e}.{w}.{leaf}" for e in range(num_experts) for w in ("w1", "w2", "w3")
                for leaf in ("weight", "scale")]
        out.append(prefix + ("ffn.gate.tid2eid" if hashed else "ffn.gate.bias"))
        compressors = {"sliding": [], "hca": ["attn.compressor."], "csa": ["attn.compressor.", "attn.indexer.compressor."]}
        for c in compressors[kind]:
            out += [prefix + c + n for n in ("wkv.weight", "wgate.weight", "ape", "norm.weight")]
        if kind == "csa":
            out += [prefix + n for n in ("attn.indexer.wq_b.weight", "attn.indexer.wq_b.scale",
                                         "attn.indexer.weights_proj.weight")]
        return out

    for i, (kind, hashed) in enumerate(layer_kinds):
        names += block(f"layers.{i}.", kind, hashed)
    if mtp:
        names += block("mtp.0.", "sliding", False)
        names += ["mtp.0." + n for n in ("enorm.weight", "hnorm.weight", "norm.weight", "e_proj.weight", "e_proj.scale",
                                         "h_proj.weight", "h_proj.scale", "hc_head_fn", "hc_head_base", "hc_head_scale")]
    return names


@pytest.mark.hf
def test_names_are_transformers_renames():
    """`to_transformers` agrees with transformers' own rename chain on every non-MTP name (experts:
    transformers fuses them, w1 and w3 into gate_up_proj, w2 into down_proj), and the renamed set is
    exactly a transformers DeepseekV4 model's parameters: no name is lost or invented."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    kinds = [("sliding", True), ("csa", True), ("hca", False), ("csa", False)]
    names = _deepseek_names(kinds, num_experts=2, mtp=True)
    transforms = get_checkpoint_conversion_mapping("deepseek_v4")
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    fused = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
    ours = set()
    for name in names:
        mine = to_transformers(name)
        assert mine is not None, name
        if name.startswith("mtp."):
            continue
        theirs, _ = rename_source_key(name, renamings, converters)
        theirs = theirs if theirs.startswith("lm_head") else "model." + theirs
        if ".experts." in name and ".shared_experts." not in name:
            expert_module = mine.removesuffix(".weight").removesuffix(".weight" + fp8.SCALE_SUFFIX)
            layer, proj = expert_module.split(".mlp.experts.")[0], expert_module.rsplit(".", 1)[1]
            if name.endswith(".weight"):
                assert theirs == f"{layer}.mlp.experts.{fused[proj]}", name
                ours.add(theirs)
            continue
        if name.endswith(".scale"):  # transformers keeps `.scale` beside the renamed module
            assert mine == theirs.removesuffix(".scale") + ".weight" + fp8.SCALE_SUFFIX, name
            continue
        assert mine == theirs, name
        ours.add(mine)

    config = DeepseekV4Config(
        vocab_size=32, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=len(kinds), num_attention_heads=2,
        head_dim=16, q_lora_rank=8, num_experts_per_tok=1, n_routed_experts=2, o_groups=2, o_lora_rank=8,
        layer_types=[{"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
                      "hca": "heavily_compressed_attention"}[k] for k, _ in kinds],
        mlp_layer_types=["hash_moe" if h else "moe" for _, h in kinds], hc_mult=2, index_n_heads=2,
        index_head_dim=8, index_topk=2, partial_rotary_factor=0.5, sliding_window=4)
    model = DeepseekV4ForCausalLM(config)
    # tid2eid and e_score_correction_bias are buffers there; rotary tables are derived.
    theirs = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers() if "rotary_emb" not in n}
    assert ours == theirs


def test_mtp_names_keep_their_own_tensors():
    """mtp.0.*: the block renamed like a layer's, the module's own tensors kept (transformers would
    turn `mtp.0.norm` into `mtp.0.kv_norm`; it drops mtp.* anyway)."""
    assert to_transformers("mtp.0.norm.weight") == "mtp.0.norm.weight"
    assert to_transformers("mtp.0.e_proj.scale") == "mtp.0.e_proj.weight" + fp8.SCALE_SUFFIX
    assert to_transformers("mtp.0.hc_head_fn") == "mtp.0.hc_head.hc_fn"
    assert to_transformers("mtp.0.attn.wkv.weight") == "mtp.0.self_attn.kv_proj.weight"
    assert to_transformers("mtp.0.ffn.experts.3.w2.scale") == "mtp.0.mlp.experts.3.down_proj.weight" + fp8.SCALE_SUFFIX
    for unknown in ("layers.0.attn.wq.weight", "model.layers.0.self_attn.q_a_proj.weight", "mtp.0.attn.norm.weight"):
        assert to_transformers(unknown) is None


def _e2m1(code: int) -> float:
    """An e2m1 code's value from its bits (sign, 2 exponent bits with bias 1, 1 mantissa bit)."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def test_fp4_experts_dequantize():
    """MXFP4: two e2m1 codes per byte, the low nibble first, times 2**(e8m0 byte - 127) per 32 inputs."""
    rng = np.random.default_rng(0)
    packed = rng.integers(-128, 128, size=(3, 40), dtype=np.int8)  # 80 inputs: 2.5 scale blocks
    exponents = rng.integers(120, 134, size=(3, 3), dtype=np.uint8)
    scale = exponents.view(ml_dtypes.float8_e8m0fnu)
    got = np.asarray(fp8.dequantize(packed, scale, fp8.DEFAULT_BLOCK))
    codes = packed.view(np.uint8)
    want = np.empty((3, 80), np.float32)
    for r in range(3):
        for c in range(80):
            byte = int(codes[r, c // 2])
            want[r, c] = _e2m1(byte & 15 if c % 2 == 0 else byte >> 4) * 2.0 ** (int(exponents[r, c // 32]) - 127)
    np.testing.assert_array_equal(got, want)
    assert fp8.logical_shape((3, 40), "I8") == (3, 80) and fp8.scale_shape((3, 40), fp8.DEFAULT_BLOCK, "I8") == (3, 3)
    with pytest.raises(ValueError, match=r"expected \[3, 3\]"):
        fp8.dequantize(packed, scale[:, :2], fp8.DEFAULT_BLOCK)


def test_fp8_with_e8m0_scales_dequantizes():
    """V4's FP8 weights: the same 128 x 128 blocks as V3, with power-of-two float8_e8m0fnu scales."""
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(130, 260)).astype(ml_dtypes.float8_e4m3fn)
    exponents = rng.integers(110, 140, size=(2, 3), dtype=np.uint8)
    got = np.asarray(fp8.dequantize(weight, exponents.view(ml_dtypes.float8_e8m0fnu), (128, 128)))
    block_scale = 2.0 ** (exponents.astype(np.float64) - 127)
    want = weight.astype(np.float64) * np.repeat(np.repeat(block_scale, 128, 0), 128, 1)[:130, :260]
    np.testing.assert_array_equal(got, want.astype(np.float32))
