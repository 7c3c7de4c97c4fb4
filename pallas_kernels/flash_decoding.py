"""The absorbed-MLA flash-decoding loop shared by the dense and the sparse MLA kernels.

A program owns `block_m` query rows (head rows of one or more window tokens, all against the same
sequence row's cache) and one part of the row's slots. It walks that part in tiles of `block_n`
slots with an online softmax in float32, and writes a normalised partial output and its
log-sum-exp. With one part per row (long batches) that partial is the answer; with several
(split-KV, for short batches with long contexts) `combine_parts` merges them by log-sum-exp.

The two kernels differ only in which slots a tile holds and which of them a row sees, so they pass
`attend_tiles` a `tile(t) -> (cache rows, readable, sees)` function, and share the launch and the
merge (`flash_decode`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .cost import attention_cost
from .contracts import EMPTY_LSE
from .fp8_cache import Fp8Pool, cache_token_bytes, entry_dtype, flat_pool
from .tiling import block_size, column_span, dot_nn, dot_nt, launch, load_block, num_parts

# Shortest part (in slots) worth a split: below this, writing and merging a float32 partial costs
# about as much as reading the part's cache.
MIN_PART_SLOTS = 512


def default_warps(block_m: int) -> int:
    """Warps per program: 8 keep a 64 x 512 float32 accumulator at 128 registers a thread."""
    return 8 if block_m >= 64 else 4


class LatentDims(NamedTuple):
    """Static feature sizes: latent Dl (512), rope Dr (64), the power-of-two blocks each is read in
    (Dl itself for DeepSeek; a wider, zero-padded block for small models such as the shipped
    kv_lora_rank=48 one), and the dtype both dot operands are cast to."""

    latent: int
    rope: int
    latent_block: int
    rope_block: int
    dtype: jnp.dtype


def latent_dims(q_nope: jax.Array, q_rope: jax.Array, latent_cache) -> LatentDims:
    """Check the operand shapes of an MLA kernel and return its `LatentDims`. An FP8 cache
    (`Fp8Pool`) is dequantized in registers to the dtype its bfloat16 RoPE part and the queries
    promote to (bfloat16 for bfloat16 queries, as FlashMLA feeds its tensor cores)."""
    latent, rope = q_nope.shape[-1], q_rope.shape[-1]
    if latent_cache.shape[-1] != latent + rope:
        raise ValueError(f"latent_cache last dim {latent_cache.shape[-1]} != Dl + Dr = {latent} + {rope}")
    dtype = jnp.promote_types(q_nope.dtype, entry_dtype(latent_cache))
    return LatentDims(latent, rope, block_size(latent), block_size(rope), dtype)


def load_queries(q_nope_ref, q_rope_ref, rows, valid, dims: LatentDims):
    """q_nope_ref [N, Dl], q_rope_ref [N, Dr]; rows [BM] -> ([BM, Dl block], [BM, Dr block]), zeros
    where not valid (padding rows and padding columns)."""
    latent_cols, latent_valid = column_span(0, dims.latent, dims.latent_block)
    rope_cols, rope_valid = column_span(0, dims.rope, dims.rope_block)
    q_nope = load_block(q_nope_ref, rows, latent_cols, valid, latent_valid)
    q_rope = load_block(q_rope_ref, rows, rope_cols, valid, rope_valid)
    return q_nope.astype(dims.dtype), q_rope.astype(dims.dtype)


def load_latent(cache_ref, rows, readable, dims: LatentDims):
    """cache_ref [P * page, Dl + Dr] (or an `Fp8Pool` of refs [P * page, ...]); rows [BN]
    -> (latent [BN, Dl block], rope key [BN, Dr block]).

    Unreadable slots read as zeros, so stale or uninitialised cache memory never meets a zero
    probability (0 * NaN would poison the row). FP8 entries are dequantized here, in registers:
    each latent column is multiplied by its block's scale and rounded to bfloat16
    (`fp8_cache.entries`), and no dequantized copy of the cache exists. Each latent column loads
    its block's scale (a [BN, Dl] gather of the slot's 4 scales at DeepSeek's widths, served from
    L1): the pipeline stages that tile in shared memory (151,616 B at 16-slot tiles), where
    spreading one [BN, 1] load per block over its columns by selects held it in registers and
    spilled with jax 0.11's Triton (docs/fp8-caches.md gives the compiled sizes).
    """
    latent_cols, latent_valid = column_span(0, dims.latent, dims.latent_block)
    if isinstance(cache_ref, Fp8Pool):
        latent = load_dequantized(cache_ref, rows, latent_cols, readable, latent_valid)
        rope_cols, rope_valid = column_span(0, dims.rope, dims.rope_block)
        rope_key = load_block(cache_ref.rope, rows, rope_cols, readable, rope_valid)
        return latent.astype(dims.dtype), rope_key.astype(dims.dtype)
    rope_cols, rope_valid = column_span(dims.latent, dims.rope, dims.rope_block)
    latent = load_block(cache_ref, rows, latent_cols, readable, latent_valid)
    rope_key = load_block(cache_ref, rows, rope_cols, readable, rope_valid)
    return latent.astype(dims.dtype), rope_key.astype(dims.dtype)


def load_dequantized(pool_ref, rows, columns, readable, column_valid):
    """An `Fp8Pool` of refs (values [rows, Dq], scales [rows, Dq / block], rope) at rows [BN] and
    in-range value columns [C] -> [BN, C]: each value times its column's block scale (a [BN, C]
    gather of the row's scales), rounded to the RoPE dtype as `fp8_cache.entries` defines an entry
    whatever the compute dtype; zeros where a row is not readable or a column not valid."""
    block_of_column = jax.lax.div(columns, pool_ref.values.shape[1] // pool_ref.scales.shape[1])
    values = load_block(pool_ref.values, rows, columns, readable, column_valid).astype(jnp.float32)
    scales = load_block(pool_ref.scales, rows, block_of_column, readable)
    return (values * scales).astype(pool_ref.rope.dtype)


def online_softmax_step(carry, scores, values):
    """One tile of an online softmax.

    carry: (running max [BM], denominator [BM], unnormalised output [BM, Dv]) float32; scores
    [BM, BN] float32, -inf where a row does not see the key; values [BN, Dv] -> the updated carry.
    """
    row_max, denom, acc = carry
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
    # A row that has seen nothing yet keeps max -inf; shifting by 0 instead keeps exp() at 0, not NaN.
    shift = jnp.where(new_max > -jnp.inf, new_max, 0.0)
    probs = jnp.exp(scores - shift[:, None])
    rescale = jnp.exp(row_max - shift)
    denom = denom * rescale + jnp.sum(probs, axis=1)
    # Probabilities go to the tensor cores in the cache dtype (bf16), accumulating in float32.
    acc = acc * rescale[:, None] + dot_nn(probs.astype(values.dtype), values)
    return new_max, denom, acc


def attend_tiles(queries, cache_ref, tile, lo, hi, softmax_scale: float, dims: LatentDims):
    """Online-softmax attention of `queries` over tiles [lo, hi).

    queries: (q_nope [BM, Dl], q_rope [BM, Dr block]) from `load_queries`.
    tile(t) -> (cache rows [BN] int32, readable [BN] bool, sees [BM or 1, BN] bool).
    Returns (running max [BM], softmax denominator [BM], unnormalised output [BM, Dl block]), float32.
    """
    q_nope, q_rope = queries
    block_m = q_nope.shape[0]

    def step(t, carry):
        rows, readable, sees = tile(t)
        latent, rope_key = load_latent(cache_ref, rows, readable, dims)
        scores = (dot_nt(q_nope, latent) + dot_nt(q_rope, rope_key)) * softmax_scale
        return online_softmax_step(carry, jnp.where(sees, scores, -jnp.inf), latent)

    init = (jnp.full((block_m,), -jnp.inf, jnp.float32), jnp.zeros((block_m,), jnp.float32),
            jnp.zeros((block_m, dims.latent_block), jnp.float32))
    return jax.lax.fori_loop(lo, hi, step, init)


def store_part(out_ref, lse_ref, start, row_max, denom, acc):
    """Normalise and store one part at rows [start, start + BM) of out_ref [N, Dl block] and lse_ref [N].

    A row that saw nothing stores output 0 and lse EMPTY_LSE, as the reference does.
    """
    block_m = acc.shape[0]
    seen = denom > 0
    safe_denom = jnp.where(seen, denom, 1.0)
    out_ref[pl.ds(start, block_m), :] = (acc / safe_denom[:, None]).astype(out_ref.dtype)
    lse_ref[pl.ds(start, block_m)] = jnp.where(seen, row_max + jnp.log(safe_denom), EMPTY_LSE)


def part_start(group, part, num_parts: int, rows_per_group: int, block_start):
    """First row a program writes in the partial outputs `[groups * num_parts * rows_per_group, ...]`."""
    return (group * num_parts + part) * rows_per_group + block_start


def part_shapes(groups: int, num_parts: int, rows_per_group: int, latent: int, out_dtype):
    """out_shape of an MLA kernel: partial outputs (float32 unless there is one part) and lse."""
    dtype = out_dtype if num_parts == 1 else jnp.float32
    rows = groups * num_parts * rows_per_group
    return (jax.ShapeDtypeStruct((rows, latent), dtype), jax.ShapeDtypeStruct((rows,), jnp.float32))


def combine_parts(out, lse, groups: int, num_parts: int, rows_per_group: int, rows: int, out_dtype):
    """Merge split-KV parts: out [G*S*Rp, Dl block], lse [G*S*Rp] -> out [G, rows, Dl block], lse [G, rows].

    Plain jnp (XLA fuses it into one pass over the partials, which are small next to the cache).
    Each part is already normalised, so the merge weights part s by exp(lse_s - lse). Empty parts
    (lse == EMPTY_LSE) get weight 0; a row with only empty parts keeps output 0 and EMPTY_LSE.
    """
    out = out.reshape(groups, num_parts, rows_per_group, -1)[:, :, :rows]
    lse = lse.reshape(groups, num_parts, rows_per_group)[:, :, :rows]
    if num_parts == 1:
        return out[:, 0].astype(out_dtype), lse[:, 0]
    top = jnp.max(lse, axis=1, keepdims=True)
    weight = jnp.where(lse > EMPTY_LSE, jnp.exp(lse - top), 0.0)
    total = jnp.sum(weight, axis=1)
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    merged = jnp.einsum("gsr,gsrd->grd", weight, out, precision=jax.lax.Precision.HIGHEST) / safe_total[..., None]
    merged_lse = jnp.where(seen, top[:, 0] + jnp.log(safe_total), EMPTY_LSE)
    return merged.astype(out_dtype), merged_lse


def flash_decode(kernel, *, name: str, q_nope, q_rope, latent_cache, page_table, operands, groups: int, num_slots: int,
                 block_m: int | None, block_n: int | None, num_splits: int | None, num_warps: int | None,
                 num_stages: int, interpret: bool | None, **params):
    """Launch an MLA flash-decoding kernel over `groups` groups of query rows and merge its parts.

    q_nope [groups, ..., Dl] and q_rope [groups, ..., Dr] hold `rows` query rows per group that see
    the same slots (a sequence row's Q*H rows, or one token's H heads); `num_slots` is the most
    slots a group's loop can visit (it sets the number of parts).
    The kernel is called as `kernel(q_nope_ref [groups*rows, Dl], q_rope_ref [groups*rows, Dr],
    cache_ref [P*page, Dl+Dr] (an `Fp8Pool` of refs for an FP8 cache), page_table_ref, *operand
    refs, out_ref, lse_ref, dims=, rows=, rows_padded=, page_size=, num_pages=, block_m=,
    block_n=, parts=, **params)` on the grid
    (row blocks, parts, groups). Returns out [groups, rows, Dl] in q_nope's dtype, lse [groups, rows].

    Default blocks: 64 query rows x 16 slots for 2-byte inputs; 32 x 16 for float32, whose query
    block and double-buffered cache tiles would otherwise outgrow shared memory. Tiles of 32 slots
    need more than the 255 registers a thread may have beside a 64 x 512 float32 accumulator with
    jax 0.11's Triton, which spills at DeepSeek's widths (dense MLA 32 bytes, where jax 0.10.2's
    uses 233 registers); with 16 neither version spills (FP8 caches: see `load_latent`).
    """
    dims = latent_dims(q_nope, q_rope, latent_cache)
    num_pages, page_size, _ = latent_cache.shape
    rows = q_nope.size // (groups * dims.latent)
    narrow = jnp.dtype(dims.dtype).itemsize <= 2
    block_m = block_m or block_size(rows, 64 if narrow else 32)
    block_n = block_n or 16
    row_blocks = pl.cdiv(rows, block_m)
    rows_padded = row_blocks * block_m
    parts = num_splits or num_parts(groups * row_blocks, pl.cdiv(num_slots, block_n), MIN_PART_SLOTS // block_n)
    kernel = functools.partial(kernel, dims=dims, rows=rows, rows_padded=rows_padded, page_size=page_size,
                               num_pages=num_pages, block_m=block_m, block_n=block_n, parts=parts, **params)
    out_shape = part_shapes(groups, parts, rows_padded, dims.latent_block, q_nope.dtype)
    # Stated at full capacity (every slot visible; the real loop stops at each row's length). A
    # group's query rows score Dl + Dr features and average Dl per slot; its slots come from HBM
    # once (its row blocks share them through L2).
    cost = attention_cost(groups, rows, num_slots, 2 * dims.latent + dims.rope, cache_token_bytes(latent_cache),
                          q_nope, q_rope, page_table, *operands, *out_shape)
    out, lse = launch(kernel, out_shape=out_shape, grid=(row_blocks, parts, groups),
                      num_warps=num_warps or default_warps(block_m), num_stages=num_stages, name=name,
                      interpret=interpret, cost=cost)(
        q_nope.reshape(groups * rows, dims.latent), q_rope.reshape(groups * rows, dims.rope),
        flat_pool(latent_cache), page_table.astype(jnp.int32), *operands)
    out, lse = combine_parts(out, lse, groups, parts, rows_padded, rows, q_nope.dtype)
    return out[..., :dims.latent], lse
