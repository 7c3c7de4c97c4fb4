"""`jaxspec.memory_plan`: per-device bytes computed before anything is allocated, checked against
what XLA's buffer assignment reports for the compiled program (sm_90a, `jaxspec.aot`; and XLA's
CPU backend for the references a CPU runs)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxspec import aot
from jaxspec.aot.model import compile_model, reduced_depth
from jaxspec.batch import cache_geometry, required_capacity
from jaxspec.decode_config import DecodeConfig
from jaxspec.loop import prefill
from jaxspec.memory_plan import GIB, plan_memory, shard_bytes, weight_bytes
from jaxspec.orbax_io import abstract_model
from jaxspec.presets import preset
from jaxspec.sampling import base_key
from jax.sharding import PartitionSpec as P

from conftest import ON_GPU

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


# DeepSeek-V3.2 narrowed so that a one-layer prefill (plus the MTP block) compiles in seconds: the
# attention's per-head widths and the latent stay DeepSeek's (what the kernels are tiled for), the
# model width, heads, vocabulary, experts and indexer shrink.
NARROW = V32.replace(num_hidden_layers=1, first_k_dense_replace=0, hidden_size=512, num_attention_heads=16,
                     q_lora_rank=512, vocab_size=8192, n_routed_experts=16, n_group=4, topk_group=2,
                     moe_intermediate_size=128, num_experts_per_tok=4, index_n_heads=16, index_topk=256)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, batch", [(None, 4), ((1, 4), 16)])
def test_the_prefill_plan_bounds_the_compiled_chunked_prefill(mesh, batch):
    """A chunked prefill (chunks of 32 of a 512-token prompt, MTP k = 1) on the Triton kernels,
    compiled for sm_90a: the plan's prefill temporaries are at least the compiled program's and
    within 3x of them (the plan adds buffers XLA frees before others are made). It counts no
    attention scores (the kernels stream them), and on a mesh the experts' dispatch of one chunk of
    tokens from every device."""
    try:
        devices = aot.gpu_devices("h100", 1 if mesh is None else math.prod(mesh))
    except RuntimeError as missing:
        pytest.skip(str(missing))
    decode = DecodeConfig(num_draft=1, backend="pallas", prefill_chunk=32)
    # XLA's own sort (the indexer's top-k) spills a few bytes at some widths; the kernels' spills
    # are tests/test_aot.py's to check.
    compiled = compile_model(NARROW, decode, phase="prefill", batch=batch, context=512, devices=devices,
                             mesh_shape=mesh, fail_on_spill=False)
    temp = aot.memory(compiled).temp
    plan = plan_memory(NARROW, decode.replace(max_new_tokens=1), batch=batch, prompt_len=512, mesh=mesh)
    assert temp <= plan.prefill_temp <= 3 * temp, (plan.describe(), temp)


@pytest.mark.parametrize("batch", [4, 16])
def test_the_references_plan_bounds_the_compiled_decode_step(h100, batch):
    """One decode step (MTP k = 2) of NARROW with FP8 weights on "xla", the references, compiled for
    sm_90a: the plan's step temporaries are at least the compiled program's and within 3x of them.
    They count the largest layer's temporaries of the step's calls: at B 4 the MTP's one-token
    calls take the experts' gathered path (16 assignments of 16 experts, a copy of each one's
    matrices), at B 16 the grouped one (`jax.lax.ragged_dot`'s copies per group); and the linears'
    dequantized weights. Counting the logits alone, the plan said 1 MiB against 29 MiB compiled."""
    decode = DecodeConfig(num_draft=2, backend="xla")
    compiled = compile_model(NARROW, decode, phase="decode", batch=batch, context=512, devices=h100,
                             dtype=jnp.float8_e4m3fn)
    temp = aot.memory(compiled).temp
    plan = plan_memory(NARROW, decode.replace(max_new_tokens=512), batch=batch, prompt_len=1, dtype=jnp.float8_e4m3fn)
    assert temp <= plan.step_temp <= 3 * temp, (plan.describe(), temp)


@pytest.mark.parametrize("name, batch, prompt_len, chunk", [("tiny", 2, 256, None), ("tiny-v3", 4, 256, 16)])
def test_the_references_plan_bounds_the_cpu_prefill(name, batch, prompt_len, chunk):
    """What the main job runs on a CPU: the prefill of the pure-jnp references ("auto" there),
    compiled by XLA's CPU backend. The plan's prefill temporaries are at least the compiled
    program's and within 3x of them; one call (the expanded form: scores, their masked copy and the
    probabilities over whole pages) and in chunks (the references' gathered latents). The backend
    and the device are pinned, so on a GPU host the same CPU program is checked (XLA's GPU compiler
    plans its temporaries differently, and "auto" would pick the kernels there)."""
    config = preset(name)
    decode = DecodeConfig(num_draft=1, max_new_tokens=1, prefill_chunk=chunk, backend="xla")
    graphdef, params, _ = abstract_model(config, jnp.float32)
    model = nnx.merge(graphdef, params)
    capacity = required_capacity(prompt_len, decode)
    geometry = cache_geometry(prompt_len, decode, batch_size=batch, capacity=capacity)
    caches = [jax.eval_shape(lambda mtp=mtp: model.init_cache(batch, capacity, mtp=mtp, **geometry.kwargs()))
              for mtp in (False, True)]
    with jax.default_device(jax.devices("cpu")[0]):
        compiled = jax.jit(prefill, static_argnames=("graphdef", "config")).trace(
            graphdef, params, jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32), *caches, jax.eval_shape(lambda: base_key(0)),
            config=decode).lower().compile()
    assert compiled.runtime_executable().client.platform == "cpu"
    temp = compiled.memory_analysis().temp_size_in_bytes
    plan = plan_memory(config, decode, batch=batch, prompt_len=prompt_len, dtype=jnp.float32)
    assert temp <= plan.prefill_temp <= 3 * temp, (plan.describe(), temp)


def test_the_kernels_plan_counts_no_attention_scores():
    """DeepSeek-V3.2 at full width, 96 rows of 32k prompts on 8 devices in chunks of 64 (the setting
    of benchmarks/fp8_caches.py): the references' float32 scores dominate the "xla" plan, the
    kernels' plan has none, and "auto" plans what this host would run (the references on a CPU,
    the Triton kernels on a GPU)."""
    decode = DecodeConfig(num_draft=3, max_new_tokens=256, cache_dtype="fp8", prefill_chunk=64)
    plan = lambda backend: plan_memory(reduced_depth(V32, 1), decode.replace(backend=backend), batch=96,
                                       prompt_len=32509, mesh=(1, 8), dtype=jnp.float8_e4m3fn)
    scores = 12 * 64 * V32.num_attention_heads * 32768 * 4  # [rows x W, H, capacity] float32 per device
    assert plan("xla").prefill_temp > scores > 3 * plan("pallas").prefill_temp
    assert plan("auto") == plan("pallas" if ON_GPU else "xla")


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
