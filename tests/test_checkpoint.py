"""Hugging Face checkpoint directories: config forms, the key layout (per-expert and fused, sharded,
with and without MTP), FP8 block dequantization, clear errors, orbax conversion, the tokenizer.

Checkpoints here are written by hand from a jaxspec model (no torch needed); the key layout below is
a second, independent statement of DeepSeek's. `test_hf_parity.py` checks against transformers.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxspec import cli, fp8
from jaxspec.checkpoint import load_hf_checkpoint, load_model
from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import generate
from jaxspec.model_config import ModelConfig
from jaxspec.models import DeepseekV3
from jaxspec.orbax_io import restore_model
from jaxspec.presets import preset
from jaxspec.shards import INDEX_FILE, write
from jaxspec.tokenizer import ByteTokenizer, load_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


# -- writing checkpoints by hand ------------------------------------------------------------------

def _block_names(prefix: str, name: str, value: np.ndarray, fused: bool) -> dict[str, np.ndarray]:
    """One decoder-block parameter in DeepSeek's layout ([out, in] weights, per-expert or fused)."""
    if name == "mlp.gate_weight":
        return {f"{prefix}mlp.gate.weight": value.T}
    if name == "mlp.e_score_correction_bias":
        return {f"{prefix}mlp.gate.e_score_correction_bias": value}
    if name.startswith("mlp.experts_"):
        proj = name.removeprefix("mlp.experts_")
        if proj.endswith(fp8.SCALE_SUFFIX):  # an FP8 model's expert scales: per expert, as DeepSeek ships them
            proj = proj.removesuffix(fp8.SCALE_SUFFIX)
            return {f"{prefix}mlp.experts.{e}.{proj}.weight{fp8.SCALE_SUFFIX}": value[e].T for e in range(value.shape[0])}
        if fused:  # transformers' in-memory layout: gate_up [E, 2I, D], down [E, D, I]
            return {f"{prefix}mlp.experts.{proj}": value.transpose(0, 2, 1)}
        return {f"{prefix}mlp.experts.{e}.{proj}.weight": value[e].T for e in range(value.shape[0])}
    return {prefix + name: value.T if value.ndim == 2 else value}


def hf_tensors(model: DeepseekV3, *, fused: bool = False) -> dict[str, np.ndarray]:
    """The model's parameters under DeepSeek's checkpoint names (MTP at model.layers.{N}); an FP8
    model's weights stay FP8 beside their `_scale_inv`."""
    mtp = f"model.layers.{model.config.num_hidden_layers}."
    out = {}
    for layer in range(model.config.num_hidden_layers):  # each layer on its own: its rows of the stacks
        for name, value in params_of(model.layer(layer)).items():
            out.update(_block_names(f"model.layers.{layer}.", name, value, fused))
    stacks = tuple(f"{run.name}." for run in model.layer_runs)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, value = ".".join(map(str, path)), np.asarray(variable.get_value())
        if name.startswith(stacks):
            continue
        if name == "embed_tokens.embedding":
            out["model.embed_tokens.weight"] = value
            if model.mtp is not None:
                out[mtp + "embed_tokens.weight"] = value
        elif name == "lm_head.weight":
            out["lm_head.weight"] = value.T
            if model.mtp is not None:
                out[mtp + "shared_head.head.weight"] = value.T
        elif name == "norm.weight":
            out["model.norm.weight"] = value
        elif name.startswith("mtp.block."):
            out.update(_block_names(mtp, name.removeprefix("mtp.block."), value, fused))
        else:
            own = name.removeprefix("mtp.").replace("shared_head_norm", "shared_head.norm")
            out[mtp + own] = value.T if value.ndim == 2 else value
    if fused:
        for key in [k for k in out if k.endswith("mlp.experts.gate_proj")]:
            stem = key.removesuffix("gate_proj")
            out[stem + "gate_up_proj"] = np.concatenate([out.pop(key), out.pop(stem + "up_proj")], axis=1)
    return out


