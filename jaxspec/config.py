"""Model and decoding configuration.

`ModelConfig` mirrors a Hugging Face DeepSeek-V3 / V3.2 `config.json`: the field names are the ones
found there, so a checkpoint's config loads with `ModelConfig.from_hf(path_or_dict)`. Fields that
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
    # Written by transformers 5 and checked below or by `from_hf` (derived or fixed for DeepSeek).
    "qk_head_dim", "layer_types", "mlp_layer_types", "mlp_bias",
})

# Known fields that must hold these values: anything else is a model variant not implemented here.
_REQUIRED_HF_VALUES = {
    "attention_bias": (False,), "mlp_bias": (False,), "hidden_act": ("silu",), "scoring_func": ("sigmoid",),
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
    """Shapes and hyper-parameters of a DeepSeek-V3 (`deepseek_v3`) or V3.2 (`deepseek_v32`) model.

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
      index_n_heads, index_head_dim, index_topk   the V3.2 lightning indexer (0 for V3)
      eos_token_id               the token that ends a row (None: rows end at the budget)

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

        for key, allowed in _REQUIRED_HF_VALUES.items():
            if key in raw and raw[key] not in allowed:
                raise ValueError(f"config.json {key}={raw[key]!r}: only {allowed[0]!r} is implemented")

        kwargs = {k: v for k, v in raw.items() if k in fields and k not in ("rope_scaling", "eos_token_id")}
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
}


def preset(name: str, **overrides) -> ModelConfig:
    """The `ModelConfig` of a named preset, with `overrides` (ModelConfig field=value) applied.

    name: one of `PRESETS` (`tiny`, `tiny-v3`, `tiny-stdlib`, `deepseek-v3`, `deepseek-v3.2`).
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
    backend: kernel implementation, "xla" (pure-jnp references), "pallas", or "auto".
    window_invariant: compute every token of a verification window as if it were alone in a
      plain [B, 1] decode step (`jaxspec.models.layers.per_position`: the window's positions run
      one after another through the token-local ops, and attention reads each token's entries in
      plain decoding's order with the pure-jnp reference ops, whatever `backend` says). Then
      greedy speculative decoding emits exactly the tokens of plain greedy decoding with the same
      flag, batch and prompts, for every k and tree, in bfloat16 as in float32: guaranteed on
      XLA's CPU backend (tests/test_exactness.py). Without it the guarantee holds only up to
      rounding: a window computes its tokens with matmul and reduction algorithms chosen for
      k + 1 rows, so in bfloat16 a near-tie between two logits can resolve differently (measured:
      11 of 12 held-out rows identical at k = 1, 10 of 12 at k = 3). Off by default: it costs
      speed (`benchmarks/heldout.py --window-invariant`). On a GPU it is untested; it reads the
      weights once per window position, so it forfeits most of verification's saving there.
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

    @property
    def max_depth(self) -> int:
        """D: the most drafts one step can accept (the depth of the tree)."""
        return 0 if self.draft_tree is None else self.draft_tree.max_depth

    def replace(self, **changes) -> "DecodeConfig":
        return dataclasses.replace(self, **changes)
