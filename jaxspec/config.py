"""Model and decoding configuration.

`ModelConfig` mirrors a Hugging Face DeepSeek-V3 / V3.2 / V4 `config.json`: the field names are the
ones found there, so a checkpoint's config loads with `ModelConfig.from_hf(path_or_dict)`. Fields that
only matter to training or to other frameworks are accepted and ignored (`_IGNORED_HF_FIELDS`);
anything else is an error, so a typo or a model family we do not implement never loads silently.

Fields that are known but must hold one value (`_REQUIRED_HF_VALUES`: no attention bias, SiLU,
sigmoid routing, interleaved RoPE, ...) are checked: a config describing a variant this code does
not implement is an error, not a different model run silently.

`DecodeConfig` holds what the decoding loop needs and the model does not (draft length or tree,
sampling and acceptance rule, token budget, cache geometry, kernel backend).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Mapping

from jaxspec.pallas_kernels.backend import BACKENDS
from jaxspec.trees import DynamicTreeSpec, StaticTree, chain_tree, parse_tree

MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "deepseek_v4")

# DeepSeek-V4's per-layer attention and MLP kinds (transformers 5.23 `configuration_deepseek_v4.py`).
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
V4_LAYER_TYPES = (SLIDING, CSA, HCA)
V4_MLP_LAYER_TYPES = ("hash_moe", "moe")
# DeepSeek's own config.json gives one compression ratio per layer (`compress_ratios`); transformers
# maps exactly these three values (`_COMPRESS_RATIO_TO_LAYER_TYPE`).
_V4_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}

# Fields that appear in released or transformers-written config.json files and do not change the
# inference math (training-only losses, parallelism hints, dtype and quantization metadata, which
# the checkpoint loader reads on its own).
_IGNORED_HF_FIELDS = frozenset({
    "architectures", "auto_map", "attention_bias", "attention_dropout", "aux_loss_alpha", "ep_size",
    "initializer_range", "pretraining_tp", "quantization_config", "seq_aux", "torch_dtype", "dtype",
    "transformers_version", "use_cache", "bos_token_id", "pad_token_id", "num_key_value_heads",
    "head_dim", "rope_interleave", "output_router_logits", "router_aux_loss_coef",
    "_name_or_path", "tie_word_embeddings", "moe_layer_freq", "hidden_act",
    "topk_method", "model_type", "rope_parameters", "eos_token_id", "index_topk_freq",
    "_attn_implementation_autoset", "use_bfloat16", "return_dict",
    # Written by transformers 5 and checked below or by `from_hf` (derived or fixed for DeepSeek).
    "qk_head_dim", "layer_types", "mlp_layer_types", "mlp_bias",
})

# Known fields that must hold these values: anything else is a model variant not implemented here.
_REQUIRED_HF_VALUES = {
    "attention_bias": (False,), "mlp_bias": (False,), "hidden_act": ("silu",),
    "topk_method": ("noaux_tc",), "moe_layer_freq": (1,), "rope_interleave": (True,),
    "tie_word_embeddings": (False,),
}

# rope_scaling / rope_parameters keys that are read elsewhere or are the defaults this code implements.
_ROPE_KEYS_HANDLED = frozenset({"type", "rope_type", "rope_theta"})
_ROPE_REQUIRED_VALUES = {"truncate": (True,), "partial_rotary_factor": (1, 1.0)}


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

        if self.model_type not in MODEL_TYPES:
            fail("model_type", f"must be one of {MODEL_TYPES}")
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
            for field in _V4_FIELDS:
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
        if model_type == "deepseek_v4":
            return cls(**_v4_kwargs_from_hf(raw, strict))

        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in raw if k not in fields and k not in _IGNORED_HF_FIELDS)
        if unknown and strict:
            raise ValueError(f"config.json has unknown fields {unknown}; pass strict=False to ignore them")

        for key, allowed in _REQUIRED_HF_VALUES.items():
            if key in raw and raw[key] not in allowed:
                raise ValueError(f"config.json {key}={raw[key]!r}: only {allowed[0]!r} is implemented")

        kwargs = {k: v for k, v in raw.items()
                  if k in fields and k not in ("rope_scaling", "eos_token_id", *_V4_FIELDS)}
        kwargs["model_type"] = model_type
        eos = raw.get("eos_token_id")
        kwargs["eos_token_id"] = eos[0] if isinstance(eos, list) else eos
        if "first_k_dense_replace" in raw and "num_hidden_layers" in raw:
            # transformers clamps it (a 2-layer test model keeps DeepSeek's default of 3); the MTP
            # block, at index num_hidden_layers, then stays MoE as it always is in transformers.
            kwargs["first_k_dense_replace"] = min(raw["first_k_dense_replace"], raw["num_hidden_layers"])

        rope = raw.get("rope_parameters")
        scaling = raw.get("rope_scaling")
        if rope is not None:  # transformers 5: theta and scaling live together
            kwargs["rope_theta"] = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
            scaling = rope
        kwargs["rope_scaling"] = _parse_rope_scaling(scaling, raw.get("max_position_embeddings"))
        if "index_topk" in raw and model_type == "deepseek_v3":
            raise ValueError("config.json index_topk is set but model_type is deepseek_v3 (expected deepseek_v32)")
        config = cls(**kwargs)
        _check_derived_fields(raw, config)
        return config

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict this config was (or could have been) read from (for V4, in the
        form transformers 5.23 writes: `layer_types`, nested `rope_parameters`, ...)."""
        if self.is_v4:
            return _v4_to_hf(self)
        out = dataclasses.asdict(self)
        for field in _V4_FIELDS:
            out.pop(field)
        out.pop("scoring_func")
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        if not self.is_v32:
            for field in ("index_n_heads", "index_head_dim", "index_topk"):
                out.pop(field)
        return out

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


