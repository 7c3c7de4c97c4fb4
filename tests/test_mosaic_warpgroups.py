"""The Mosaic attention kernels with the warpgroups they run on a GPU, interpreted: a scorer and two
followers, their barriers and handshake (`gathered_softmax_mosaic`), which the rest of the suite
leaves out by interpreting one warpgroup that owns every column.

The simulator runs a launch's warpgroups as threads in XLA's CPU thread pool, which needs a
thread more than the warpgroups (`mosaic_gpu.interpreted_warpgroups`), so the cases run in a
subprocess started with NPROC=4 and `JAXSPEC_INTERPRET_WARPGROUPS=gpu`; the same process then
clears JAX's caches and runs them again with one warpgroup. Each case is small (a launch with
three warpgroups costs about 1.5 s interpreted, one compiled program per warpgroup thread) and
covers what the handshake must get right: several tiles (the scorer waits for the followers'
`consumed` between them), a row with no tiles and a token that selects nothing (the scorer hands
over the denominator without a tile), split-KV parts, a tree's masks and FP8 dequantization.

    python tests/test_mosaic_warpgroups.py OUT.npz    # what the test's subprocess runs
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jaxspec.pallas_kernels.mla_attention_mosaic import mla_attention_mosaic  # noqa: E402
from jaxspec.pallas_kernels.mosaic_gpu import WARPGROUPS_VARIABLE, interpreted_warpgroups  # noqa: E402
from jaxspec.pallas_kernels.sparse_mla_attention_mosaic import sparse_mla_attention_mosaic  # noqa: E402
from cuda_lowering import mosaic_gpu_dump  # noqa: E402
from test_fp8_cache import fp8_pool_of  # noqa: E402
from test_kernels import latent_inputs, make_window, scale_for  # noqa: E402
from test_sliding_compressed_attention import make_case, run  # noqa: E402
from test_sparse_mosaic import sparse_case  # noqa: E402
from virtual_devices import REPO, virtual_devices_env  # noqa: E402


def dense(fp8: bool, tree: bool, batch: int, part_slots: int):
    """mla_attention_mosaic over two 64-slot pages (two tiles) a row, split into parts of part_slots;
    the rows cycle long, padded, empty (`make_window`), so batch 1 is one long row."""
    rng = np.random.default_rng(70 + fp8)
    latent = 512 if fp8 else 256  # FP8 caches take whole 512-value blocks; 256 gives a follower 128 columns
    window = make_window(rng, batch, 3, 64, 2, tree=tree)
    q_nope, q_rope, cache = latent_inputs(rng, window, 2, latent, 64, jnp.bfloat16)
    cache = fp8_pool_of(cache, latent) if fp8 else cache
    return mla_attention_mosaic(q_nope, q_rope, cache, jnp.asarray(window.page_table), window.vis(),
                                softmax_scale=scale_for(latent, 64), interpret=True, part_slots=part_slots)


def sparse():
    """sparse_mla_attention_mosaic: 80 selected slots (two tiles) a token, -1 and past-the-pages
    slots among them, token (0, 0) selecting nothing."""
    _, args = sparse_case(np.random.default_rng(71), batch=1, num_queries=2, heads=4, latent=256, rope=64,
                          page_size=16, max_pages=6, topk=80)
    return sparse_mla_attention_mosaic(*args, softmax_scale=scale_for(256, 64), interpret=True)


def sliding():
    """DeepSeek-V4's sliding kernel, one token a row (a long row, a short one, an empty one): ring,
    CSA top-k entries and extra keys, D 256."""
    case = make_case(np.random.default_rng(72), batch=3, num_queries=1, heads=4, dim=256, topk=40, extra=2,
                     page=8, ring_pages=2, window=8)
    return (run(case, jnp.bfloat16, backend="mosaic"),)


CASES = {"dense-tree": lambda: dense(False, True, 3, 128), "dense-fp8-chain-parts": lambda: dense(True, False, 1, 64),
         "sparse": sparse, "sliding": sliding}


def run_cases(path: str) -> None:
    """Every case with the GPU's warpgroups, then with one, into an .npz ("case/warpgroups/output")."""
    found = {}
    for warpgroups in ("gpu", "1"):
        os.environ[WARPGROUPS_VARIABLE] = warpgroups
        jax.clear_caches()  # the variable is read when a kernel is traced
        for name, case in CASES.items():
            for i, out in enumerate(jax.block_until_ready(case())):
                found[f"{name}/{warpgroups}/{i}"] = np.asarray(out.astype(jnp.float32))
    np.savez(path, **found)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    path = tmp_path_factory.mktemp("warpgroups") / "outputs.npz"
    env = {**virtual_devices_env(1), "NPROC": "4"}
    subprocess.run([sys.executable, __file__, str(path)], cwd=REPO, env=env, check=True, timeout=600)
    return dict(np.load(path))


