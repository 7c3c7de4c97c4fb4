"""Block loads, page addressing and visibility inside Pallas GPU kernels (Triton lowering).

The kernels treat every operand as a 2-D array in global memory and address it themselves, the way
a Triton kernel does: caches are viewed as `[num_pages * page_size, D]` (a free reshape), so a
cache slot is one row, and a block is a gather of rows. Everything a kernel needs for that lives
here as plain functions of arrays and refs, so the kernel bodies only say what they compute (and a
Mosaic GPU port only has to replace these helpers).

Rules these helpers keep, because both the Triton lowering and interpret mode depend on them:
  * every block has power-of-two extents (Triton tensors must), so a dimension that is not a power
    of two (the tiny configs' 8-wide RoPE part) is read as a wider block with masked columns;
  * every index is clamped into bounds and masked instead, never left out of bounds: on the GPU a
    masked lane is not read, but interpret mode reads every lane before masking, so in-bounds
    indices keep both modes exact;
  * loads index with arrays only and stores with slices only (interpret mode supports neither
    mixed indexers nor masked stores with repeated indices): outputs are padded to whole blocks,
    so a store is always an unmasked, in-bounds slice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .backend import interpret_mode
from .cost import cost_metadata
from .visibility import VisibleSlots, kv_bound, slot_bound, slot_counts, tree_mask_of

# Triton's tl.dot needs every extent >= 16, so a block is never smaller than that.
MIN_BLOCK = 16
# Programs to aim for when splitting work: two per SM of an H100/H200 (132 SMs).
TARGET_PROGRAMS = 264


def block_size(extent: int, cap: int | None = None) -> int:
    """The power-of-two block (>= MIN_BLOCK) that holds `extent` elements, or `cap` if smaller."""
    size = max(MIN_BLOCK, pl.next_power_of_2(extent))
    return size if cap is None else min(cap, size)


def launch(kernel, *, out_shape, grid, num_warps: int, num_stages: int, name: str, interpret: bool | None,
           cost: pl.CostEstimate):
    """pallas_call with the Triton lowering; operands are whole arrays in global memory.

    interpret None = interpret mode exactly when there is no GPU; False forces the Triton lowering
    (how the tests lower for CUDA on a CPU-only machine). cost: the launch's flops and bytes, which
    compiled programs count (`cost.py`).
    """
    interpret = interpret_mode() if interpret is None else interpret
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, name=name, interpret=interpret,
                          compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                          cost_estimate=cost, metadata=cost_metadata(cost))


def column_span(start, width: int, block: int):
    """Columns [start, start + width) as a block of `block` columns -> (columns [block], valid or None).

    When the width is already the block (DeepSeek's 512 and 64) the columns are a plain range,
    which Triton sees as contiguous; otherwise they are clamped and masked so the padding columns
    read as zeros. (Always index arrays, never slices: interpret mode cannot mix the two.)
    """
    lane = jnp.arange(block, dtype=jnp.int32)
    if width == block:
        return start + lane, None
    return start + jnp.minimum(lane, width - 1), lane < width


def load_block(ref, rows, columns, row_valid=None, column_valid=None):
    """Gather `ref[rows, columns]` from a 2-D ref; zeros where a row or column is not valid.

    rows: [R] in-bounds int32 row indices, or a scalar (one row); columns: [C] in-bounds int32.
    Returns [R, C] (or [C] for one row) in the ref's dtype.
    """
    if jnp.ndim(rows) == 0:
        index, row_mask, col_mask = (rows, columns), None, column_valid
    else:
        index = (rows[:, None], columns[None, :])
        row_mask = None if row_valid is None else row_valid[:, None]
        col_mask = None if column_valid is None else column_valid[None, :]
    masks = [m for m in (row_mask, col_mask) if m is not None]
    if not masks:
        return ref[index]
    mask = masks[0] if len(masks) == 1 else masks[0] & masks[1]
    # A float fill: Triton casts the fill to the ref's type, and has no integer -> float8 cast.
    return plgpu.load(ref.at[index], mask=mask, other=0.0 if jnp.issubdtype(ref.dtype, jnp.floating) else 0)


def load_vector(ref, index, valid):
    """Gather a 1-D ref at in-bounds `index` ([R] int32); zeros where not valid."""
    return plgpu.load(ref.at[index], mask=valid, other=0)


def block_indices(start, block: int, extent: int):
    """Indices [start, start + block) of an axis of `extent` -> (clamped indices [block], valid [block])."""
    index = start + jnp.arange(block, dtype=jnp.int32)
    return jnp.minimum(index, extent - 1), index < extent


def slot_rows(page_table_ref, row, slots, page_size: int, num_pages: int):
    """Cache rows of a sequence row's slots: page_table[row, slot // page] * page + slot % page.

    page_table_ref: [B, max_pages] int32; slots: [N] int32 (any value: clamped here, the caller
    masks what it does not want). Returns [N] int32 rows of the `[num_pages * page_size, D]` view,
    always in bounds. Reading the page per slot (not per tile) lets a tile span pages and any page
    size work, and a slot's D values stay contiguous, which is what coalescing needs.
    """
    max_pages = page_table_ref.shape[1]
    slots = jnp.maximum(slots, 0)
    page_index = jnp.minimum(jax.lax.div(slots, page_size), max_pages - 1)
    page = plgpu.load(page_table_ref.at[row, page_index])
    page = jnp.clip(page, 0, num_pages - 1)
    return page * page_size + jax.lax.rem(slots, page_size)


def tile_range(part, num_parts: int, num_tiles):
    """Tiles [lo, hi) of part `part` when `num_tiles` tiles are cut into `num_parts` contiguous parts.

    num_tiles may be traced (a row's own length), so every part of a short row still gets work.
    """
    per_part = jax.lax.div(num_tiles + num_parts - 1, num_parts)
    lo = jnp.minimum(part * per_part, num_tiles)
    return lo, jnp.minimum(lo + per_part, num_tiles)


def num_parts(programs: int, num_tiles: int, min_tiles_per_part: int) -> int:
    """How many parts to cut a loop of `num_tiles` tiles into so that `programs` programs become
    about TARGET_PROGRAMS, keeping every part at least `min_tiles_per_part` tiles long."""
    wanted = pl.cdiv(TARGET_PROGRAMS, programs)
    return max(1, min(wanted, num_tiles // max(1, min_tiles_per_part)))


def dot_nt(a, b):
    """a [M, K] @ b[N, K].T -> [M, N] float32; full float32 precision for float32 inputs (no TF32)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [M, K] @ b [K, N] -> [M, N] float32, same precision rule as `dot_nt`."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


def visibility_operands(vis: VisibleSlots, num_queries: int) -> list[jax.Array]:
    """Per-token visibility as kernel operands, which a kernel reads with `token_bounds` (and
    `visible`): what `visibility.visible_mask` says, in a form a block can read.

    A window's `Visibility`: `[prefix [B], query_len [B]]` int32, from which the kernel computes
    each token's bound itself; a tree adds `ancestor [B * Q, Q]` int32 (the tree mask as 0/1).
    Why not the bounds: passed as they are, the window's two vectors leave XLA nothing to compute
    before the launch, where bounds [B, Q] took a kernel of XLA's at every layer of a one-token
    decode step (the same bounds at every layer: XLA does not hoist them out of the layer scan).
    Slot counts [B, Q] (`visibility.slot_counts(vis)`): `[bound [B, Q], span [B]]`, the counts
    clipped at 0 and their largest in each row.
    """
    if slot_counts(vis):
        bound = kv_bound(vis, num_queries)
        return [bound, jnp.max(bound, axis=1)]
    operands = [vis.prefix_len.astype(jnp.int32), vis.query_len.astype(jnp.int32)]
    tree_mask = tree_mask_of(vis)
    if tree_mask is not None:
        operands.append(tree_mask.reshape(-1, num_queries).astype(jnp.int32))
    return operands


def token_bounds(vis_refs, row, tokens, token_valid, *, num_queries: int, counts: bool):
    """The visibility of sequence row `row`'s tokens from `visibility_operands`' refs ->
    (bounds [R] int32: each token's exclusive slot bound, 0 for padding and where token_valid is
    False; span: the largest bound of the row's Q tokens, a scalar; prefix_ref and ancestor_ref
    for `visible`, None for a chain and for slot counts). tokens [R] in-bounds window indices;
    num_queries: the call's Q; counts: `visibility.slot_counts(vis)` of the call. A window's
    bounds are `visibility.kv_bound`'s, computed here by its definition (`visibility.slot_bound`)."""
    if counts:
        bound_ref, span_ref = vis_refs
        return load_block(bound_ref, row, tokens, column_valid=token_valid), span_ref[row], None, None
    prefix_ref, query_len_ref, *tree_refs = vis_refs
    prefix, length = prefix_ref[row], query_len_ref[row]
    bounds = jnp.where(token_valid, slot_bound(prefix, length, tokens), 0)
    span = jnp.where(length > 0, jnp.maximum(prefix + jnp.minimum(length, num_queries), 0), 0)
    return bounds, span, (prefix_ref if tree_refs else None), (tree_refs[0] if tree_refs else None)


def visible(slots, bounds, row, tokens, prefix_ref, ancestor_ref):
    """[R, N] bool: token `tokens[r]` of sequence row `row` sees slot `slots[n]`.

    slots [N] int32, bounds [R] int32 (the `bound` operand at those tokens), tokens [R] in-bounds window indices.
    A chain needs only the bound; a tree also needs the window slots to be ancestors.
    """
    sees = slots[None, :] < bounds[:, None]
    if ancestor_ref is None:
        return sees
    num_queries = ancestor_ref.shape[1]
    window = slots - prefix_ref[row]  # window index of each slot, negative in the prefix
    in_window = window >= 0
    ancestor = plgpu.load(
        ancestor_ref.at[(row * num_queries + tokens)[:, None], jnp.clip(window, 0, num_queries - 1)[None, :]],
        mask=sees & in_window[None, :], other=0)
    return sees & (~in_window[None, :] | (ancestor != 0))
