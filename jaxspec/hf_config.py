"""Hugging Face `config.json` <-> `ModelConfig`, for DeepSeek-V3 / V3.2 and V4.

Fields that only matter to training or to other frameworks are accepted and ignored
(`_IGNORED_HF_FIELDS`); anything else is an error, so a typo or a model family we do not implement
never loads silently.

Fields that are known but must hold one value (`_REQUIRED_HF_VALUES`: no attention bias, SiLU,
sigmoid routing, interleaved RoPE, ...) are checked: a config describing a variant this code does
not implement is an error, not a different model run silently.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from jaxspec.model_fields import CSA, HCA, MODEL_TYPES, SLIDING, V4_FIELDS, RopeScaling

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

# Fields every config.json of a model states: without them transformers would build DeepSeek-V3's
# full size (its defaults), which for a config meant to describe another model is a silent error.
_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")

# rope_scaling / rope_parameters keys that are read elsewhere or are the defaults this code implements.
_ROPE_KEYS_HANDLED = frozenset({"type", "rope_type", "rope_theta"})
_ROPE_REQUIRED_VALUES = {"truncate": (True,), "partial_rotary_factor": (1, 1.0)}


def config_from_hf(config_class: type, source: str | os.PathLike | Mapping[str, Any], *, strict: bool = True):
    """Build a `config_class` (`jaxspec.model_config.ModelConfig`, which passes itself: this module
    does not import it, so the two modules form no import cycle) from a Hugging Face `config.json` (a path, a directory holding one, or its
    dict); `ModelConfig.from_hf` documents the forms read and `strict`."""
    if isinstance(source, Mapping):
        raw = dict(source)
    else:
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"config.json: {path} does not exist")
        with open(path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as error:
                raise ValueError(f"config.json: {path} is not valid JSON ({error})") from None
        if not isinstance(raw, Mapping):
            raise ValueError(f"config.json: {path} holds a JSON {type(raw).__name__}, not an object of fields")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json model_type={model_type!r}: must be one of {MODEL_TYPES}")
    missing = [key for key in _SIZE_FIELDS if key not in raw]
    if missing:
        raise ValueError(f"config.json has no {missing}: they size the model, and this code does not guess them "
                         "(transformers would take its defaults: DeepSeek's full size)")
    if model_type == "deepseek_v4":
        return config_class(**_v4_kwargs_from_hf(raw, strict))

    fields = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(k for k in raw if k not in fields and k not in _IGNORED_HF_FIELDS)
    if unknown and strict:
        raise ValueError(f"config.json has unknown fields {unknown}; pass strict=False to ignore them")

    for key, allowed in _REQUIRED_HF_VALUES.items():
        if key in raw and raw[key] not in allowed:
            raise ValueError(f"config.json {key}={raw[key]!r}: only {allowed[0]!r} is implemented")

    kwargs = {k: v for k, v in raw.items()
              if k in fields and k not in ("rope_scaling", "eos_token_id", *V4_FIELDS)}
    kwargs["model_type"] = model_type
    kwargs["scale_fmt"] = _scale_fmt(raw)
    eos = raw.get("eos_token_id")
    kwargs["eos_token_id"] = (eos[0] if eos else None) if isinstance(eos, list) else eos  # [] names none
    if "first_k_dense_replace" in raw and "num_hidden_layers" in raw:
        # transformers clamps it (a 2-layer test model keeps DeepSeek's default of 3); the MTP
        # block, at index num_hidden_layers, then stays MoE as it always is in transformers.
        kwargs["first_k_dense_replace"] = min(raw["first_k_dense_replace"], raw["num_hidden_layers"])

    rope = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if rope is not None and not isinstance(rope, Mapping):
        raise ValueError(f"config.json rope_parameters={rope!r}: must be an object of fields or null")
    if rope is not None:  # transformers 5: theta and scaling live together
        kwargs["rope_theta"] = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = rope
    kwargs["rope_scaling"] = _parse_rope_scaling(scaling, raw.get("max_position_embeddings"))
    if "index_topk" in raw and model_type == "deepseek_v3":
        raise ValueError("config.json index_topk is set but model_type is deepseek_v3 (expected deepseek_v32)")
    config = config_class(**kwargs)
    _check_derived_fields(raw, config)
    return config


def _scale_fmt(raw: Mapping[str, Any]) -> str | None:
    """The FP8 scale format of a config.json: DeepSeek's keep it with the weights' FP8 format
    (`quantization_config.scale_fmt`); `config_to_hf` writes it at the top level, so that a config
    without FP8 weights does not look quantized to transformers."""
    if "scale_fmt" in raw:
        return raw["scale_fmt"]
    return (raw.get("quantization_config") or {}).get("scale_fmt")


def config_to_hf(config) -> dict[str, Any]:
    """The `config.json` dict `config` was (or could have been) read from (for V4, in the
    form transformers 5.23 writes: `layer_types`, nested `rope_parameters`, ...)."""
    if config.is_v4:
        return _v4_to_hf(config)
    out = dataclasses.asdict(config)
    for field in V4_FIELDS:
        out.pop(field)
    out.pop("scoring_func")
    if config.scale_fmt is None:
        out.pop("scale_fmt")
    if config.rope_scaling is not None:
        out["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(config.rope_scaling)}
    if not config.is_v32:
        for field in ("index_n_heads", "index_head_dim", "index_topk"):
            out.pop(field)
    return out


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
    "expert_dtype", "scale_fmt",
})
_V4_HF_FIELDS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "norm_topk_prob",
                 "routed_scaling_factor", "max_position_embeddings", "rope_theta", "num_nextn_predict_layers",
                 "rms_norm_eps", "index_n_heads", "index_head_dim", "index_topk", "scoring_func",
                 "qk_rope_head_dim", *V4_FIELDS)
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
    kw = {**_V4_HF_DEFAULTS, **{k: v for k, v in raw.items() if k in _V4_HF_FIELDS}, "scale_fmt": _scale_fmt(raw)}
    n = kw["num_hidden_layers"]
    eos = raw.get("eos_token_id", _V4_HF_DEFAULTS["eos_token_id"])
    kw["eos_token_id"] = (eos[0] if eos else None) if isinstance(eos, list) else eos  # [] names none

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


def _v4_to_hf(config) -> dict[str, Any]:
    """A V4 ModelConfig -> the config.json transformers 5.23 writes for it (loads in `DeepseekV4Config`)."""
    out = {name: getattr(config, name) for name in _V4_HF_FIELDS if name not in ("qk_rope_head_dim", "rope_theta")}
    factor = config.qk_rope_head_dim / config.head_dim
    compress = {"rope_type": "default"}
    if config.rope_scaling is not None:
        rs = config.rope_scaling
        compress = {"rope_type": "yarn", "factor": rs.factor, "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow,
                    "original_max_position_embeddings": rs.original_max_position_embeddings, "attention_factor": 1.0}
    if config.scale_fmt is not None:
        out["scale_fmt"] = config.scale_fmt
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
    if not isinstance(scaling, Mapping):
        raise ValueError(f"config.json rope_scaling / rope_parameters={scaling!r}: must be an object of fields or null")
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


def _check_derived_fields(raw: Mapping[str, Any], config) -> None:
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

