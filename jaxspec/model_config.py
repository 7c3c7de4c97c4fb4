"""`ModelConfig`: the shapes and hyper-parameters of a DeepSeek-V3 / V3.2 / V4 model, and their checks.

The field names are those of a Hugging Face `config.json`; reading and writing that file is
`jaxspec.hf_config` (`ModelConfig.from_hf` / `to_hf`), the named shapes are `jaxspec.presets`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any, Mapping

from jaxspec.hf_config import config_from_hf, config_to_hf
from jaxspec.model_fields import (CSA, HCA, MODEL_TYPES, SCALE_FMTS, SLIDING, V4_FIELDS, V4_LAYER_TYPES,
                                  V4_MLP_LAYER_TYPES, RopeScaling)

# Re-exported: the names callers know this module by.
__all__ = ["CSA", "HCA", "MODEL_TYPES", "SLIDING", "V4_FIELDS", "V4_LAYER_TYPES", "V4_MLP_LAYER_TYPES",
           "ModelConfig", "RopeScaling"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a DeepSeek-V3 (`deepseek_v3`), V3.2 (`deepseek_v32`) or V4
    (`deepseek_v4`) model.

    Field names and meanings are those of the Hugging Face config. V3.2 adds the DSA lightning
    indexer (`index_n_heads`, `index_head_dim`, `index_topk`); for V3 they are 0.

    Fields (defaults: DeepSeek-V3 671B):
      model_type                 "deepseek_v3" or "deepseek_v32" (V3.2: DSA indexer in every layer)
      vocab_size, hidden_size    token vocabulary; residual width D
      intermediate_size          hidden width of the dense SwiGLU MLPs (layers < first_k_dense_replace)
      moe_intermediate_size      hidden width of one routed (and each shared) expert
      num_hidden_layers          decoder layers of the target (the MTP block is extra)
      num_attention_heads        MLA query heads H
      q_lora_rank                query latent width (None: a plain q_proj)
      kv_lora_rank               cached KV latent width (512)
      qk_nope_head_dim, qk_rope_head_dim, v_head_dim   per-head query/key parts and value width
      n_routed_experts, n_shared_experts, num_experts_per_tok   E, shared experts, top-k per token
      n_group, topk_group        group-limited routing: E split in n_group, top topk_group kept
      norm_topk_prob, routed_scaling_factor   renormalise the top-k weights; scale them
      first_k_dense_replace      layers below this use the dense MLP, the rest MoE
      rms_norm_eps, rope_theta, rope_scaling (`RopeScaling`, YaRN), max_position_embeddings
      num_nextn_predict_layers   MTP modules (0: none; one module is built and drafts)
      index_n_heads, index_head_dim, index_topk   the V3.2 / V4 lightning indexer (0 for V3)
      eos_token_id               the token that ends a row (None: rows end at the budget)
      scoring_func               router scores: "sigmoid" (V3, V3.2) or "sqrtsoftplus" (V4)
      scale_fmt                  DeepSeek's FP8 scale format (`quantization_config.scale_fmt` in its
                                 config.json): "ue8m0" rounds FP8 scales up to powers of two, None
                                 keeps amax / 448. Read by FP8 caches' indexer keys and queries, and
                                 by random FP8 weights' block scales (DeepSeek's releases since V3.1
                                 scale weights and activations so).

    DeepSeek-V4 (`model_type` "deepseek_v4", transformers' `DeepseekV4Config` names; at their
    neutral defaults below for V3 / V3.2, and `validate` insists on that):
      head_dim                   shared-KV MQA head width (512); K = V
      qk_rope_head_dim           its last RoPE-rotated dims (64; transformers: head_dim * partial_rotary_factor)
      layer_types                per layer: "sliding_attention", "compressed_sparse_attention" (CSA),
                                 "heavily_compressed_attention" (HCA)
      mlp_layer_types            per layer: "hash_moe" (experts from `tid2eid[token]`) or "moe" (learned top-k)
      compress_rates             ((layer type, m), ...): tokens per compressed entry (CSA 4, HCA 128);
                                 a dict is accepted and stored as sorted pairs (hashable)
      rope_theta, compress_rope_theta   RoPE bases of the "main" rope (sliding layers) and the
                                 "compress" rope (CSA / HCA layers)
      rope_scaling               for V4: the compress rope's YaRN (transformers applies YaRN only
                                 there); its cos/sin magnitude is 1 (transformers forces
                                 attention_factor = 1.0), stored as mscale == mscale_all_dim == 1
      hc_mult, hc_sinkhorn_iters, hc_eps   mHC residual streams, Sinkhorn iterations, its epsilon
      sliding_window             the sliding-window width (a query sees itself and sliding_window - 1 before)
      o_groups, o_lora_rank      grouped low-rank output projection
      swiglu_limit               experts' SwiGLU clamp (None: no clamp, V3)
    For V4, `intermediate_size` equals `moe_intermediate_size` (transformers' attribute map: the
    shared expert's width), every layer is MoE (`first_k_dense_replace` 0), routing is not
    group-limited (`n_group` = `topk_group` = 1), and the MLA-only widths (`kv_lora_rank`,
    `qk_nope_head_dim`, `v_head_dim`) are 0. The MTP block (`num_nextn_predict_layers`) is a
    sliding-window layer with learned routing, as in both released V4 checkpoints (their
    `compress_ratios` entry past the last layer is 0).

    Build one with `ModelConfig.from_hf(path_or_dict)` or `preset(name)`. Every inconsistent or
    impossible value raises ValueError naming the field (`validate`).
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
    scoring_func: str = "sigmoid"
    scale_fmt: str | None = None
    # DeepSeek-V4 only (neutral defaults otherwise; see the class docstring).
    head_dim: int = 0
    layer_types: tuple[str, ...] | None = None
    mlp_layer_types: tuple[str, ...] | None = None
    compress_rates: tuple[tuple[str, int], ...] | None = None
    compress_rope_theta: float = 0.0
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 0
    hc_eps: float = 0.0
    sliding_window: int = 0
    o_groups: int = 0
    o_lora_rank: int = 0
    swiglu_limit: float | None = None

    def __post_init__(self):
        # Lists and dicts (as read from JSON) are stored as tuples, so a config stays hashable (a
        # static argument of compiled functions).
        for field in ("layer_types", "mlp_layer_types"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, field, tuple(value))
        if isinstance(self.compress_rates, Mapping):
            object.__setattr__(self, "compress_rates", tuple(sorted(self.compress_rates.items())))
        elif self.compress_rates is not None and not isinstance(self.compress_rates, tuple):
            object.__setattr__(self, "compress_rates", tuple(tuple(pair) for pair in self.compress_rates))
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

    @property
    def is_v4(self) -> bool:
        """True for DeepSeek-V4: sliding / CSA / HCA attention, mHC, hash and learned MoE."""
        return self.model_type == "deepseek_v4"

    def compress_rate(self, layer: int) -> int:
        """V4: tokens per compressed entry of layer `layer` (m: 4 for CSA, m': 128 for HCA; 0 for a
        sliding-window layer and for the MTP block, `layer == num_hidden_layers`)."""
        kind = self.layer_type(layer)
        return 0 if kind == SLIDING else dict(self.compress_rates)[kind]

    def layer_type(self, layer: int) -> str:
        """V4: the attention kind of layer `layer` (`layer_types`; the MTP block, at index
        num_hidden_layers, is "sliding_attention")."""
        if not self.is_v4:
            raise ValueError(f"layer_type: model_type={self.model_type!r} has no V4 layer types")
        if not 0 <= layer <= self.num_hidden_layers:
            raise ValueError(f"layer={layer}: must be in [0, num_hidden_layers={self.num_hidden_layers}]")
        return SLIDING if layer == self.num_hidden_layers else self.layer_types[layer]

    def is_hash_layer(self, layer: int) -> bool:
        """V4: whether layer `layer` routes by `tid2eid[token]` (never the MTP block)."""
        return self.is_v4 and layer < self.num_hidden_layers and self.mlp_layer_types[layer] == "hash_moe"

    def rope_for(self, kind: str) -> "ModelConfig":
        """V4: this config with the RoPE of `kind` ("main": rope_theta, no scaling; "compress":
        compress_rope_theta with rope_scaling) in `rope_theta` / `rope_scaling`, the fields
        `models.rope.rope_angles` reads."""
        if kind == "main":
            return self.replace(rope_scaling=None)
        if kind == "compress":
            return self.replace(rope_theta=self.compress_rope_theta)
        raise ValueError(f"kind={kind!r}: must be 'main' or 'compress'")

    # -- validation -----------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise `ValueError` naming the first field that is impossible or inconsistent."""

        def fail(field: str, why: str):
            raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {why}")

        # Types first (a config.json may hold "64" or 64.5): the range checks below compare numbers.
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), str(field.type)
            if value is None and kind.endswith("| None"):
                continue
            if kind.startswith("int") and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                fail(field.name, "must be an integer")
            if kind.startswith("float") and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                fail(field.name, "must be a number")
            if kind.startswith("bool") and not isinstance(value, bool):
                fail(field.name, "must be true or false")
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            fail("eos_token_id", f"must be a token id in [0, vocab_size={self.vocab_size}) or null")
        if self.model_type not in MODEL_TYPES:
            fail("model_type", f"must be one of {MODEL_TYPES}")
        if self.scale_fmt not in SCALE_FMTS:
            fail("scale_fmt", f"must be one of {SCALE_FMTS} (None: scales amax / 448)")
        mla_widths = () if self.is_v4 else ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", *mla_widths, "max_position_embeddings"):
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
        if self.is_v4:
            self._validate_v4(fail)
        else:
            for field in V4_FIELDS:
                if getattr(self, field) != _V4_FIELD_DEFAULTS[field]:
                    fail(field, f"is a deepseek_v4 field; model_type {self.model_type} needs "
                                f"{_V4_FIELD_DEFAULTS[field]!r}")
            if self.scoring_func != "sigmoid":
                fail("scoring_func", f"model_type {self.model_type} routes with 'sigmoid' only")
        rs = self.rope_scaling
        if rs is not None:
            if rs.factor < 1:
                fail("rope_scaling", "factor must be >= 1")
            if rs.original_max_position_embeddings <= 0:
                fail("rope_scaling", "original_max_position_embeddings must be > 0")
            if rs.beta_fast <= rs.beta_slow:
                fail("rope_scaling", "beta_fast must be > beta_slow")

    def _validate_v4(self, fail) -> None:
        """The DeepSeek-V4 fields: present, consistent, and the variant transformers 5.23 builds."""
        n = self.num_hidden_layers
        for field in ("head_dim", "o_groups", "o_lora_rank", "sliding_window", "hc_mult", "hc_sinkhorn_iters",
                      "n_routed_experts", "moe_intermediate_size"):
            if getattr(self, field) <= 0:
                fail(field, "must be > 0 for model_type deepseek_v4")
        if self.hc_eps <= 0:
            fail("hc_eps", "must be > 0")
        if self.compress_rope_theta <= 0:
            fail("compress_rope_theta", "must be > 0")
        if self.qk_rope_head_dim > self.head_dim:
            fail("qk_rope_head_dim", f"must be <= head_dim={self.head_dim} (RoPE covers the last dims)")
        if self.num_attention_heads % self.o_groups:
            fail("o_groups", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.q_lora_rank is None:
            fail("q_lora_rank", "deepseek_v4 projects queries through q_a_proj: it needs q_lora_rank")
        if self.intermediate_size != self.moe_intermediate_size:
            fail("intermediate_size", f"must equal moe_intermediate_size={self.moe_intermediate_size} for "
                                      "deepseek_v4 (the shared expert's width)")
        for field, allowed in (("layer_types", V4_LAYER_TYPES), ("mlp_layer_types", V4_MLP_LAYER_TYPES)):
            types = getattr(self, field)
            if types is None or len(types) != n:
                fail(field, f"must list one entry per layer (num_hidden_layers={n})")
            if any(t not in allowed for t in types):
                fail(field, f"entries must be in {allowed}")
        rates = dict(self.compress_rates or ())
        if sorted(rates) != sorted((CSA, HCA)) or any(int(m) != m or m < 1 for m in rates.values()):
            fail("compress_rates", f"must give a rate >= 1 for {CSA!r} and {HCA!r}")
        if CSA in self.layer_types:
            for field in ("index_n_heads", "index_head_dim", "index_topk"):
                if getattr(self, field) <= 0:
                    fail(field, "must be > 0: compressed_sparse_attention layers have the lightning indexer")
            if self.index_head_dim < self.qk_rope_head_dim:
                fail("index_head_dim", f"must be >= qk_rope_head_dim={self.qk_rope_head_dim} (the indexer "
                                       "rotates its last qk_rope_head_dim dims)")
        if self.scoring_func not in ("sigmoid", "sqrtsoftplus"):
            fail("scoring_func", "must be 'sigmoid' or 'sqrtsoftplus'")
        if self.swiglu_limit is not None and self.swiglu_limit <= 0:
            fail("swiglu_limit", "must be > 0 or None (no clamp)")
        # transformers' DeepseekV4 MoE: no dense layers, no group limiting, always renormalised
        # top-k weights, exactly one shared expert of moe_intermediate_size.
        for field, want in (("first_k_dense_replace", 0), ("n_group", 1), ("topk_group", 1),
                            ("norm_topk_prob", True), ("n_shared_experts", 1)):
            if getattr(self, field) != want:
                fail(field, f"must be {want!r} for model_type deepseek_v4")
        for field in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, field) != 0:
                fail(field, "is an MLA width; deepseek_v4 has none (must be 0)")

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any], *, strict: bool = True) -> "ModelConfig":
        """Build from a Hugging Face `config.json` (a path, a directory holding one, or its dict).

        Both forms found in the wild are read: `rope_theta` + `rope_scaling` (released DeepSeek
        checkpoints) and `rope_parameters` (written by transformers 5). With `strict`, a field that
        is neither used nor known to be irrelevant raises `ValueError`.
        """
        return config_from_hf(cls, source, strict=strict)

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict this config was (or could have been) read from (for V4, in the
        form transformers 5.23 writes: `layer_types`, nested `rope_parameters`, ...)."""
        return config_to_hf(self)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


_V4_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in V4_FIELDS}