def write_checkpoint(directory, config: dict, tensors: dict[str, np.ndarray], shards: int = 1) -> None:
    """config.json plus `shards` safetensors files (an index when more than one)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        write(directory / "model.safetensors", tensors)
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        write(directory / file, {n: tensors[n] for n in part})
        weight_map.update(dict.fromkeys(part, file))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def released_config(config: ModelConfig) -> dict:
    """config.json as DeepSeek releases it (rope_scaling + rope_theta, their extra fields)."""
    raw = config.to_hf()
    raw.update(architectures=["DeepseekV3ForCausalLM"], attention_bias=False, hidden_act="silu",
               scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, ep_size=1, aux_loss_alpha=0.001,
               seq_aux=True, torch_dtype="bfloat16", num_key_value_heads=config.num_attention_heads,
               tie_word_embeddings=False, bos_token_id=0, transformers_version="4.33.1")
    return raw


def params_of(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same_params(a, b):
    pa, pb = params_of(a), params_of(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        np.testing.assert_array_equal(pa[name], pb[name], err_msg=name)


@pytest.fixture(scope="module")
def model() -> DeepseekV3:
    return DeepseekV3(preset("tiny"), rngs=nnx.Rngs(5))


def quiet(_line: str) -> None:
    pass


# -- config.json forms ----------------------------------------------------------------------------

# What transformers 5.23 `DeepseekV32Config(...).save_pretrained` writes for the `tiny` preset's shapes.
TRANSFORMERS_5_TINY = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 257,
    "first_k_dense_replace": 1, "head_dim": 8, "hidden_act": "silu", "hidden_size": 64, "index_head_dim": 16,
    "index_n_heads": 2, "index_topk": 16, "initializer_range": 0.02, "intermediate_size": 128, "kv_lora_rank": 32,
    "layer_types": ["indexed_attention", "indexed_attention"], "max_position_embeddings": 1024, "mlp_bias": False,
    "mlp_layer_types": ["dense", "sparse"], "model_type": "deepseek_v32", "moe_intermediate_size": 32,
    "n_group": 4, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4,
    "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 4, "output_router_logits": False,
    "pad_token_id": None, "q_lora_rank": 32, "qk_head_dim": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "original_max_position_embeddings": 256, "rope_theta": 10000.0, "rope_type": "yarn",
                        "type": "yarn"},
    "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 2, "transformers_version": "5.23.0",
    "use_cache": True, "v_head_dim": 16, "vocab_size": 258,
}


def test_config_forms_released_and_transformers_5_agree():
    tiny = preset("tiny")
    assert ModelConfig.from_hf(released_config(tiny)) == tiny
    # transformers' V3.2 config has no MTP field: the default (1) stands, the loader decides from the weights.
    assert ModelConfig.from_hf(TRANSFORMERS_5_TINY) == tiny


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias=True: only False"),
    ({"rope_interleave": False}, "rope_interleave=False"),
    ({"mlp_layer_types": ["sparse", "sparse"]}, "mlp_layer_types"),
    ({"qk_head_dim": 32}, "qk_head_dim=32"),
    ({"rope_parameters": {**TRANSFORMERS_5_TINY["rope_parameters"], "attention_factor": 2.0}}, "attention_factor"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "only 'yarn'"),
])
def test_config_variants_not_implemented_raise(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**TRANSFORMERS_5_TINY, **change})


def test_config_clamps_dense_prefix_like_transformers():
    raw = {**TRANSFORMERS_5_TINY, "first_k_dense_replace": 3, "mlp_layer_types": ["dense", "dense"]}
    config = ModelConfig.from_hf(raw)
    assert config.first_k_dense_replace == 2 and config.is_moe_layer(2)  # the MTP block stays MoE


# -- loading --------------------------------------------------------------------------------------

def test_round_trip_single_file_identical(model, tmp_path):
    write_checkpoint(tmp_path / "hf", released_config(model.config), hf_tensors(model))
    lines = []
    loaded = load_hf_checkpoint(tmp_path / "hf", log=lines.append)
    assert loaded.config == model.config
    assert_same_params(loaded, model)
    assert any(line.startswith("[1/1] model.safetensors:") for line in lines), lines
    config = DecodeConfig(num_draft=2, max_new_tokens=10, backend="xla")
    prompts = [[256, 5, 6, 7, 8], [256, 9]]
    np.testing.assert_array_equal(np.asarray(generate(loaded, prompts, config).tokens),
                                  np.asarray(generate(model, prompts, config).tokens))


def test_sharded_fused_experts_and_progress(model, tmp_path):
    write_checkpoint(tmp_path / "hf", TRANSFORMERS_5_TINY, hf_tensors(model, fused=True), shards=3)
    lines = []
    assert_same_params(load_hf_checkpoint(tmp_path / "hf", log=lines.append), model)
    shard_lines = [line for line in lines if line.startswith("[")]
    assert [line.split()[0] for line in shard_lines] == ["[1/3]", "[2/3]", "[3/3]"]
    assert all("tensors" in line and "GiB" in line for line in shard_lines)


def test_no_mtp_layer_loads_with_mtp_off(model, tmp_path):
    mtp = f"model.layers.{model.config.num_hidden_layers}."
    tensors = {k: v for k, v in hf_tensors(model).items() if not k.startswith(mtp)}
    write_checkpoint(tmp_path / "hf", released_config(model.config), tensors)
    lines = []
    loaded = load_hf_checkpoint(tmp_path / "hf", log=lines.append)
    assert loaded.mtp is None and loaded.config.num_nextn_predict_layers == 0
    assert any("no MTP layer" in line and "MTP off" in line for line in lines)
    np.testing.assert_array_equal(np.asarray(loaded.lm_head.weight[...]), np.asarray(model.lm_head.weight[...]))


def _load_error(model, tmp_path, edit) -> str:
    tensors = hf_tensors(model)
    edit(tensors)
    write_checkpoint(tmp_path / "hf", released_config(model.config), tensors)
    with pytest.raises(ValueError) as error:
        load_hf_checkpoint(tmp_path / "hf", log=quiet)
    return str(error.value)


def test_missing_unexpected_misshaped_are_listed(model, tmp_path):
    def edit(t):
        del t["model.layers.0.self_attn.q_a_proj.weight"]
        del t["model.layers.1.mlp.experts.3.up_proj.weight"]
        t["model.layers.0.self_attn.extra.weight"] = np.zeros((2, 3), np.float32)
        t["model.layers.1.self_attn.o_proj.weight"] = np.zeros((5, 64), np.float32)
    message = _load_error(model, tmp_path, edit)
    assert "2 missing, 1 unexpected, 1 mis-shaped" in message
    assert ("missing: model.layers.0.self_attn.q_a_proj.weight (row 0 of dense_layers.self_attn.q_a_proj.weight) "
            "[1, 64, 32]") in message
    assert ("missing: model.layers.1.mlp.experts.{e}.up_proj.weight (row 0 of moe_layers.mlp.experts_up_proj): "
            "experts [3] of 8") in message
    assert "unexpected: model.layers.0.self_attn.extra.weight [2, 3] F32" in message
    assert "mis-shaped: model.layers.1.self_attn.o_proj.weight [5, 64] does not fit" in message


def test_experts_given_twice_and_layers_beyond_mtp_are_errors(model, tmp_path):
    def edit(t):
        t["model.layers.1.mlp.experts.gate_up_proj"] = np.zeros((8, 64, 64), np.float32)
        t["model.layers.3.input_layernorm.weight"] = np.ones((64,), np.float32)
    message = _load_error(model, tmp_path, edit)
    assert ("model.layers.1.mlp.experts.{e}.gate_proj.weight (row 0 of moe_layers.mlp.experts_gate_proj) "
            "is given more than once") in message
    assert "unexpected: model.layers.3.input_layernorm.weight" in message


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_checkpoint(tmp_path, log=quiet)
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_hf()))
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_hf_checkpoint(tmp_path, log=quiet)


# -- FP8 ------------------------------------------------------------------------------------------

def quantize_blocks(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-style block quantization: per block, scale = amax / 448, fp8 = weight / scale."""
    rows, cols = weight.shape
    scale = np.empty(fp8.scale_shape(weight.shape, block), np.float32)
    quantized = np.empty(weight.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scale[i, j] = max(np.abs(weight[part]).max(), 1e-12) / FP8_MAX
            quantized[part] = (weight[part] / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return quantized, scale


def test_dequantize_edge_blocks_elementwise():
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(300, 200)).astype(np.float32) * rng.uniform(0.01, 10, (300, 1)).astype(np.float32)
    quantized, scale = quantize_blocks(weight, (128, 128))
    assert scale.shape == (3, 2)  # partial last blocks: 44 rows, 72 columns
    out = np.asarray(fp8.dequantize(quantized, scale, (128, 128)))
    rows, cols = np.indices(weight.shape)
    block_scale = scale[rows // 128, cols // 128]
    np.testing.assert_array_equal(out, quantized.astype(np.float32) * block_scale)
    # e4m3: 3 mantissa bits, and values below the smallest subnormal (2^-9 of the scale) flush to 0.
    assert np.all(np.abs(out - weight) <= 2 ** -4 * np.abs(weight) + 2 ** -9 * block_scale)
    with pytest.raises(ValueError, match="does not fit weight"):
        fp8.dequantize(quantized, scale[:, :1], (128, 128))


def test_fp8_checkpoint_equals_float_checkpoint(model, tmp_path):
    """Every 2-D weight of the layers and the MTP block as FP8 in 16 x 16 blocks (shapes such as
    40 and 96 leave partial edge blocks): loads to the same weights as the dequantized float file."""
    block = (16, 16)
    float_tensors, fp8_tensors = hf_tensors(model), {}
    for name, value in hf_tensors(model).items():
        if value.ndim == 2 and ".layers." in name and "mlp.gate." not in name and "shared_head.head" not in name \
                and "embed_tokens" not in name:
            quantized, scale = quantize_blocks(value, block)
            fp8_tensors[name], fp8_tensors[name + fp8.SCALE_SUFFIX] = quantized, scale
            float_tensors[name] = np.asarray(fp8.dequantize(quantized, scale, block))
        else:
            fp8_tensors[name] = value
    assert any(dim % block[0] for v in fp8_tensors.values() if v.dtype == ml_dtypes.float8_e4m3fn for dim in v.shape)
    config = {**released_config(model.config),
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)}}
    write_checkpoint(tmp_path / "fp8", config, fp8_tensors, shards=2)
    write_checkpoint(tmp_path / "float", released_config(model.config), float_tensors)
    from_fp8 = load_hf_checkpoint(tmp_path / "fp8", log=quiet)
    assert_same_params(from_fp8, load_hf_checkpoint(tmp_path / "float", log=quiet))
    q_a = np.asarray(from_fp8.layer(0).self_attn.q_a_proj.weight[...])
    np.testing.assert_allclose(q_a, np.asarray(model.layer(0).self_attn.q_a_proj.weight[...]), rtol=2 ** -3,
                               atol=1e-3)


