"""Grouped matmul (ragged dot): rows sorted by group, each group multiplied by its own matrix.

    out[m] = lhs[m] @ rhs[g(m)]      g(m) = the group whose rows [offset_g, offset_g + size_g) hold m

with `offset_g = sum(group_sizes[:g])`; rows past `sum(group_sizes)` are zero. This is
`jax.lax.ragged_dot`'s definition, and the reference is that op. The MoE runs its experts with it
(rows = token-expert assignments sorted by expert, groups = experts). XLA's GPU backend lowers
`ragged_dot` to one dense matmul over every group (256x the routed work at DeepSeek-V3's 256
experts), so on a GPU the op runs a Pallas kernel that reads only the groups that have rows: the
Triton one (`grouped_matmul_pallas.py`), or the Mosaic GPU one (`grouped_matmul_mosaic.py`) where
the backend asks for it and it takes the operands (`grouped_matmul_backend`).

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


def grouped_matmul_backend(backend: str, lhs, rhs, rhs_scale_inv=None) -> str:
    """The implementation `grouped_matmul` runs for these operands (arrays or
    `jax.ShapeDtypeStruct`s; rhs [G, K, N] or a stack [n, G, K, N]): `resolve_backend`'s, except
    that where it names the Mosaic kernel but that kernel does not take the operands
    (`grouped_matmul_mosaic.accepts`: float32, or K or N not whole 128-blocks, as kv_a_proj's 576
    columns), the Triton kernel runs them. Unlike the attention ops, an explicit "mosaic" falls
    back too: one model's linears and experts all go through this op at many shapes, and one
    backend name must serve the model."""
    implementation = resolve_backend(backend, "grouped_matmul")
    if implementation == "mosaic":
        from .grouped_matmul_mosaic import accepts
        if not accepts(lhs, rhs, rhs_scale_inv):
            return "pallas"
    return implementation


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rhs_scale_inv: jax.Array | None = None,
                   *, rhs_row: jax.Array | None = None, backend: str = "auto") -> jax.Array:
    """Multiply each group of rows by its group's matrix.

    Args:
      lhs: [M, K] rows sorted by group; rhs: [G, K, N] one matrix per group, float or float8_e4m3fn.
      group_sizes: [G] integer rows per group, summing to at most M (rows past the sum are zero).
      rhs_scale_inv: None, or with an FP8 rhs its float32 block scales [G, ceil(K / 128), ceil(N / 128)].
      rhs_row: None, or an int32 scalar r in [0, n): rhs is then a stack [n, G, K, N] (and
        rhs_scale_inv [n, G, ...]) of which the groups' matrices are row r, as a layer inside a
        scan holds its weights (`models.stack.StackRow`). The kernel reads row r where it lies in
        the stack: slicing it out first would make XLA copy it (all of a layer's experts).
      backend: "xla" (`jax.lax.ragged_dot`), "pallas" (Triton), "mosaic" (Mosaic GPU where it takes the
        operands, `grouped_matmul_backend`) or "auto".

    Returns:
      [M, N] in the promoted dtype of lhs and rhs (lhs's dtype for an FP8 rhs, whose values are bfloat16).
    """
    if rhs_row is not None:
        if rhs.ndim != 4 or (rhs_scale_inv is not None and rhs_scale_inv.ndim != 4):
            raise ValueError(f"rhs: with rhs_row, must be a stack [n, G, K, N] (and rhs_scale_inv [n, G, ...]), "
                             f"got shape {rhs.shape}")
        if resolve_backend(backend, "grouped_matmul") == "xla":  # the reference reads the row as a plain value
            row = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, rhs_row, keepdims=False)
            return grouped_matmul(lhs, row(rhs), group_sizes, row(rhs_scale_inv), backend="xla")
        check_grouped_matmul_args(lhs, rhs[0], group_sizes, None if rhs_scale_inv is None else rhs_scale_inv[0])
    else:
        check_grouped_matmul_args(lhs, rhs, group_sizes, rhs_scale_inv)
    implementation = grouped_matmul_backend(backend, lhs, rhs, rhs_scale_inv)
    if implementation != "xla":
        from .grouped_matmul_pallas import current_tiles, grouped_matmul_pallas
    if implementation == "mosaic":  # the same tile variant: K step and K splits
        from .grouped_matmul_mosaic import grouped_matmul_mosaic
        return grouped_matmul_mosaic(lhs, rhs, group_sizes, rhs_scale_inv, rhs_row, tiles=current_tiles(),
                                     interpret=interpret_mode())
    if implementation == "pallas":
        return grouped_matmul_pallas(lhs, rhs, group_sizes, rhs_scale_inv, rhs_row, interpret=interpret_mode(),
                                     tiles=current_tiles())
    return grouped_matmul_reference(lhs, rhs, group_sizes, rhs_scale_inv)
