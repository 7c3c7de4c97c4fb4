"""Runs of identical decoder layers: parameters stacked `[n, ...]` and run as one `jax.lax.scan`.

XLA compiles an unrolled layer loop once per layer, so a 61-layer decode step takes minutes to
compile; a scan's body is compiled once, whatever the depth (MaxText's `scan_layers` does the same
for DeepSeek). A run is `repeats` copies of a unit of `period` layers (V3: period 1, the dense
prefix and the MoE layers; V4: the repeating pattern of its layer kinds). Its parameters are one
module built under `nnx.vmap`, every array carrying a leading axis named `layers` (`LAYERS`, which
`jaxspec.sharding` never splits), so a unit's r-th copy is row r of each.

    stack = stack_layers(lambda rngs: DecoderLayer(config, 3, rngs=rngs), count, rngs)
    carry = run_layers(stack, lambda layer, r, carry: layer(...), carry)       # one lax.scan
    carry = run_layers(stack, ..., carry, unroll=True)                          # a python loop
    layer = layer_slice(stack, 5)                                               # row 5, for inspection

Unrolling indexes the same stacked parameters (nothing to convert): a switch for debugging and
per-layer inspection, as MaxText keeps one.

Inside `run_layers` a unit's parameters are `StackRow`s: the whole stack and the row, not a slice.
Why: XLA's GPU compiler copies a dynamic slice of a loop's operand before a gemm or a custom call
reads it (measured on the deviceless H100 compile of V3.2: a 7 GiB temporary for one layer's routed
experts, and one layer's dense weights in every call), so a scan that sliced its parameters would
read every weight twice and hold a layer's experts twice. Indexing a `StackRow` (`param[...]`)
still reads the row that way, which is right for small parameters and for the pure-jnp references;
the ops that read most of the bytes (`pallas_kernels.grouped_matmul`, for the routed experts and,
on the GPU backends, for `models.layers.Linear`) take the stack and the row (`in_place`) and read
the row where it lies.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Hashable, Sequence, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

# The logical name of the stacked axis (`jaxspec.sharding` maps it to no mesh axis).
LAYERS = "layers"

Carry = TypeVar("Carry")


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Layers [start, start + period * repeats) held by the model attribute `name`: a stack of
    `repeats` units of `period` layers (period 1: the unit is the layer itself; period p > 1: the
    unit is an `nnx.List` of p layers)."""

    name: str
    start: int
    period: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    def locate(self, layer: int) -> tuple[str, int]:
        """Decoder layer `layer` (in [start, stop)) -> (the parameter path prefix of its unit's
        module, e.g. "moe_layers." or "layer_groups.1.0.", the row of the stacked axis)."""
        if not self.start <= layer < self.stop:
            raise ValueError(f"layer={layer}: run {self.name!r} holds layers [{self.start}, {self.stop})")
        offset = layer - self.start
        sub = "" if self.period == 1 else f"{offset % self.period}."
        return f"{self.name}.{sub}", offset // self.period


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackRow:
    """Row `row` (an int32 scalar, traced inside a scan) of a stacked parameter `stack` [n, ...]:
    the value a layer's parameter holds inside `run_layers`. It reads like the row itself (`shape`,
    `dtype`, `param[...]`); `in_place` gives ops that can address the stack the stack and the row."""

    stack: jax.Array
    row: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype

    @property
    def ndim(self) -> int:
        return self.stack.ndim - 1

    def __getitem__(self, index):
        return jax.lax.dynamic_index_in_dim(self.stack, self.row, axis=0, keepdims=False)[index]


def in_place(value) -> tuple[jax.Array, jax.Array]:
    """A parameter's value -> (a stack [n, ...], the row of it that is the value): a `StackRow`'s
    own, or (value[None], 0) for a plain array (a layer outside any stack, such as the MTP block)."""
    if isinstance(value, StackRow):
        return value.stack, value.row
    return value[None], jnp.zeros((), jnp.int32)