def test_fp8_scale_missing_or_misshaped(model, tmp_path):
    def edit(t):
        for name in ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
            t[name] = t[name].astype(ml_dtypes.float8_e4m3fn)
        t["model.layers.0.self_attn.o_proj.weight_scale_inv"] = np.ones((2, 2), np.float32)
        t["model.layers.0.mlp.up_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
    message = _load_error(model, tmp_path, edit)
    assert "missing: model.layers.0.self_attn.q_a_proj.weight_scale_inv [1, 1] (the scale of FP8" in message
    assert "mis-shaped: model.layers.0.self_attn.o_proj.weight_scale_inv [2, 2]: expected [1, 1]" in message
    assert "unexpected: model.layers.0.mlp.up_proj.weight_scale_inv [1, 1] F32 (a scale without an FP8" in message


def test_other_quantization_methods_raise(model, tmp_path):
    config = {**released_config(model.config), "quantization_config": {"quant_method": "mxfp4"}}
    write_checkpoint(tmp_path / "hf", config, hf_tensors(model))
    with pytest.raises(ValueError, match="quant_method='mxfp4'"):
        load_hf_checkpoint(tmp_path / "hf", log=quiet)


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_fp8_resident_load_keeps_weights_and_scales(fp8_tiny, tmp_path):
    """An FP8 checkpoint (sharded) loads with dtype float8_e4m3fn to exactly the FP8 model written
    (weights and transposed scales, per-expert rows stacked), and with bfloat16 to the dequantized
    weights; jaxspec convert --dtype fp8 keeps them too."""
    write_checkpoint(tmp_path / "hf", {**released_config(fp8_tiny.config), "quantization_config": FP8_CONFIG},
                     hf_tensors(fp8_tiny), shards=2)
    kept = load_hf_checkpoint(tmp_path / "hf", dtype=ml_dtypes.float8_e4m3fn, log=quiet)
    assert_same_params(kept, fp8_tiny)
    dequantized = params_of(load_hf_checkpoint(tmp_path / "hf", dtype=jnp.bfloat16, log=quiet))
    for name, value in params_of(fp8_tiny).items():
        if name.endswith(fp8.SCALE_SUFFIX):
            assert name not in dequantized
            continue
        scale = params_of(fp8_tiny).get(name + fp8.SCALE_SUFFIX)
        want = value if scale is None else np.asarray(fp8.dequantize(value, scale, (128, 128)).astype(jnp.bfloat16))
        np.testing.assert_array_equal(dequantized[name], want, err_msg=name)
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "orbax"), "--dtype", "fp8"]) == 0
    assert_same_params(load_model(tmp_path / "orbax", dtype=ml_dtypes.float8_e4m3fn, log=quiet), fp8_tiny)


