"""Loading onto a mesh: on 8 virtual CPU devices (a subprocess, so the rest of the suite keeps one
device), a Hugging Face checkpoint (`load_hf_checkpoint(..., mesh=)`, `jaxspec.mesh_loading`) and an
orbax save (`restore_model(..., mesh=)`; `save_model` of a sharded model) load into the default plan's shards (routed experts split
8 ways, the rest whole, a stacked parameter's layers axis never split) with exactly the values of a one-device load: FP8 kept or dequantized,
per-expert or transformers' fused experts; and each expert's tensors are read once, not once per
device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from virtual_devices import virtual_devices_env

TESTS = Path(__file__).resolve().parent

SCRIPT = r"""
import collections, sys
import jax, jax.numpy as jnp, ml_dtypes, numpy as np
from flax import nnx
sys.path.insert(0, sys.argv[2])
from test_checkpoint import FP8_CONFIG, hf_tensors, params_of, released_config, write_checkpoint
from jaxspec import shards, sharding
from jaxspec.checkpoint import load_model
from jaxspec.models import DeepseekV3
from jaxspec.orbax_io import save_model
from jaxspec.presets import preset

root = __import__("pathlib").Path(sys.argv[1])
fp8_model = DeepseekV3(preset("tiny"), rngs=nnx.Rngs(6), dtype=ml_dtypes.float8_e4m3fn)
float_model = DeepseekV3(preset("tiny"), rngs=nnx.Rngs(5))
write_checkpoint(root / "fp8", {**released_config(fp8_model.config), "quantization_config": FP8_CONFIG},
                 hf_tensors(fp8_model), shards=2)
write_checkpoint(root / "fused", released_config(float_model.config), hf_tensors(float_model, fused=True))
save_model(fp8_model, root / "orbax")

reads = collections.Counter()
read = shards.read
shards.read = lambda info: (reads.update([(info.file, info.start)]), read(info))[1]
quiet = lambda line: None
mesh = sharding.make_mesh(2, 4)
for directory, dtype in [("fp8", ml_dtypes.float8_e4m3fn), ("fp8", jnp.bfloat16), ("fused", jnp.float32),
                         ("orbax", ml_dtypes.float8_e4m3fn)]:
    whole = params_of(load_model(root / directory, dtype=dtype, log=quiet))
    reads.clear()
    split = load_model(root / directory, dtype=dtype, mesh=mesh, log=quiet)
    if directory == "fp8":  # per-expert tensors: each read once (weight, and its scale), not once per device
        assert max(reads.values()) == 1, reads.most_common(3)
    for path, variable in nnx.to_flat_state(nnx.state(split, nnx.Param)):
        name, value = ".".join(map(str, path)), variable.get_value()
        assert value.dtype == whole[name].dtype and (np.asarray(value) == whole[name]).all(), (directory, name)
        blocks = {s.data.shape for s in value.addressable_shards}
        experts = name.startswith("moe_layers.") + 0  # the experts axis: after the layers axis, never split
        expected = value.shape if ".experts_" not in name else (
            *value.shape[:experts], value.shape[experts] // 8, *value.shape[experts + 1:])
        assert blocks == {expected}, (directory, name, blocks)
# orbax saves a sharded model as it restores one: each device writes its block.
save_model(split, root / "resaved")
resaved = params_of(load_model(root / "resaved", dtype=dtype, log=quiet))
assert resaved.keys() == whole.keys()
for name, value in resaved.items():
    assert value.dtype == whole[name].dtype and (value == whole[name]).all(), ("resaved", name)
print("ok")
"""


def test_checkpoint_loads_into_the_plans_shards(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(TESTS)], env=virtual_devices_env(8),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]
