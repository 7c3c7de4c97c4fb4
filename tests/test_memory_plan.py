"""`jaxspec.memory_plan`: per-device bytes computed before anything is allocated, checked against
what XLA's buffer assignment reports for the compiled program (sm_90a, `jaxspec.aot`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from jaxspec import aot
from jaxspec.aot.model import compile_model, reduced_depth
from jaxspec.decode_config import DecodeConfig
from jaxspec.memory_plan import GIB, plan_memory, shard_bytes, weight_bytes
from jaxspec.orbax_io import abstract_model
from jaxspec.presets import preset
from jax.sharding import PartitionSpec as P

V32 = preset("deepseek-v3.2")


def test_a_sharded_fp8_decode_step_agrees_with_the_compiled_program():
    """One full-width V3.2 layer with FP8 weights on a 1 x 8 mesh of H200s (default plan: experts
    split 8 ways, rows 4 per device), B = 32, context 4096, MTP k = 2: the plan's weights, caches and
    loop state are the compiled step's per-device arguments, and with the step's temporaries within
    10% of its peak. (k = 2 at B = 32 is also the window whose absorbed-query dot XLA once failed to
    tile: `models.mla.absorb_query`.)"""
    try:
        devices = aot.gpu_devices("h200", 8)
    except RuntimeError as missing:  # no CUDA plugin, or JAX_PLATFORMS lets it look for a driver
        pytest.skip(str(missing))
    config = reduced_depth(V32, 1)
    decode = DecodeConfig(num_draft=2, backend="pallas")
    compiled = compile_model(config, decode, phase="decode", batch=32, context=4096, devices=devices,
                             dtype=jnp.float8_e4m3fn, mesh_shape=(1, 8))
    memory = aot.memory(compiled)
    plan = plan_memory(config, decode.replace(max_new_tokens=4096), batch=32, prompt_len=1, mesh=(1, 8),
                       dtype=jnp.float8_e4m3fn)
    assert abs(memory.argument - plan.resident) <= 0.01 * memory.argument, (plan.describe(), memory)
    assert abs(memory.alias - plan.caches) <= 0.05 * memory.alias
    peak = memory.argument + memory.temp + memory.output - memory.alias
    assert abs(plan.resident + plan.step_temp - peak) <= 0.10 * peak, (plan.describe(), memory)


def test_weights_count_every_parameter_once_on_one_device():
    config = preset("tiny")
    _, state, _ = abstract_model(config, jnp.float32)
    expected = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert weight_bytes(config, jnp.float32) == expected
    assert expected / 2 < weight_bytes(config, jnp.bfloat16) < expected  # the MoE router stays float32


def test_experts_are_split_over_the_mesh_and_the_rest_is_replicated():
    """Under the default plan the routed experts split over all 8 devices and nothing else does."""
    config = preset("tiny")
    _, state, flat = abstract_model(config, jnp.float32)
    experts = sum(math.prod(v.shape) * 4 for name, v in flat.items() if ".experts_" in name)
    whole = weight_bytes(config, jnp.float32)
    assert experts > 0
    assert weight_bytes(config, jnp.float32, mesh=(1, 8)) == whole - experts + experts // 8
    assert weight_bytes(config, jnp.float32, mesh=(2, 4)) == whole - experts + experts // 8


def test_shard_bytes_rounds_an_uneven_split_up():
    sizes = {"data": 2, "model": 4}
    assert shard_bytes((10, 6), jnp.float32, P(("data", "model"), None), sizes) == 2 * 6 * 4
    assert shard_bytes((10, 6), jnp.bfloat16, P(None, "model"), sizes) == 10 * 2 * 2
    assert shard_bytes((10, 6), jnp.bfloat16, P(), sizes) == 10 * 6 * 2


def test_a_setting_that_does_not_fit_is_refused_with_its_numbers():
    """Six full-width V3.2 layers in bfloat16 (three dense, three MoE of about 21 GiB each, and the MTP
    block, MoE too) on one 80 GB H100."""
    plan = plan_memory(reduced_depth(V32, 6), DecodeConfig(num_draft=3, max_new_tokens=64), batch=1, prompt_len=16,
                       device_memory=80e9)
    assert plan.weights > 80 * GIB
    with pytest.raises(ValueError, match=r"does not fit: \d+\.\d\d GiB per device needed, 74\.51 GiB available "
                                         r"\(weights \d+\.\d\d"):
        plan.check()


def test_a_long_prompt_can_fit_decoding_and_not_its_prefill():
    """Prefill's temporaries grow with batch x prompt x (vocabulary + heads x cache): the plan says
    which program does not fit."""
    config = reduced_depth(V32, 1)
    plan = plan_memory(config, DecodeConfig(num_draft=1, max_new_tokens=64), batch=32, prompt_len=4096,
                       device_memory=141e9)
    assert plan.prefill_temp > 10 * plan.step_temp
    with pytest.raises(ValueError, match="temporaries of prefill"):
        plan.check()


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch=0, prompt_len=4), r"batch=0: must be >= 1"),
    (dict(batch=1, prompt_len=0), r"prompt_len=0: must be >= 1"),
    (dict(batch=1, prompt_len=4, mesh=(0, 8)), r"mesh=\(0, 8\)"),
    (dict(batch=1, prompt_len=4, plan="zz"), r"plan='zz': must be one of"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_memory(preset("tiny"), DecodeConfig(), **kwargs)
