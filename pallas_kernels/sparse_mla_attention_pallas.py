"""Pallas GPU kernel (Triton lowering) for `sparse_mla_attention`: MLA over each token's own slots.

Every window token (b, q) has its own index set `indices[b, q, :]` (2048 slots for DeepSeek-V3.2),
shared by its H heads, so the unit of work is one token: a program holds `block_m` of its head
rows (64 of DeepSeek's 128) and gathers its selected slots from the paged cache in tiles of
`block_n`. Grid:

    (H / block_m, num_parts, B * Q)   axis 0 varies fastest on the GPU

so a token's head blocks run side by side and share the gathered rows through L2. `-1` entries are
masked (and not read); the index list may be cut into `num_parts` parts for small batches, merged
by log-sum-exp exactly as in the dense kernel (`flash_decoding.py`).

The slots' cache rows are looked up in the page table by XLA before the launch (`paged.selected_rows`,
one int32 a slot: 8 KiB a token), not in the kernel's loop. In the loop the lookup was a chain of
two dependent loads (the slot, then its page) ahead of the gather, and Triton's pipeliner turned
that into synchronous global loads and a wait for every copy in flight at each tile, so each tile
paid the memory latency several times and the kernel ran at 7% of its roofline on an H200. A row
list is one load ahead of the gather, which Triton prefetches with the tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .flash_decoding import LatentDims, attend_tiles, flash_decode, load_queries, part_start, store_part
from .paged import selected_rows
from .tiling import block_indices, load_block, tile_range


def _sparse_mla_kernel(q_nope_ref, q_rope_ref, cache_ref, page_table_ref, cache_rows_ref, out_ref, lse_ref, *,
                       dims: LatentDims, rows: int, rows_padded: int, page_size: int, num_pages: int, block_m: int,
                       block_n: int, parts: int, softmax_scale: float):
    """One (head block, part, token) program.

    q_nope_ref [B * Q * H, Dl], q_rope_ref [B * Q * H, Dr] (rows = H per token), cache_ref
    [P * page, Dl + Dr], page_table_ref (unused: `cache_rows_ref` holds the lookups),
    cache_rows_ref [B * Q, K] int32 (each selected slot's row of cache_ref, -1 for a slot that
    is not read); outputs out_ref [B * Q * parts * Hp, Dl], lse_ref [B * Q * parts * Hp].
    """
    del page_table_ref, page_size, num_pages
    head_block, part, token = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    topk = cache_rows_ref.shape[1]

    heads, valid = block_indices(head_block * block_m, block_m, rows)
    queries = load_queries(q_nope_ref, q_rope_ref, token * rows + heads, valid, dims)
    lo, hi = tile_range(part, parts, pl.cdiv(topk, block_n))

    def tile(t):
        columns, listed = block_indices(t * block_n, block_n, topk)
        cache_rows = load_block(cache_rows_ref, token, columns, column_valid=listed)
        selected = listed & (cache_rows >= 0)
        return jnp.maximum(cache_rows, 0), selected, selected[None, :]

    row_max, denom, acc = attend_tiles(queries, cache_ref, tile, lo, hi, softmax_scale, dims)
    store_part(out_ref, lse_ref, part_start(token, part, parts, rows_padded, head_block * block_m), row_max, denom,
               acc)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "block_m", "block_n", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def sparse_mla_attention_pallas(q_nope: jax.Array, q_rope: jax.Array, latent_cache: jax.Array,
                                page_table: jax.Array, indices: jax.Array, *, softmax_scale: float,
                                block_m: int | None = None, block_n: int | None = None, num_splits: int | None = None,
                                num_warps: int | None = None, num_stages: int = 2, interpret: bool | None = None):
    """`sparse_mla_attention` as a Pallas kernel; same arguments and results as the reference.

    q_nope [B, Q, H, Dl], q_rope [B, Q, H, Dr], latent_cache [P, page, Dl + Dr],
    page_table [B, max_pages] int32, indices [B, Q, K] int32 (-1 = skip)
    -> out [B, Q, H, Dl] (q_nope.dtype), lse [B, Q, H] float32.

    Tuning (static) as in `mla_attention_pallas`: block_m head rows per program, block_n selected
    slots per tile, num_splits parts of the index list, num_warps, num_stages; interpret None =
    interpret mode off a GPU.
    """
    batch, num_queries, heads, latent = q_nope.shape
    num_pages, page_size = latent_cache.shape[:2]
    topk = indices.shape[-1]
    # -1 and slots past the row's pages address nothing (`paged.py`): both are skipped.
    cache_rows = selected_rows(page_table.astype(jnp.int32), indices.reshape(batch, -1).astype(jnp.int32),
                               page_size, num_pages)
    out, lse = flash_decode(
        _sparse_mla_kernel, name="sparse_mla_attention", q_nope=q_nope, q_rope=q_rope, latent_cache=latent_cache,
        page_table=page_table, operands=[cache_rows.reshape(batch * num_queries, topk)],
        groups=batch * num_queries, num_slots=topk, block_m=block_m, block_n=block_n,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        softmax_scale=softmax_scale)
    return out.reshape(batch, num_queries, heads, latent), lse.reshape(batch, num_queries, heads)
