"""`jaxspec.orbax_io`: save/restore round trips exactly, a save in the older per-layer layout
restores to the same model and `jaxspec convert` rewrites it, and a checkpoint that does not fit its
config fails clearly."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxspec import cli
from jaxspec.model_config import ModelConfig
from jaxspec.models import DeepseekV3
from jaxspec.orbax_io import restore_model, save_model, saved_dtype
from jaxspec.presets import preset


def _params(model) -> dict:
    return {path: variable.get_value() for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def model() -> DeepseekV3:
    return DeepseekV3(preset("tiny"), rngs=nnx.Rngs(3))


def test_round_trip_identical_model(model, tmp_path):
    save_model(model, tmp_path / "ckpt")
    restored = restore_model(tmp_path / "ckpt")
    assert restored.config == model.config
    before, after = _params(model), _params(restored)
    assert before.keys() == after.keys()
    for path in before:
        assert after[path].dtype == before[path].dtype, path
        np.testing.assert_array_equal(np.asarray(after[path]), np.asarray(before[path]), err_msg=str(path))
    # The same graph and every variable (not only parameters) the same bits: `generate` traces the
    # same program with the same inputs, so generations are equal without compiling one here.
    (graph, state), (restored_graph, restored_state) = nnx.split(model), nnx.split(restored)
    assert restored_graph == graph
    jax.tree.map(np.testing.assert_array_equal, restored_state, state)


def test_bfloat16_storage_restores_model_dtypes(model, tmp_path):
    save_model(model, tmp_path / "ckpt", dtype=jnp.bfloat16)
    assert ModelConfig.from_hf(tmp_path / "ckpt") == model.config
    restored = restore_model(tmp_path / "ckpt")
    before, after = _params(model), _params(restored)
    for path in before:
        assert after[path].dtype == before[path].dtype, path
        expected = np.asarray(before[path].astype(jnp.bfloat16).astype(before[path].dtype))
        np.testing.assert_array_equal(np.asarray(after[path]), expected, err_msg=str(path))
    with pytest.raises(ValueError, match=r"saved without them \(from a float model\): restore it with dtype=bfloat16"):
        restore_model(tmp_path / "ckpt", dtype=jnp.float8_e4m3fn)


def test_mismatched_shapes_raise_listing_them(model, tmp_path):
    save_model(model, tmp_path / "ckpt")
    config_path = tmp_path / "ckpt" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(hidden_size=32, num_hidden_layers=3)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        restore_model(tmp_path / "ckpt")
    message = str(error.value)
    assert "embed_tokens.embedding: checkpoint (258, 64) != model (258, 32)" in message
    # Three layers: the MoE stack holds two rows where the save has one.
    assert "moe_layers.self_attn.o_proj.weight: checkpoint (1, 64, 64) != model (2, 64, 32)" in message


def _dotted(module) -> dict[str, jax.Array]:
    return {".".join(map(str, path)): value for path, value in _params(module).items()}


def test_per_layer_save_restores_stacked_and_converts(model, tmp_path):
    """A save as written before the layers were stacked (one array per layer, `layers.{i}.<path>`,
    each layer's from `model.layer(i)`) restores to the same parameters, says which command rewrites
    it, and `jaxspec convert OLD NEW` writes today's stacked names, which restore the same again."""
    stacks = tuple(f"{run.name}." for run in model.layer_runs)
    old = {name: value for name, value in _dotted(model).items() if not name.startswith(stacks)}
    for layer in range(model.config.num_hidden_layers):
        old.update({f"layers.{layer}.{name}": value for name, value in _dotted(model.layer(layer)).items()})
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(model.config.to_hf()))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "old" / "params", old)

    lines = []
    restored = restore_model(tmp_path / "old", log=lines.append)
    want, got = _params(model), _params(restored)
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want[path]), err_msg=str(path))
    assert any(f"jaxspec convert {tmp_path / 'old'} NEW" in line for line in lines), lines

    # without --dtype: the save's own dtype (float32 here), so the rewrite changes no bit
    assert cli.main(["convert", str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    assert saved_dtype(tmp_path / "new") == saved_dtype(tmp_path / "old") == jnp.float32
    with ocp.StandardCheckpointer() as checkpointer:
        names = set(checkpointer.metadata(tmp_path / "new" / "params").item_metadata.keys())
    assert names == set(_dotted(model))
    lines.clear()
    converted = _params(restore_model(tmp_path / "new", log=lines.append))
    assert not lines
    for path in want:
        np.testing.assert_array_equal(np.asarray(converted[path]), np.asarray(want[path]), err_msg=str(path))

    # a bfloat16 save stays bfloat16, its bits unchanged
    save_model(model, tmp_path / "half", dtype=jnp.bfloat16)
    assert cli.main(["convert", str(tmp_path / "half"), str(tmp_path / "half-new")]) == 0
    assert saved_dtype(tmp_path / "half-new") == jnp.bfloat16
    half, rewritten = (_params(restore_model(tmp_path / name)) for name in ("half", "half-new"))
    for path in half:
        np.testing.assert_array_equal(np.asarray(rewritten[path]), np.asarray(half[path]), err_msg=str(path))


def test_convert_keeps_an_fp8_save_fp8(tmp_path):
    """`jaxspec convert` without --dtype rewrites a save of FP8 weights as FP8 weights with the same
    block scales, byte for byte (its config.json names bfloat16, the dtype such a model computes in)."""
    fp8 = DeepseekV3(preset("tiny"), rngs=nnx.Rngs(4), dtype=jnp.float8_e4m3fn)
    save_model(fp8, tmp_path / "fp8")
    assert cli.main(["convert", str(tmp_path / "fp8"), str(tmp_path / "fp8-new")]) == 0
    assert saved_dtype(tmp_path / "fp8") == saved_dtype(tmp_path / "fp8-new") == jnp.float8_e4m3fn
    want, got = (_params(restore_model(tmp_path / name, dtype=jnp.float8_e4m3fn)) for name in ("fp8", "fp8-new"))
    assert got.keys() == want.keys() and any("scale_inv" in str(path) for path in want)
    for path in want:  # as bytes: the FP8 weights' bits, not their values
        assert got[path].dtype == want[path].dtype, path
        np.testing.assert_array_equal(np.asarray(got[path]).view(np.uint8), np.asarray(want[path]).view(np.uint8),
                                      err_msg=str(path))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="not a saved model"):
        restore_model(tmp_path)



def test_an_interrupted_save_is_named(model, tmp_path):
    """config.json beside a params/ folder orbax never finished (no array metadata): a ValueError
    saying so, not an AttributeError from inside the restore."""
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_hf()))
    (tmp_path / "params").mkdir()
    with pytest.raises(ValueError, match="holds no complete orbax save"):
        restore_model(tmp_path)
