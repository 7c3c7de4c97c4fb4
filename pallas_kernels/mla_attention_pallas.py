"""Pallas GPU kernel (Triton lowering) for `mla_attention`: absorbed MLA decode over the paged cache.

Work layout. The Q window tokens x H heads of one sequence row are flattened into M = Q * H query
rows (row m = q * H + h) that all attend to the same cache, so they are processed together: a
program holds `block_m` of those rows and streams the row's latent cache past them in tiles of
`block_n` slots. block_m is 64 because a 64 x 512 float32 accumulator is 128 KiB, half an SM's
register file (128 registers a thread at 8 warps); all of M = 128..1024 would not fit. Grid:

    (M / block_m, num_parts, B)   axis 0 varies fastest on the GPU

so the programs that share a row's pages (its M / block_m row blocks: 2 for DeepSeek at Q = 1)
are scheduled side by side and read the same tiles at about the same time: HBM serves a page once
per sequence row and L2 the repeats (the benchmark's bandwidth column shows how close that holds).
Visibility is per token (`bound` per query row, plus the tree's ancestor mask inside the window),
and a row's slots are cut into `num_parts` contiguous parts (flash-decoding split-KV) when
B * M / block_m programs alone would leave the GPU idle; see `flash_decoding.py` for the loop and
the log-sum-exp merge.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .flash_decoding import LatentDims, attend_tiles, flash_decode, load_queries, part_start, store_part
from .tiling import block_indices, slot_rows, tile_range, token_bounds, visibility_operands, visible
from .visibility import Visibility


def _mla_kernel(q_nope_ref, q_rope_ref, cache_ref, page_table_ref, *refs, dims: LatentDims,
                rows: int, rows_padded: int, page_size: int, num_pages: int, block_m: int, block_n: int, parts: int,
                heads: int, softmax_scale: float):
    """One (row block, part, sequence row) program.

    q_nope_ref [B * M, Dl], q_rope_ref [B * M, Dr] (M = rows = Q * H), cache_ref [P * page, Dl + Dr],
    page_table_ref [B, max_pages], then the window's visibility refs (`tiling.visibility_operands`);
    outputs out_ref [B * parts * Mp, Dl], lse_ref [B * parts * Mp].
    """
    *vis_refs, out_ref, lse_ref = refs
    row_block, part, seq = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    query_rows, valid = block_indices(row_block * block_m, block_m, rows)
    queries = load_queries(q_nope_ref, q_rope_ref, seq * rows + query_rows, valid, dims)
    tokens = jax.lax.div(query_rows, heads)
    bounds, span, prefix_ref, ancestor_ref = token_bounds(vis_refs, seq, tokens, valid, num_queries=rows // heads,
                                                          counts=False)
    lo, hi = tile_range(part, parts, jax.lax.div(span + block_n - 1, block_n))

    def tile(t):
        slots = t * block_n + jnp.arange(block_n, dtype=jnp.int32)
        cache_rows = slot_rows(page_table_ref, seq, slots, page_size, num_pages)
        return cache_rows, slots < span, visible(slots, bounds, seq, tokens, prefix_ref, ancestor_ref)

    row_max, denom, acc = attend_tiles(queries, cache_ref, tile, lo, hi, softmax_scale, dims)
    store_part(out_ref, lse_ref, part_start(seq, part, parts, rows_padded, row_block * block_m), row_max, denom, acc)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "block_m", "block_n", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def mla_attention_pallas(q_nope: jax.Array, q_rope: jax.Array, latent_cache: jax.Array, page_table: jax.Array,
                         vis: Visibility, *, softmax_scale: float, block_m: int | None = None, block_n: int | None = None,
                         num_splits: int | None = None, num_warps: int | None = None, num_stages: int = 2,
                         interpret: bool | None = None):
    """`mla_attention` as a Pallas kernel; same arguments and results as `mla_attention_reference`.

    q_nope [B, Q, H, Dl], q_rope [B, Q, H, Dr], latent_cache [P, page, Dl + Dr],
    page_table [B, max_pages] int32 -> out [B, Q, H, Dl] (q_nope.dtype), lse [B, Q, H] float32.

    Tuning (static): block_m query rows per program and block_n slots per tile (powers of two
    >= 16, block_n independent of the page size; defaults in `flash_decode`: 64 x 16 for bf16),
    num_splits parts per row (default: enough programs for the GPU, parts >= MIN_PART_SLOTS),
    num_warps (default 8 for block_m >= 64, else 4) and num_stages of the Triton pipeline.
    interpret: None = interpret mode off a GPU; False forces the Triton lowering.
    """
    batch, num_queries, heads, latent = q_nope.shape
    page_size = latent_cache.shape[1]
    out, lse = flash_decode(
        _mla_kernel, name="mla_attention", q_nope=q_nope, q_rope=q_rope, latent_cache=latent_cache,
        page_table=page_table, operands=visibility_operands(vis, num_queries), groups=batch,
        num_slots=page_table.shape[1] * page_size, block_m=block_m, block_n=block_n,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret, heads=heads,
        softmax_scale=softmax_scale)
    return out.reshape(batch, num_queries, heads, latent), lse.reshape(batch, num_queries, heads)
