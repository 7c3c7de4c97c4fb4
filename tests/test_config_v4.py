"""ModelConfig for DeepSeek-V4: the released config.json files, transformers 5.23's legacy-field folding,
round trips through transformers' `DeepseekV4Config`, and clear errors."""

from __future__ import annotations

import pytest

from jaxspec.model_config import CSA, HCA, SLIDING, ModelConfig
from jaxspec.presets import preset

# DeepSeek's released config.json files (huggingface.co/deepseek-ai/DeepSeek-V4-Flash and -Pro), the
# fields as shipped: legacy forms (compress_ratios with one extra entry for the MTP block,
# num_hash_layers, qk_rope_head_dim, rope_scaling) that transformers folds.
_V4_RELEASED_COMMON = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu",
    "index_head_dim": 128, "index_n_heads": 64, "initializer_range": 0.02, "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4", "n_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": 6,
    "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "scoring_func": "sqrtsoftplus", "sliding_window": 128, "swiglu_limit": 10.0,
    "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
}
RELEASED = {
    "deepseek-v4-flash": {
        **_V4_RELEASED_COMMON, "expert_dtype": "fp4", "hidden_size": 4096, "index_topk": 512, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "num_attention_heads": 64, "num_hidden_layers": 43, "o_groups": 8, "q_lora_rank": 1024,
        "routed_scaling_factor": 1.5, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    },
    "deepseek-v4-pro": {
        **_V4_RELEASED_COMMON, "hidden_size": 7168, "index_topk": 1024, "moe_intermediate_size": 3072,
        "n_routed_experts": 384, "num_attention_heads": 128, "num_hidden_layers": 61, "o_groups": 16,
        "q_lora_rank": 1536, "routed_scaling_factor": 2.5, "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
    },
}


def _hf_config(raw):
    from transformers import DeepseekV4Config
    return DeepseekV4Config(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})


def _assert_folded_like_transformers(config: ModelConfig, raw):
    """Our reading of `raw` says what transformers' DeepseekV4Config.__post_init__ makes of it."""
    hf = _hf_config(raw)
    assert list(config.layer_types) == hf.layer_types
    assert list(config.mlp_layer_types) == hf.mlp_layer_types
    assert dict(config.compress_rates) == hf.compress_rates
    assert config.qk_rope_head_dim == hf.qk_rope_head_dim
    main, compress = hf.rope_parameters["main"], hf.rope_parameters["compress"]
    assert (config.rope_theta, config.compress_rope_theta) == (main["rope_theta"], compress["rope_theta"])
    assert main["rope_type"] == "default"
    if config.rope_scaling is None:
        assert compress["rope_type"] == "default"
    else:
        rs = config.rope_scaling
        assert compress["rope_type"] == "yarn" and compress["attention_factor"] == 1.0
        assert (rs.factor, rs.original_max_position_embeddings, rs.beta_fast, rs.beta_slow) == (
            compress["factor"], compress["original_max_position_embeddings"], compress.get("beta_fast", 32),
            compress.get("beta_slow", 1))  # transformers' YaRN defaults


@pytest.mark.hf
@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_v4_configs_are_the_presets(name):
    config = ModelConfig.from_hf(RELEASED[name])
    assert config == preset(name)
    _assert_folded_like_transformers(config, RELEASED[name])


@pytest.mark.hf
@pytest.mark.parametrize("name", ["tiny-v4", "deepseek-v4-flash", "deepseek-v4-pro"])
def test_v4_presets_round_trip_through_transformers(name, tmp_path):
    """to_hf() loads in transformers' DeepseekV4Config, and what transformers saves reads back equal."""
    config = preset(name)
    _hf_config(config.to_hf()).save_pretrained(tmp_path)
    assert ModelConfig.from_hf(tmp_path) == config


