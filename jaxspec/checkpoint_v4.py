"""DeepSeek-V4 checkpoint names: DeepSeek's (as released) or transformers' `save_pretrained`'s ->
transformers 5.23's module names -> our parameter paths.

DeepSeek releases V4 (deepseek-ai/DeepSeek-V4-Flash, -Pro) under the module names of its own
inference code (`inference/model.py`): `embed`, `head`, `layers.{i}.attn.wq_a`, `layers.{i}.ffn.experts.{e}.w1`,
`mtp.{i}.e_proj`, ... transformers 5.23 renames them on load (`transformers/conversion_mapping.py`,
key "deepseek_v4") to its module tree, which our V4 parameter tree mirrors (`jaxspec.models`
`DeepseekV4`). `to_transformers` is that rename, written as explicit tables rather than
transformers' ordered regex chain; `tests/test_checkpoint_v4.py` checks it against
`transformers.core_model_loading.rename_source_key` name by name. Two deliberate differences:

  * routed experts keep one name per expert in the V3 release form
    (`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`: w1 = gate, w3 = up, w2 = down);
    transformers fuses them into `mlp.experts.gate_up_proj` / `down_proj` while loading;
  * `mtp.{i}.*` (which transformers drops: `_keys_to_ignore_on_load_unexpected`) is renamed like a
    decoder layer under `mtp.{i}.`, its own tensors (`enorm`, `hnorm`, `e_proj`, `h_proj`, `norm`,
    `hc_head_*`) kept; transformers' chain would turn `mtp.0.norm` into `mtp.0.kv_norm`.

Scales: DeepSeek names a weight's scale `<module>.scale` (`float8_e8m0fnu` for V4-Flash / -Pro);
it is renamed `<module>.weight_scale_inv`, the V3 form `jaxspec.fp8` reads, so the rest of the
loader is the V3 one. The renamed tensors keep their original names for error messages
(`renamed_headers`).

Layout of the name (D = DeepSeek, T = transformers), block part (`layers.{i}.` or `mtp.{i}.`):

    attn_norm / ffn_norm                 -> input_layernorm / post_attention_layernorm
    hc_attn_{fn,base,scale} / hc_ffn_*   -> attn_hc.{fn,base,scale} / ffn_hc.*
    attn.attn_sink                       -> self_attn.sinks
    attn.{wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b}
                                         -> self_attn.{q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_a_proj, o_b_proj}
    attn.compressor.{wkv, wgate, ape, norm}
                                         -> self_attn.compressor.{kv_proj, gate_proj, position_bias, kv_norm}
    attn.indexer.{wq_b, weights_proj}    -> self_attn.compressor.indexer.{q_b_proj, scorer.weights_proj}
    attn.indexer.compressor.{...}        -> self_attn.compressor.indexer.{kv_proj, gate_proj, position_bias, kv_norm}
    ffn.gate.{weight, bias, tid2eid}     -> mlp.gate.{weight, e_score_correction_bias, tid2eid}
    ffn.shared_experts.{w1, w2, w3}      -> mlp.shared_experts.{gate_proj, down_proj, up_proj}
    ffn.experts.{e}.{w1, w2, w3}         -> mlp.experts.{e}.{gate_proj, down_proj, up_proj}

and top level: `embed` -> `model.embed_tokens`, `head` -> `lm_head`, `norm` -> `model.norm`,
`hc_head_{fn,base,scale}` -> `model.hc_head.hc_{fn,base,scale}`, `layers.` -> `model.layers.`.

transformers' `save_pretrained` writes a third form, which loads too: it runs its load renames
backwards, so the blocks carry DeepSeek's module names under `model.layers.{i}.`, the head is
`head.weight`, and the other top-level tensors keep transformers' names (`model.embed_tokens.weight`,
`model.norm.weight`, `model.hc_head.*`). One rename does not invert: the attention's `kv_norm`
comes back as `attn.norm` (the compressors' `norm` -> `kv_norm`, reversed), renamed here to
`self_attn.kv_norm`. transformers has no V4 MTP module, so such a checkpoint has no `mtp.*`.
"""

from __future__ import annotations

import re
from typing import Mapping

from jaxspec import fp8, shards

DEEPSEEK_SCALE = ".scale"

_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
        "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
