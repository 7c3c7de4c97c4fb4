"""Named model shapes: CPU-sized test models and the released DeepSeek-V3 / V3.2 / V4 shapes (no weights)."""

from __future__ import annotations

from typing import Any

from jaxspec.model_config import CSA, HCA, SLIDING, ModelConfig, RopeScaling

_TINY = dict(
    model_type="deepseek_v32", vocab_size=258, hidden_size=64, intermediate_size=128,
    moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, q_lora_rank=32,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True,
    routed_scaling_factor=2.5, first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=256, beta_fast=32.0,
                             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    max_position_embeddings=1024, num_nextn_predict_layers=1, index_n_heads=2, index_head_dim=16,
    index_topk=16, eos_token_id=257,
)

_DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096,
                                                       beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                                       mscale_all_dim=1.0),
    eos_token_id=1,
)

# DeepSeek-V4 shapes shared by the presets below (transformers' `DeepseekV4Config` field names).
_V4_COMMON = dict(
    model_type="deepseek_v4", vocab_size=129280, max_position_embeddings=1048576, head_dim=512,
    qk_rope_head_dim=64, o_lora_rank=1024, num_experts_per_tok=6, n_shared_experts=1, norm_topk_prob=True,
    scoring_func="sqrtsoftplus", rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling=RopeScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0),
    compress_rates={CSA: 4, HCA: 128}, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, sliding_window=128,
    swiglu_limit=10.0, index_n_heads=64, index_head_dim=128, num_nextn_predict_layers=1, eos_token_id=1,
    first_k_dense_replace=0, n_group=1, topk_group=1, kv_lora_rank=0, qk_nope_head_dim=0, v_head_dim=0,
)
# The released V4 checkpoints' `quantization_config.scale_fmt` (their scales are float8_e8m0fnu).
_V4_RELEASED = dict(_V4_COMMON, scale_fmt="ue8m0")

PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized, MoE (with group limiting) and DSA (index_topk well under typical contexts) on.
    "tiny": _TINY,
    # The same architecture without the DSA indexer: the V3 form of the tiny model.
    "tiny-v3": {**_TINY, "model_type": "deepseek_v3", "index_n_heads": 0, "index_head_dim": 0, "index_topk": 0},
    # The shipped default model (examples/train_tiny.py, trained on the Python stdlib): deeper and
    # wider than `tiny`, so a target call costs several MTP calls and drafting pays off on a CPU.
    # Layer 0 is dense, the rest (and the MTP block) route each token to 1 of 4 experts plus a shared one.
    # Its FP8 caches scale the indexer's keys as V3.2's release does (powers of two).
    "tiny-stdlib": {**_TINY, "scale_fmt": "ue8m0", "hidden_size": 96, "intermediate_size": 384, "moe_intermediate_size": 96,
                    "num_hidden_layers": 12, "first_k_dense_replace": 1, "q_lora_rank": 48, "kv_lora_rank": 48,
                    "qk_nope_head_dim": 24, "qk_rope_head_dim": 16, "v_head_dim": 24, "n_routed_experts": 4,
                    "n_group": 2, "topk_group": 1, "num_experts_per_tok": 1, "index_n_heads": 2,
                    "index_head_dim": 32, "index_topk": 64},
    # DeepSeek-V3 (671B) shapes, no weights.
    "deepseek-v3": _DEEPSEEK_V3,
    # DeepSeek-V3.2-Exp shapes, no weights; its config's `quantization_config.scale_fmt`.
    "deepseek-v3.2": {**_DEEPSEEK_V3, "model_type": "deepseek_v32", "index_n_heads": 64,
                      "index_head_dim": 128, "index_topk": 2048, "scale_fmt": "ue8m0"},
    # CPU-sized DeepSeek-V4 for tests: every attention kind (sliding, CSA, HCA), hash-routed then
    # learned MoE, 4 mHC streams, an 8-token sliding window, CSA entries every 4 tokens and HCA
    # every 8 (so a few dozen tokens cross many compression windows and leave the sliding window),
    # the indexer keeping 4 of them, YaRN on the compress rope, one MTP block.
    "tiny-v4": {**_V4_COMMON, "vocab_size": 258, "hidden_size": 64, "intermediate_size": 32,
                "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 32,
                "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
                "n_routed_experts": 8, "num_experts_per_tok": 2, "routed_scaling_factor": 1.5,
                "max_position_embeddings": 1024, "sliding_window": 8, "compress_rates": {CSA: 4, HCA: 8},
                "rope_scaling": RopeScaling(factor=4.0, original_max_position_embeddings=256, beta_fast=32.0,
                                            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                "layer_types": (SLIDING, CSA, HCA, CSA), "mlp_layer_types": ("hash_moe", "hash_moe", "moe", "moe"),
                "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4, "eos_token_id": 257},
    # DeepSeek-V4-Flash shapes, no weights: huggingface.co/deepseek-ai/DeepSeek-V4-Flash config.json
    # (hidden 4096, 43 layers, 64 heads, q_lora_rank 1024, o_groups 8, 256 experts of 2048, top 6,
    # routed_scaling_factor 1.5, index_topk 512, compress_ratios [0, 0] + [4, 128] * 20 + [4] for the
    # 43 layers and a final 0 for the MTP block, num_hash_layers 3).
    "deepseek-v4-flash": {**_V4_RELEASED, "hidden_size": 4096, "intermediate_size": 2048,
                          "moe_intermediate_size": 2048, "num_hidden_layers": 43, "num_attention_heads": 64,
                          "q_lora_rank": 1024, "o_groups": 8, "n_routed_experts": 256, "routed_scaling_factor": 1.5,
                          "index_topk": 512, "layer_types": (SLIDING,) * 2 + (CSA, HCA) * 20 + (CSA,),
                          "mlp_layer_types": ("hash_moe",) * 3 + ("moe",) * 40},
    # DeepSeek-V4-Pro shapes, no weights: huggingface.co/deepseek-ai/DeepSeek-V4-Pro config.json
    # (hidden 7168, 61 layers, 128 heads, q_lora_rank 1536, o_groups 16, 384 experts of 3072, top 6,
    # routed_scaling_factor 2.5, index_topk 1024, compress_ratios [128, 128] + [4, 128] * 29 + [4]
    # for the 61 layers and a final 0 for the MTP block, num_hash_layers 3).
    "deepseek-v4-pro": {**_V4_RELEASED, "hidden_size": 7168, "intermediate_size": 3072,
                        "moe_intermediate_size": 3072, "num_hidden_layers": 61, "num_attention_heads": 128,
                        "q_lora_rank": 1536, "o_groups": 16, "n_routed_experts": 384, "routed_scaling_factor": 2.5,
                        "index_topk": 1024, "layer_types": (HCA,) * 2 + (CSA, HCA) * 29 + (CSA,),
                        "mlp_layer_types": ("hash_moe",) * 3 + ("moe",) * 58},
}


def preset(name: str, **overrides) -> ModelConfig:
    """The `ModelConfig` of a named preset, with `overrides` (ModelConfig field=value) applied.

    name: one of `PRESETS` (`tiny`, `tiny-v3`, `tiny-stdlib`, `deepseek-v3`, `deepseek-v3.2`, `tiny-v4`,
    `deepseek-v4-flash`, `deepseek-v4-pro`).
    Raises ValueError for an unknown name, and ModelConfig's ValueError for an inconsistent override.
    """
    if name not in PRESETS:
        raise ValueError(f"preset name={name!r}: must be one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