@pytest.mark.hf
@pytest.mark.parametrize("legacy", [
    {},  # transformers' defaults: 2 HCA layers then HCA / CSA alternating, 3 hash layers
    {"compress_rate_csa": 8, "compress_rate_hca": 32, "num_hash_layers": 1},
    {"compress_ratios": [0, 4, 128, 4, 0, 0], "num_hash_layers": 0, "partial_rotary_factor": 0.25},
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "rope_theta": 5000.0}, "rope_scaling": None},
    {"rope_scaling": None, "qk_rope_head_dim": 16},
])
def test_legacy_fields_fold_as_transformers_does(legacy):
    raw = {"model_type": "deepseek_v4", "num_hidden_layers": 5, "hidden_size": 64, "num_attention_heads": 4,
           "head_dim": 32, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "index_head_dim": 16, "vocab_size": 100,
           "max_position_embeddings": 128,
           "rope_scaling": {"type": "yarn", "factor": 2, "original_max_position_embeddings": 64}, **legacy}
    raw = {k: v for k, v in raw.items() if v is not None}
    _assert_folded_like_transformers(ModelConfig.from_hf(raw), raw)


def test_v4_helpers():
    config = preset("tiny-v4")
    assert [config.layer_type(i) for i in range(5)] == [SLIDING, CSA, HCA, CSA, SLIDING]  # 4 = the MTP block
    assert [config.compress_rate(i) for i in range(5)] == [0, 4, 8, 4, 0]
    assert [config.is_hash_layer(i) for i in range(5)] == [True, True, False, False, False]
    assert config.rope_for("main").rope_scaling is None and config.rope_for("main").rope_theta == 10000
    assert config.rope_for("compress").rope_theta == 160000 and config.rope_for("compress").rope_scaling.factor == 4
    assert hash(config) == hash(preset("tiny-v4"))  # tuples, not lists: usable as a static argument


@pytest.mark.parametrize("changes, match", [
    (dict(layer_types=(SLIDING, CSA)), "layer_types"),
    (dict(layer_types=(SLIDING, "full_attention", HCA, CSA)), "layer_types"),
    (dict(mlp_layer_types=("hash_moe", "dense", "moe", "moe")), "mlp_layer_types"),
    (dict(o_groups=3), "o_groups"),
    (dict(compress_rates={CSA: 4}), "compress_rates"),
    (dict(head_dim=4), "qk_rope_head_dim"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(hc_mult=0), "hc_mult"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(swiglu_limit=-1.0), "swiglu_limit"),
    (dict(n_group=2), "n_group"),
    (dict(index_topk=0), "index_topk"),
    (dict(kv_lora_rank=512), "kv_lora_rank"),
])
def test_impossible_v4_values_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        preset("tiny-v4", **changes)


def test_v4_fields_refused_on_v3():
    with pytest.raises(ValueError, match="hc_mult"):
        preset("tiny", hc_mult=4)
    with pytest.raises(ValueError, match="scoring_func"):
        preset("tiny", scoring_func="sqrtsoftplus")


def test_v4_config_json_errors():
    raw = RELEASED["deepseek-v4-flash"]
    with pytest.raises(ValueError, match="MTP block"):
        ModelConfig.from_hf({**raw, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 4]})
    with pytest.raises(ValueError, match=r"compress_ratios has \[2\]"):
        ModelConfig.from_hf({**raw, "compress_ratios": [2] * 44})
    with pytest.raises(ValueError, match="unknown fields"):
        ModelConfig.from_hf({**raw, "dspark_block_size": 5})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf({**raw, "num_key_value_heads": 8})
    with pytest.raises(ValueError, match="main rope_type"):
        ModelConfig.from_hf({**raw, "rope_scaling": None,
                             "rope_parameters": {"main": {"rope_type": "yarn", "factor": 2.0},
                                                 "compress": {"rope_type": "default"}}})
    with pytest.raises(ValueError, match="both rope_parameters and rope_scaling"):
        ModelConfig.from_hf({**raw, "rope_parameters": {"rope_type": "default"}})
    with pytest.raises(ValueError, match="attention_factor"):
        ModelConfig.from_hf({**raw, "rope_scaling": {**raw["rope_scaling"], "attention_factor": 1.3}})
    assert ModelConfig.from_hf({**raw, "dspark_block_size": 5}, strict=False) == preset("deepseek-v4-flash")
