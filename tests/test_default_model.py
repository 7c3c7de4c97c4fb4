"""The shipped default model (examples/checkpoints/tiny-stdlib) is trained: it predicts held-out
Python source well, and its MTP module drafts what the target would say. Also the two training
objectives `examples/train_tiny.py` adds to `jaxspec.train`: the DSA indexer's KL loss and the
chained MTP loss (`mtp_depth`).

The text is the held-out stdlib files (`training.json` lists them; `examples/train_tiny.py` never
trains on them). The loss bound sits far below an untrained model (about 5.6 nats/byte) and a
model of the held-out files' own byte frequencies (3.06 nats/byte); chance agreement of two top-1
byte guesses is a few percent. Each bound leaves a margin under the shipped model's measured value.
"""

from __future__ import annotations

import json
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.models import DeepseekV3
from jaxspec.orbax_io import restore_model
from jaxspec.pallas_kernels import Visibility
from jaxspec.presets import preset
from jaxspec.models.rope import rope_angles
from jaxspec.train import _attention_kl, indexer_kl_loss, losses, train

CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "checkpoints",
                          "tiny-stdlib")
PROMPT_BYTES, CONTINUATION_BYTES = 96, 160  # as benchmarks/heldout.py decodes

# Bounds with a margin under the shipped checkpoint's values on the Python 3.11 stdlib (in comments).
MAX_CONTINUATION_NATS_PER_BYTE = 2.0  # measured 1.78
MIN_MTP_AGREEMENT = 0.6  # measured 0.70
MIN_MTP_ACCURACY = 0.4  # measured 0.47


@pytest.fixture(scope="module")
def model():
    return restore_model(CHECKPOINT)


@pytest.fixture(scope="module")
def held_out_texts() -> list[bytes]:
    with open(os.path.join(CHECKPOINT, "training.json")) as f:
        names = json.load(f)["held_out"]
    texts = []
    for name in names:
        with open(os.path.join(sysconfig.get_paths()["stdlib"], name), "rb") as f:
            texts.append(f.read())
    return texts


def _snippets(texts: list[bytes], per_text: int, length: int) -> np.ndarray:
    """[len(texts) * per_text, length] byte windows starting at line starts spread over each text."""
    rows = []
    for text in texts:
        for i in range(per_text):
            start = min(text.find(b"\n", i * len(text) // per_text) + 1, len(text) - length)
            rows.append(np.frombuffer(text[start:start + length], np.uint8))
    return np.stack(rows).astype(np.int32)


@nnx.jit
def _forward(model, tokens: jax.Array):
    """Teacher-forced target logits [B, L, V] and MTP logits [B, L-1, V] (MTP row i predicts byte i + 2)."""
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    vis = Visibility(prefix_len=jnp.zeros((batch,), jnp.int32), query_len=jnp.full((batch,), length, jnp.int32))
    logits, hidden, _ = model(tokens, positions, model.init_cache(batch, length, page_size=length), vis,
                              form="expanded", backend="xla")
    mtp_logits, _, _ = model.draft(tokens[:, 1:], hidden[:, :-1], positions[:, :-1],
                                   model.init_cache(batch, length, page_size=length, mtp=True),
                                   vis._replace(query_len=vis.query_len - 1), form="expanded", backend="xla")
    return logits, mtp_logits


def test_held_out_continuation_loss(model, held_out_texts):
    """Prompt with a held-out snippet: the model's per-byte loss on the true continuation is low.
    (What it generates, Python-looking text, is checked on the main job's output in test_examples.)"""
    snippets = _snippets(held_out_texts, 2, PROMPT_BYTES + CONTINUATION_BYTES)
    logits, _ = _forward(model, jnp.asarray(snippets))
    log_probs = jax.nn.log_softmax(logits[:, PROMPT_BYTES - 1:-1])
    nll = -jnp.take_along_axis(log_probs, jnp.asarray(snippets[:, PROMPT_BYTES:, None]), axis=-1)
    assert float(jnp.mean(nll)) < MAX_CONTINUATION_NATS_PER_BYTE


def test_mtp_top1_agrees_with_target(model, held_out_texts):
    """On held-out text the MTP module's top-1 for byte i+2 equals the target's top-1 for it (given the
    true byte i+1), and the true byte, at rates well above chance."""
    snippets = _snippets(held_out_texts, 2, PROMPT_BYTES + CONTINUATION_BYTES)
    logits, mtp_logits = _forward(model, jnp.asarray(snippets))
    mtp_top1 = jnp.argmax(mtp_logits[:, :-1], axis=-1)
    agreement = float(jnp.mean(mtp_top1 == jnp.argmax(logits[:, 1:-1], axis=-1)))
    accuracy = float(jnp.mean(mtp_top1 == jnp.asarray(snippets[:, 2:])))
    assert agreement >= MIN_MTP_AGREEMENT, agreement
    assert accuracy >= MIN_MTP_ACCURACY, accuracy


# -- the training objectives examples/train_tiny.py adds (jaxspec.train) ------------------------------


def _tiny_batch(length: int = 24) -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, length)), jnp.int32)


