"""FP8-resident weights (DeepSeek's float8_e4m3fn with 128 x 128 block scales, kept on device):
block quantization against numpy, a quantized Linear against the dequantized weight on both
backends, a tiny FP8 model's logits bit for bit equal to the same model dequantized at load, and one
DeepSeek-V3.2 MoE layer compiled for an H100 reading 1 byte per expert weight.

Random FP8 models quantize a normal draw (`block_fp8.quantize`); their dequantized twin is built
the way the loader dequantizes (`jaxspec.fp8.dequantize(...)` in float32, cast to bfloat16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxspec import fp8
from jaxspec.models import DeepseekV3, DeepseekV4
from jaxspec.models.layers import Linear
from jaxspec.models.moe import MoE
from jaxspec.pallas_kernels import Visibility, block_fp8
from jaxspec.pallas_kernels.backend import DEFAULT_DEVICE_KIND, gpu_lowering
from jaxspec.pallas_kernels.grouped_matmul_pallas import grouped_matmul_pallas
from jaxspec.presets import preset
from conftest import ON_GPU, on_cpu
from test_tree_decoding import equations

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def test_quantize_blocks_against_numpy():
    """Per 128 x 128 block (partial edge blocks, a leading expert axis): scale = amax / 448, values
    within e4m3's rounding, and dequantization is float32(fp8) times its block's scale, exactly."""
    rng = np.random.default_rng(0)
    weight = (rng.normal(size=(2, 300, 200)) * rng.uniform(0.01, 10, (2, 300, 1))).astype(np.float32)
    quantized, scale = map(np.asarray, jax.jit(block_fp8.quantize)(weight))
    assert quantized.dtype == ml_dtypes.float8_e4m3fn and scale.shape == (2, 3, 2) and scale.dtype == np.float32
    e, rows, cols = np.indices(weight.shape)
    block_scale = scale[e, rows // 128, cols // 128]
    for i in range(3):
        for j in range(2):
            amax = np.abs(weight[:, 128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]).max(axis=(1, 2))
            np.testing.assert_allclose(scale[:, i, j], amax / FP8_MAX, rtol=1e-6)
    out = np.asarray(block_fp8.dequantize(quantized, scale, jnp.float32))
    np.testing.assert_array_equal(out, quantized.astype(np.float32) * block_scale)
    assert np.all(np.abs(out - weight) <= 2 ** -4 * np.abs(weight) + 2 ** -9 * block_scale)
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(quantized[0], scale[0], (128, 128))), out[0])


def test_quantize_power_of_two_scales():
    """power_of_two (DeepSeek's "ue8m0"): each block's scale is amax / 448 rounded up to a power
    of two (kept where it already is one), so every value fits e4m3 and dequantizes as before:
    float32(fp8) times the scale, exactly."""
    rng = np.random.default_rng(1)
    weight = (rng.normal(size=(3, 256, 384)) * 10.0 ** rng.uniform(-6, 2, (3, 1, 1))).astype(np.float32)
    weight[0, :128, :128] *= FP8_MAX / np.abs(weight[0, :128, :128]).max() * 2.0 ** -10  # amax / 448 = 2^-10
    quantized, scale = map(np.asarray, jax.jit(functools.partial(block_fp8.quantize, power_of_two=True))(weight))
    blocks = np.abs(weight).reshape(3, 2, 128, 3, 128).max(axis=(2, 4)) / np.float32(FP8_MAX)
    np.testing.assert_array_equal(scale, 2.0 ** np.ceil(np.log2(blocks.astype(np.float64))))
    assert scale[0, 0, 0] == 2.0 ** -10
    out = np.asarray(block_fp8.dequantize(quantized, scale, jnp.float32))
    block_scale = np.repeat(np.repeat(scale, 128, axis=1), 128, axis=2)
    np.testing.assert_array_equal(out, quantized.astype(np.float32) * block_scale)
    assert np.all(np.abs(out - weight) <= 2 ** -4 * np.abs(weight) + 2 ** -9 * block_scale)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_random_fp8_model_scales_follow_the_configs_scale_fmt(scale_fmt):
    """A random FP8 model draws its block scales in its config's format: every `*_scale_inv` of a
    "ue8m0" tiny V3.2 (attention, indexer, dense MLP, experts, MTP) is a power of two, and amax /
    448 ones otherwise (almost none a power of two)."""
    model = DeepseekV3(preset("tiny", scale_fmt=scale_fmt), rngs=nnx.Rngs(0), dtype=FP8)
    scales = [np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model))
              if "scale_inv" in jax.tree_util.keystr(path)]
    assert len(scales) > 10
    powers = np.concatenate([np.frexp(scale)[0].reshape(-1) == 0.5 for scale in scales])
    assert powers.all() if scale_fmt == "ue8m0" else powers.mean() < 0.01


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_quantized_linear_multiplies_by_the_dequantized_weight(backend):
    """A 300 -> 200 FP8 Linear (partial blocks both ways) equals the bfloat16 dequantized weight's
    product bit for bit: XLA's dot on "xla", the grouped kernel with a bfloat16 rhs on "pallas"."""
    layer = Linear(300, 200, rngs=nnx.Rngs(1), dtype=FP8, names=("embed", "mlp"))
    weight, scale_inv = layer.weight[...], layer.weight_scale_inv[...]
    assert weight.dtype == FP8 and scale_inv.shape == (3, 2)
    assert layer.weight_scale_inv.get_metadata()["out_sharding"] == layer.weight.get_metadata()["out_sharding"]
    dense = fp8.dequantize(weight, scale_inv, (128, 128)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(layer.dense_weight()), np.asarray(dense))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 300)), jnp.bfloat16)
    got = jax.jit(lambda x: layer(x, backend=backend))(x)
    if backend == "xla":
        want = x @ dense
    else:  # (natively on a GPU: the interpreter's dot sums K in another order than Triton's)
        want = grouped_matmul_pallas(x.reshape(10, 300), dense[None], jnp.asarray([10]),
                                     interpret=not ON_GPU).reshape(2, 5, 200)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(x @ dense, np.float32), rtol=2e-2, atol=2e-2)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def dequantized_twin(model: DeepseekV3) -> DeepseekV3:
    """The bfloat16 model a dequantizing load of `model`'s FP8 weights gives (every other
    parameter as it is)."""
    values = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekV3(model.config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)))
    twin = {}
    for path, variable in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        value = values[name]
        if name + fp8.SCALE_SUFFIX in values:
            value = fp8.dequantize(value, values[name + fp8.SCALE_SUFFIX], (128, 128)).astype(jnp.bfloat16)
        assert value.dtype == variable.get_value().dtype, name
        twin[path] = variable.replace(value)
    assert len(twin) == len(values) - sum(name.endswith(fp8.SCALE_SUFFIX) for name in values)
    return nnx.merge(graphdef, nnx.from_flat_state(twin))


