"""Shared fixtures: tiny trained models (so drafts really get accepted), marker handling, and the
suite's CPU budget (cheaper XLA code generation, heaviest modules scheduled first).

`gpu` tests run only where JAX sees a GPU; `hf` tests only where torch and transformers import.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pickle
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxspec.config import preset
from jaxspec.models import DeepseekV3
from jaxspec.train import train

# Compiling dominates the suite's CPU time and its programs run briefly: XLA's cheaper CPU code
# generation takes about 20% less CPU time (test_exactness: 149 s against 189 s). Every comparison
# runs both of its sides under the same flags; the subprocesses tests start inherit them. Set
# before JAX initializes its backends, which importing it does not do.
CHEAP_CODEGEN = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CHEAP_CODEGEN}".strip()

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


TRAIN_STEPS = 150


def _trained(name: str, shared_dir: Path | None) -> DeepseekV3:
    """The `name` preset trained for TRAIN_STEPS steps on the word language.

    Under xdist every worker is its own process with its own session fixtures, and training costs
    ~40 s of CPU: the first worker to ask trains and leaves the parameters in `shared_dir` (one
    directory per pytest run); the others wait on the lock and load them, bit for bit the same.
    """
    model = DeepseekV3(preset(name), rngs=nnx.Rngs(0))
    if shared_dir is None:
        train(model, word_batches(seed=0), steps=TRAIN_STEPS, learning_rate=1e-2)
        return model
    saved = shared_dir / f"trained-{name}-{TRAIN_STEPS}.pkl"
    with open(shared_dir / f"trained-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        params = nnx.state(model, nnx.Param)
        if saved.exists():
            nnx.replace_by_pure_dict(params, jax.tree.map(jax.numpy.asarray, pickle.loads(saved.read_bytes())))
            nnx.update(model, params)
        else:
            train(model, word_batches(seed=0), steps=TRAIN_STEPS, learning_rate=1e-2)
            pure = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
            partial = saved.with_suffix(".partial")
            partial.write_bytes(pickle.dumps(pure))
            os.replace(partial, saved)
    return model


@pytest.fixture(scope="session")
def _shared_dir(tmp_path_factory) -> Path | None:
    """A directory all xdist workers of this run share (None without xdist: one process, nothing to
    share). Workers' base temp dirs are `pytest-N/popen-gwK`, so their parent is this run's own."""
    return tmp_path_factory.getbasetemp().parent if "PYTEST_XDIST_WORKER" in os.environ else None


@pytest.fixture(scope="session")
def trained_v32(_shared_dir) -> DeepseekV3:
    """The `tiny` preset (DeepSeek-V3.2: DSA with index_topk=16, MoE), trained for a few seconds."""
    return _trained("tiny", _shared_dir)


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
def trained_v3(_shared_dir) -> DeepseekV3:
    """The `tiny-v3` preset (dense MLA, MoE), trained the same way."""
    return _trained("tiny-v3", _shared_dir)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module: one pytest process compiles hundreds of
    programs, and keeping them all for the whole run only grows memory (a full run once crashed
    inside XLA's CPU compiler late in the session; each module alone passed)."""
    yield
    jax.clear_caches()


# The heaviest modules, heaviest first (summed test durations of a full run; the trained fixtures'
# ~40 s each land in the first module to use them). `.ci/run` hands out whole modules
# (`--dist loadfile`) in collection order (`--no-loadscope-reorder`), so the two workers start on
# the long ones and finish together on the short ones, which keep their own order after these.
HEAVIEST_FIRST = ["test_tree_decoding.py", "test_v4_loop.py", "test_sharding.py", "test_exactness.py", "test_loop.py",
                  "test_hf_parity.py", "test_examples.py", "test_default_model.py", "test_model.py",
                  "test_public_api.py", "test_sharding_v4.py", "test_pallas_backend.py", "test_checkpoint.py",
                  "test_fp8.py", "test_mesh_loading.py", "test_memory_plan.py", "test_aot.py", "test_orbax_io.py",
                  "test_v4_model.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its order
    has_gpu = jax.default_backend() == "gpu"
    has_hf = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')"))
        if "hf" in item.keywords and not has_hf:
            item.add_marker(pytest.mark.skip(reason="needs the hf extra (torch + transformers)"))
