"""`benchmarks/gather_copies.py`, the Mosaic GPU kernels' gather timed alone: every variant stages
the rows it was asked for (interpreted here, checked again on every GPU run), and each compiles for
an H100 without one, one program per SM within the shared memory a block may use."""

from __future__ import annotations

import functools
import json
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


def test_smoke_run_stages_the_rows_asked_for(tmp_path):
    path = tmp_path / "rows.json"
    assert gather_copies.main(["--smoke", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [row["impl"] for row in rows] == list(gather_copies.VARIANTS)
    assert all(row["correct"] and row["seconds"] > 0 and row["bytes"] > 0 for row in rows)


@pytest.mark.parametrize("variant", list(gather_copies.VARIANTS))
def test_each_variant_compiles_for_h100(h100, variant):
    sizes = gather_copies.FULL
    rows = jax.ShapeDtypeStruct((sizes["programs"], sizes["tiles"] * gather_copies.KEYS), jnp.int32)
    cache = jax.ShapeDtypeStruct((sizes["cache_rows"], sizes["width"]), jnp.bfloat16)
    compiled = aot.compile_gpu(functools.partial(gather_copies.gather, variant, interpret=False), rows, cache,
                               devices=h100)
    [launch] = aot.mosaic_launches(compiled)
    assert launch.grid == (sizes["programs"], 1, 1) and launch.threads == (128, 1, 1)
    assert launch.shared_memory <= SM90_SMEM
