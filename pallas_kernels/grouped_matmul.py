"""Grouped matmul (ragged dot): rows sorted by group, each group multiplied by its own matrix.

    out[m] = lhs[m] @ rhs[g(m)]      g(m) = the group whose rows [offset_g, offset_g + size_g) hold m

with `offset_g = sum(group_sizes[:g])`; rows past `sum(group_sizes)` are zero. This is
`jax.lax.ragged_dot`'s definition, and the reference is that op. The MoE runs its experts with it
(rows = token-expert assignments sorted by expert, groups = experts). XLA's GPU backend lowers
`ragged_dot` to one dense matmul over every group (256x the routed work at DeepSeek-V3's 256
experts), so on a GPU the op runs the Pallas kernel (`grouped_matmul_pallas.py`), which reads only
the groups that have rows.

FP8 groups: `rhs` may be DeepSeek's block-scaled `float8_e4m3fn` [G, K, N] with its float32 scales
`rhs_scale_inv` [G, ceil(K / 128), ceil(N / 128)] (`block_fp8`). Its matrices are then the
dequantized bfloat16 values `block_fp8.dequantize(rhs, rhs_scale_inv)`, exactly: the reference
dequantizes them all first, the kernel dequantizes each weight tile after loading it, so only the
FP8 bytes and the scales are read from memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import block_fp8
from .backend import interpret_mode, resolve_backend
from .contracts import check_grouped_matmul_args


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                             rhs_scale_inv: jax.Array | None = None) -> jax.Array:
    """The definition of `grouped_matmul`: `jax.lax.ragged_dot` (of the dequantized rhs when it is
    FP8). Same arguments and result."""
    check_grouped_matmul_args(lhs, rhs, group_sizes, rhs_scale_inv)
    if rhs_scale_inv is not None:
        rhs = block_fp8.dequantize(rhs, rhs_scale_inv).astype(lhs.dtype)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32))


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rhs_scale_inv: jax.Array | None = None,
                   *, backend: str = "auto") -> jax.Array:
    """Multiply each group of rows by its group's matrix.

    Args:
      lhs: [M, K] rows sorted by group; rhs: [G, K, N] one matrix per group, float or float8_e4m3fn.
      group_sizes: [G] integer rows per group, summing to at most M (rows past the sum are zero).
      rhs_scale_inv: None, or with an FP8 rhs its float32 block scales [G, ceil(K / 128), ceil(N / 128)].
      backend: "xla" (`jax.lax.ragged_dot`), "pallas" or "auto".

    Returns:
      [M, N] in the promoted dtype of lhs and rhs (lhs's dtype for an FP8 rhs, whose values are bfloat16).
    """
    check_grouped_matmul_args(lhs, rhs, group_sizes, rhs_scale_inv)
    if resolve_backend(backend) == "pallas":
        from .grouped_matmul_pallas import grouped_matmul_pallas
        return grouped_matmul_pallas(lhs, rhs, group_sizes, rhs_scale_inv, interpret=interpret_mode())
    return grouped_matmul_reference(lhs, rhs, group_sizes, rhs_scale_inv)
