"""Model and decoding configuration.

`ModelConfig` mirrors a Hugging Face DeepSeek-V3 / V3.2 `config.json`: the field names are the ones
found there, so a checkpoint's config loads with `ModelConfig.from_hf(path_or_dict)`. Fields that
only matter to training or to other frameworks are accepted and ignored (`_IGNORED_HF_FIELDS`);
anything else is an error, so a typo or a model family we do not implement never loads silently.

`DecodeConfig` holds what the decoding loop needs and the model does not (draft length, token
budget, cache geometry, kernel backend).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from jaxspec.pallas_kernels.backend import BACKENDS

MODEL_TYPES = ("deepseek_v3", "deepseek_v32")

# Fields that appear in released or transformers-written config.json files and do not change the
# inference math (training-only losses, parallelism hints, dtype and quantization metadata, which
# the checkpoint loader reads on its own).
_IGNORED_HF_FIELDS = frozenset({
    "architectures", "auto_map", "attention_bias", "attention_dropout", "aux_loss_alpha", "ep_size",
    "initializer_range", "pretraining_tp", "quantization_config", "seq_aux", "torch_dtype", "dtype",
    "transformers_version", "use_cache", "bos_token_id", "pad_token_id", "num_key_value_heads",
    "head_dim", "rope_interleave", "output_router_logits", "router_aux_loss_coef",
    "_name_or_path", "tie_word_embeddings", "moe_layer_freq", "hidden_act", "scoring_func",
    "topk_method", "model_type", "rope_parameters", "eos_token_id", "index_topk_freq",
    "_attn_implementation_autoset", "use_bfloat16", "return_dict",
})


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN RoPE scaling (`rope_scaling` with `type: yarn`), as DeepSeek-V3 ships it."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a DeepSeek-V3 (`deepseek_v3`) or V3.2 (`deepseek_v32`) model.

    Field names and meanings are those of the Hugging Face config. V3.2 adds the DSA lightning
    indexer (`index_n_heads`, `index_head_dim`, `index_topk`); for V3 they are 0.
    """

    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 163840
    num_nextn_predict_layers: int = 1
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    eos_token_id: int | None = None

    def __post_init__(self):
        self.validate()

    # -- derived quantities ---------------------------------------------------------------------

    @property
    def is_v32(self) -> bool:
        """True when every layer carries the DSA lightning indexer (DeepSeek-V3.2)."""
        return self.model_type == "deepseek_v32"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached MLA entry: normalized latent then rotated RoPE key (512 + 64)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim ** -0.5`, times `mscale**2` under YaRN (DeepSeek-V3 `MLA.__init__`)."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim and rs.factor > 1:
            mscale = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
            scale *= mscale * mscale
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    # -- validation -----------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise `ValueError` naming the first field that is impossible or inconsistent."""

        def fail(field: str, why: str):
            raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {why}")

        if self.model_type not in MODEL_TYPES:
            fail("model_type", f"must be one of {MODEL_TYPES}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                      "max_position_embeddings"):
            if getattr(self, field) <= 0:
                fail(field, "must be > 0")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            fail("qk_rope_head_dim", "must be a positive even number (RoPE rotates pairs)")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            fail("q_lora_rank", "must be > 0 or null (plain q_proj)")
        if self.rms_norm_eps <= 0:
            fail("rms_norm_eps", "must be > 0")
        if self.rope_theta <= 0:
            fail("rope_theta", "must be > 0")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            fail("first_k_dense_replace", f"must be in [0, num_hidden_layers={self.num_hidden_layers}]")
        if self.num_nextn_predict_layers < 0:
            fail("num_nextn_predict_layers", "must be >= 0")
        if self.n_routed_experts < 0:
            fail("n_routed_experts", "must be >= 0")
        if self.n_routed_experts > 0:
            if self.moe_intermediate_size <= 0:
                fail("moe_intermediate_size", "must be > 0 when n_routed_experts > 0")
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                fail("num_experts_per_tok", f"must be in [1, n_routed_experts={self.n_routed_experts}]")
            if self.n_group <= 0 or self.n_routed_experts % self.n_group:
                fail("n_group", f"must divide n_routed_experts={self.n_routed_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                fail("topk_group", f"must be in [1, n_group={self.n_group}]")
            per_group = self.n_routed_experts // self.n_group
            if self.num_experts_per_tok > self.topk_group * per_group:
                fail("num_experts_per_tok",
                     f"cannot pick more than topk_group * experts_per_group = {self.topk_group * per_group}")
            if self.n_shared_experts < 0:
                fail("n_shared_experts", "must be >= 0")
        if self.is_v32:
            for field in ("index_n_heads", "index_head_dim", "index_topk"):
                if getattr(self, field) <= 0:
                    fail(field, "must be > 0 for model_type deepseek_v32")
            if self.q_lora_rank is None:
                fail("q_lora_rank", "deepseek_v32's indexer projects the query latent: it needs q_lora_rank")
            if self.index_head_dim < self.qk_rope_head_dim:
                fail("index_head_dim", f"must be >= qk_rope_head_dim={self.qk_rope_head_dim} "
                                       "(the indexer rotates its first qk_rope_head_dim dims)")
        rs = self.rope_scaling
        if rs is not None:
            if rs.factor < 1:
                fail("rope_scaling", "factor must be >= 1")
            if rs.original_max_position_embeddings <= 0:
                fail("rope_scaling", "original_max_position_embeddings must be > 0")
            if rs.beta_fast <= rs.beta_slow:
                fail("rope_scaling", "beta_fast must be > beta_slow")

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any], *, strict: bool = True) -> "ModelConfig":
        """Build from a Hugging Face `config.json` (a path, a directory holding one, or its dict).

        Both forms found in the wild are read: `rope_theta` + `rope_scaling` (released DeepSeek
        checkpoints) and `rope_parameters` (written by transformers 5). With `strict`, a field that
        is neither used nor known to be irrelevant raises `ValueError`.
        """
        if isinstance(source, Mapping):
            raw = dict(source)
        else:
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                raw = json.load(f)
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json model_type={model_type!r}: must be one of {MODEL_TYPES}")

        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in raw if k not in fields and k not in _IGNORED_HF_FIELDS)
        if unknown and strict:
            raise ValueError(f"config.json has unknown fields {unknown}; pass strict=False to ignore them")

        kwargs = {k: v for k, v in raw.items() if k in fields and k not in ("rope_scaling", "eos_token_id")}
        kwargs["model_type"] = model_type
        eos = raw.get("eos_token_id")
        kwargs["eos_token_id"] = eos[0] if isinstance(eos, list) else eos

        rope = raw.get("rope_parameters")
        scaling = raw.get("rope_scaling")
        if rope is not None:  # transformers 5: theta and scaling live together
            kwargs["rope_theta"] = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
            scaling = rope
        kwargs["rope_scaling"] = _parse_rope_scaling(scaling)
        if "index_topk" in raw and model_type == "deepseek_v3":
            raise ValueError("config.json index_topk is set but model_type is deepseek_v3 (expected deepseek_v32)")
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict this config was (or could have been) read from."""
        out = dataclasses.asdict(self)
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        if not self.is_v32:
            for field in ("index_n_heads", "index_head_dim", "index_topk"):
                out.pop(field)
        return out

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _parse_rope_scaling(scaling: Mapping[str, Any] | None) -> RopeScaling | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ValueError(f"config.json rope_scaling type={kind!r}: only 'yarn' (DeepSeek-V3) is supported")
    names = {f.name for f in dataclasses.fields(RopeScaling)}
    return RopeScaling(**{k: v for k, v in scaling.items() if k in names and v is not None})


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

PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized, MoE (with group limiting) and DSA (index_topk well under typical contexts) on.
    "tiny": _TINY,
    # The same architecture without the DSA indexer: the V3 form of the tiny model.
    "tiny-v3": {**_TINY, "model_type": "deepseek_v3", "index_n_heads": 0, "index_head_dim": 0, "index_topk": 0},
    # DeepSeek-V3 (671B) shapes, no weights.
    "deepseek-v3": _DEEPSEEK_V3,
    # DeepSeek-V3.2-Exp shapes, no weights.
    "deepseek-v3.2": {**_DEEPSEEK_V3, "model_type": "deepseek_v32", "index_n_heads": 64,
                      "index_head_dim": 128, "index_topk": 2048},
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named configuration (`tiny`, `tiny-v3`, `deepseek-v3`, `deepseek-v3.2`), fields overridable."""
    if name not in PRESETS:
        raise ValueError(f"preset name={name!r}: must be one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


MAX_DRAFT_TOKENS = 7


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """What the decoding loop needs beyond the model.

    num_draft: k, draft tokens per speculative step (0 = plain greedy decoding, the baseline;
      1..MAX_DRAFT_TOKENS chains the one MTP layer).
    max_new_tokens: per-row budget of generated tokens (the first token after the prompt counts).
    eos_token_id: a row stops after emitting it; None = only the budget stops rows.
    page_size: cache slots per page.
    max_cache_len: slots per row; None sizes the cache to the prompts and the budget.
    backend: kernel implementation, "xla" (pure-jnp references), "pallas", or "auto".
    """

    num_draft: int = 3
    max_new_tokens: int = 64
    eos_token_id: int | None = None
    page_size: int = 64
    max_cache_len: int | None = None
    backend: str = "auto"

    def __post_init__(self):
        if not 0 <= self.num_draft <= MAX_DRAFT_TOKENS:
            raise ValueError(f"DecodeConfig.num_draft={self.num_draft}: must be in [0, {MAX_DRAFT_TOKENS}]")
        if self.max_new_tokens < 1:
            raise ValueError(f"DecodeConfig.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.page_size < 1:
            raise ValueError(f"DecodeConfig.page_size={self.page_size}: must be >= 1")
        if self.max_cache_len is not None and self.max_cache_len < 1:
            raise ValueError(f"DecodeConfig.max_cache_len={self.max_cache_len}: must be >= 1 or None")
        if self.backend not in BACKENDS:
            raise ValueError(f"DecodeConfig.backend={self.backend!r}: must be one of {BACKENDS}")

    def replace(self, **changes) -> "DecodeConfig":
        return dataclasses.replace(self, **changes)
