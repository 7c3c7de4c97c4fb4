"""The vocabulary of `ModelConfig`'s fields: model types, DeepSeek-V4's layer kinds, the V4-only
field names and YaRN's `RopeScaling`. A leaf module, so that `jaxspec.model_config` (the config and
its checks) and `jaxspec.hf_config` (config.json in and out) both build on it without importing
each other.
"""

from __future__ import annotations

import dataclasses

MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "deepseek_v4")

# DeepSeek's activation-scale formats (`quantization_config.scale_fmt`): None keeps FP8 scales at
# amax / 448, "ue8m0" rounds them up to powers of two.
SCALE_FMTS = (None, "ue8m0")

# DeepSeek-V4's per-layer attention and MLP kinds (transformers 5.23 `configuration_deepseek_v4.py`).
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
V4_LAYER_TYPES = (SLIDING, CSA, HCA)
V4_MLP_LAYER_TYPES = ("hash_moe", "moe")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN RoPE scaling (`rope_scaling` with `type: yarn`), as DeepSeek-V3 ships it."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


# ModelConfig's DeepSeek-V4-only fields: at neutral defaults for V3 / V3.2.
V4_FIELDS = ("head_dim", "layer_types", "mlp_layer_types", "compress_rates", "compress_rope_theta", "hc_mult",
             "hc_sinkhorn_iters", "hc_eps", "sliding_window", "o_groups", "o_lora_rank", "swiglu_limit")
