"""ModelConfig / DecodeConfig: Hugging Face config.json round trips, presets, and clear errors."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decode_config import DecodeConfig
from jaxspec.model_config import ModelConfig
from jaxspec.presets import PRESETS, preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_hf_json(name, tmp_path):
    config = preset(name)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_hf()))
    assert ModelConfig.from_hf(path) == config
    assert ModelConfig.from_hf(tmp_path) == config  # a directory holding config.json


def test_released_deepseek_v32_config_fields():
    """The fields of DeepSeek-V3.2-Exp's released config.json (values as shipped) load as V3.2."""
    raw = {
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 129280,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
        "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "bos_token_id": 0, "eos_token_id": 1, "pretraining_tp": 1, "tie_word_embeddings": False,
        "rope_theta": 10000, "attention_bias": False, "attention_dropout": 0.0, "num_nextn_predict_layers": 1,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
    }
    config = ModelConfig.from_hf(raw)
    assert config.is_v32 and config.latent_dim == 576 and config.rope_scaling.factor == 40
    # DeepSeek's FP8 release rounds activation scales to powers of two (`scale_fmt` "ue8m0", in its
    # inference config and, for V3.1 on, in quantization_config): the preset's setting.
    assert config.scale_fmt is None
    with_fmt = {**raw, "quantization_config": {**raw["quantization_config"], "scale_fmt": "ue8m0"}}
    assert ModelConfig.from_hf(with_fmt) == preset("deepseek-v3.2")
    written = preset("deepseek-v3.2").to_hf()
    assert written["scale_fmt"] == "ue8m0" and "scale_fmt" not in preset("tiny").to_hf()


@pytest.mark.parametrize("changes, match", [
    (dict(model_type="llama"), "model_type"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(n_group=3), "n_group"),
    (dict(topk_group=5), "topk_group"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(first_k_dense_replace=3), "first_k_dense_replace"),
    (dict(index_topk=0), "index_topk"),
    (dict(index_head_dim=4), "index_head_dim"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(scale_fmt="e4m3"), "scale_fmt"),
])
def test_impossible_values_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        preset("tiny", **changes)


def test_unknown_and_unsupported_hf_fields():
    raw = preset("tiny").to_hf()
    with pytest.raises(ValueError, match=r"unknown fields \['hiden_size'\]"):
        ModelConfig.from_hf({**raw, "hiden_size": 64})
    assert ModelConfig.from_hf({**raw, "hiden_size": 64}, strict=False) == preset("tiny")
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({**raw, "model_type": "qwen2"})
    with pytest.raises(ValueError, match="rope_scaling type='linear'"):
        ModelConfig.from_hf({**raw, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="preset name='huge'"):
        preset("huge")


def test_decode_config_ranges():
    for bad, match in [(dict(max_new_tokens=0), "max_new_tokens"), (dict(page_size=0), "page_size"),
                       (dict(max_cache_len=0), "max_cache_len"), (dict(num_draft=8), "num_draft")]:
        with pytest.raises(ValueError, match=match):
            DecodeConfig(**bad)


def test_decode_config_numbers_are_python_numbers_or_refused():
    """Any integer type (a numpy integer, a 0-d array) becomes an int, so a config built from
    numpy hashes, compares and sizes caches like one built from ints; a float, a string or a bool
    where an integer belongs is refused naming the field (they failed later, deep in `prepare`, or
    were truncated)."""
    config = DecodeConfig(num_draft=np.int64(2), max_new_tokens=jnp.int32(16), eos_token_id=np.uint8(7),
                          temperature=np.float32(0.5), top_k=np.int16(4))
    assert config == DecodeConfig(num_draft=2, max_new_tokens=16, eos_token_id=7, temperature=0.5, top_k=4)
    assert [type(v) for v in (config.num_draft, config.max_new_tokens, config.eos_token_id, config.temperature)] \
        == [int, int, int, float]
    for bad, match in [(dict(max_new_tokens=2.5), r"max_new_tokens=2.5: must be an integer"),
                       (dict(num_draft="3"), r"num_draft='3': must be an integer"),
                       (dict(page_size=None), r"page_size=None: must be an integer"),
                       (dict(max_cache_len=10.5), r"max_cache_len=10.5: must be None or an integer >= 1"),
                       (dict(prefill_chunk=True), r"prefill_chunk=True: must be None \(one call\) or an integer >= 1"),
                       (dict(temperature=1.0, top_k=2.5), r"top_k=2.5: must be an integer"),
                       (dict(temperature="0.5"), r"temperature='0.5': must be a number"),
                       (dict(eos_token_id="26"), r"eos_token_id='26': must be None or a token id >= 0"),
                       (dict(eos_token_id=-1), r"eos_token_id=-1: must be a token id >= 0"),
                       (dict(relaxed=3), r"relaxed=3: must be None or \(top_k, delta\)"),
                       (dict(relaxed=("a", 0.1)), r"relaxed top_k='a': must be an integer")]:
        with pytest.raises(ValueError, match=match):
            DecodeConfig(**bad)


def test_hf_config_that_cannot_describe_a_model_is_refused(tmp_path):
    """A config.json without the fields that size the model (transformers would take DeepSeek-V3's
    full size for them), with fields of the wrong type, an EOS id outside the vocabulary, or a file
    that is not a JSON object: a ValueError naming the field or the file."""
    raw = preset("tiny").to_hf()
    for bad, match in [({"model_type": "deepseek_v3"}, r"has no \['vocab_size', 'hidden_size', 'num_hidden_layers', "
                                                       r"'num_attention_heads'\]"),
                       ({k: v for k, v in raw.items() if k != "vocab_size"}, r"has no \['vocab_size'\]"),
                       ({**raw, "hidden_size": "64"}, "ModelConfig.hidden_size='64': must be an integer"),
                       ({**raw, "hidden_size": 64.5}, "ModelConfig.hidden_size=64.5: must be an integer"),
                       ({**raw, "rms_norm_eps": None}, "ModelConfig.rms_norm_eps=None: must be a number"),
                       ({**raw, "eos_token_id": 10**6}, r"eos_token_id=1000000: must be a token id in \[0, "
                                                        r"vocab_size=258\)"),
                       ({**raw, "rope_scaling": "yarn"}, "rope_scaling / rope_parameters='yarn': must be an object")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf(bad)
    assert ModelConfig.from_hf({**raw, "eos_token_id": []}).eos_token_id is None
    for text, match in [("[1, 2]", "holds a JSON list, not an object"), ("{bad", "is not valid JSON")]:
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf(tmp_path)
