"""One process of tests/test_multihost.py's pair: the Python entry points on a mesh that spans two
processes, several checks in one run (starting processes and compiling is what costs).

    python multihost_worker.py ROOT PORT PROCESS_ID

ROOT holds `hf/` (a Hugging Face checkpoint of the trained tiny model) and `case.json` (the prompts,
the mesh and the decode settings). The process joins the run, then writes `ROOT/result-<id>.json`:

  * disagreement: check_agreement's error when the processes pass different decode settings;
  * reads: each tensor this process read from the safetensors files (jaxspec.shards.read is the
    loader's only way to tensor data) while loading the checkpoint onto the mesh;
  * greedy: greedy MTP tokens of the loaded model;
  * restored_params / restored_differ: the model saved with save_model and restored with
    restore_model by both processes, against the loaded one, parameter by parameter;
  * sampled: the restored model's sampled tokens with a fixed key.

and then decodes until it is killed (the lost-peer check kills its peer meanwhile).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

root, port, process_id = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
case = json.loads((root / "case.json").read_text())

from jaxspec import distributed  # noqa: E402  (initialize comes before any other JAX call)

distributed.initialize(f"127.0.0.1:{port}", 2, process_id, initialization_timeout=60,
                       heartbeat_timeout=case["heartbeat_timeout"], shutdown_timeout=case["heartbeat_timeout"])

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxspec import shards, sharding  # noqa: E402
from jaxspec.checkpoint import load_model  # noqa: E402
from jaxspec.decode_config import DecodeConfig  # noqa: E402
from jaxspec.generation import generate  # noqa: E402
from jaxspec.orbax_io import restore_model, save_model  # noqa: E402

result = {"process": jax.process_index(), "local_devices": jax.local_device_count()}
try:
    distributed.check_agreement(decoding={"max_new_tokens": 12 + process_id})
except ValueError as error:
    result["disagreement"] = str(error)
distributed.check_agreement(decoding=case["decode"])

reads = []  # (file, first byte) of every tensor read
read = shards.read
shards.read = lambda info: (reads.append((Path(info.file).name, info.start)), read(info))[1]
mesh = sharding.make_mesh(*case["mesh"])
model = load_model(root / "hf", mesh=mesh, log=lambda line: None)
shards.read = read
result["reads"] = reads

prompts = case["prompts"]
greedy = DecodeConfig(num_draft=3, eos_token_id=model.config.eos_token_id, **case["decode"])


def tokens(run_model, config, key=0) -> list[list[int]]:
    done = distributed.gather(generate(run_model, prompts, config, key=key, mesh=mesh))
    return [done.row_tokens(row) for row in range(len(prompts))]


def params(of) -> dict:
    """Every parameter of `of`, whole, by dotted path."""
    flat = nnx.to_flat_state(nnx.state(of, nnx.Param))
    return distributed.gather({".".join(map(str, path)): variable.get_value() for path, variable in flat})


result["greedy"] = tokens(model, greedy)
save_model(model, root / "saved")
restored = restore_model(root / "saved", mesh=mesh)
before, after = params(model), params(restored)
result["restored_params"] = len(after)
result["restored_differ"] = sorted(name for name in before.keys() | after.keys() if name not in before
                                   or name not in after or before[name].dtype != after[name].dtype
                                   or not (before[name] == after[name]).all())
sampled = DecodeConfig(num_draft=3, eos_token_id=model.config.eos_token_id, temperature=1.0, top_k=5,
                       **case["decode"])
result["sampled"] = tokens(restored, sampled, key=case["sample_key"])
(root / f"result-{process_id}.part").write_text(json.dumps(result))
(root / f"result-{process_id}.part").rename(root / f"result-{process_id}.json")  # whole when it appears

print("decoding until killed", flush=True)
while True:  # a program compiled above: the peer dies mid-decode, not mid-compile
    jax.block_until_ready(generate(model, prompts, greedy, mesh=mesh).tokens)