def bfloat16_ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in units in the last place of bfloat16 at the larger magnitude (both hold
    bfloat16 values, or float32 ones that are compared exactly)."""
    spacing = np.spacing(np.maximum(np.abs(got), np.abs(want)).astype(ml_dtypes.bfloat16)).astype(np.float32)
    return np.abs(got - want) / np.maximum(spacing, np.finfo(np.float32).tiny)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_the_gpu_warpgroups_compute_what_one_warpgroup_does(outputs, name):
    """Each kernel's three warpgroups give one warpgroup's results: the log-sum-exps bit for bit
    (the scorer computes them either way), the outputs within one bfloat16 unit in the last place
    (the followers' `P V` and normalisation run in programs of their own, which XLA's CPU compiler
    may round differently; a handshake that let a follower read the wrong tile's P, rescale or
    denominator would be off by far more)."""
    produced = sorted(key.rsplit("/", 1)[1] for key in outputs if key.startswith(f"{name}/gpu/"))
    assert produced and produced == sorted(key.rsplit("/", 1)[1] for key in outputs if key.startswith(f"{name}/1/"))
    for i in produced:
        got, want = outputs[f"{name}/gpu/{i}"], outputs[f"{name}/1/{i}"]
        assert got.shape == want.shape and np.array_equal(np.isnan(got), np.isnan(want))
        if i == "1":  # the log-sum-exps
            np.testing.assert_array_equal(got, want)
        finite = ~np.isnan(want)
        assert bfloat16_ulps(got[finite], want[finite]).max(initial=0.0) <= 1.0


def test_the_gpu_warpgroups_are_refused_where_the_pool_would_hang(monkeypatch):
    """JAXSPEC_INTERPRET_WARPGROUPS=gpu with XLA's CPU pool too small for the warpgroups and the
    call that waits for them is a ValueError naming NPROC, before any kernel hangs; an unknown
    setting is one too; unset, one warpgroup."""
    monkeypatch.delenv(WARPGROUPS_VARIABLE, raising=False)
    assert interpreted_warpgroups(3) == 1
    monkeypatch.setenv(WARPGROUPS_VARIABLE, "gpu")
    monkeypatch.setenv("NPROC", "3")
    with pytest.raises(ValueError, match="NPROC=4"):
        interpreted_warpgroups(3)
    monkeypatch.setenv("NPROC", "4")
    assert interpreted_warpgroups(3) == 3
    monkeypatch.setenv(WARPGROUPS_VARIABLE, "2")
    with pytest.raises(ValueError, match="'1' .* or 'gpu'"):
        interpreted_warpgroups(3)


# Compiles dense MLA's three warpgroups for sm_90a at a small shape, in a process of its own: Mosaic
# GPU reads its dump settings at a process's first Mosaic compile.
REGISTER_PROBE = """
import sys, jax, jax.numpy as jnp
from jaxspec import aot
from jaxspec.pallas_kernels.mla_attention_mosaic import mla_attention_mosaic
from jaxspec.pallas_kernels.visibility import Visibility
spec = jax.ShapeDtypeStruct
args = (spec((1, 1, 16, 256), jnp.bfloat16), spec((1, 1, 16, 64), jnp.bfloat16), spec((2, 64, 320), jnp.bfloat16),
        spec((1, 2), jnp.int32), Visibility(spec((1,), jnp.int32), spec((1,), jnp.int32)))
aot.compile_gpu(lambda *a: mla_attention_mosaic(*a, softmax_scale=0.1), *args, devices=aot.gpu_devices("h100"))
"""


def test_the_register_split_fits_what_the_launch_allocates(h100, tmp_path):
    """`setmaxnreg` hands registers between a block's warpgroups and never adds any: the scorer's
    increase waits until the followers' decreases have freed what it asks for. So, compiled for
    sm_90a (ptxas' report and the PTX in Mosaic GPU's dump), the scorer's count plus the followers'
    fit in the block's launch allocation, the registers a thread ptxas reports times the
    warpgroups. A split past it (192 / 160 / 160 against 3 x 168) never returned on an H200, where
    the simulator, which has no register pool, ran it."""
    from jaxspec.pallas_kernels.gathered_softmax_mosaic import FOLLOWERS

    text, report = mosaic_gpu_dump(tmp_path, REGISTER_PROBE, "mla_attention_mosaic")
    launched = int(re.search(r"Used (\d+) registers", report).group(1))
    threads = int(re.search(r"\.maxntid (\d+)", text).group(1))
    increases = {int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", text)}
    decreases = {int(n) for n in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", text)}
    assert threads == 128 * (1 + FOLLOWERS) and len(increases) == len(decreases) == 1
    (scorer,), (follower,) = increases, decreases
    assert scorer * 128 + FOLLOWERS * follower * 128 <= launched * threads
    assert follower <= launched <= scorer  # each moves the way its instruction says


if __name__ == "__main__":
    run_cases(sys.argv[1])