_V4_FIELDS = ("head_dim", "layer_types", "mlp_layer_types", "compress_rates", "compress_rope_theta", "hc_mult",
              "hc_sinkhorn_iters", "hc_eps", "sliding_window", "o_groups", "o_lora_rank", "swiglu_limit")
_V4_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in _V4_FIELDS}

# transformers 5.23 `DeepseekV4Config`'s defaults, for fields a V4 config.json leaves out.
_V4_HF_DEFAULTS = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
    head_dim=512, q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5, max_position_embeddings=1048576,
    rope_theta=10000.0, compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1.0e-6,
    swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128,
    index_topk=512, num_nextn_predict_layers=1, rms_norm_eps=1.0e-6, eos_token_id=1,
)
_V4_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_V4_DEFAULT_NUM_HASH_LAYERS = 3

# V4 config.json fields that are read by `_v4_kwargs_from_hf` without being ModelConfig fields (legacy
# forms transformers folds), or that do not change inference (quantization and training metadata).
_V4_HF_READ = frozenset({
    "compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers", "partial_rotary_factor",
    "rope_scaling", "rope_parameters", "num_key_value_heads", "intermediate_size", "router_jitter_noise",
    "expert_dtype",
})
_V4_HF_FIELDS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "norm_topk_prob",
                 "routed_scaling_factor", "max_position_embeddings", "rope_theta", "num_nextn_predict_layers",
                 "rms_norm_eps", "index_n_heads", "index_head_dim", "index_topk", "scoring_func",
                 "qk_rope_head_dim", *_V4_FIELDS)
# Keys of a V4 rope dict (flat, or each of `main` / `compress`) and what this code requires of them.
_V4_ROPE_KEYS = frozenset({"type", "rope_type", "rope_theta", "partial_rotary_factor", "factor", "beta_fast",
                           "beta_slow", "original_max_position_embeddings", "attention_factor", "truncate"})


