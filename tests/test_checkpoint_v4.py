"""DeepSeek-V4 checkpoints in DeepSeek's own layout: the names (against transformers 5.23's renames),
V4's FP8 (e8m0 scales) and MXFP4 experts (against an independent decoding of the formats); and in
the layout transformers' `save_pretrained` writes, decoded through the main job against transformers.
"""

from __future__ import annotations

import ast
import importlib.util

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxspec import fp8, shards
from jaxspec.checkpoint import load_hf_checkpoint, load_model
from jaxspec.checkpoint_v4 import to_transformers
from jaxspec.model_config import CSA, HCA, SLIDING
from jaxspec.orbax_io import abstract_model, save_model
from jaxspec.presets import preset
from layer_names import layer_rows, restacked, unstacked
from test_checkpoint import write_checkpoint


def _released_names(layer_kinds: list[tuple[str, bool]], num_experts: int, mtp: bool) -> list[str]:
    """Every tensor name of a V4 checkpoint in DeepSeek's layout, per (attention kind, hash routing)
    layer, as deepseek-ai/DeepSeek-V4-Pro's safetensors headers list them (FP8 Linear weights with
    a `.scale`; compressors, norms, router, sinks, hyper-connections without)."""
    names = ["embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"]

    def block(prefix: str, kind: str, hashed: bool) -> list[str]:
        out = [prefix + n for n in ("attn_norm.weight", "ffn_norm.weight", "attn.attn_sink", "attn.q_norm.weight",
                                    "attn.kv_norm.weight", "ffn.gate.weight")]
        out += [f"{prefix}hc_{k}_{p}" for k in ("attn", "ffn") for p in ("fn", "base", "scale")]
        out += [f"{prefix}attn.{w}.{leaf}" for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b") for leaf in ("weight", "scale")]
        out += [f"{prefix}ffn.shared_experts.{w}.{leaf}" for w in ("w1", "w2", "w3") for leaf in ("weight", "scale")]
        out += [f"{prefix}ffn.experts.{e}.{w}.{leaf}" for e in range(num_experts) for w in ("w1", "w2", "w3")
                for leaf in ("weight", "scale")]
        out.append(prefix + ("ffn.gate.tid2eid" if hashed else "ffn.gate.bias"))
        compressors = {"sliding": [], "hca": ["attn.compressor."], "csa": ["attn.compressor.", "attn.indexer.compressor."]}
        for c in compressors[kind]:
            out += [prefix + c + n for n in ("wkv.weight", "wgate.weight", "ape", "norm.weight")]
        if kind == "csa":
            out += [prefix + n for n in ("attn.indexer.wq_b.weight", "attn.indexer.wq_b.scale",
                                         "attn.indexer.weights_proj.weight")]
        return out

    for i, (kind, hashed) in enumerate(layer_kinds):
        names += block(f"layers.{i}.", kind, hashed)
    if mtp:
        names += block("mtp.0.", "sliding", False)
        names += ["mtp.0." + n for n in ("enorm.weight", "hnorm.weight", "norm.weight", "e_proj.weight", "e_proj.scale",
                                         "h_proj.weight", "h_proj.scale", "hc_head_fn", "hc_head_base", "hc_head_scale")]
    return names


@pytest.mark.hf
def test_names_are_transformers_renames():
    """`to_transformers` agrees with transformers' own rename chain on every non-MTP name (experts:
    transformers fuses them, w1 and w3 into gate_up_proj, w2 into down_proj), and the renamed set is
    exactly a transformers DeepseekV4 model's parameters: no name is lost or invented."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    kinds = [("sliding", True), ("csa", True), ("hca", False), ("csa", False)]
    names = _released_names(kinds, num_experts=2, mtp=True)
    transforms = get_checkpoint_conversion_mapping("deepseek_v4")
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    fused = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
    ours = set()
    for name in names:
        mine = to_transformers(name)
        assert mine is not None, name
        if name.startswith("mtp."):
            continue
        theirs, _ = rename_source_key(name, renamings, converters)
        theirs = theirs if theirs.startswith("lm_head") else "model." + theirs
        if ".experts." in name and ".shared_experts." not in name:
            expert_module = mine.removesuffix(".weight").removesuffix(".weight" + fp8.SCALE_SUFFIX)
            layer, proj = expert_module.split(".mlp.experts.")[0], expert_module.rsplit(".", 1)[1]
            if name.endswith(".weight"):
                assert theirs == f"{layer}.mlp.experts.{fused[proj]}", name
                ours.add(theirs)
            continue
        if name.endswith(".scale"):  # transformers keeps `.scale` beside the renamed module
            assert mine == theirs.removesuffix(".scale") + ".weight" + fp8.SCALE_SUFFIX, name
            continue
        assert mine == theirs, name
        ours.add(mine)

    config = DeepseekV4Config(
        vocab_size=32, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=len(kinds), num_attention_heads=2,
        head_dim=16, q_lora_rank=8, num_experts_per_tok=1, n_routed_experts=2, o_groups=2, o_lora_rank=8,
        layer_types=[{"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
                      "hca": "heavily_compressed_attention"}[k] for k, _ in kinds],
        mlp_layer_types=["hash_moe" if h else "moe" for _, h in kinds], hc_mult=2, index_n_heads=2,
        index_head_dim=8, index_topk=2, partial_rotary_factor=0.5, sliding_window=4)
    model = DeepseekV4ForCausalLM(config)
    # tid2eid and e_score_correction_bias are buffers there; rotary tables are derived.
    theirs = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers() if "rotary_emb" not in n}
    assert ours == theirs


def test_mtp_names_keep_their_own_tensors():
    """mtp.0.*: the block renamed like a layer's, the module's own tensors kept (transformers would
    turn `mtp.0.norm` into `mtp.0.kv_norm`; it drops mtp.* anyway)."""
    assert to_transformers("mtp.0.norm.weight") == "mtp.0.norm.weight"
    assert to_transformers("mtp.0.e_proj.scale") == "mtp.0.e_proj.weight" + fp8.SCALE_SUFFIX
    assert to_transformers("mtp.0.hc_head_fn") == "mtp.0.hc_head.hc_fn"
    assert to_transformers("mtp.0.attn.wkv.weight") == "mtp.0.self_attn.kv_proj.weight"
    assert to_transformers("mtp.0.ffn.experts.3.w2.scale") == "mtp.0.mlp.experts.3.down_proj.weight" + fp8.SCALE_SUFFIX
    for unknown in ("layers.0.attn.wq.weight", "model.layers.0.self_attn.q_a_proj.weight", "mtp.0.attn.norm.weight"):
        assert to_transformers(unknown) is None


def _e2m1(code: int) -> float:
    """An e2m1 code's value from its bits (sign, 2 exponent bits with bias 1, 1 mantissa bit)."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def test_fp4_experts_dequantize():
    """MXFP4: two e2m1 codes per byte, the low nibble first, times 2**(e8m0 byte - 127) per 32 inputs."""
    rng = np.random.default_rng(0)
    packed = rng.integers(-128, 128, size=(3, 40), dtype=np.int8)  # 80 inputs: 2.5 scale blocks
    exponents = rng.integers(120, 134, size=(3, 3), dtype=np.uint8)
    scale = exponents.view(ml_dtypes.float8_e8m0fnu)
    got = np.asarray(fp8.dequantize(packed, scale, fp8.DEFAULT_BLOCK))
    codes = packed.view(np.uint8)
    want = np.empty((3, 80), np.float32)
    for r in range(3):
        for c in range(80):
            byte = int(codes[r, c // 2])
            want[r, c] = _e2m1(byte & 15 if c % 2 == 0 else byte >> 4) * 2.0 ** (int(exponents[r, c // 32]) - 127)
    np.testing.assert_array_equal(got, want)
    assert fp8.logical_shape((3, 40), "I8") == (3, 80) and fp8.scale_shape((3, 40), fp8.DEFAULT_BLOCK, "I8") == (3, 3)
    with pytest.raises(ValueError, match=r"expected \[3, 3\]"):
        fp8.dequantize(packed, scale[:, :2], fp8.DEFAULT_BLOCK)


def test_fp8_with_e8m0_scales_dequantizes():
    """V4's FP8 weights: the same 128 x 128 blocks as V3, with power-of-two float8_e8m0fnu scales."""
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(130, 260)).astype(ml_dtypes.float8_e4m3fn)
    exponents = rng.integers(110, 140, size=(2, 3), dtype=np.uint8)
    got = np.asarray(fp8.dequantize(weight, exponents.view(ml_dtypes.float8_e8m0fnu), (128, 128)))
    block_scale = 2.0 ** (exponents.astype(np.float64) - 127)
    want = weight.astype(np.float64) * np.repeat(np.repeat(block_scale, 128, 0), 128, 1)[:130, :260]
    np.testing.assert_array_equal(got, want.astype(np.float32))


# -- a V4 checkpoint in DeepSeek's layout, written by hand from a jaxspec model ------------------------
# Our V4 tree mirrors transformers' modules; DeepSeek's names are restated here independently of
# jaxspec.checkpoint_v4 (its inverse, as the released headers spell them).

_ATTN = {"q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b", "kv_proj": "wkv", "kv_norm": "kv_norm",
         "o_a_proj": "wo_a", "o_b_proj": "wo_b"}
_COMPRESSOR = {"kv_proj.weight": "wkv.weight", "gate_proj.weight": "wgate.weight", "position_bias": "ape",
               "kv_norm.weight": "norm.weight"}
_FFN = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_BLOCK = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.sinks": "attn.attn_sink", "mlp.gate_weight": "ffn.gate.weight",
          "mlp.e_score_correction_bias": "ffn.gate.bias", "mlp.tid2eid": "ffn.gate.tid2eid",
          **{f"{k}_hc.{p}": f"hc_{k}_{p}" for k in ("attn", "ffn") for p in ("fn", "base", "scale")}}
_TOP = {"embed_tokens.embedding": "embed.weight", "lm_head.weight": "head.weight", "norm.weight": "norm.weight",
        "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
_FP8 = ("attn.wq_a.", "attn.wq_b.", "attn.wkv.", "attn.wo_a.", "attn.wo_b.", "attn.indexer.wq_b.",
        "ffn.shared_experts.", "mtp.0.e_proj.", "mtp.0.h_proj.")


def _block_name(path: str) -> str:
    """A decoder-block parameter (our path relative to the block, not a routed expert) -> DeepSeek's name."""
    if path in _BLOCK:
        return _BLOCK[path]
    if path.startswith("self_attn.compressor.indexer."):
        rest = path.removeprefix("self_attn.compressor.indexer.")
        if rest in _COMPRESSOR:
            return f"attn.indexer.compressor.{_COMPRESSOR[rest]}"
        return f"attn.indexer.{'wq_b' if rest.startswith('q_b_proj') else 'weights_proj'}.weight"
    if path.startswith("self_attn.compressor."):
        return f"attn.compressor.{_COMPRESSOR[path.removeprefix('self_attn.compressor.')]}"
    if path.startswith("self_attn."):
        module, leaf = path.removeprefix("self_attn.").split(".")
        return f"attn.{_ATTN[module]}.{leaf}"
    if path.startswith("mlp.shared_experts."):
        return f"ffn.shared_experts.{_FFN[path.split('.')[2]]}.weight"
    raise AssertionError(f"no DeepSeek name for block parameter {path}")


def _deepseek_name(path: str) -> tuple[str, bool]:
    """A parameter that is not a routed-expert stack -> (DeepSeek's name, stored transposed): every
    Linear weight is [out, in] there, [in, out] here; embedding, norms and raw parameters as they are."""
    if path in _TOP:
        name = _TOP[path]
    elif path.startswith("layers."):
        _, layer, rest = path.split(".", 2)
        name = f"layers.{layer}.{_block_name(rest)}"
    elif path.startswith("mtp.block."):
        name = "mtp.0." + _block_name(path.removeprefix("mtp.block."))
    elif path.startswith("mtp.hc_head."):
        name = "mtp.0.hc_head_" + path.rsplit("_", 1)[1]
    elif path.startswith("mtp."):
        name = "mtp.0." + path.removeprefix("mtp.")
    else:
        raise AssertionError(f"no DeepSeek name for {path}")
    linear = name.endswith(".weight") and path != "embed_tokens.embedding"
    return name, linear and "norm" not in name.rsplit(".", 2)[-2]


def _expert_names(path: str) -> str:
    """A routed-expert stack `[<prefix>]mlp.experts_<proj>` -> DeepSeek's per-expert name, `{}` for the expert."""
    prefix, proj = path.split("mlp.experts_")
    block = "mtp.0." if prefix == "mtp.block." else prefix
    return f"{block}ffn.experts.{{}}.{_FFN[proj]}.weight"


def deepseek_tensors(params: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """Our V4 parameters (dotted paths, the layers stacked) under DeepSeek's released names, unquantized."""
    out = {}
    for path, value in unstacked(params, config).items():
        if "mlp.experts_" in path:
            out.update({_expert_names(path).format(e): value[e].T for e in range(value.shape[0])})
        else:
            name, transposed = _deepseek_name(path)
            out[name] = value.T if transposed else value
    return out


def from_deepseek(params: dict[str, np.ndarray], tensors: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """`deepseek_tensors` inverted: each parameter of `params` (for its shape and dtype) from `tensors`."""
    out = {}
    for path, value in unstacked(params, config).items():
        if "mlp.experts_" in path:
            out[path] = np.stack([tensors[_expert_names(path).format(e)].T for e in range(value.shape[0])])
        else:
            name, transposed = _deepseek_name(path)
            out[path] = tensors[name].T if transposed else tensors[name]
        out[path] = out[path].astype(value.dtype)
    return restacked(params, out, config)


def quantize_as_released(tensors: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """DeepSeek's V4 formats, exactly representable: each FP8 weight becomes float8_e4m3fn with a
    power-of-two e8m0 scale per 128 x 128 block, each routed expert random MXFP4 codes with e8m0
    scales per 32 inputs. Returns the stored tensors; the float value each one stands for replaces
    its entry in `tensors` (so the model to compare with is built from the updated floats)."""
    stored = {}
    for name, value in list(tensors.items()):
        if name.endswith(".weight") and ".experts." in name and ".shared_experts." not in name:
            rows, cols = value.shape
            codes = rng.integers(0, 16, size=(rows, cols), dtype=np.uint8)
            exponents = rng.integers(121, 125, size=(rows, -(-cols // 32)), dtype=np.uint8)
            magnitude = np.array([_e2m1(c) for c in range(16)], np.float32)[codes]
            tensors[name] = magnitude * np.repeat(2.0 ** (exponents.astype(np.float32) - 127), 32, 1)[:, :cols]
            stored[name] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.int8)
            stored[name.removesuffix(".weight") + ".scale"] = exponents.view(ml_dtypes.float8_e8m0fnu)
        elif name.endswith(".weight") and any(part in name for part in _FP8):
            exponent = np.uint8(127 + int(np.floor(np.log2(np.abs(value).max() / 448))) + 1)
            weight = (value / 2.0 ** (int(exponent) - 127)).astype(ml_dtypes.float8_e4m3fn)
            tensors[name] = weight.astype(np.float32) * np.float32(2.0 ** (int(exponent) - 127))
            stored[name] = weight
            stored[name.removesuffix(".weight") + ".scale"] = np.full(
                (-(-value.shape[0] // 128), -(-value.shape[1] // 128)), exponent).view(ml_dtypes.float8_e8m0fnu)
        else:
            stored[name] = value
    return stored


def random_param(path: str, spec: jax.ShapeDtypeStruct, rng: np.random.Generator, num_experts: int,
                 stacked: bool) -> np.ndarray:
    """A random value for a parameter (`stacked`: one per row of its leading layers axis): distinct
    experts per token for a hash table, around 1 for a norm weight, fan-in scaled normal for
    matrices, small normal otherwise."""
    lead, shape = (spec.shape[:1], spec.shape[1:]) if stacked else ((), spec.shape)
    if path.endswith("tid2eid"):
        vocab, k = shape
        return np.argsort(rng.random((*lead, vocab, num_experts)), axis=-1)[..., :k].astype(spec.dtype)
    if len(shape) >= 2:
        return (rng.normal(size=spec.shape) * shape[-2] ** -0.5).astype(spec.dtype)
    center = 1.0 if "norm" in path else 0.0
    return (center + 0.1 * rng.normal(size=spec.shape)).astype(spec.dtype)


@pytest.fixture(scope="module")
def released_v4(tmp_path_factory):
    """A tiny V4 (every attention kind, hash and learned routing, MTP) written in DeepSeek's layout and
    formats (FP8 with e8m0 scales, MXFP4 experts), the in-memory model it stands for, and the
    checkpoint directory."""
    # tiny-v4's first three layers: sliding + hash, CSA + hash, HCA + learned (the fourth repeats CSA),
    # with the released checkpoints' power-of-two scales (their config.json's `scale_fmt`).
    config = preset("tiny-v4", num_hidden_layers=3, layer_types=("sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention"), mlp_layer_types=("hash_moe", "hash_moe", "moe"),
                    scale_fmt="ue8m0")
    graphdef, state, abstract = abstract_model(config, jnp.float32)  # no eager init: seconds, not tens
    rng = np.random.default_rng(0)
    params = {path: random_param(path, variable.get_value(), rng, config.n_routed_experts,
                                 stacked=bool(layer_rows(path, config)[0]))
              for path, variable in abstract.items()}
    floats = deepseek_tensors(params, config)
    stored = quantize_as_released(floats, rng)
    # The in-memory model holds the values the quantized tensors stand for.
    values = from_deepseek(params, floats, config)
    model = nnx.merge(graphdef, nnx.from_flat_state({p: v.replace(jnp.asarray(values[".".join(map(str, p))]))
                                                     for p, v in nnx.to_flat_state(state)}))
    directory = tmp_path_factory.mktemp("v4") / "released"
    hf_config = {**config.to_hf(), "expert_dtype": "fp4",
                 "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}}
    write_checkpoint(directory, hf_config, stored, shards=2)
    return model, stored, hf_config, directory


def _assert_same_model(got, want) -> None:
    """Same config and every parameter bit-equal (so the same logits: a function of both)."""
    assert got.config == want.config
    got_params = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(got, nnx.Param))}
    want_params = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(want, nnx.Param))}
    assert sorted(got_params) == sorted(want_params)
    for path, value in want_params.items():
        np.testing.assert_array_equal(np.asarray(got_params[path]), np.asarray(value), err_msg=path)


def test_released_layout_loads_every_parameter_and_converts(released_v4, tmp_path):
    """Every parameter arrives, bit-equal to the value its stored (FP8 / FP4 / bf16 / f32) tensor
    stands for, in a model of the same config: so the loaded model's target and MTP logits are the
    in-memory model's (not recompiled here: 22 s on 2 cores). Converted to orbax (`jaxspec convert`)
    it restores identical."""
    model, _, _, directory = released_v4
    lines = []
    loaded = load_hf_checkpoint(directory, dtype=jnp.float32, log=lines.append)
    assert "+ MTP" in lines[0]
    _assert_same_model(loaded, model)
    save_model(loaded, tmp_path / "orbax")
    _assert_same_model(load_model(tmp_path / "orbax", log=lambda line: None), model)



def test_what_does_not_fit_is_listed_by_deepseek_name(released_v4, tmp_path):
    """One ValueError before any tensor is read, naming DeepSeek's tensors: a missing one, an
    unknown one, a mis-shaped MXFP4 scale; an FP8-layout model refuses the MXFP4 experts."""
    _, stored, hf_config, _ = released_v4
    edited = dict(stored)
    del edited["layers.1.attn.compressor.ape"]
    edited["layers.0.attn.wq.weight"] = stored["layers.0.attn.wq_a.weight"]
    edited["layers.2.ffn.experts.3.w1.scale"] = stored["layers.2.ffn.experts.3.w1.scale"][:, :1]
    write_checkpoint(tmp_path / "edited", hf_config, edited, shards=2)
    with pytest.raises(ValueError) as error:
        load_hf_checkpoint(tmp_path / "edited", log=lambda line: None)
    message = str(error.value)
    assert ("missing: model.layers.1.self_attn.compressor.position_bias (row 0 of "
            "layer_groups.0.1.self_attn.compressor.position_bias)") in message
    assert "unexpected: layers.0.attn.wq.weight [32, 64] F8_E4M3 (not a DeepSeek-V4 tensor name)" in message
    assert ("mis-shaped: layers.2.ffn.experts.3.w1.scale (= model.layers.2.mlp.experts.3.gate_proj.weight_scale_inv)"
            " [32, 1]: expected [32, 2] for [32, 32] I8 in 1x32 blocks") in message
    with pytest.raises(ValueError, match=r"not FP8: layers.0.ffn.experts.0.w1.weight \(= .*\) \[32, 32\] I8: "
                                         r"MXFP4 \(int8\) has no lossless FP8 form"):
        load_hf_checkpoint(tmp_path / "edited", dtype=jnp.float8_e4m3fn, log=lambda line: None)


def test_fp8_experts_load_fp8_resident(released_v4, tmp_path):
    """DeepSeek-V4-Flash-Base's layout (FP8 experts, float32 scales; expert_dtype "fp8") fills an
    FP8-layout model: exactly DeepSeek's FP8 weights stay FP8, as stored, each scale beside it."""
    model, stored, hf_config, _ = released_v4
    params = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    base, scales = {}, {}
    for name, value in deepseek_tensors(params, model.config).items():
        if stored[name].dtype not in (np.int8, ml_dtypes.float8_e4m3fn):
            base[name] = stored[name]
            continue
        scale = np.float32(2.0 ** np.ceil(np.log2(np.abs(value).max() / 448)))
        base[name] = (value / scale).astype(ml_dtypes.float8_e4m3fn)
        scales[name] = np.full((-(-value.shape[0] // 128), -(-value.shape[1] // 128)), scale, np.float32)
        base[name.removesuffix(".weight") + ".scale"] = scales[name]
    write_checkpoint(tmp_path / "base", {**hf_config, "expert_dtype": "fp8"}, base, shards=2)
    loaded = load_hf_checkpoint(tmp_path / "base", dtype=jnp.float8_e4m3fn, log=lambda line: None)
    got = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(loaded, nnx.Param))}
    kept = {path: value for path, value in got.items() if value.dtype == ml_dtypes.float8_e4m3fn}
    # DeepSeek's FP8 list, no more:
    assert set(deepseek_tensors({p: params[p] for p in kept}, model.config)) == set(scales)
    for path, value in from_deepseek(kept, base, model.config).items():
        np.testing.assert_array_equal(got[path].view(np.uint8), value.view(np.uint8), err_msg=path)
    scale_params = {path: got[path + fp8.SCALE_SUFFIX] for path in kept}
    for path, value in from_deepseek(scale_params, scales, model.config).items():
        np.testing.assert_array_equal(got[path + fp8.SCALE_SUFFIX], value, err_msg=path)


@pytest.mark.hf
def test_transformers_saved_v4_decodes_like_transformers(tmp_path, capsys, monkeypatch):
    """A tiny DeepseekV4ForCausalLM (sliding, CSA and HCA layers, hash-routed then learned MoE, 4 mHC
    streams) on random weights, saved by transformers' `save_pretrained`, runs through the main job's
    `--checkpoint` and decodes greedily token for token as transformers' `generate` does (its CSA
    top-k with ties broken by index, as jax.lax.top_k breaks them: `test_v4_model._stable_topk`)."""
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV4ForCausalLM

    from test_checkpoint import EXAMPLES
    from test_v4_model import _stable_topk, hf_config, randomize

    config = preset("tiny-v4", eos_token_id=None)  # no EOS: both decode the whole budget
    assert set(config.layer_types) == {SLIDING, CSA, HCA} and set(config.mlp_layer_types) == {"hash_moe", "moe"}
    assert config.hc_mult > 1
    torch.manual_seed(0)
    hf_model = DeepseekV4ForCausalLM(hf_config(config)).eval()
    randomize(hf_model, 11, (config.vocab_size, config.n_routed_experts))
    hf_model.save_pretrained(tmp_path)
    assert any(".attn.wq_a." in name for name in shards.read_headers(tmp_path))  # transformers' saved layout

    prompt_len, new_tokens = 23, 9  # past the 8-token sliding window and several CSA / HCA blocks
    prompts = torch.randint(0, config.vocab_size, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(torch.Tensor, "topk", _stable_topk)
    with torch.no_grad():
        want = hf_model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[:, prompt_len:].tolist()

    spec = importlib.util.spec_from_file_location("generate_example", EXAMPLES / "generate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()
    ids = [",".join(map(str, row)) for row in prompts.tolist()]
    script.main(["--checkpoint", str(tmp_path), "--prompt-ids", ids[0], "--prompt-ids", ids[1], "--mtp", "0",
                 "--max-new-tokens", str(new_tokens), "--backend", "xla"])
    out = capsys.readouterr()
    assert "no MTP layer" in out.err  # transformers' V4 has no MTP module to save
    rows = [line.split(" -> ")[1] for line in out.out.splitlines() if line.startswith("[")]
    assert [ast.literal_eval(row) for row in rows] == want
