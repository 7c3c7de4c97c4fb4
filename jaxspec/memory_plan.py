"""How many bytes a decoding setting needs on each device, computed before anything is allocated.

    plan = plan_memory(preset("deepseek-v3.2"), DecodeConfig(num_draft=3), batch=32, prompt_len=2048,
                       mesh=(1, 8), dtype=jnp.float8_e4m3fn, device_memory=141e9)
    print(plan.describe()); plan.check()      # ValueError naming the numbers if it does not fit

Everything is arithmetic on shapes: the parameters of an abstract model (`nnx.eval_shape`, their
logical axis names mapped to the mesh by `jaxspec.sharding`), the caches `generate` would build
(`default_capacity` slots per row, rows padded to the mesh and split as the plan says), the loop
state, and an estimate of the largest temporaries of the two programs `generate` runs (prefill over
the whole prompt or, with `DecodeConfig.prefill_chunk`, one chunk at a time, and one speculative
step; with `DecodeConfig.prefill_in_loop` the step alone, its state holding the prompts). The
figures are per device, for the fullest device.

Weights and caches are exact: they match the compiled programs' argument bytes, the caches being
the arrays the model's `init_cache` builds for the geometry `jaxspec.batch` gives them. Temporaries
are estimated, erring high, from the terms that dominate XLA's buffer assignment for these programs,
and follow the program that will run: the backend `DecodeConfig.backend` resolves to
(`pallas_kernels.resolve_backend`: "auto" is the pure-jnp references on a CPU host, so a plan for a
GPU made on a CPU host, as `benchmarks/fp8_caches.py` makes it, names `backend="pallas"`) and the
mesh. A decode step: the float32 logits of the window and a companion of each, and the largest one
layer's temporaries of its model calls, each a chunk of 1 to `window` tokens a row (on "xla" at few
tokens, the experts' gathered matrices). On "xla" both count a layer's FP8 linear weights
dequantized in float32 too. Prefill, per call of
T = rows x W tokens on a device (W the prompt, or one `prefill_chunk`): the float32 logits [T, V]
(every plan replicates the vocabulary, `jaxspec.sharding.RULES`: each device computes its own
rows' logits in full), a few [T, D] activations, and one layer's temporaries as the model counts
them (`DecoderModel.prefill_layer_bytes`: attention for that backend, where the kernels stream the
scores the references materialize, and the experts' dispatch, on a mesh one chunk of every device's
tokens). The terms are added although XLA frees some before it makes others (the logits come after
the layers), so they err high: 1.6-3.7x what sm_90a and XLA CPU compiles hold, which
docs/model-interface.md lists.
At DeepSeek-V3.2's scale the weights and caches dominate; a one-call prefill's scores and keys grow
with batch x prompt x heads x cache, which is why a long prompt at a large batch can fit for
decoding and not for its prefill (the plan says which; a `prefill_chunk` bounds them by the chunk
instead of the prompt).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from flax import nnx

from jaxspec import sharding
from jaxspec.batch import cache_geometry, default_capacity
from jaxspec.decode_config import DecodeConfig
from jaxspec.model_config import ModelConfig
from jaxspec.models.interface import cache_bytes
from jaxspec.orbax_io import abstract_model
from jaxspec.pallas_kernels import resolve_backend

GIB = 2 ** 30


def readable(num_bytes: int) -> str:
    """E.g. "3.5 MiB", "131.32 GiB"."""
    return f"{num_bytes / 2 ** 20:,.1f} MiB" if num_bytes < GIB else f"{num_bytes / GIB:,.2f} GiB"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device: weights, caches (target and MTP), loop state, and the larger of the two
    programs' estimated temporaries (prefill, decode step). device_memory: what a device holds
    (None: unknown, `check` passes)."""

    weights: int
    caches: int
    state: int
    prefill_temp: int
    step_temp: int
    device_memory: int | None = None

    @property
    def resident(self) -> int:
        """What stays on the device between programs: weights, caches and loop state."""
        return self.weights + self.caches + self.state

    @property
    def total(self) -> int:
        """The peak: the resident bytes plus the larger program's temporaries."""
        return self.resident + max(self.prefill_temp, self.step_temp)

    def describe(self) -> str:
        rows = [("weights", self.weights), ("caches", self.caches), ("loop state", self.state),
                ("prefill temporaries", self.prefill_temp), ("decode step temporaries", self.step_temp),
                ("total (peak of the two programs)", self.total)]
        lines = [f"{name:34s} {value / GIB:10.2f} GiB" for name, value in rows]
        if self.device_memory is not None:
            lines.append(f"{'device memory':34s} {self.device_memory / GIB:10.2f} GiB")
        return "\n".join(lines)

    def check(self) -> None:
        """Raise ValueError, naming the numbers, when the plan does not fit `device_memory`."""
        if self.device_memory is None or self.total <= self.device_memory:
            return
        worst = "prefill" if self.prefill_temp >= self.step_temp else "the decode step"
        raise ValueError(f"does not fit: {self.total / GIB:.2f} GiB per device needed, {self.device_memory / GIB:.2f} "
                         f"GiB available (weights {self.weights / GIB:.2f}, caches {self.caches / GIB:.2f}, loop "
                         f"state {self.state / GIB:.2f}, temporaries of {worst} "
                         f"{max(self.prefill_temp, self.step_temp) / GIB:.2f}); use more devices, a smaller batch "
                         "or context, or FP8 weights")


