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
"""

from __future__ import annotations

import json

from jax.experimental import pallas as pl

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
    if not isinstance(entries, dict) or any(_PREFIX + field not in entries for field in _FIELDS):
        return None
    return pl.CostEstimate(**{field: int(entries[_PREFIX + field]) for field in _FIELDS})


def array_bytes(*arrays) -> int:
    """Total bytes of arrays or `jax.ShapeDtypeStruct`s (a kernel's operands and outputs)."""
    return sum(x.size * x.dtype.itemsize for x in arrays)