def _v4_kwargs_from_hf(raw: Mapping[str, Any], strict: bool) -> dict[str, Any]:
    """A DeepSeek-V4 config.json -> ModelConfig keyword arguments, with the legacy fields DeepSeek's
    own config.json ships folded exactly as transformers 5.23's `DeepseekV4Config.__post_init__`
    folds them:
      * `compress_rates` {CSA: 4, HCA: 128} by default; `compress_rate_csa` / `compress_rate_hca` override;
      * `layer_types`: given > from `compress_ratios` (0 / 4 / 128 per layer) > 2 HCA layers then
        HCA / CSA alternating; cut to num_hidden_layers (DeepSeek's list has one more entry per
        MTP block, which must be 0: the MTP block here is a sliding-window layer);
      * `mlp_layer_types`: given > `num_hash_layers` (default 3) "hash_moe" layers, then "moe";
      * `qk_rope_head_dim` = head_dim * partial_rotary_factor, that factor given or legacy
        `qk_rope_head_dim / head_dim` or 64 / 512;
      * `rope_parameters` nested {main, compress} as written, else the flat `rope_parameters` /
        legacy `rope_scaling` is the compress rope's scaling (rope_theta: main, compress_rope_theta:
        compress); main is plain RoPE, compress YaRN's cos/sin magnitude is 1 (attention_factor 1.0).
    Fields left out take transformers' defaults (`_V4_HF_DEFAULTS`).
    """
    allowed = set(_V4_HF_FIELDS) | _V4_HF_READ | _IGNORED_HF_FIELDS
    unknown = sorted(k for k in raw if k not in allowed)
    if unknown and strict:
        raise ValueError(f"config.json has unknown fields {unknown}; pass strict=False to ignore them")
    for key, allowed_values in {**_REQUIRED_HF_VALUES, "num_key_value_heads": (1,), "router_jitter_noise": (0, 0.0),
                                "topk_method": ("noaux_tc",)}.items():
        if key in raw and raw[key] not in allowed_values:
            raise ValueError(f"config.json {key}={raw[key]!r}: only {allowed_values[0]!r} is implemented")
    kw = {**_V4_HF_DEFAULTS, **{k: v for k, v in raw.items() if k in _V4_HF_FIELDS}}
    n = kw["num_hidden_layers"]
    eos = raw.get("eos_token_id", _V4_HF_DEFAULTS["eos_token_id"])
    kw["eos_token_id"] = eos[0] if isinstance(eos, list) else eos

    rates = dict(raw.get("compress_rates") or _V4_DEFAULT_COMPRESS_RATES)
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if raw.get(key) is not None:
            rates[kind] = raw[key]
    kw["compress_rates"] = rates

    types = raw.get("layer_types")
    ratios = raw.get("compress_ratios")
    if types is None and ratios is not None:
        bad = sorted({r for r in ratios if r not in _V4_RATIO_TO_LAYER_TYPE})
        if bad:
            raise ValueError(f"config.json compress_ratios has {bad}: only {sorted(_V4_RATIO_TO_LAYER_TYPE)} are known")
        if any(ratios[n:]):
            raise ValueError(f"config.json compress_ratios[{n}:]={ratios[n:]}: the MTP block must be a sliding-window "
                             "layer (0), as in the released V4 checkpoints")
        types = [_V4_RATIO_TO_LAYER_TYPE[r] for r in ratios]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    kw["layer_types"] = tuple(types[:n])
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        hashed = raw.get("num_hash_layers")
        hashed = _V4_DEFAULT_NUM_HASH_LAYERS if hashed is None else hashed
        mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    kw["mlp_layer_types"] = tuple(mlp_types[:n])

    head_dim = kw["head_dim"]
    factor = raw.get("partial_rotary_factor")
    if factor is None:
        factor = raw["qk_rope_head_dim"] / head_dim if "qk_rope_head_dim" in raw else 64 / 512
    kw["qk_rope_head_dim"] = int(head_dim * factor)
    kw["rope_theta"], kw["compress_rope_theta"], kw["rope_scaling"] = _v4_ropes(raw, kw, factor)

    if raw.get("intermediate_size", kw["moe_intermediate_size"]) != kw["moe_intermediate_size"]:
        raise ValueError(f"config.json intermediate_size={raw['intermediate_size']}: deepseek_v4 reads it as "
                         f"moe_intermediate_size={kw['moe_intermediate_size']} (transformers' attribute map)")
    kw.update(model_type="deepseek_v4", intermediate_size=kw["moe_intermediate_size"], first_k_dense_replace=0,
              n_group=1, topk_group=1, kv_lora_rank=0, qk_nope_head_dim=0, v_head_dim=0)
    return kw


