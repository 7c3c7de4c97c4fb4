"""`jaxspec.orbax_io`: save/restore round trips exactly, and a checkpoint that does not fit its config fails clearly."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.model_config import ModelConfig
from jaxspec.models import DeepseekV3
from jaxspec.orbax_io import restore_model, save_model
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
    assert "missing layers.2." in message


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="not a saved model"):
        restore_model(tmp_path)