def test_indexer_kl_loss_reaches_only_the_indexer():
    """The gradient is zero outside the indexers and reaches every layer's indexer: each row of the
    stacked ones (through the scan) and the MTP block's."""
    model = DeepseekV3(preset("tiny"), rngs=nnx.Rngs(0))
    grads = nnx.jit(nnx.grad(indexer_kl_loss))(model, _tiny_batch())
    grads = {".".join(map(str, path)): np.abs(np.asarray(g.get_value())) for path, g in nnx.to_flat_state(grads)}
    assert all(g.sum() == 0 for name, g in grads.items() if ".indexer." not in name)
    for prefix in ("dense_layers", "moe_layers"):
        rows = grads[f"{prefix}.self_attn.indexer.wq_b.weight"]
        assert (rows.reshape(rows.shape[0], -1).sum(axis=1) > 0).all(), prefix
    assert grads["mtp.block.self_attn.indexer.wq_b.weight"].sum() > 0


def test_indexer_kl_loss_is_the_mean_over_layers_one_by_one():
    """The loss the stacks' scans give equals the same loss written out layer by layer (each layer
    on its own, `model.layer(i)`), as it was computed before the layers were stacked."""
    model = DeepseekV3(preset("tiny"), rngs=nnx.Rngs(0))
    tokens = _tiny_batch()

    @nnx.jit
    def layer_by_layer(model, tokens):
        batch, length = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        vis = Visibility(prefix_len=jnp.zeros((batch,), jnp.int32), query_len=jnp.full((batch,), length, jnp.int32))
        cos, sin = rope_angles(model.config, positions)
        cache = model.init_cache(batch, length, page_size=length)
        x, kls = model.embed_tokens(tokens).astype(model.dtype), []
        for i in range(model.config.num_hidden_layers):
            layer = model.layer(i)
            kls.append(_attention_kl(layer.self_attn, layer.input_layernorm(x), cos, sin, vis))
            x, cache = layer(x, cos, sin, cache, i, vis, form="expanded", backend="xla")
        mtp = model.mtp
        mtp_in = mtp.eh_proj(jnp.concatenate([mtp.enorm(model.embed_tokens(tokens[:, 1:]).astype(model.dtype)),
                                              mtp.hnorm(model.norm(x)[:, :-1])], axis=-1), backend="xla")
        kls.append(_attention_kl(mtp.block.self_attn, mtp.block.input_layernorm(mtp_in), cos[:, :-1], sin[:, :-1],
                                 vis._replace(query_len=vis.query_len - 1)))
        return jnp.mean(jnp.stack(kls))

    np.testing.assert_array_equal(np.asarray(nnx.jit(indexer_kl_loss)(model, tokens)),
                                  np.asarray(layer_by_layer(model, tokens)))


def test_a_training_step_changes_every_layers_rows():
    """One AdamW step past warmup (`jaxspec.train.train`, the indexer loss on) moves every row of
    every stacked parameter (the router's score-correction bias, which no loss reaches, excepted):
    the scans' gradients reach each layer's weights."""
    model = DeepseekV3(preset("tiny"), rngs=nnx.Rngs(0))
    stacks = tuple(f"{run.name}." for run in model.layer_runs)
    before = {name: np.asarray(value) for name, value in _flat_params(model).items()
              if name.startswith(stacks) and not name.endswith("e_score_correction_bias")}
    train(model, iter([np.asarray(_tiny_batch(16))] * 2), steps=2, warmup=1, indexer_kl_weight=1.0)
    for name, value in _flat_params(model).items():
        if name in before:
            changed = (np.asarray(value) != before[name]).reshape(value.shape[0], -1).any(axis=1)
            assert changed.all(), (name, changed)


def _flat_params(model) -> dict[str, jax.Array]:
    return {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@nnx.jit
def _chained_mtp_losses(model, tokens):
    """CE of the MTP module at depth 1 (fed the target's hidden) and depth 2 (fed its own), written out."""
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    vis = Visibility(prefix_len=jnp.zeros((batch,), jnp.int32), query_len=jnp.full((batch,), length, jnp.int32))
    _, hidden, _ = model(tokens, positions, model.init_cache(batch, length, page_size=length), vis, form="expanded",
                         backend="xla")
    vis = vis._replace(query_len=vis.query_len - 1)
    depth1, hidden1, _ = model.draft(tokens[:, 1:], hidden[:, :-1], positions[:, :-1],
                                     model.init_cache(batch, length, page_size=length, mtp=True), vis,
                                     form="expanded", backend="xla")
    depth2, _, _ = model.draft(tokens[:, 2:], hidden1[:, :-1], positions[:, 1:-1],
                               model.init_cache(batch, length, page_size=length, mtp=True),
                               vis._replace(query_len=vis.query_len - 1), form="expanded", backend="xla")
    ce = lambda logits, targets: jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
    return ce(depth1[:, :-1], tokens[:, 2:]), ce(depth2[:, :-1], tokens[:, 3:])


def test_mtp_depth_one_is_deepseek_mtp_loss_and_deeper_chains_feed_back_the_hidden():
    model = DeepseekV3(preset("tiny"), rngs=nnx.Rngs(0))
    tokens = _tiny_batch()
    first, second = map(float, _chained_mtp_losses(model, tokens))
    mtp_loss = nnx.jit(lambda model, tokens, depth: losses(model, tokens, mtp_depth=depth)[1], static_argnums=2)
    np.testing.assert_allclose(float(mtp_loss(model, tokens, 1)), first, rtol=1e-5)
    np.testing.assert_allclose(float(mtp_loss(model, tokens, 2)), (first + second) / 2, rtol=1e-5)
