"""Split-KV for the Mosaic GPU attention kernels: how many parts a list of keys is cut into, and the
merge of the parts' normalised partials.

A kernel that walks a long key list in one thread block leaves SMs idle when there are few query
blocks (B 1 decodes one token on 2 of an H100's 132 SMs), so its list is cut into parts of
`part_slots` keys, each part a thread block writing a normalised float32 partial and its
log-sum-exp, which `combine_parts` merges. The part count comes from the list's length alone, never
from B or Q, so a query row's bits do not depend on what shares its call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .contracts import EMPTY_LSE

# Parts `combine_parts` folds in one XLA fusion: 16 spill a few bytes at Q 4 on sm_90a, 8 none.
COMBINE_GROUP = 8


def num_parts(slots: int, part_slots: int) -> int:
    """Parts of a key list `slots` long, in parts of `part_slots`: set by the list's length only
    (never B or Q)."""
    return max(1, pl.cdiv(slots, part_slots))


def check_part_slots(name: str, part_slots: int, tile: int) -> None:
    """ValueError unless part_slots is a positive multiple of the kernel's `tile` (parts are whole
    tiles)."""
    if part_slots < tile or part_slots % tile:
        raise ValueError(f"{name}: part_slots={part_slots}: must be a positive multiple of {tile}")


def combine_parts(out: jax.Array, lse: jax.Array, out_dtype) -> tuple[jax.Array, jax.Array]:
    """Merge split-KV parts: out [G, parts, M, D], lse [G, parts, M] float32 -> out [G, M, D]
    (out_dtype), lse [G, M].

    Elementwise per row, parts in a fixed order (a Python loop, not a reduction whose order XLA
    may choose by shape), so a row's result does not depend on how many rows share the call.
    Empty parts (lse == EMPTY_LSE) get weight 0; a row with only empty parts keeps output 0 and
    EMPTY_LSE. With one part the result is the part's, rounded to out_dtype (its weight is
    exp(0) = 1 and its total 1).
    """
    parts = out.shape[1]
    top = jnp.max(lse, axis=1)  # a maximum is exact in any order
    merged, total = jnp.zeros_like(out[:, 0]), jnp.zeros_like(top)
    for p in range(parts):
        if p and p % COMBINE_GROUP == 0:
            # One fusion over every part spills registers (3,388 bytes a thread at 128 parts, DeepSeek's
            # 128k slots); a barrier every COMBINE_GROUP parts keeps the fold's order and so its bits.
            merged, total = jax.lax.optimization_barrier((merged, total))
        weight = jnp.where(lse[:, p] > EMPTY_LSE, jnp.exp(lse[:, p] - top), 0.0)
        merged, total = merged + weight[..., None] * out[:, p], total + weight
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    return (merged / safe_total[..., None]).astype(out_dtype), jnp.where(seen, top + jnp.log(safe_total), EMPTY_LSE)
