"""Sharding plans: where every parameter and cache entry of a DeepSeek model lives on a device mesh.

A mesh has the axes `MESH_AXES = ("data", "model")` (`make_mesh(data, model)`). Every `nnx.Param`
of `jaxspec.models` carries logical axis names (`models.layers.param`: `vocab`, `embed`, `q_lora`,
`kv_lora`, `heads`, `mlp`, `experts`, `expert_mlp`, `index_heads`, None = never sharded; `layers`, the
stacked axis of a run of decoder layers, `models.stack`, which every plan replicates: each device
runs every layer), and one
rule table per plan (`RULES`) maps those names to mesh axes, through flax's own logical-axis
machinery (`nnx.logical_axis_rules` + `nnx.get_partition_spec`). Plans (`PLANS`):

* "dp" (the default): attention data-parallel over rows. The batch is split over all devices
  ("data" and "model"); attention, dense and shared-expert weights are replicated; each device's
  latent cache holds only its own rows (its share of the page pool, with a page table local to the
  shard), so attention, cache writes and a tree path's compaction never cross devices. MLA has a
  single latent KV head, so splitting rows is the only way to split the cache itself.
* "tp": rows over "data", attention heads over "model" (`q_b_proj` / `kv_b_proj` split by heads,
  `o_proj` by its input, a psum after it); the latent cache is replicated over "model" (every
  head reads the whole latent), which costs `model`-fold cache memory and a psum per layer but
  keeps a row's attention on `model` devices.

DeepSeek-V4 uses the same names: its query projection and per-head sinks are `heads` (tp splits
them, and its grouped output projection by group), its shared-KV projection, compressors, mHC
weights and hyper head carry no mesh-mapped name (small, replicated), hash routing's `tid2eid`
table is replicated (each device looks up its own rows' tokens inside the shard_map), and its
`V4Cache` rings and entry pools are split by rows like the latent cache (`cache_specs`).

In both plans the routed experts are split over all devices (expert parallelism, `experts` ->
("data", "model")): `models.moe.MoE` dispatches and combines inside the `shard_map` the loop runs
in (its docstring says how and why).

Why "dp" is the default: at the long contexts and large batches a 671B model on 8 GPUs is served
at, the latent cache dominates, and tp holds `model`-fold of it per device and computes the
row-local layers `model`-fold over, to save the attention weights dp replicates
(docs/model-interface.md has the compiled figures).

Running on a mesh: the loop (`jaxspec.generation.generate`, `jaxspec.loop.init_state` / `step`)
runs its whole computation (prefill and the while loop) inside one `jax.shard_map` over the mesh,
so the model code sees per-device blocks: its rows, its experts, (tp) its heads. The model learns
which mesh axes it runs under from `current()`, a trace-time context the loop sets inside the
shard_map body (as flax's logical-axis rules are a context); outside it (one device) the model runs
today's code path. Placement helpers for a loader or a memory plan work on real or abstract
(`nnx.eval_shape`) parameters and caches: `param_shardings`, `cache_shardings`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "model")
PLANS = ("dp", "tp")
DEFAULT_PLAN = "dp"
LOGICAL_AXES = ("layers", "vocab", "embed", "q_lora", "kv_lora", "heads", "mlp", "experts", "expert_mlp",
                "index_heads")

_REPLICATED = {name: None for name in LOGICAL_AXES}
# Logical name -> mesh axes, per plan. Every name is listed (None = replicated): flax leaves a name
# it finds no rule for in the spec, which a mesh would then reject.
RULES: dict[str, dict[str, str | tuple[str, ...] | None]] = {
    "dp": {**_REPLICATED, "experts": MESH_AXES},
    "tp": {**_REPLICATED, "heads": "model", "experts": MESH_AXES},
}
# The mesh axes the rows (batch) of a plan are split over, and those its attention heads are.
ROW_AXES = {"dp": MESH_AXES, "tp": ("data",)}
HEAD_AXES = {"dp": (), "tp": ("model",)}


@dataclasses.dataclass(frozen=True)
class Parallel:
    """What the model code needs to know inside the shard_map (see `current`): the mesh axes the
    rows are split over, those the routed experts are split over, those the attention heads are
    split over (empty: replicated)."""

    row_axes: tuple[str, ...]
    expert_axes: tuple[str, ...]
    head_axes: tuple[str, ...]


def check_plan(plan: str) -> None:
    if plan not in PLANS:
        raise ValueError(f"plan={plan!r}: must be one of {PLANS}")


def check_mesh(mesh: Mesh, plan: str = DEFAULT_PLAN) -> None:
    """ValueError unless `mesh` is a `jax.sharding.Mesh` with axes exactly `MESH_AXES` and `plan` is known."""
    check_plan(plan)
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh (see jaxspec.sharding.make_mesh), got {type(mesh).__name__}")
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh: axis names must be {MESH_AXES}, got {tuple(mesh.axis_names)}")


def make_mesh(data: int, model: int, devices: Sequence | None = None) -> Mesh:
    """A `data` x `model` mesh over `devices` (default: the first data * model of `jax.devices()`)."""
    if data < 1 or model < 1:
        raise ValueError(f"mesh shape {data}x{model}: both sizes must be >= 1")
    devices = jax.devices() if devices is None else list(devices)
    if data * model > len(devices):
        raise ValueError(f"mesh shape {data}x{model} needs {data * model} devices; {len(devices)} available")
    return Mesh(np.array(devices[:data * model]).reshape(data, model), MESH_AXES)


def parallel(plan: str) -> Parallel:
    """The `Parallel` view of `plan`."""
    check_plan(plan)
    return Parallel(row_axes=ROW_AXES[plan], expert_axes=MESH_AXES, head_axes=HEAD_AXES[plan])


def row_shards(mesh: Mesh | None, plan: str = DEFAULT_PLAN) -> int:
    """How many parts the rows are split into: the batch is padded to a multiple of this."""
    if mesh is None:
        return 1
    return int(np.prod([mesh.shape[a] for a in ROW_AXES[plan]]))


def _num_experts_check(state: nnx.State, mesh: Mesh) -> None:
    """Expert stacks must divide evenly over the devices (every device holds E / n experts)."""
    n = mesh.size
    for path, variable in nnx.to_flat_state(state):
        names = variable.get_metadata().get("out_sharding") or ()
        if "experts" in names and variable.shape[names.index("experts")] % n:
            raise ValueError(f"{'.'.join(map(str, path))}: {variable.shape[names.index('experts')]} experts do "
                             f"not split over {n} devices")


def param_specs(state: nnx.State, plan: str = DEFAULT_PLAN) -> nnx.State:
    """The `PartitionSpec` of every parameter of `state` (`nnx.split(model)[1]`, real or from
    `nnx.eval_shape`) under `plan`: the same tree, each Variable holding its spec."""
    check_plan(plan)
    with nnx.logical_axis_rules(tuple(RULES[plan].items())):
        return nnx.get_partition_spec(state)


def param_shardings(state: nnx.State, mesh: Mesh, plan: str = DEFAULT_PLAN) -> nnx.State:
    """The `NamedSharding` of every parameter of `state` on `mesh` under `plan` (same tree)."""
    check_mesh(mesh, plan)
    _num_experts_check(state, mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(state, plan))


def shard_params(state: nnx.State, mesh: Mesh, plan: str = DEFAULT_PLAN) -> nnx.State:
    """`state` placed on `mesh` as `plan` says (`jax.device_put` slice by slice)."""
    return jax.device_put(state, param_shardings(state, mesh, plan))


def put(value, sharding: NamedSharding) -> jax.Array:
    """A host value, the same on every process (an array-like or a `jax.random.key`), as one global
    array laid out by `sharding`. Unlike `jax.device_put`, this works when `sharding` spans other
    processes' devices (a multi-host mesh): each process fills only its own devices' blocks. On
    one process it is `jax.device_put` (which also places a traced value)."""
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
        return jax.random.wrap_key_data(put(jax.random.key_data(value), sharding),
                                        impl=jax.random.key_impl(value))
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def row_spec(plan: str = DEFAULT_PLAN) -> PartitionSpec:
    """The spec of an array whose leading axis is rows (or a cache's pages): split over the row axes."""
    check_plan(plan)
    return PartitionSpec(ROW_AXES[plan])


def cache_specs(cache, plan: str = DEFAULT_PLAN):
    """The `PartitionSpec` of every leaf of a model's cache (a `jaxspec.models.interface.DecodeCache`,
    real or abstract) under `plan`, as the cache lays itself out (`DecodeCache.partition_specs`)
    given `row_spec(plan)`: each device holds its own rows' pages. None stays None."""
    return None if cache is None else cache.partition_specs(row_spec(plan))


def cache_shardings(cache, mesh: Mesh, plan: str = DEFAULT_PLAN):
    """The `NamedSharding` of every leaf of a model's cache on `mesh` under `plan` (None stays None)."""
    check_mesh(mesh, plan)
    specs = cache_specs(cache, plan)
    return None if specs is None else jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


# -- inside the shard_map: the trace-time context the model reads ------------------------------

_CURRENT: contextvars.ContextVar[Parallel | None] = contextvars.ContextVar("jaxspec_parallel", default=None)


@contextlib.contextmanager
def running(par: Parallel):
    """Trace the enclosed model code as one device's block of a shard_map under `par`."""
    token = _CURRENT.set(par)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> Parallel | None:
    """The `Parallel` the code being traced runs under, or None on one device (no shard_map)."""
    return _CURRENT.get()


def on_mesh(fn, mesh: Mesh, plan: str, in_specs, out_specs):
    """`fn` as one device's block of a `jax.shard_map` over `mesh`, traced under `running(parallel(plan))`.

    check_vma is off: the loop's replicated outputs (its key and step counter) are replicated by
    construction (every device takes the same steps), and the Pallas kernels inside carry no
    varying-axes annotations."""
    par = parallel(plan)

    def body(*args):
        with running(par):
            return fn(*args)

    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def any_row(flags: jax.Array) -> jax.Array:
    """flags [B] bool (this device's rows) -> [] bool: any row of the whole batch (all devices)."""
    par = current()
    local = flags.any()
    if par is None:
        return local
    return jax.lax.psum(local.astype(np.int32), par.row_axes) > 0


def row_block(num_rows: int) -> tuple[jax.Array, int] | None:
    """Inside the shard_map: (the batch-wide indices [num_rows] int32 of this device's rows, the
    whole batch's size); a device's rows are one contiguous block, in mesh order. None on one device."""
    par = current()
    if par is None:
        return None
    shards = jax.lax.axis_size(par.row_axes)
    first = jax.lax.axis_index(par.row_axes).astype(np.int32) * num_rows
    return first + jax.numpy.arange(num_rows, dtype=np.int32), num_rows * shards