def repeating_runs(units: Sequence[Hashable], max_period: int = 2) -> tuple[tuple[int, int, int], ...]:
    """The fewest runs that cover a list of layer kinds, each run a unit of 1 .. max_period
    consecutive kinds repeated: units [L] (anything comparable: a layer's kind) -> ((start, period,
    repeats), ...) in layer order. Ties go to the segmentation whose first run covers the most
    layers, then to the shorter unit.

    Fewest runs, not the longest run at each step: each run is a scan whose body is compiled once,
    so the compile time grows with the number of runs. Taking the longest run first would split
    DeepSeek-V4-Flash (S, S, C, H, C, H, ..., C; the first three layers hash-routed) into
    [S] x 2, [C/hash, H] x 1, [C, H] x 19, [C] x 1 where [S] x 2, [C/hash] x 1, [H, C] x 20 suffices.
    A dynamic programme over the layer list (a few thousand comparisons at 61 layers).
    """
    units = list(units)
    count = len(units)
    fewest: list[tuple[int, tuple[tuple[int, int, int], ...]]] = [(0, ())] * (count + 1)
    for start in range(count - 1, -1, -1):
        options = []
        for period in range(1, min(max_period, count - start) + 1):
            unit = units[start:start + period]
            repeats = 1
            while units[start + repeats * period:start + (repeats + 1) * period] == unit:
                repeats += 1
            for r in range(1, repeats + 1):
                runs, rest = fewest[start + r * period]
                options.append((runs + 1, -r * period, period, ((start, period, r),) + rest))
        best = min(options, key=lambda option: option[:3])
        fewest[start] = (best[0], best[3])
    return fewest[0][1]


def run_of(runs: Sequence[LayerRun], layer: int, num_layers: int) -> tuple[int, LayerRun]:
    """(its index in `runs`, the run) holding decoder layer `layer`; ValueError naming `index` unless
    0 <= layer < num_layers."""
    if not 0 <= layer < num_layers:
        raise ValueError(f"index={layer}: must be in [0, num_hidden_layers={num_layers})")
    return next((k, run) for k, run in enumerate(runs) if run.start <= layer < run.stop)


def stack_layers(make: Callable[[nnx.Rngs], nnx.Module], repeats: int, rngs: nnx.Rngs) -> nnx.Module:
    """`repeats` modules `make(rngs)`, each drawn from its own split of `rngs`, as one module whose
    every parameter is stacked [repeats, ...] on an axis named `LAYERS`."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: a stack needs at least one layer")

    @nnx.split_rngs(splits=repeats)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def build(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return build(rngs)


def stack_depth(stack: nnx.Module) -> int:
    """The number of units in `stack` (the leading size of its parameters)."""
    return jax.tree.leaves(nnx.state(stack))[0].shape[0]


@functools.partial(jax.jit, donate_argnums=0)
def write_row(stacked: jax.Array, value: jax.Array, index: jax.Array) -> jax.Array:
    """`stacked` with its entry at the leading indices `index` (int32 [k]: a layer row, or a layer
    row and an expert) set to `value` (stacked.shape[k:]), written in place: `stacked` is donated,
    so filling a stack row by row (the checkpoint loaders) never holds two copies of it. Its
    sharding is kept (the leading axes are never split, or only the written row's block is touched)."""
    start = tuple(index) + (0,) * value.ndim
    return jax.lax.dynamic_update_slice(stacked, value.reshape((1,) * index.shape[0] + value.shape), start)


def row_sharding(stacked: jax.sharding.Sharding, rows: int = 1) -> jax.sharding.Sharding:
    """The sharding of one entry of a stacked array placed as `stacked`, its `rows` leading axes
    dropped (a `NamedSharding`'s spec loses them; any other sharding is returned as is)."""
    if isinstance(stacked, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(stacked.mesh, jax.sharding.PartitionSpec(*stacked.spec[rows:]))
    return stacked


def layer_slice(stack: nnx.Module, row) -> nnx.Module:
    """Unit `row` of `stack` as a module of its own (row: an int or a traced int32 scalar); its
    parameters are slices of the stack's (copies, outside a trace)."""
    graphdef, state = nnx.split(stack)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[row], state))


def run_layers(stack: nnx.Module, body: Callable[[nnx.Module, jax.Array, Carry], Carry], carry: Carry, *,
               unroll: bool = False) -> Carry:
    """carry = body(unit_r, r, carry) for r = 0 .. repeats - 1, in order; r is an int32 scalar.

    As one `jax.lax.scan` over the stacked parameters (compiled once, whatever the depth), or with
    `unroll` as a python loop over `layer_slice`s (one copy of the body per unit in the program).
    The carry should hold what the units update (the residual stream, the caches): a cache in the
    carry is updated in place, never copied, so a donated cache stays aliased through the scan.
    """
    graphdef, state = nnx.split(stack)
    depth = stack_depth(stack)

    def unit(r: jax.Array) -> nnx.Module:  # the unit's parameters as `StackRow`s of the whole stacks
        return nnx.merge(graphdef, jax.tree.map(lambda a: StackRow(a, r), state))

    if unroll:
        for r in range(depth):
            carry = body(unit(jnp.int32(r)), jnp.int32(r), carry)
        return carry

    def step(carry, r):
        return body(unit(r), r, carry), None

    return jax.lax.scan(step, carry, jnp.arange(depth, dtype=jnp.int32))[0]