def test_fp8_resident_load_refuses_what_it_cannot_keep(model, fp8_tiny, tmp_path):
    """dtype float8_e4m3fn: a checkpoint without FP8 weights, with other blocks than 128 x 128, or
    with a weight in bf16 that DeepSeek's layout has in FP8, is a clear error before any read."""
    keep = dict(dtype=ml_dtypes.float8_e4m3fn, log=quiet)
    write_checkpoint(tmp_path / "bf16", released_config(model.config), hf_tensors(model))
    with pytest.raises(ValueError, match=r"has none \(no F8_E4M3 tensor\): load it with dtype=bfloat16"):
        load_hf_checkpoint(tmp_path / "bf16", **keep)
    spec = importlib.util.spec_from_file_location("generate_example", EXAMPLES / "generate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit, match=r"--dtype fp8: dtype=float8_e4m3fn keeps a checkpoint's FP8 weights"):
        script.main(["--checkpoint", str(tmp_path / "bf16"), "--prompt-ids", "1,2", "--dtype", "fp8"])

    tensors = hf_tensors(fp8_tiny)
    config = {**released_config(fp8_tiny.config), "quantization_config": {**FP8_CONFIG, "weight_block_size": [16, 16]}}
    write_checkpoint(tmp_path / "blocks", config, tensors)
    with pytest.raises(ValueError, match=r"needs DeepSeek's 128x128 scale blocks; .* weight_block_size \[16, 16\]"):
        load_hf_checkpoint(tmp_path / "blocks", **keep)

    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = np.asarray(fp8.dequantize(tensors[name], tensors.pop(name + fp8.SCALE_SUFFIX), (128, 128)))
    write_checkpoint(tmp_path / "mixed", {**released_config(fp8_tiny.config), "quantization_config": FP8_CONFIG}, tensors)
    with pytest.raises(ValueError, match=rf"not FP8: {name} \[64, 64\] F32: FP8 with a scale in DeepSeek's layout"):
        load_hf_checkpoint(tmp_path / "mixed", **keep)


# -- orbax conversion -----------------------------------------------------------------------------

def test_convert_then_restore_is_identical(model, tmp_path, capsys):
    write_checkpoint(tmp_path / "hf", released_config(model.config), hf_tensors(model))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "orbax"), "--dtype", "float32"]) == 0
    assert "[1/1] model.safetensors" in capsys.readouterr().err
    assert (tmp_path / "orbax" / "tokenizer_config.json").exists()
    restored = restore_model(tmp_path / "orbax")
    assert restored.config == model.config
    assert_same_params(restored, model)
    assert_same_params(load_model(tmp_path / "orbax", log=quiet), model)
    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error, naming SRC
        cli.main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "nowhere: no such directory" in capsys.readouterr().err