def _axis_sizes(mesh: Mesh | tuple[int, int] | None) -> dict[str, int]:
    if mesh is None:
        return {axis: 1 for axis in sharding.MESH_AXES}
    if isinstance(mesh, Mesh):
        sharding.check_mesh(mesh)
        return dict(mesh.shape)
    shape = tuple(mesh)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"mesh={mesh!r}: a jax.sharding.Mesh or a (data, model) pair of sizes >= 1")
    return dict(zip(sharding.MESH_AXES, shape))


def shard_bytes(shape: tuple[int, ...], dtype, spec: PartitionSpec, axis_sizes: dict[str, int]) -> int:
    """Bytes of the largest shard of a [shape] `dtype` array laid out by `spec` on a mesh of
    `axis_sizes` (a split that does not divide rounds up, as XLA pads it)."""
    dims = list(shape)
    for i, axes in enumerate(tuple(spec)[:len(dims)]):
        if axes is None:
            continue
        parts = math.prod(axis_sizes[a] for a in ((axes,) if isinstance(axes, str) else axes))
        dims[i] = -(-dims[i] // parts)
    return math.prod(dims) * jnp.dtype(dtype).itemsize


def weight_bytes(config: ModelConfig, dtype, mesh=None, plan: str = sharding.DEFAULT_PLAN) -> int:
    """Per-device parameter bytes of `config` built with `dtype` (`jnp.float8_e4m3fn`: DeepSeek's FP8
    layout) on `mesh` (None: one device) under `plan`."""
    return _param_bytes(abstract_model(config, dtype)[1], mesh, plan)


def _param_bytes(state: nnx.State, mesh, plan: str) -> int:
    """Per-device bytes of the (abstract) parameters `state` on `mesh` under `plan`."""
    sizes = _axis_sizes(mesh)
    leaves = jax.tree.leaves(state)
    if mesh is None:
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    specs = jax.tree.leaves(sharding.param_specs(state, plan), is_leaf=lambda x: isinstance(x, PartitionSpec))
    return sum(shard_bytes(x.shape, x.dtype, spec, sizes) for x, spec in zip(leaves, specs, strict=True))


def _dequantized_linears(flat: dict[str, nnx.Variable], stacks: set[str]) -> int:
    """The bytes of one layer's FP8 linear weights dequantized in float32, for the layer whose are
    largest (a stack's row, or the MTP block): what the references ("xla") can hold of them at once,
    erring high (each such linear multiplies by its weight dequantized, `models.layers.Linear`; the
    routed experts' copies are the feed-forward part's, `moe.prefill_temp_bytes`). flat: the
    abstract parameters by dotted path (`orbax_io.abstract_model`); stacks: the layer stacks' names."""
    per_layer: dict[str, int] = {}
    for name, variable in flat.items():
        value = variable.get_value()
        if value.dtype != jnp.float8_e4m3fn or ".experts_" in name:
            continue
        # a stack's rows are its layers (V4's runs are "layer_groups.G": a row holds the group's layers)
        owner = next((stack for stack in stacks if name.startswith(stack + ".")), name.split(".")[0])
        elements = math.prod(value.shape[1:] if owner in stacks else value.shape)
        per_layer[owner] = per_layer.get(owner, 0) + elements
    return 4 * max(per_layer.values(), default=0)


def plan_memory(config: ModelConfig, decode: DecodeConfig, *, batch: int, prompt_len: int, mesh=None,
                plan: str = sharding.DEFAULT_PLAN, dtype=jnp.bfloat16, device_memory: int | None = None) -> MemoryPlan:
    """The per-device `MemoryPlan` of `generate` on `batch` prompts padded to `prompt_len` tokens
    (`jaxspec.batch.prompt_bucket` gives the width `generate` pads its longest prompt to, and
    `budget_bucket` the `max_new_tokens` it builds for), decoding
    as `decode` says (its draft settings, `max_new_tokens`, `prefill_chunk`, cache dtype and the
    backend its temporaries are those of), with parameters built in `dtype`, on
    `mesh` (a `jax.sharding.Mesh`, a (data, model) pair of sizes, or None for one device) under
    `plan`. Raises ValueError on a bad batch, prompt length, mesh or plan."""
    if batch < 1:
        raise ValueError(f"batch={batch}: must be >= 1")
    if prompt_len < 1:
        raise ValueError(f"prompt_len={prompt_len}: must be >= 1")
    sharding.check_plan(plan)
    sizes = _axis_sizes(mesh)
    row_parts = math.prod(sizes[a] for a in sharding.ROW_AXES[plan])
    rows = -(-batch // row_parts)  # this device's rows, the batch padded to the mesh
    act = jnp.dtype(jnp.bfloat16 if jnp.dtype(dtype) == jnp.float8_e4m3fn else dtype).itemsize
    f32 = 4

    capacity = default_capacity(prompt_len, decode)
    drafting = decode.draft_tree is not None
    # The model, abstract (nothing allocated), in the activations' dtype its caches take.
    graphdef, params, flat = abstract_model(config, dtype)
    model = nnx.merge(graphdef, params)
    geometry = cache_geometry(prompt_len, decode, batch_size=rows, capacity=capacity)
    caches = sum(cache_bytes(model, geometry, mtp=mtp) for mtp in ((False, True) if drafting else (False,)))

    vocab, window = config.vocab_size, decode.window_size
    heads_local = config.num_attention_heads // math.prod(sizes[a] for a in sharding.HEAD_AXES[plan])
    hidden = model.hidden_width
    # The loop state: emitted tokens, the MTP seed (logits and hidden) and the draft window.
    state = rows * ((decode.max_new_tokens + decode.max_depth + 1) * 4 + vocab * f32 + hidden * act
                    + window * 4)
    if decode.prefill_in_loop:  # the prompts and their lengths ride in the loop state
        state += rows * (prompt_len + 1) * 4
    backend = resolve_backend(decode.backend)
    row_shards = None if mesh is None else row_parts
    # The references dequantize a layer's FP8 linear weights in XLA (the kernels, tile by tile).
    dequantized = _dequantized_linears(flat, {run.name for run in model.layer_runs}) if backend == "xla" else 0
    # The ops gather a row's slots in whole pages.
    slots = -(-capacity // decode.page_size) * decode.page_size
    # A step: the float32 logits of the target's window and of the MTP's next draft, each with a
    # same-sized float32 companion (probabilities, acceptance's work on them), and the largest one
    # layer's temporaries of its model calls (the layers run one at a time: scans), each a chunk of
    # W tokens a row (the absorbed form), W from 1 (a chained draft) to the window (verification):
    # at few tokens the references' experts take the gathered path, whose copies of every
    # assignment's expert matrices are the largest term there (`moe.expert_path`; one full-width
    # V3.2 layer at B 32 on "xla": 21 GiB in bfloat16, 42 GiB with FP8 experts).
    step_layer = max(model.prefill_layer_bytes(rows=rows, width=width, prompt_len=capacity, capacity=slots,
                                               heads=heads_local, chunked=True, backend=backend,
                                               row_shards=row_shards)
                     for width in range(1, window + 1)) + dequantized
    step_temp = rows * (window + (1 if drafting else 0)) * vocab * f32 * 2 + step_layer
    # Prefill, per call of T = rows x W tokens (W = the whole prompt, or one `prefill_chunk`): a
    # few [T, H] activations, one layer's temporaries as the model counts them for the backend the
    # config resolves to (the layers run one at a time: a scan), and the float32 logits of each
    # row's last prompt position, the target's and the MTP's (the calls compute those rows only,
    # `logits_at`). Prompts fed through the loop have no prefill program: the step's own calls run them.
    prefill_temp = 0
    if not decode.prefill_in_loop:
        width = decode.prefill_width(prompt_len)
        chunked = decode.prefill_chunk is not None
        logit_rows = 2 if drafting else 1
        layer = model.prefill_layer_bytes(rows=rows, width=width, prompt_len=prompt_len, capacity=slots,
                                          heads=heads_local, chunked=chunked, backend=backend, row_shards=row_shards)
        prefill_temp = rows * (logit_rows * vocab * f32 + width * hidden * act * 8) + layer + dequantized
    return MemoryPlan(weights=_param_bytes(params, mesh, plan), caches=caches, state=state,
                      prefill_temp=prefill_temp, step_temp=step_temp,
                      device_memory=None if device_memory is None else int(device_memory))


def device_memory(device=None) -> int | None:
    """Bytes a device can allocate (`memory_stats()["bytes_limit"]`), or None where the runtime does
    not say (the CPU)."""
    device = jax.local_devices()[0] if device is None else device
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else stats.get("bytes_limit")
