"""Pallas GPU kernel (Triton lowering) for `indexer_topk`: DSA lightning-indexer scores, then top-k.

Scores. `I[b, q, s] = sum_h w[b, q, h] * relu(q_idx[b, q, h] . key[s])` for the slots token (b, q)
sees, -inf elsewhere. A program holds `block_q` window tokens x all their Hi heads as one
`[block_q * Hi, Di]` query block (128 rows: 2 tokens of DeepSeek-V3.2's 64 heads x 128), so one
tensor-core dot per key tile scores every head of those tokens; the ReLU, head weights and the sum
over heads (a reshape to `[block_q, Hi, block_n]` and an exact float32 sum) follow in registers,
and only `[block_q, block_n]` scores are written. Grid:

    (Q / block_q, slot chunks, B)   axis 0 varies fastest on the GPU

so every key tile is read from HBM once per sequence row. A chunk is `tiles_per_program` key
tiles, so the query block is loaded once per chunk; tiles past the row's last visible slot are
filled with -inf without reading keys.

Top-k. The scores go to `select_topk`, the reference's own selection (`lax.top_k`, or for a call
of few tokens a count of ranks giving the same indices): it is exact, breaks ties towards the
lower slot exactly as the reference does, and XLA's GPU top-k for
k = 2048 over <= 128k slots costs about as much as writing the scores (the benchmark,
`benchmarks/attention_kernels.py`, times it against `lax.approx_max_k` and a full sort). An in-kernel
selection would save that write and read, but would have to reproduce the exact tie order to stay
equal to the reference; a radix-select kernel is the next step if the benchmark says top-k
dominates.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .cost import indexer_cost
from .contracts import select_topk
from .fp8_cache import Fp8Pool, cache_token_bytes, flat_pool
from .tiling import (TARGET_PROGRAMS, block_indices, block_size, column_span, dot_nt, launch, load_block, load_vector,
                     slot_rows, tile_range, token_bounds, visibility_operands, visible)
from .visibility import VisibleSlots, slot_counts

# Query rows (tokens x heads) per program: a 128 x 128 bf16 query block plus a 128 x 64 float32
# score tile stay in registers at 4 warps.
QUERY_ROWS = 128
# Key tiles per program at most: longer chunks reuse the query block more but leave fewer programs.
MAX_TILES_PER_PROGRAM = 16


def _indexer_kernel(q_ref, weights_ref, key_ref, page_table_ref, *refs, counts: bool, num_queries: int, heads: int,
                    heads_block: int, dim_block: int, page_size: int, num_pages: int, block_q: int, block_n: int,
                    queries_padded: int, chunks: int):
    """One (token block, slot chunk, sequence row) program.

    q_ref [B * Q * Hi, Di], weights_ref [B * Q * Hi], key_ref [P * page, Di] (FP8 keys: an
    `Fp8Pool` of e4m3 values [P * page, Di] and scales [P * page]), page_table_ref
    [B, max_pages], then the visibility's refs (`tiling.visibility_operands`; counts: whether
    they are slot counts); output scores_ref [B * Qp, S padded to block_n] float32.
    """
    *vis_refs, scores_ref = refs
    token_block, chunk, seq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    fp8 = isinstance(key_ref, Fp8Pool)
    key_values_ref = key_ref.values if fp8 else key_ref
    dim = key_values_ref.shape[1]

    # Query rows: token-major, each token's heads padded to `heads_block` (zero rows score 0).
    row = jnp.arange(block_q * heads_block, dtype=jnp.int32)
    row_token = token_block * block_q + jax.lax.div(row, heads_block)
    row_head = jax.lax.rem(row, heads_block)
    row_valid = (row_token < num_queries) & (row_head < heads)
    q_rows = (seq * num_queries + jnp.minimum(row_token, num_queries - 1)) * heads + jnp.minimum(row_head, heads - 1)
    columns, column_valid = column_span(0, dim, dim_block)
    queries = load_block(q_ref, q_rows, columns, row_valid, column_valid)
    weights = load_vector(weights_ref, q_rows, row_valid).astype(jnp.float32)

    tokens, token_valid = block_indices(token_block * block_q, block_q, num_queries)
    bounds, span, prefix_ref, ancestor_ref = token_bounds(vis_refs, seq, tokens, token_valid,
                                                          num_queries=num_queries, counts=counts)
    out_rows = pl.ds(seq * queries_padded + token_block * block_q, block_q)
    lo, hi = tile_range(chunk, chunks, scores_ref.shape[1] // block_n)
    seen_hi = jnp.clip(jax.lax.div(span + block_n - 1, block_n), lo, hi)

    def score_tile(t, carry):
        slots = t * block_n + jnp.arange(block_n, dtype=jnp.int32)
        cache_rows = slot_rows(page_table_ref, seq, slots, page_size, num_pages)
        keys = load_block(key_values_ref, cache_rows, columns, slots < span, column_valid)
        # e4m3 operands go to the tensor cores as bfloat16, which holds every e4m3 value exactly:
        # the products are exact and accumulate in float32, as DeepSeek's fp8_index does.
        dtype = jnp.bfloat16 if fp8 else jnp.promote_types(queries.dtype, keys.dtype)
        logits = dot_nt(queries.astype(dtype), keys.astype(dtype))  # [block_q * heads_block, block_n]
        per_head = jnp.maximum(logits, 0.0) * weights[:, None]
        scores = jnp.sum(per_head.reshape(block_q, heads_block, block_n), axis=1)
        if fp8:  # the key's scale multiplies the head sum (`indexer.score_keys`)
            scores = scores * load_vector(key_ref.scales, cache_rows, slots < span)[None, :]
        sees = visible(slots, bounds, seq, tokens, prefix_ref, ancestor_ref)
        scores_ref[out_rows, pl.ds(t * block_n, block_n)] = jnp.where(sees, scores, -jnp.inf)
        return carry

    def unseen_tile(t, carry):
        scores_ref[out_rows, pl.ds(t * block_n, block_n)] = jnp.full((block_q, block_n), -jnp.inf, jnp.float32)
        return carry

    jax.lax.fori_loop(lo, seen_hi, score_tile, 0)
    jax.lax.fori_loop(seen_hi, hi, unseen_tile, 0)


@functools.partial(jax.jit, static_argnames=("block_n", "tiles_per_program", "num_warps", "num_stages", "interpret"))
def indexer_scores_pallas(q_idx: jax.Array, weights: jax.Array, key_cache: jax.Array, page_table: jax.Array,
                          vis: VisibleSlots, *, block_n: int = 64, tiles_per_program: int | None = None,
                          num_warps: int = 4, num_stages: int = 2, interpret: bool | None = None) -> jax.Array:
    """`indexer_scores_reference` as a Pallas kernel.

    q_idx [B, Q, Hi, Di], weights [B, Q, Hi], key_cache [P, page, Di] (or an `Fp8Pool` of FP8 keys,
    q_idx then e4m3), page_table [B, max_pages], vis a `Visibility` or slot counts [B, Q]
    -> scores [B, Q, S] float32 (S = max_pages * page; -inf where not visible).

    Tuning (static): block_n slots per key tile (power of two >= 16), tiles_per_program (default:
    enough programs for the GPU, at most MAX_TILES_PER_PROGRAM), num_warps, num_stages;
    interpret None = interpret mode off a GPU.
    """
    batch, num_queries, heads, dim = q_idx.shape
    num_pages, page_size, _ = key_cache.shape
    num_slots = page_table.shape[1] * page_size
    heads_block = block_size(heads)
    block_q = min(max(1, QUERY_ROWS // heads_block), pl.next_power_of_2(num_queries))
    token_blocks = pl.cdiv(num_queries, block_q)
    queries_padded = token_blocks * block_q
    num_tiles = pl.cdiv(num_slots, block_n)
    if tiles_per_program is None:
        tiles_per_program = min(MAX_TILES_PER_PROGRAM, max(1, num_tiles * batch * token_blocks // TARGET_PROGRAMS))
    chunks = pl.cdiv(num_tiles, tiles_per_program)

    kernel = functools.partial(
        _indexer_kernel, counts=slot_counts(vis), num_queries=num_queries, heads=heads, heads_block=heads_block,
        dim_block=block_size(dim), page_size=page_size, num_pages=num_pages, block_q=block_q, block_n=block_n,
        queries_padded=queries_padded, chunks=chunks)
    out_shape = jax.ShapeDtypeStruct((batch * queries_padded, num_tiles * block_n), jnp.float32)
    vis_operands = visibility_operands(vis, num_queries)
    # Stated at full capacity (every slot visible): a row's keys come from HBM once; each head's
    # logit is a Di-long dot, then ReLU, weight and sum.
    cost = indexer_cost(batch, num_queries, heads, num_slots, dim, cache_token_bytes(key_cache), q_idx, weights,
                        page_table, *vis_operands, out_shape)
    scores = launch(kernel, out_shape=out_shape, grid=(token_blocks, chunks, batch), num_warps=num_warps,
                    num_stages=num_stages, name="indexer_scores", interpret=interpret, cost=cost)(
        q_idx.reshape(-1, dim), weights.reshape(-1), _flat_keys(key_cache), page_table.astype(jnp.int32), *vis_operands)
    return scores.reshape(batch, queries_padded, -1)[:, :num_queries, :num_slots]


def _flat_keys(key_cache):
    """The key pool as the kernel reads it: [P * page, Di], or an `Fp8Pool` of values [P * page, Di]
    and scales [P * page] (one per key: a vector load, where a [.., 1] column would not lower)."""
    flat = flat_pool(key_cache)
    return dataclasses.replace(flat, scales=flat.scales[:, 0]) if isinstance(flat, Fp8Pool) else flat


@functools.partial(jax.jit, static_argnames=("topk", "interpret"))
def indexer_topk_pallas(q_idx: jax.Array, weights: jax.Array, key_cache: jax.Array, page_table: jax.Array,
                        vis: VisibleSlots, *, topk: int, interpret: bool | None = None) -> jax.Array:
    """`indexer_topk` with Pallas scores; same arguments and result as `indexer_topk_reference`.

    q_idx [B, Q, Hi, Di], weights [B, Q, Hi], key_cache [P, page, Di], page_table [B, max_pages]
    -> indices [B, Q, topk] int32, best first, -1 where fewer than topk slots are visible.
    """
    return select_topk(indexer_scores_pallas(q_idx, weights, key_cache, page_table, vis, interpret=interpret), topk)
