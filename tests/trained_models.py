"""The suite's trained tiny models: how they are trained, and where they are stored.

Speculative decoding needs drafts that are sometimes accepted and sometimes rejected, so the loop
tests run on tiny models trained briefly on a byte-level "language" of words (`word_batches`):
within a word the next bytes are certain (drafts accepted), at a word boundary the next word is a
coin toss (drafts rejected), and decoding it covers every acceptance count from 0 to k.

Training them took about 140 s of the suite's CPU time (compiling the train steps dominates), and
what they learn depends on the machine's floating-point code paths. So they are trained once, by
this file run as a script, and stored as orbax checkpoints under `tests/fixtures/<preset>/` with a
`training.json` saying how; the tests restore them bit for bit (`load`). `tests/test_train.py`
checks that each stored model still has its preset's shape and exercises `jaxspec.train` itself.

Regenerate after changing a preset or the model's parameters (about two minutes on 2 cores):

    JAX_PLATFORMS=cpu python tests/trained_models.py            # all three
    JAX_PLATFORMS=cpu python tests/trained_models.py tiny-v4    # one
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxspec.models import model_class
from jaxspec.orbax_io import restore_model, save_model
from jaxspec.presets import preset
from jaxspec.train import train

FIXTURES = Path(__file__).resolve().parent / "fixtures"

WORDS = [b"the ", b"quick ", b"brown ", b"fox ", b"jumps ", b"over ", b"lazy ", b"dog ", b"and ", b"cat "]

# preset -> how it is trained (`jaxspec.train.train` arguments; the batches are word_batches(seed=0)).
# tiny-v4 chains the MTP twice while training: with depth 1 alone, k = 4 never had all four drafts
# accepted. Its losses end near 0.5 from 5.5 (within-word bytes are certain, the next word a guess).
RECIPES = {
    "tiny": dict(steps=150, batch=16, length=48, learning_rate=1e-2, mtp_depth=1),       # DeepSeek-V3.2 (DSA)
    "tiny-v3": dict(steps=150, batch=16, length=48, learning_rate=1e-2, mtp_depth=1),    # dense MLA
    "tiny-v4": dict(steps=80, batch=8, length=32, learning_rate=1e-2, mtp_depth=2),      # DeepSeek-V4
}


def word_batches(seed: int, batch: int = 16, length: int = 48):
    """Endless [batch, length] int32 batches of byte-level word text, each row starting at a random
    offset (0..7) into its words."""
    rng = np.random.default_rng(seed)
    while True:
        rows = []
        for _ in range(batch):
            text = b"".join(WORDS[i] for i in rng.integers(0, len(WORDS), length))
            start = rng.integers(0, 8)
            rows.append(list(text[start:start + length]))
        yield np.array(rows, np.int32)


def fixture_dir(name: str) -> Path:
    return FIXTURES / name


def load(name: str):
    """The stored trained `name` model (float32), exactly as `train_and_save` left it."""
    directory = fixture_dir(name)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is missing: run `JAX_PLATFORMS=cpu python tests/trained_models.py {name}`")
    return restore_model(directory)


def train_and_save(name: str) -> dict:
    """Train the `name` preset from seed 0 as RECIPES says and store it (replacing any old one)."""
    recipe = RECIPES[name]
    config = preset(name)
    model = model_class(config)(config, rngs=nnx.Rngs(0))
    start = time.perf_counter()
    losses = train(model, word_batches(seed=0, batch=recipe["batch"], length=recipe["length"]),
                   steps=recipe["steps"], learning_rate=recipe["learning_rate"], mtp_depth=recipe["mtp_depth"],
                   log_every=max(1, recipe["steps"] // 5))
    save_model(model, fixture_dir(name))
    record = {"preset": name, "recipe": recipe, "batches": "word_batches(seed=0)", "init": "nnx.Rngs(0)",
              "first_loss": losses[0], "final_loss": losses[-1], "train_seconds": round(time.perf_counter() - start, 1),
              "jax": jax.__version__, "machine": platform.machine(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    (fixture_dir(name) / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"presets to train, of {', '.join(RECIPES)} (default: all)")
    names = parser.parse_args().names or list(RECIPES)
    if unknown := [name for name in names if name not in RECIPES]:
        parser.error(f"names {unknown}: each must be one of {', '.join(RECIPES)}")
    for name in names:
        print(f"training {name}: {RECIPES[name]}", flush=True)
        record = train_and_save(name)
        print(f"{name}: loss {record['first_loss'][0]:.3f} -> {record['final_loss'][0]:.3f} in "
              f"{record['train_seconds']} s, stored in {fixture_dir(name)}", flush=True)


if __name__ == "__main__":
    main()
