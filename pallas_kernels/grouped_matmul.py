"""Grouped matmul (ragged dot): rows sorted by group, each group multiplied by its own matrix.

    out[m] = lhs[m] @ rhs[g(m)]      g(m) = the group whose rows [offset_g, offset_g + size_g) hold m

with `offset_g = sum(group_sizes[:g])`; rows past `sum(group_sizes)` are zero. This is
`jax.lax.ragged_dot`'s definition, and the reference is that op. The MoE runs its experts with it
(rows = token-expert assignments sorted by expert, groups = experts). XLA's GPU backend lowers
`ragged_dot` to one dense matmul over every group (256x the routed work at DeepSeek-V3's 256
experts), so on a GPU the op runs the Pallas kernel (`grouped_matmul_pallas.py`), which reads only
the groups that have rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .backend import interpret_mode, resolve_backend


def check_grouped_matmul_args(lhs, rhs, group_sizes) -> None:
    """ValueError naming the argument unless lhs [M, K], rhs [G, K, N], group_sizes [G] integer."""
    if lhs.ndim != 2:
        raise ValueError(f"lhs: must be [M, K], got shape {lhs.shape}")
    if rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"rhs: must be [G, K, N] with K = lhs.shape[1] = {lhs.shape[1]}, got shape {rhs.shape}")
    if group_sizes.shape != rhs.shape[:1] or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes: must be integer [G] with G = rhs.shape[0] = {rhs.shape[0]}, "
                         f"got {group_sizes.dtype}{list(group_sizes.shape)}")


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The definition of `grouped_matmul`: `jax.lax.ragged_dot`. Same arguments and result."""
    check_grouped_matmul_args(lhs, rhs, group_sizes)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32))


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, backend: str = "auto") -> jax.Array:
    """Multiply each group of rows by its group's matrix.

    Args:
      lhs: [M, K] rows sorted by group; rhs: [G, K, N] one matrix per group.
      group_sizes: [G] integer rows per group, summing to at most M (rows past the sum are zero).
      backend: "xla" (`jax.lax.ragged_dot`), "pallas" or "auto".

    Returns:
      [M, N] in the promoted dtype of lhs and rhs.
    """
    check_grouped_matmul_args(lhs, rhs, group_sizes)
    if resolve_backend(backend) == "pallas":
        from .grouped_matmul_pallas import grouped_matmul_pallas
        return grouped_matmul_pallas(lhs, rhs, group_sizes, interpret=interpret_mode())
    return grouped_matmul_reference(lhs, rhs, group_sizes)
