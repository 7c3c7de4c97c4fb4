"""Sharding plans (`jaxspec.sharding`): logical names on every parameter, the plans' rules, argument
checks, and (in a subprocess with 8 virtual CPU devices, `tests/sharding_checks.py`) mesh runs
equal to one-device runs token for token and parameters split as the plans say."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax._src import source_info_util
from jax.sharding import Mesh, PartitionSpec

from jaxspec import generation, sharding
from jaxspec.batch import prepare
from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import generate
from jaxspec.models import DeepseekV3, model_class
from jaxspec.presets import preset
from jaxspec.sampling import base_key
from virtual_devices import virtual_devices_env


@pytest.fixture(scope="module")
def abstract_state():
    return nnx.split(nnx.eval_shape(lambda: DeepseekV3(preset("tiny"), rngs=nnx.Rngs(0))))[1]


def test_every_parameter_is_named(abstract_state):
    for path, variable in nnx.to_flat_state(abstract_state):
        names = variable.get_metadata().get("out_sharding")
        where = ".".join(map(str, path))
        assert names is not None and len(names) == len(variable.shape), where
        assert set(names) <= set(sharding.LOGICAL_AXES) | {None}, (where, names)


def test_plan_rules(abstract_state):
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(sharding.param_specs(abstract_state, "dp"))}
    # Stacked layers: the leading `layers` axis is never split.
    assert flat["moe_layers.mlp.experts_gate_proj"] == PartitionSpec(None, ("data", "model"), None, None)
    assert flat["moe_layers.self_attn.q_b_proj.weight"] == PartitionSpec(None, None, None)
    assert flat["moe_layers.mlp.gate_weight"] == PartitionSpec(None, None, None)  # the router: every device routes
    tp = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(sharding.param_specs(abstract_state, "tp"))}
    assert tp["moe_layers.self_attn.q_b_proj.weight"] == PartitionSpec(None, None, "model")
    assert tp["dense_layers.self_attn.o_proj.weight"] == PartitionSpec(None, "model", None)
    assert tp["mtp.block.mlp.experts_down_proj"] == PartitionSpec(("data", "model"), None, None)


def test_bad_mesh_and_plan():
    device = np.array(jax.devices()[:1]).reshape(1, 1)
    with pytest.raises(ValueError, match="axis names must be"):
        sharding.check_mesh(Mesh(device, ("x", "y")))
    with pytest.raises(ValueError, match="plan='fsdp'"):
        sharding.check_mesh(Mesh(device, sharding.MESH_AXES), "fsdp")
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh(4, 4)
    model = DeepseekV3(preset("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="axis names must be"):
        generate(model, [[1, 2]], DecodeConfig(), mesh=Mesh(device, ("x", "y")))
    with pytest.raises(ValueError, match="page_table: not supported with a mesh"):
        generate(model, [[1, 2]], DecodeConfig(), mesh=Mesh(device, sharding.MESH_AXES),
                 page_table=jax.numpy.zeros((1, 1), jax.numpy.int32))


def test_mesh_runs_equal_one_device():
    """8 virtual devices: greedy (k=3 chain on V3.2, dynamic tree on V3) and a sampled run equal
    the one-device runs on meshes 2x4 and 1x8, plans dp and tp, a batch no mesh divides; every
    parameter's per-device block as the plan says."""
    checks = pathlib.Path(__file__).resolve().parent / "sharding_checks.py"
    done = subprocess.run([sys.executable, str(checks)], env=virtual_devices_env(8), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "sharding checks passed" in done.stdout


def _zero_sized_operands(jaxpr) -> list[str]:
    """Where an equation of `jaxpr` (a core Jaxpr), or of any jaxpr nested in it, takes a
    zero-sized array: 'primitive shape at file:line' for each."""
    found = []
    for eqn in jaxpr.eqns:
        for var in eqn.invars:
            if 0 in getattr(var.aval, "shape", ()):
                found.append(f"{eqn.primitive} {var.aval.str_short()} at {source_info_util.summarize(eqn.source_info)}")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _zero_sized_operands(sub)
    return found


@pytest.mark.parametrize("preset_name, draft", [("tiny", dict(num_draft=3)), ("tiny", dict(num_draft=1, tree="2,2,3")),
                                                ("tiny", dict(num_draft=1, tree="small", temperature=1.0)),
                                                ("tiny-v4", dict(num_draft=2))])
def test_mesh_programs_hold_no_zero_sized_arrays(preset_name, draft):
    """The mesh program (prefill and loop in one shard_map) traced on a 1x1 mesh, for chains,
    dynamic and sampled static trees, V3.2 and V4, has no zero-sized array anywhere. jax 0.11
    hoists such constants into the shard_map (`x.at[:, a:b].set(y)` with a:b the whole axis is a
    scatter with a zero-sized index: the dynamic tree 2,2,3 wrote its one-level window so), and
    Shardy's canonicalizer (jax 0.11.2) crashes the compile removing them, a segfault."""
    model = model_class(preset(preset_name))(preset(preset_name), rngs=nnx.Rngs(0))
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), sharding.MESH_AXES)
    config = DecodeConfig(max_new_tokens=8, **draft)
    batch = prepare(model, [[1, 2, 3], [4]], config, mesh=mesh, plan="dp")
    graphdef, params = nnx.split(model)
    fn, (params, sampling), static = generation._program(graphdef, params, batch, config, mesh, "dp")
    traced = fn.trace(graphdef, params, batch.prompts, batch.prompt_lens, batch.target_cache, batch.mtp_cache,
                      base_key(0), sampling, *static)
    assert any(eqn.primitive.name == "shard_map" for eqn in traced.jaxpr.jaxpr.eqns)
    assert _zero_sized_operands(traced.jaxpr.jaxpr) == []
