"""Shared fixtures: tiny trained models (so drafts really get accepted) and marker handling.

`gpu` tests run only where JAX sees a GPU; `hf` tests only where torch and transformers import.
"""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest
from flax import nnx

from jaxspec.config import preset
from jaxspec.models import DeepseekV3
from jaxspec.train import train

# A byte-level "language" of words: within a word the next bytes are certain (drafts accepted),
# at a word boundary the next word is a coin toss (drafts rejected). Decoding it covers every
# acceptance count from 0 to k.
WORDS = [b"the ", b"quick ", b"brown ", b"fox ", b"jumps ", b"over ", b"lazy ", b"dog ", b"and ", b"cat "]


def word_batches(seed: int, batch: int = 16, length: int = 48):
    rng = np.random.default_rng(seed)
    while True:
        rows = []
        for _ in range(batch):
            text = b"".join(WORDS[i] for i in rng.integers(0, len(WORDS), length))
            start = rng.integers(0, 8)
            rows.append(list(text[start:start + length]))
        yield np.array(rows, np.int32)


def _trained(name: str) -> DeepseekV3:
    model = DeepseekV3(preset(name), rngs=nnx.Rngs(0))
    train(model, word_batches(seed=0), steps=150, learning_rate=1e-2)
    return model


@pytest.fixture(scope="session")
def trained_v32() -> DeepseekV3:
    """The `tiny` preset (DeepSeek-V3.2: DSA with index_topk=16, MoE), trained for a few seconds."""
    return _trained("tiny")


@pytest.fixture(scope="session")
def fp8_tiny() -> DeepseekV3:
    """A random `tiny` DeepSeek-V3.2 in DeepSeek's FP8 layout (dtype float8_e4m3fn: FP8 linear
    weights with 128 x 128 block scales), shared by the FP8 model and loader tests."""
    return DeepseekV3(preset("tiny"), rngs=nnx.Rngs(4), dtype=jax.numpy.float8_e4m3fn)


@pytest.fixture(scope="session")
def h100():
    """One abstract H100 SXM for compiling GPU programs on this host (`jaxspec.aot`); skips with
    the instrument's reason (the CUDA plugin is missing, or the run lacks JAX_PLATFORMS=cpu)."""
    from jaxspec import aot
    try:
        return aot.gpu_devices("h100")
    except RuntimeError as missing:
        pytest.skip(str(missing))


@pytest.fixture(scope="session")
def trained_v3() -> DeepseekV3:
    """The `tiny-v3` preset (dense MLA, MoE), trained the same way."""
    return _trained("tiny-v3")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module: one pytest process compiles hundreds of
    programs, and keeping them all for the whole run only grows memory (a full run once crashed
    inside XLA's CPU compiler late in the session; each module alone passed)."""
    yield
    jax.clear_caches()


def pytest_collection_modifyitems(config, items):
    has_gpu = jax.default_backend() == "gpu"
    has_hf = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')"))
        if "hf" in item.keywords and not has_hf:
            item.add_marker(pytest.mark.skip(reason="needs the hf extra (torch + transformers)"))