# -- tokenizer ------------------------------------------------------------------------------------

def test_hf_tokenizer_from_directory(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.decoder = tokenizers.decoders.WordPiece()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("hello world") == [3, 4]
    assert loaded.decode([0, 3, 4, 1]) == "hello world"
    assert (loaded.bos_token_id, loaded.eos_token_id) == (0, 1)


def test_directory_without_tokenizer_is_bytes(tmp_path):
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


# -- the main job ---------------------------------------------------------------------------------

def test_generate_example_runs_hf_and_converted_checkpoints(model, tmp_path, capsys):
    """`examples/generate.py --checkpoint DIR --prompt-ids ...` on a directory without a tokenizer
    prints ids, the same for the Hugging Face directory and its `jaxspec convert` output."""
    write_checkpoint(tmp_path / "hf", released_config(model.config), hf_tensors(model), shards=2)
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "orbax"), "--dtype", "float32"]) == 0
    spec = importlib.util.spec_from_file_location("generate_example", EXAMPLES / "generate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = {}
    for kind in ("hf", "orbax"):
        capsys.readouterr()
        script.main(["--checkpoint", str(tmp_path / kind), "--prompt-ids", "256,5,6,7", "--prompt-ids", "9",
                     "--mtp", "2", "--max-new-tokens", "6", "--backend", "xla"])
        rows[kind] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert rows["hf"] == rows["orbax"]
    assert rows["hf"][0].startswith("[0] [256, 5, 6, 7] -> [") and rows["hf"][1].startswith("[1] [9] -> [")
    with pytest.raises(SystemExit):
        script.parse_args(["--checkpoint", str(tmp_path / "hf"), "--prompt", "text needs a tokenizer"])
    assert "no tokenizer.json there; give --prompt-ids" in capsys.readouterr().err
