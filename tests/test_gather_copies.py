"""`benchmarks/gather_copies.py`, the Mosaic GPU kernels' gather timed alone: each variant compiles
for an H100 without one, one program per SM within the shared memory a block may use. That every
variant stages the rows it was asked for is checked by its own run, interpreted in the GPU
report's smoke run (`tests/test_gpu_report.py`) and again on every GPU."""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gather_copies  # noqa: E402

from jaxspec import aot  # noqa: E402
from test_sparse_mosaic import SM90_SMEM  # noqa: E402


@pytest.mark.parametrize("variant", list(gather_copies.VARIANTS))
def test_each_variant_compiles_for_h100(h100, variant):
    sizes = gather_copies.FULL
    rows = jax.ShapeDtypeStruct((sizes["programs"], sizes["tiles"] * gather_copies.KEYS), jnp.int32)
    cache = jax.ShapeDtypeStruct((sizes["cache_rows"], sizes["width"]), jnp.bfloat16)
    compiled = aot.compile_gpu(functools.partial(gather_copies.gather, variant, interpret=False), rows, cache,
                               devices=h100)
    [launch] = aot.mosaic_launches(compiled)
    warpgroups = gather_copies.VARIANTS[variant][2]
    assert launch.grid == (sizes["programs"], 1, 1) and launch.threads == (128 * warpgroups, 1, 1)
    assert launch.shared_memory <= SM90_SMEM
