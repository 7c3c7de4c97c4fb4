"""DeepSeek-V4 on a mesh (`jaxspec.sharding`): every V4 parameter's logical names map under both
plans, every leaf of a `V4Cache` is split by rows, and (in a subprocess with 8 virtual CPU devices,
this file run as a script) greedy MTP k = 3 on tiny-v4 equals the one-device run token for token on
a 4x2 mesh under tp: rings, compressor states and entries split into 4 row blocks, heads (sinks, the
grouped output projection) split 2 ways, hash routing inside the shard_map (each device looks its
own tokens' experts up), experts split over all 8 devices. (Each mesh run is a compile of about
40 s here; dp's row split is tp's over both axes, and V3's meshes run every shape and plan in
test_sharding.)

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python tests/test_sharding_v4.py
"""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from jaxspec import sharding
from jaxspec.cache_v4 import init_v4_cache
from jaxspec.decode_config import DecodeConfig
from jaxspec.orbax_io import abstract_model
from jaxspec.presets import preset
from virtual_devices import virtual_devices_env

# Three rows of different lengths: the mesh's 4 row shards do not divide them, so the run pads the batch.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 8], [20, 21, 22, 23, 24]]


def test_every_v4_parameter_maps_under_both_plans():
    _, state, _ = abstract_model(preset("tiny-v4"), jax.numpy.float32)
    for plan in sharding.PLANS:
        specs = dict(nnx.to_flat_state(sharding.param_specs(state, plan)))
        for path, variable in nnx.to_flat_state(state):
            names = variable.get_metadata().get("out_sharding")
            where = ".".join(map(str, path))
            assert names is not None and len(names) == len(variable.shape), where
            spec = specs[path].get_value()
            axes = {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}
            assert axes <= set(sharding.MESH_AXES), (plan, where, spec)
            if "hc" in where:  # mHC and the hyper head: small, replicated
                assert axes == set(), (plan, where, spec)
    tp = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(sharding.param_specs(state, "tp"))}
    # Layers 0 and 1 are the first unit of the first stack (`layer_groups.0`), whose axis stays whole.
    assert tp["layer_groups.0.1.self_attn.sinks"] == PartitionSpec(None, "model")
    assert tp["layer_groups.0.0.mlp.tid2eid"] == PartitionSpec(None, None, None)  # every device looks up its own tokens


@pytest.mark.parametrize("cache_dtype", [None, "fp8"])
def test_v4_cache_split_by_rows(cache_dtype):
    cache = jax.eval_shape(lambda: init_v4_cache(preset("tiny-v4"), 4, 64, max_window=4, page_size=8, row_shards=2,
                                                 cache_dtype=cache_dtype))
    for plan in sharding.PLANS:
        specs = sharding.cache_specs(cache, plan)
        leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        assert len(leaves) == len(jax.tree.leaves(cache))
        rows = sharding.row_spec(plan)
        # Every pool split by pages (axis 1, after the stacked layers), an FP8 pool's every part
        # alike; page tables and lengths by rows.
        pools = PartitionSpec(None, *rows)
        assert specs.csa_index_entries == specs.hca_state == pools
        assert jax.tree.leaves(specs.window, is_leaf=lambda x: isinstance(x, PartitionSpec)) == (
            [pools] * (3 if cache_dtype else 1))
        assert specs.lengths == specs.page_table["window"] == rows


def test_v4_mesh_runs_equal_one_device():
    done = subprocess.run([sys.executable, __file__], env=virtual_devices_env(8), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "v4 sharding checks passed" in done.stdout


def main() -> None:
    from jaxspec.generation import generate
    from jaxspec.models import DeepseekV4, moe

    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    moe.EP_CHUNK_TOKENS = 4  # prefills exchange tokens in several chunks
    model = DeepseekV4(preset("tiny-v4"), rngs=nnx.Rngs(0))
    # 16 new tokens: the rows cross the sliding window (8) and many CSA (4) / HCA (8) blocks.
    chain = DecodeConfig(num_draft=3, max_new_tokens=16, backend="xla")
    ref = generate(model, PROMPTS, chain)
    # tp on 4x2: each device holds 2 of the 4 heads, one whole output group (o_groups 2).
    got = generate(model, PROMPTS, chain, mesh=sharding.make_mesh(4, 2), plan="tp")
    for field in ("tokens", "num_tokens", "accepted"):
        a, b = np.asarray(getattr(got, field)), np.asarray(getattr(ref, field))
        assert a.shape == b.shape and (a == b).all(), f"V4 k=3 tp on 4x2 {field}:\n{a}\n{b}"
    # 2x4 tp would leave one head per device, half of an output group: refused before tracing.
    try:
        generate(model, PROMPTS, chain, mesh=sharding.make_mesh(2, 4), plan="tp")
    except ValueError as refused:
        assert "o_groups=2" in str(refused), refused
    else:
        raise AssertionError("tp on 2x4 with o_groups 2 was not refused")
    print("v4 sharding checks passed")


if __name__ == "__main__":
    main()