def _v4_ropes(raw: Mapping[str, Any], kw: Mapping[str, Any], factor: float):
    """(main rope_theta, compress_rope_theta, compress RopeScaling or None) of a V4 config.json."""
    params = raw.get("rope_parameters") or {}
    if params and raw.get("rope_scaling"):
        raise ValueError("config.json has both rope_parameters and rope_scaling: give one (transformers' readings of "
                         "the pair differ by version)")
    if isinstance(params.get("main"), Mapping) and isinstance(params.get("compress"), Mapping):
        main, compress = params["main"], params["compress"]
    else:  # flat: rope_parameters (transformers) or legacy rope_scaling, theta beside it
        flat = {k: v for k, v in (params or raw.get("rope_scaling") or {}).items() if k not in ("main", "compress")}
        # As transformers: a flat dict's own rope_theta is dropped; the bases are the top-level fields.
        main = {"rope_type": "default", "rope_theta": kw["rope_theta"]}
        compress = {**flat, "rope_theta": kw["compress_rope_theta"]}
    for label, rope in (("main", main), ("compress", compress)):
        unknown = sorted(set(rope) - _V4_ROPE_KEYS)
        if unknown:
            raise ValueError(f"config.json rope_parameters.{label} has unsupported keys {unknown}")
        if rope.get("partial_rotary_factor", factor) != factor:
            raise ValueError(f"config.json rope_parameters.{label}.partial_rotary_factor="
                             f"{rope['partial_rotary_factor']}: differs from partial_rotary_factor={factor}")
    if main.get("rope_type", main.get("type", "default")) != "default":
        raise ValueError(f"config.json rope_parameters.main rope_type={main.get('rope_type', main.get('type'))!r}: "
                         "the main (sliding-window) rope is plain RoPE in DeepSeek-V4")
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"config.json rope_parameters.compress rope_type={kind!r}: only 'default' or 'yarn'")
    if compress.get("attention_factor", 1.0) != 1.0:
        raise ValueError(f"config.json rope_parameters.compress attention_factor={compress['attention_factor']}: "
                         "DeepSeek-V4 leaves cos/sin unscaled (1.0)")
    scaling = None
    if kind == "yarn":
        yarn = {k: v for k, v in compress.items() if k not in ("rope_theta", "partial_rotary_factor", "attention_factor")}
        # A cos/sin magnitude of 1 (transformers' forced attention_factor) is mscale == mscale_all_dim.
        scaling = _parse_rope_scaling({**yarn, "mscale": 1.0, "mscale_all_dim": 1.0}, kw["max_position_embeddings"])
    return (float(main.get("rope_theta", kw["rope_theta"])), float(compress.get("rope_theta", kw["compress_rope_theta"])),
            scaling)