# A module of a block (before its leaf: `.weight`, `.scale`, or nothing for raw parameters).
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          **{f"hc_{kind}_{part}": f"{kind}_hc.{part}" for kind in ("attn", "ffn") for part in ("fn", "base", "scale")},
          "attn.attn_sink": "self_attn.sinks", "attn.wq_a": "self_attn.q_a_proj", "attn.q_norm": "self_attn.q_a_norm",
          "attn.wq_b": "self_attn.q_b_proj", "attn.wkv": "self_attn.kv_proj", "attn.kv_norm": "self_attn.kv_norm",
          "attn.wo_a": "self_attn.o_a_proj", "attn.wo_b": "self_attn.o_b_proj",
          "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
          "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj",
          "ffn.gate": "mlp.gate", "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
          "ffn.gate.tid2eid": "mlp.gate.tid2eid"}
_COMPRESSORS = {"attn.compressor.": "self_attn.compressor.", "attn.indexer.compressor.": "self_attn.compressor.indexer."}
_COMPRESSOR = {"wkv": "kv_proj", "wgate": "gate_proj", "ape": "position_bias", "norm": "kv_norm"}
_FFN = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_SHARED_EXPERT = re.compile(r"ffn\.shared_experts\.(w[123])")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])")
# The MTP module's own tensors (everything else under mtp.{i}. is its decoder block).
_MTP_OWN = {"enorm": "enorm", "hnorm": "hnorm", "e_proj": "e_proj", "h_proj": "h_proj", "norm": "norm",
            "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
# Block modules only transformers' `save_pretrained` writes (module docstring), under its layer prefix.
_SAVED_BLOCK = {"attn.norm": "self_attn.kv_norm"}
_LAYERS = "model.layers"
_LAYER = re.compile(r"(model\.layers|layers|mtp)\.(\d+)\.(.+)")
_LEAVES = (".weight", DEEPSEEK_SCALE)


def _block_module(module: str) -> str | None:
    """A block's module name (leaf removed), DeepSeek's -> transformers'; None if unknown."""
    if module in _BLOCK:
        return _BLOCK[module]
    for prefix, renamed in _COMPRESSORS.items():
        if module.startswith(prefix) and module[len(prefix):] in _COMPRESSOR:
            return renamed + _COMPRESSOR[module[len(prefix):]]
    if match := _SHARED_EXPERT.fullmatch(module):
        return f"mlp.shared_experts.{_FFN[match[1]]}"
    if match := _EXPERT.fullmatch(module):
        return f"mlp.experts.{match[1]}.{_FFN[match[2]]}"
    return None


def _split_leaf(name: str) -> tuple[str, str]:
    """`a.b.weight` -> (`a.b`, `.weight`); a raw parameter (`ape`, `attn_sink`, `hc_attn_fn`) -> (name, "")."""
    for leaf in _LEAVES:
        if name.endswith(leaf):
            return name[: -len(leaf)], leaf
    return name, ""


def to_transformers(name: str) -> str | None:
    """DeepSeek's tensor name, or the one transformers' `save_pretrained` writes, -> transformers
    5.23's (per-expert, `mtp.{i}.` kept; module docstring).

    A scale (`<module>.scale`) maps to `<transformers module>.weight_scale_inv`. None for a name
    neither layout has.
    """
    if name in _TOP:
        return _TOP[name]
    if name in _TOP.values():  # save_pretrained's top-level names are transformers' own
        return name
    match = _LAYER.fullmatch(name)
    if match is None:
        return None
    scope, index, rest = match[1], match[2], match[3]
    module, leaf = _split_leaf(rest)
    if scope == "mtp" and module in _MTP_OWN:
        renamed = _MTP_OWN[module]
    elif scope == _LAYERS and module in _SAVED_BLOCK:
        renamed = _SAVED_BLOCK[module]
    else:
        renamed = _block_module(module)
    if renamed is None:
        return None
    if leaf == DEEPSEEK_SCALE:
        leaf = ".weight" + fp8.SCALE_SUFFIX
    return f"{'mtp' if scope == 'mtp' else _LAYERS}.{index}.{renamed}{leaf}"


def renamed_headers(tensors: Mapping[str, shards.TensorInfo]
                    ) -> tuple[dict[str, shards.TensorInfo], dict[str, str], list[str]]:
    """A V4 checkpoint's headers (DeepSeek's or `save_pretrained`'s names) under transformers' names
    -> (renamed tensors, transformers name -> stored name, stored names with no V4 meaning)."""
    renamed, origin, unknown = {}, {}, []
    for name, info in tensors.items():
        new = to_transformers(name)
        if new is None:
            unknown.append(name)
            continue
        renamed[new], origin[new] = info, name
    return renamed, origin, unknown