@functools.cache
def _forward(graphdef, backend):
    @jax.jit
    def run(params, tokens, positions, cache, vis):
        return nnx.merge(graphdef, params)(tokens, positions, cache, vis, backend=backend)
    return run


def prefill_then_decode(model, backend):
    """Logits and hidden states of a 6-token prompt (2 rows, one padded to 4 tokens: 20 token-expert
    pairs, the grouped expert path), then on "xla" of one decode token per row on its cache (4 pairs:
    the gathered path; on "pallas" it would run the same kernels again)."""
    graphdef, params = nnx.split(model)
    if backend == "xla":
        params = on_cpu(params)
    run = _forward(graphdef, backend)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 256, (2, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    vis = Visibility(jnp.zeros(2, jnp.int32), jnp.asarray([6, 4], jnp.int32))
    logits, hidden, cache = run(params, tokens, positions, model.init_cache(2, 16, page_size=8), vis)
    if backend == "pallas":
        return [logits, hidden]
    prefix = jnp.asarray([6, 4], jnp.int32)
    next_logits, next_hidden, _ = run(params, jnp.asarray([[7], [9]], jnp.int32), prefix[:, None], cache,
                                      Visibility(prefix, jnp.ones(2, jnp.int32)))
    return [logits, hidden, next_logits, next_hidden]


@pytest.fixture(scope="module")
def fp8_model_and_twin(fp8_tiny) -> tuple[DeepseekV3, DeepseekV3]:
    """A random FP8 tiny DeepSeek-V3.2 (MLA, DSA indexer, MoE, MTP) and its dequantized twin."""
    return fp8_tiny, dequantized_twin(fp8_tiny)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_fp8_model_equals_its_dequantized_twin_bit_for_bit(fp8_model_and_twin, backend):
    """The FP8 model and the same weights dequantized to bfloat16: prefill and a decode step give
    identical logits and hidden states (pallas: interpret mode on the CPU, the kernels on a GPU;
    xla: on the CPU device everywhere, `conftest.on_cpu`)."""
    model, twin = fp8_model_and_twin
    assert model.dtype == jnp.bfloat16 and model.layer(1).mlp.experts_up_proj.dtype == FP8
    assert model.lm_head.weight_scale_inv is None and model.mtp.eh_proj.weight_scale_inv is None
    for got, want in zip(prefill_then_decode(model, backend), prefill_then_decode(twin, backend)):
        assert np.isfinite(np.asarray(got, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------------------------------------------------------
# One DeepSeek-V3.2 MoE layer with FP8 experts compiled for an H100 (no GPU needed; the CUDA plugin is)
# ----------------------------------------------------------------------------------------------


def test_fp8_moe_layer_compiled_reads_fp8_bytes(h100):
    """Decode at batch 32 (256 token-expert pairs over 256 experts): the layer's parameters are
    1 byte per expert weight plus 4 bytes per 128 x 128 block, the bytes accessed are those FP8
    bytes of every expert that can be hit (not twice them), and no temporary holds a bfloat16 copy
    of an expert's weights, let alone the stack."""
    from jaxspec import aot

    config = preset("deepseek-v3.2")
    dim, hidden, experts, topk = (config.hidden_size, config.moe_intermediate_size, config.n_routed_experts,
                                  config.num_experts_per_tok)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: MoE(config, rngs=nnx.Rngs(0), dtype=FP8)))
    num_tokens = 32
    x = jax.ShapeDtypeStruct((1, num_tokens, dim), jnp.bfloat16)
    compiled = aot.compile_gpu(lambda p, x: nnx.merge(graphdef, p)(x, backend="auto"), params, x, devices=h100)

    expert_weights = 3 * dim * hidden
    fp8_bytes = expert_weights + 3 * 4 * (dim // 128) * (hidden // 128)  # one expert, weights + scales
    stack_bytes = (experts + config.n_shared_experts) * fp8_bytes + dim * experts * 4 + experts * 4
    mem = aot.memory(compiled)
    assert stack_bytes <= mem.argument <= stack_bytes + 4 * num_tokens * dim
    cost = aot.program_cost(compiled)
    # Three for the routed experts, three for the shared expert's FP8 Linears (one group each).
    assert [call.name for call in aot.pallas_calls(compiled)] == ["grouped_matmul"] * 6
    hit = min(experts, num_tokens * topk) + config.n_shared_experts
    ideal = hit * fp8_bytes + dim * experts * 4 + 2 * num_tokens * dim * 2
    assert ideal * 0.99 <= cost.bytes_accessed <= 1.25 * ideal
    assert mem.temp < 2 * dim * hidden  # less than one expert matrix in bfloat16
    launches = aot.kernel_launches(compiled)
    assert launches and all(l.shared_memory <= 227 * 1024 and l.spill_stores == l.spill_loads == 0 for l in launches)


def test_fp8_linear_compiled_reads_fp8_bytes(h100):
    """DeepSeek-V3.2's o_proj (16384 -> 7168) in FP8 at a k = 3 verification window (B = 32, Q = 4):
    1 byte per weight plus scales as parameter and as bytes accessed, and no bfloat16 copy of the
    weight in temp (XLA's dot of the dequantized weight would write one: 235 MB)."""
    from jaxspec import aot

    fan_in, fan_out, rows = 16384, 7168, 128
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Linear(fan_in, fan_out, rngs=nnx.Rngs(0), dtype=FP8)))
    x = jax.ShapeDtypeStruct((32, 4, fan_in), jnp.bfloat16)
    compiled = aot.compile_gpu(lambda p, x: nnx.merge(graphdef, p)(x, backend="auto"), params, x, devices=h100)
    weight_bytes = fan_in * fan_out + 4 * (fan_in // 128) * (fan_out // 128)
    activations = rows * (fan_in + fan_out) * 2
    mem, cost = aot.memory(compiled), aot.program_cost(compiled)
    assert [call.name for call in aot.pallas_calls(compiled)] == ["grouped_matmul"]
    assert weight_bytes <= mem.argument <= weight_bytes + rows * fan_in * 2
    assert weight_bytes <= cost.bytes_accessed <= 1.05 * (weight_bytes + activations)
    assert mem.temp < 0.05 * 2 * fan_in * fan_out
    # the projection's op classes: the kernel's stated cost is the grouped matmul's, the rest XLA's
    (call,) = aot.pallas_calls(compiled)
    classes = aot.op_class_costs(compiled)
    assert classes["grouped_matmul"] == (call.flops, call.bytes_accessed) and classes["attention"] == (0, 0)
    assert classes["xla"] == (cost.xla_flops, cost.xla_bytes)


@pytest.mark.parametrize("name, backend", [("tiny", "xla"), ("tiny", "pallas"), ("tiny-v4", "xla")])
def test_every_fp8_linear_follows_the_models_backend(name, backend):
    """A tiny FP8 model's decode forward (B 2, one token) traced for an H100 as `aot.compile_gpu`
    traces it (`gpu_lowering`: which kernels run is decided while tracing, and the compiled
    program's Pallas launches are the traced program's `pallas_call`s): on "xla", the reference,
    it runs no Pallas kernel at all, its FP8 linears included (XLA's dot of the dequantized weight;
    a layer left to resolve "auto" itself would run Triton's grouped matmul there: 18 of them in
    V3.2, 30 in V4); on "pallas" each FP8 linear a V3.2 layer calls is one grouped-matmul site
    (kv_b_proj is read as its dequantized weight, `MLA._up_projections`), beside the routed
    experts' three."""
    config = preset(name)
    model = nnx.eval_shape(lambda: (DeepseekV4 if config.is_v4 else DeepseekV3)(config, rngs=nnx.Rngs(4), dtype=FP8))
    graphdef, params = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((2, 1), jnp.int32)
    cache = jax.eval_shape(lambda: model.init_cache(2, 64, page_size=64))
    vis = Visibility(jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32))
    forward = lambda p, t, c, v: nnx.merge(graphdef, p)(t, t, c, v, backend=backend)[0]
    with gpu_lowering(DEFAULT_DEVICE_KIND):
        jaxpr = jax.make_jaxpr(forward)(params, tokens, cache, vis).jaxpr
    names = [eqn.params["name"] for eqn in equations(jaxpr) if eqn.primitive.name == "pallas_call"]
    if backend == "xla":
        assert names == []
    else:
        linears = [path for run in model.layer_runs for path, module in nnx.iter_graph(getattr(model, run.name))
                   if isinstance(module, Linear) and module.weight_scale_inv is not None and path[-1] != "kv_b_proj"]
        assert linears and names.count("grouped_matmul") == len(linears) + 3