def _v4_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A V4 ModelConfig -> the config.json transformers 5.23 writes for it (loads in `DeepseekV4Config`)."""
    out = {name: getattr(config, name) for name in _V4_HF_FIELDS if name not in ("qk_rope_head_dim", "rope_theta")}
    factor = config.qk_rope_head_dim / config.head_dim
    compress = {"rope_type": "default"}
    if config.rope_scaling is not None:
        rs = config.rope_scaling
        compress = {"rope_type": "yarn", "factor": rs.factor, "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow,
                    "original_max_position_embeddings": rs.original_max_position_embeddings, "attention_factor": 1.0}
    out.update(
        model_type="deepseek_v4", eos_token_id=config.eos_token_id, layer_types=list(config.layer_types),
        mlp_layer_types=list(config.mlp_layer_types), compress_rates=dict(config.compress_rates),
        partial_rotary_factor=factor, num_key_value_heads=1, rope_theta=config.rope_theta,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": config.rope_theta, "partial_rotary_factor": factor},
            "compress": {**compress, "rope_theta": config.compress_rope_theta, "partial_rotary_factor": factor}},
    )
    return out


def _parse_rope_scaling(scaling: Mapping[str, Any] | None, max_position_embeddings: int | None) -> RopeScaling | None:
    """`rope_scaling` (or transformers 5 `rope_parameters`) -> RopeScaling, None for plain RoPE.

    A key this code does not implement (e.g. an explicit `attention_factor`) raises rather than
    being dropped. A missing `factor` is `max_position_embeddings / original_max_position_embeddings`,
    as transformers derives it.
    """
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ValueError(f"config.json rope_scaling type={kind!r}: only 'yarn' (DeepSeek-V3) is supported")
    names = {f.name for f in dataclasses.fields(RopeScaling)}
    for key, allowed in _ROPE_REQUIRED_VALUES.items():
        if scaling.get(key, allowed[0]) not in allowed:
            raise ValueError(f"config.json rope_scaling {key}={scaling[key]!r}: only {allowed[0]!r} is implemented")
    unknown = sorted(k for k in scaling if k not in names | _ROPE_KEYS_HANDLED | _ROPE_REQUIRED_VALUES.keys())
    if unknown:
        raise ValueError(f"config.json rope_scaling has unsupported keys {unknown}")
    values = {k: v for k, v in scaling.items() if k in names and v is not None}
    if "factor" not in values and max_position_embeddings and "original_max_position_embeddings" in values:
        values["factor"] = max_position_embeddings / values["original_max_position_embeddings"]
    return RopeScaling(**values)


def _check_derived_fields(raw: Mapping[str, Any], config: ModelConfig) -> None:
    """Fields transformers 5 derives and writes must agree with the ones they derive from: the
    per-layer type lists must say what first_k_dense_replace and model_type say (dense MLPs first,
    then MoE; every layer indexed for V3.2), the only layouts implemented here."""
    layers = range(config.num_hidden_layers)
    expected = {
        "qk_head_dim": config.qk_head_dim,
        "mlp_layer_types": ["sparse" if config.is_moe_layer(i) else "dense" for i in layers],
        "layer_types": ["indexed_attention" if config.is_v32 else "full_attention" for _ in layers],
    }
    for key, want in expected.items():
        if key in raw and raw[key] != want:
            raise ValueError(f"config.json {key}={raw[key]!r}: expected {want} for this model "
                             f"(first_k_dense_replace={config.first_k_dense_replace}, model_type={config.model_type})")


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

PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized, MoE (with group limiting) and DSA (index_topk well under typical contexts) on.
    "tiny": _TINY,
    # The same architecture without the DSA indexer: the V3 form of the tiny model.
    "tiny-v3": {**_TINY, "model_type": "deepseek_v3", "index_n_heads": 0, "index_head_dim": 0, "index_topk": 0},
    # The shipped default model (examples/train_tiny.py, trained on the Python stdlib): deeper and
    # wider than `tiny`, so a target call costs several MTP calls and drafting pays off on a CPU.
    # Layer 0 is dense, the rest (and the MTP block) route each token to 1 of 4 experts plus a shared one.
    "tiny-stdlib": {**_TINY, "hidden_size": 96, "intermediate_size": 384, "moe_intermediate_size": 96,
                    "num_hidden_layers": 12, "first_k_dense_replace": 1, "q_lora_rank": 48, "kv_lora_rank": 48,
                    "qk_nope_head_dim": 24, "qk_rope_head_dim": 16, "v_head_dim": 24, "n_routed_experts": 4,
                    "n_group": 2, "topk_group": 1, "num_experts_per_tok": 1, "index_n_heads": 2,
                    "index_head_dim": 32, "index_topk": 64},
    # DeepSeek-V3 (671B) shapes, no weights.
    "deepseek-v3": _DEEPSEEK_V3,
    # DeepSeek-V3.2-Exp shapes, no weights.
    "deepseek-v3.2": {**_DEEPSEEK_V3, "model_type": "deepseek_v32", "index_n_heads": 64,
                      "index_head_dim": 128, "index_topk": 2048},
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
    "deepseek-v4-flash": {**_V4_COMMON, "hidden_size": 4096, "intermediate_size": 2048,
                          "moe_intermediate_size": 2048, "num_hidden_layers": 43, "num_attention_heads": 64,
                          "q_lora_rank": 1024, "o_groups": 8, "n_routed_experts": 256, "routed_scaling_factor": 1.5,
                          "index_topk": 512, "layer_types": (SLIDING,) * 2 + (CSA, HCA) * 20 + (CSA,),
                          "mlp_layer_types": ("hash_moe",) * 3 + ("moe",) * 40},
    # DeepSeek-V4-Pro shapes, no weights: huggingface.co/deepseek-ai/DeepSeek-V4-Pro config.json
    # (hidden 7168, 61 layers, 128 heads, q_lora_rank 1536, o_groups 16, 384 experts of 3072, top 6,
    # routed_scaling_factor 2.5, index_topk 1024, compress_ratios [128, 128] + [4, 128] * 29 + [4]
    # for the 61 layers and a final 0 for the MTP block, num_hash_layers 3).
    "deepseek-v4-pro": {**_V4_COMMON, "hidden_size": 7168, "intermediate_size": 3072,
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


MAX_DRAFT_TOKENS = 7


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """What the decoding loop needs beyond the model. Every field is static (part of the compiled
    computation); the sampling seed is not a field but an argument of `generate`.

    num_draft: k, draft tokens per speculative step when `tree` is None (0 = plain decoding, the
      baseline; 1..MAX_DRAFT_TOKENS chains the one MTP layer). With a tree it must be >= 1 and is
      otherwise unused: the tree decides the drafts.
    tree: None (a chain of num_draft), a `StaticTree`, a `DynamicTreeSpec` (EAGLE-2), or a string
      for either (`jaxspec.trees.parse_tree`: a name in STATIC_TREES, or "top_k,depth,budget");
      stored parsed.
    temperature: 0 = greedy (lossless against plain greedy decoding); > 0 samples, and lossless
      rejection sampling makes the output distributed as the target's processed distribution.
    top_k / top_p: sampling filters (0 / 1.0 = off); they need temperature > 0.
    relaxed: None, or (top_k, delta) for relaxed acceptance: a draft among the target's top_k and
      within delta of its top-1 probability is accepted. LOSSY: the output is no longer the
      target's greedy output. Needs temperature 0 and drafts.
    max_new_tokens: per-row budget of generated tokens (the first token after the prompt counts).
    eos_token_id: a row stops after emitting it; None = only the budget stops rows.
    page_size: cache slots per page.
    max_cache_len: slots per row; None sizes the cache to the prompts and the budget.
    backend: kernel implementation, "xla" (pure-jnp references), "pallas" (Triton kernels),
      "mosaic" (Mosaic GPU kernels where an op has one, its Triton kernel elsewhere), or "auto"
      (`jaxspec.pallas_kernels.backend`).
    window_invariant: compute every token of a verification window as if it were alone in a
      plain [B, 1] decode step (`jaxspec.models.layers.per_position`: the window's positions run
      one after another through the token-local ops, and attention reads each token's entries in
      plain decoding's order with the pure-jnp reference ops; on the "mosaic" backend without DSA,
      with the Mosaic GPU kernel, which is window-invariant by construction: docs/kernels.md). Then
      greedy speculative decoding emits exactly the tokens of plain greedy decoding with the same
      flag, batch and prompts, for every k and tree, in bfloat16 as in float32: guaranteed on
      XLA's CPU backend (tests/test_exactness.py). Without it the guarantee holds only up to
      rounding: a window computes its tokens with matmul and reduction algorithms chosen for
      k + 1 rows, so in bfloat16 a near-tie between two logits can resolve differently (measured:
      11 of 12 held-out rows identical at k = 1, 10 of 12 at k = 3). Off by default: it costs
      speed (`benchmarks/heldout.py --window-invariant`). On a GPU it was measured on an H100
      (every held-out row identical, both backends; README) and is not a test; it reads the
      weights once per window position, so it forfeits most of verification's saving there.
      DeepSeek-V4 trees run each node as a one-token chain call (`models/v4_attention.py`); V4's
      attention reduces over its whole ring, so a plain and a speculative run compare bit for
      bit when their rings have one size (the prompt at least as wide as the window).
      With `prefill_chunk` set it covers the target's prefill chunks too (the one-call prefill
      and the MTP's calls are not window-invariant): its caches and the first token are then the
      same, bit for bit, for every chunk size, on caches of one geometry (V4's attention reduces
      over its whole ring, which `generate` sizes by the widest call, so by the chunk).
    prefill_chunk: None (default) runs the whole padded prompt [B, P] through the target and the
      MTP module in one call each. C >= 1 runs it in ceil(P / C) calls of min(C, P) tokens inside
      one `jax.lax.fori_loop` (`jaxspec.loop.prefill`), so the prefill's activations and
      DeepSeek-V4's rings (`jaxspec.cache_v4`, sized by the widest call) follow C instead of P.
      Any C works: a chunk may end anywhere in a page or a compression block, as a verification
      window does (each call re-closes the blocks that ended before it from the projection
      rings). Greedy output equals the one-call prefill's up to rounding (token for token on the
      tests' models); the chunks use the cached ("absorbed") attention form.
    """

    num_draft: int = 3
    max_new_tokens: int = 64
    eos_token_id: int | None = None
    page_size: int = 64
    max_cache_len: int | None = None
    backend: str = "auto"
    tree: StaticTree | DynamicTreeSpec | str | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    relaxed: tuple[int, float] | None = None
    window_invariant: bool = False
    prefill_chunk: int | None = None

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
        if not isinstance(self.window_invariant, bool):
            raise ValueError(f"DecodeConfig.window_invariant={self.window_invariant!r}: must be True or False")
        if self.prefill_chunk is not None and (isinstance(self.prefill_chunk, bool)
                                               or not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1):
            raise ValueError(f"DecodeConfig.prefill_chunk={self.prefill_chunk!r}: must be None (one call) or an "
                             "integer >= 1 (tokens per prefill call)")
        self._check_tree()
        self._check_sampling()

    def _check_tree(self):
        if isinstance(self.tree, str):
            object.__setattr__(self, "tree", parse_tree(self.tree))
        if self.tree is None:
            return
        if not isinstance(self.tree, (StaticTree, DynamicTreeSpec)):
            raise ValueError(f"DecodeConfig.tree={self.tree!r}: must be None, a StaticTree, a DynamicTreeSpec "
                             "or a string for one")
        if self.num_draft == 0:
            raise ValueError("DecodeConfig.num_draft=0 means plain decoding, but a tree is given; "
                             "use num_draft >= 1 (the tree decides the drafts)")

    def _check_sampling(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"DecodeConfig.temperature={self.temperature}: must be a finite number >= 0")
        if self.top_k < 0:
            raise ValueError(f"DecodeConfig.top_k={self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"DecodeConfig.top_p={self.top_p}: must be in (0, 1] (1 = off)")
        for name, value, off in (("top_k", self.top_k, 0), ("top_p", self.top_p, 1.0)):
            if self.temperature == 0 and value != off:
                raise ValueError(f"DecodeConfig.{name}={value} filters sampling, but temperature=0 is greedy; "
                                 f"set temperature > 0 or leave {name} at {off}")
        if self.relaxed is None:
            return
        if len(self.relaxed) != 2:
            raise ValueError(f"DecodeConfig.relaxed={self.relaxed!r}: must be None or (top_k, delta)")
        top_k, delta = self.relaxed
        if int(top_k) != top_k or top_k < 1:
            raise ValueError(f"DecodeConfig.relaxed top_k={top_k}: must be an integer >= 1")
        if not 0 <= delta <= 1:
            raise ValueError(f"DecodeConfig.relaxed delta={delta}: must be in [0, 1] (a probability gap)")
        if self.temperature > 0:
            raise ValueError(f"DecodeConfig.relaxed={self.relaxed!r} is a lossy variant of greedy acceptance; "
                             f"it needs temperature=0, got {self.temperature}")
        if self.num_draft == 0:
            raise ValueError("DecodeConfig.relaxed needs drafts to accept; num_draft=0 is plain decoding")
        object.__setattr__(self, "relaxed", (int(top_k), float(delta)))  # hashable, whatever was passed

    @functools.cached_property
    def draft_tree(self) -> StaticTree | DynamicTreeSpec | None:
        """The tree drafted each step: `tree`, else the chain of num_draft drafts; None for plain decoding."""
        if self.tree is not None:
            return self.tree
        return chain_tree(self.num_draft) if self.num_draft else None

    @property
    def window_size(self) -> int:
        """N: tokens per verification window (the root plus the drafts)."""
        return 1 if self.draft_tree is None else self.draft_tree.num_nodes

    def prefill_width(self, prompt_width: int) -> int:
        """Tokens per prefill call for a [B, prompt_width] prompt: all of them, or the chunk (at most
        the prompt: a longer chunk would only add padding)."""
        return prompt_width if self.prefill_chunk is None else min(self.prefill_chunk, prompt_width)

    @property
    def max_depth(self) -> int:
        """D: the most drafts one step can accept (the depth of the tree)."""
        return 0 if self.draft_tree is None else self.draft_tree.max_depth

    def replace(self, **changes) -> "DecodeConfig":
        return dataclasses.replace(self, **changes)
