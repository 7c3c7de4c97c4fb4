"""How a Pallas kernel states its own cost, so that a compiled program's flops and bytes include it.

XLA's HLO cost analysis sees a Pallas kernel as an opaque custom call and counts nothing for it.
So every kernel states its cost for the shapes it is launched with, as a `pl.CostEstimate`, and
passes it to `pallas_call` twice: as `cost_estimate` (what Pallas's own tooling reads) and, encoded
by `cost_metadata`, as `metadata`. The Triton lowering copies `metadata` into the custom call's
backend config (`serialized_metadata`), which survives into the optimized HLO, where
`jaxspec.aot.program_cost` reads it back with `read_cost_metadata`. A kernel launched through
`tiling.launch` only passes `cost=`; any other `pallas_call` must pass
`metadata=cost_metadata(cost)` itself. Pallas's batching rule scales `cost_estimate` but not
`metadata`, so a kernel must not be vmapped: state the cost of the batched launch instead (none of
ours is).

Mosaic GPU's lowering drops `metadata` (jax 0.10 and 0.11), so a Mosaic GPU kernel is launched
inside `stating(cost, name)` instead: the same entries, and the op's name, become XLA frontend
attributes of its custom call (`jax.experimental.xla_metadata`), which also survive into the
optimized HLO.
"""

from __future__ import annotations

import contextlib
import json

from jax.experimental import pallas as pl
from jax.experimental.xla_metadata import set_xla_metadata

# Keys of the metadata entries (flat strings: `metadata` is a str -> str mapping).
_FIELDS = ("flops", "transcendentals", "bytes_accessed")
_PREFIX = "jaxspec_"


def cost_metadata(cost: pl.CostEstimate) -> dict[str, str]:
    """The `metadata` argument of a `pallas_call` that carries `cost`."""
    return {_PREFIX + field: str(int(getattr(cost, field))) for field in _FIELDS}


def read_cost_metadata(serialized: str) -> pl.CostEstimate | None:
    """The cost in a custom call's serialized metadata (JSON text), or None if it carries none."""
    try:
        entries = json.loads(serialized)
    except ValueError:
        return None
    return cost_of(entries) if isinstance(entries, dict) else None


def cost_of(entries: dict[str, str]) -> pl.CostEstimate | None:
    """The cost `cost_metadata` wrote into `entries` (str -> str), or None if they hold none."""
    if any(_PREFIX + field not in entries for field in _FIELDS):
        return None
    return pl.CostEstimate(**{field: int(entries[_PREFIX + field]) for field in _FIELDS})


# The frontend attribute naming a Mosaic GPU kernel's op (`stating`).
KERNEL_ATTRIBUTE = _PREFIX + "kernel"


@contextlib.contextmanager
def stating(cost: pl.CostEstimate, name: str):
    """Launch a Mosaic GPU kernel inside: its custom call carries `cost` and the op's `name` (the
    Triton kernel's name for the same op, so both count in the same op class) as frontend
    attributes. Every op traced inside gets them, so hold only the launch."""
    with set_xla_metadata(**cost_metadata(cost), **{KERNEL_ATTRIBUTE: name}):
        yield


def array_bytes(*arrays) -> int:
    """Total bytes of arrays or `jax.ShapeDtypeStruct`s (a kernel's operands and outputs)."""
    return sum(x.size * x.dtype.itemsize for x in arrays)


def attention_cost(groups: int, rows: int, keys: int, width: int, key_bytes: int, *arrays,
                   reads: int | None = None) -> pl.CostEstimate:
    """An attention kernel's statement, at capacity: `groups` groups of `rows` query rows, each row
    scoring and averaging `keys` keys over `width` features in all (score plus value: Dl + Dr + Dl
    for MLA, 2 D for V4), a group reading `reads` keys (default `keys`) of `key_bytes` from HBM
    once (its row blocks share them through L2), and `arrays` (the other operands and the outputs)
    once."""
    return pl.CostEstimate(flops=2 * groups * rows * keys * width, transcendentals=groups * rows * keys,
                           bytes_accessed=groups * (keys if reads is None else reads) * key_bytes
                           + array_bytes(*arrays))


def indexer_cost(batch: int, num_queries: int, heads: int, slots: int, dim: int, key_bytes: int,
                 *arrays) -> pl.CostEstimate:
    """An indexer scores kernel's statement, at capacity: each head's logit a `dim`-long dot, then
    ReLU, weight and sum, for every slot of a row; a row's keys (`key_bytes` each) read from HBM
    once, and `arrays` (the other operands and the output) once."""
    return pl.CostEstimate(flops=batch * num_queries * heads * slots * (2 * dim + 3), transcendentals=0,
                           bytes_accessed=batch * slots * key_bytes + array_bytes(*arrays))
