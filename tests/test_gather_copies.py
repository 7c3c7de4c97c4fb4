"""`benchmarks/gather_copies.py`, the Mosaic GPU kernels' gather timed alone: each variant compiles
for an H100 without one, one program per SM within the shared memory a block may use. That every
variant stages the rows it was asked for is checked by its own run: interpreted in the GPU
report's smoke run (`tests/test_gpu_report.py`), except the variants the simulator cannot run
(`interpretable`), and again on every GPU."""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
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
    warpgroups = gather_copies.VARIANTS[variant].warpgroups
    assert launch.grid == (sizes["programs"], 1, 1) and launch.threads == (128 * warpgroups, 1, 1)
    assert launch.shared_memory <= SM90_SMEM


def test_tile_rows_are_whole_pages_and_row_copies_scatter():
    """A "tile" copy's first row is a multiple of KEYS (a tiled copy's dynamic row splits into
    (row // 8, row % 8), and a start off the 8-row grid reads zeros past the tile: `rows_for`);
    the row variants' rows are scattered over the whole cache."""
    rng = np.random.default_rng(0)
    tiles = gather_copies.rows_for("tile", 3, 5, 1024, rng).reshape(3, 5, gather_copies.KEYS)
    assert (tiles[..., 0] % gather_copies.KEYS == 0).all()
    np.testing.assert_array_equal(tiles - tiles[..., :1], np.broadcast_to(np.arange(gather_copies.KEYS), tiles.shape))
    assert tiles.max() < 1024 and len(np.unique(tiles[..., 0])) > 1
    rows = gather_copies.rows_for("rows", 3, 5, 1024, rng)
    assert rows.min() >= 0 and rows.max() < 1024 and (np.diff(rows, axis=1) != 1).any()
