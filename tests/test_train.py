"""`jaxspec.train` and the suite's stored trained models (`trained_models`).

The loop tests restore tiny models trained once on the word language instead of training them in
every run. Here: each stored model still has its preset's shape (a changed preset needs them
retrained), and training works on the hardest case, a DeepSeek-V4 model (integer hash routing
tables that must stay fixed, compressed sparse attention with its indexer). `train` hands
`mtp_depth` to `losses`, whose chaining test_default_model checks.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from flax import nnx

import trained_models
from jaxspec.model_config import CSA, ModelConfig
from jaxspec.models import DeepseekV4
from jaxspec.presets import preset
from jaxspec.train import train


@pytest.mark.parametrize("name", list(trained_models.RECIPES))
def test_stored_model_has_its_presets_shape(name):
    stored = ModelConfig.from_hf(trained_models.fixture_dir(name) / "config.json")
    assert stored == preset(name), (f"tests/fixtures/{name} was trained for another `{name}` preset: "
                                    f"run `JAX_PLATFORMS=cpu python tests/trained_models.py {name}`")


def test_training_v4_lowers_both_losses_and_keeps_the_hash_tables():
    """Three AdamW steps (warmup 1: the first step has learning rate 0) on one repeated batch of a
    one-layer tiny V4 (CSA with hash routing) and its MTP: the target and MTP losses fall by over a
    nat, `tid2eid` is unchanged, every parameter is finite."""
    config = preset("tiny-v4", num_hidden_layers=1, layer_types=(CSA,), mlp_layer_types=("hash_moe",))
    model = DeepseekV4(config, rngs=nnx.Rngs(0))
    before = {path: np.asarray(v) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
              if not np.issubdtype(v.get_value().dtype, np.inexact)}
    assert before, "the hash-routed layer should hold an integer tid2eid table"
    batch = next(trained_models.word_batches(seed=0, batch=4, length=16))
    losses = train(model, itertools.repeat(batch), steps=3, learning_rate=1e-2, warmup=1)
    (target0, mtp0), (target2, mtp2) = losses[0], losses[-1]
    assert target2 < target0 - 1 and mtp2 < mtp0 - 1, losses
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = np.asarray(variable.get_value())
        if path in before:
            np.testing.assert_array_equal(value, before[path], err_msg=f"{path} changed")
        else:
            assert np.isfinite(value).all(), path
