"""Shared fixtures: tiny trained models (so drafts really get accepted; stored, see
`trained_models`), marker handling, and the suite's CPU budget (cheaper XLA code generation,
one compilation cache for the run, heaviest modules scheduled first).

`gpu` tests run only where JAX sees a GPU; `hf` tests only where torch and transformers import.
On a GPU (JAX's default platform there, `docs/gpu-testing.md`) the whole suite runs on it: see
ON_GPU for what changes.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest
from flax import nnx

import trained_models
from jaxspec.models import DeepseekV3, DeepseekV4
from jaxspec.presets import preset

# Compiling dominates the suite's CPU time and its programs run briefly, so the suite asks XLA for
# cheaper CPU code generation: no LLVM optimization (about 20% less CPU: test_exactness 149 s
# against 189 s) and XLA's legacy elemental emitters rather than its newer fusion emitters, which
# compile these programs in about 35% less time (a tiny-v4 k = 2 generate: 17.3 s -> 10.5 s of
# XLA compile; test_v4_loop: 266 s -> 198 s of CPU). Every comparison runs both of its sides under
# the same flags; the subprocesses tests start inherit them. Set before JAX initializes its
# backends, which importing it does not do.
CHEAP_CODEGEN = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_use_fusion_emitters=false"]


def _known_to_xla(flags: list[str]) -> bool:
    """Whether this jaxlib's XLA knows every one of `flags`: an unknown flag in XLA_FLAGS aborts
    the process (XLA drops debug flags over releases; the suite must run on newer jax too)."""
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                           env={**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"})
    return probe.returncode == 0


def _runs_on_gpu() -> bool:
    """Whether JAX's platform in this run is a GPU, decided before JAX initializes its backends:
    JAX_PLATFORMS when set (CI sets "cpu"), else a probe of what JAX picks (about 2 s)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] in ("cuda", "gpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                           text=True)
    return probe.stdout.strip().endswith("gpu")


# pytest-xdist's workers inherit the environment of the controlling process, which loads this
# file first, so the probes run once per run.
ON_GPU = os.environ.setdefault("JAXSPEC_TESTS_ON_GPU", str(int(_runs_on_gpu()))) == "1"
# The Mosaic GPU kernels' tests (`interpret=MOSAIC_INTERPRET`) run the simulator on the CPU, and on a
# GPU the kernels themselves, compiled for it: the same assertions, bit-for-bit ones included, then
# hold for the real kernels (every shape those tests interpret also compiles for sm_90a:
# `tests/mosaic_native_probe.py`).
MOSAIC_INTERPRET = not ON_GPU
if ON_GPU:
    # Several pytest workers share the GPU: each allocates what it needs instead of 75% of it. The
    # suite's float32 comparisons mean on a GPU what they mean on the CPU: float32 matmuls in full
    # float32 (JAX's GPU default is TF32, about 1e-3 relative; the kernels state HIGHEST). The
    # cheap-codegen flags are not set: XLA's GPU compiler reads the optimization level too.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    # No autotuning of XLA's GPU matmuls: the H200's suite modules took about 5x their CPU time
    # (test_acceptance 44 s against 8 s, test_compile_generate 49 s against 8 s), programs that
    # run in milliseconds, so their compiles dominate, and the autotuner compiles and times
    # candidate kernels for every new matmul shape. Its choice also depends on timings, so two
    # compiles of one matmul could pick different kernels (and bits); the defaults are fixed.
    # What this saves is not measured yet.
    if "--xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    jax.config.update("jax_default_matmul_precision", os.environ["JAX_DEFAULT_MATMUL_PRECISION"])
else:
    # A flag this XLA does not know is left out (one probe, about 2 s).
    _set = os.environ.get("XLA_FLAGS", "").split()
    _missing = [flag for flag in CHEAP_CODEGEN if flag not in _set]
    if _missing and not _known_to_xla(_missing):
        _missing = [flag for flag in _missing if _known_to_xla([flag])]
    os.environ["XLA_FLAGS"] = " ".join(_set + _missing)



def on_cpu(tree):
    """`tree`'s arrays committed to the host's CPU device, so the jitted calls that take them run
    there on a GPU host too: for a bit-for-bit identity of the pure-jnp references (the "xla"
    backend) that is a property of the program on XLA's CPU backend, while XLA's GPU compiler may
    fuse one side's dequantization into a matmul and pick another matmul kernel than the other
    side's (another summation order)."""
    return jax.device_put(tree, jax.devices("cpu")[0])


# One persistent compilation cache for the whole run on the CPU, shared by the pytest workers and
# every subprocess a test starts (they inherit the variables): many tests compile a program
# another module, worker or script run already compiled (the README's blocks, the report's smoke
# units, the scripts the examples and mesh tests start), and jax.clear_caches() after each module
# drops the in-memory copies. Every program is cached, however quick to compile (the gains are
# spread over hundreds of them). Two full runs of this tree on a quiet 2-core host: 1012 s
# without, 882 s with (32.2 against 27.9 minutes of CPU); clean-clone `.ci/run`s then took 875,
# 930 and 982 s of pytest, against 1029 and 1062 s before. A run started with
# JAX_COMPILATION_CACHE_DIR keeps that directory; the one made here is removed when the run ends.
# On a GPU too: there a program's compile is slower than on the CPU (XLA's GPU pipeline, Triton's
# and Mosaic GPU's kernels, ptxas), and the GPU report's suite part runs one pytest of 8 workers
# over the modules left, whose programs repeat across modules as on the CPU. What it saves there
# is not yet measured (deviceless compiles, `jaxspec.aot`, write nothing to it either way).
OWNS_COMPILE_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if OWNS_COMPILE_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxspec-tests-compile-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    # JAX read its variables when it was imported, above; the workers and subprocesses import it
    # with them set.
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_unconfigure(config):
    # pytest-xdist's workers inherit the directory; the process that made it removes it.
    if OWNS_COMPILE_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def trained_v32() -> DeepseekV3:
    """The `tiny` preset (DeepSeek-V3.2: DSA with index_topk=16, MoE), trained on the word language
    (stored: `trained_models`)."""
    return trained_models.load("tiny")


@pytest.fixture(scope="session")
def trained_v3() -> DeepseekV3:
    """The `tiny-v3` preset (dense MLA, MoE), trained the same way."""
    return trained_models.load("tiny-v3")


@pytest.fixture(scope="session")
def trained_v4() -> DeepseekV4:
    """The `tiny-v4` preset (DeepSeek-V4: sliding, CSA and HCA layers, hash and learned MoE), trained
    on the word language with the MTP chained twice."""
    return trained_models.load("tiny-v4")


@pytest.fixture(scope="session")
def fp8_tiny() -> DeepseekV3:
    """A random `tiny` DeepSeek-V3.2 in DeepSeek's FP8 layout (dtype float8_e4m3fn: FP8 linear
    weights with 128 x 128 block scales), shared by the FP8 model and loader tests."""
    return DeepseekV3(preset("tiny"), rngs=nnx.Rngs(4), dtype=jax.numpy.float8_e4m3fn)


@pytest.fixture(scope="session")
def h100():
    """One abstract H100 SXM for compiling GPU programs on this host (`jaxspec.aot`); skips with
    the instrument's reason (the CUDA plugin is missing, or the run lacks JAX_PLATFORMS=cpu). On a
    GPU host the plugin registers anyway, and the deviceless compiles run there too."""
    from jaxspec import aot
    try:
        return aot.gpu_devices("h100")
    except RuntimeError as missing:
        pytest.skip(str(missing))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module: one pytest process compiles hundreds of
    programs, and keeping them all for the whole run only grows memory (a full run once crashed
    inside XLA's CPU compiler late in the session; each module alone passed)."""
    yield
    jax.clear_caches()


# The modules of 10 s or more, heaviest first (summed test durations of a full run, `--durations=0`;
# last taken on 11-29, 1,720 s in all: in this order the two workers' shares come to 860 s each, in
# the order before 843 and 877, with the Mosaic grouped matmul's 39 s among the short modules).
# `.ci/run` hands out whole modules (`--dist loadfile`) in collection order
# (`--no-loadscope-reorder`), so the two workers start on the long ones and finish together on the
# short ones, which keep their own order after these.
HEAVIEST_FIRST = ["test_gpu_report.py", "test_v4_loop.py", "test_fp8_cache_v4.py", "test_prefill_in_loop.py",
                  "test_fp8_cache.py", "test_v4_mosaic.py", "test_multihost.py", "test_mla_mosaic.py",
                  "test_sparse_mosaic.py", "test_aot.py", "test_tree_decoding.py", "test_loop.py",
                  "test_memory_plan.py", "test_model.py", "test_exactness.py", "test_sharding.py",
                  "test_grouped_matmul_mosaic.py", "test_hf_parity.py", "test_interface.py", "test_examples.py",
                  "test_default_model.py", "test_grouped_matmul.py", "test_public_api.py", "test_sharding_v4.py",
                  "test_mosaic_warpgroups.py", "test_mesh_loading.py", "test_v4_layers.py", "test_checkpoint.py",
                  "test_v4_attention.py", "test_chunked_prefill.py", "test_notebook.py", "test_pallas_backend.py",
                  "test_fp8.py", "test_v4_model.py", "test_stack.py", "test_kernels.py", "test_orbax_io.py"]


# `benchmarks/gpu_report.py` runs the GPU suite lightest first instead (its clock usually ends the
# run, and light modules first leave the most modules complete).
LIGHTEST_FIRST = os.environ.get("JAXSPEC_TEST_ORDER") == "lightest-first"


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    sign = -1 if LIGHTEST_FIRST else 1
    # stable: each module keeps its order
    items.sort(key=lambda item: sign * rank.get(item.path.name, len(rank)))
    has_gpu = jax.default_backend() == "gpu"
    has_hf = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')"))
        if "hf" in item.keywords and not has_hf:
            item.add_marker(pytest.mark.skip(reason="needs the hf extra (torch + transformers)"))
