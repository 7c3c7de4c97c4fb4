"""Pallas Mosaic GPU kernel (`plgpu.kernel`: TMA, wgmma) for `indexer_topk`: DSA lightning-indexer
scores over the paged key cache, then the reference's own top-k.

Scores. `I[b, q, s] = sum_h w[b, q, h] * relu(q_idx[b, q, h] . key[s])`. Keys are contiguous within
a page, so a tile of TILE (64) slots arrives by TMA, one copy per page it spans (one copy for
DeepSeek's 64-slot pages), double-buffered against the tensor cores. Each tile is scored by one
wgmma per window token,

    [TILE slots, Di] (keys, SMEM)  x  [Di, Hp] (the token's queries transposed, SMEM)  ->  [TILE, Hp] float32

with the slots as the wgmma's rows: the ReLU, the head weights (a column broadcast) and the sum over
heads (a row reduction) then stay in registers, and only TILE float32 scores per token leave.
Putting the keys on the M side needs no transposed operand: the queries are transposed once in XLA
(`[B, Q, Di, Hp]`, small), and Mosaic GPU's CPU interpreter in jax 0.10 executes only untransposed
wgmma operands.

Grid: `(B, slot chunks, Q)`, its last axis fastest (Mosaic GPU launches a Pallas grid reversed: the
last axis is CUDA's x), so the Q programs that read the same key chunk run side by side and the
chunk comes from HBM once, the rest of its reads from L2. A token's scores are a
function of its own queries, weights and keys only (fixed tiles, one wgmma per token and tile): they
do not depend on B, Q or the chunking, bit for bit. Tiles wholly past a token's last visible slot
are written as -inf without reading keys. Visibility inside the kernel is the chain bound
(`kv_bound`: of the window's `Visibility`, or the given slot counts); a tree's non-ancestor window slots (at most Q per token) are set to -inf afterwards by
a scatter of B * Q * Q entries.

FP8 keys (`fp8_cache.Fp8Pool`: e4m3, one float32 scale per key) arrive as e4m3 tiles and their
scales, one copy each per page the tile spans; the e4m3 values go through registers into a
bfloat16 tile (which holds every e4m3 value), so the wgmma's products are exact and sum in float32
as the reference's do, and each slot's head sum is multiplied by its key's scale
(`indexer.score_keys`, DeepSeek's `fp8_index`). The e4m3 queries are widened to bfloat16 in XLA
with the transposition. Pages must then hold 32 slots or more: a TMA copy moves a multiple of
128 bytes, 32 scales.

Top-k. As in the Triton path (`indexer_pallas.py`), the scores go to `select_topk` (XLA's
`lax.top_k`, or for a call of few tokens a count of ranks giving the same indices): exact, ties
to the lower slot exactly as the reference. The cost is the score matrix
`[B, Q, S]` float32 written by the kernel and read once by the top-k: 4 bytes per (token, slot)
against the keys' 2 * Di bytes per slot read once per row, so at B = 32, Q = 1, S = 4096 it is
0.5 MiB written + 0.5 MiB read beside 32 MiB of keys. An in-kernel selection would have to keep the
exact tie order; that is left for when the benchmark says top-k dominates.

Constraints (checked, ValueError): keys and queries bfloat16 or float16 (the wgmma operand types),
or FP8 keys with e4m3 or bfloat16 queries in pages of a multiple of 32;
Di a multiple of 64 (one 128-byte swizzled row per 64 features); page_size a multiple of 8 that
divides 64 or is a multiple of it. The head count is padded to a multiple of 64 with zero weights.

Interpreted on the CPU through `mosaic_gpu.interpreting` (a private JAX API, `mosaic_gpu.JAX_RANGE`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .contracts import select_topk
from .cost import indexer_cost, stating
from .fp8_cache import E4M3, Fp8Pool, cache_token_bytes
from .mosaic_gpu import UPCAST_8BIT, compiler_params, interpreting, swizzled
from .visibility import VisibleSlots, kv_bound, tree_mask_of

# Slots per tile: the wgmma's M (one warpgroup).
TILE = 64
# Tiles per program at most: the scores of a chunk wait in SMEM for one store.
CHUNK_TILES = 16
# How a bfloat16 wgmma operand sits in SMEM: 8-row tiles of 128-byte rows, swizzled.
SWIZZLED = swizzled(jnp.bfloat16, 64)
_OPERAND_DTYPES = (jnp.bfloat16, jnp.float16)
# Page sizes FP8 keys need: a TMA copy moves a multiple of 128 bytes, 32 of their float32 scales.
FP8_MIN_PAGE = 32


def check_mosaic_operands(name: str, *arrays: jax.Array) -> None:
    """ValueError unless the arrays are wgmma operand types."""
    for array in arrays:
        if array.dtype not in _OPERAND_DTYPES:
            raise ValueError(f"{name}: dtype {array.dtype} not supported by the Mosaic GPU kernel: "
                             "must be bfloat16 or float16")


def copy_tile(cache_ref, page_table_ref, row, tile, dst, barrier, *, page_size: int):
    """TMA the cache rows of slots [tile * TILE, (tile + 1) * TILE) of sequence row `row` into `dst`
    ([TILE, ...] SMEM; cache_ref [P, page, ...]), one copy per page the tile spans; `barrier`
    completes after all of them (it counts `copies_per_tile(page_size)` arrivals). Table entries
    past the row's pages are clamped: those slots are never visible, so what they read does not
    matter."""
    max_pages = page_table_ref.shape[1]
    rows = min(page_size, TILE)
    for piece in range(TILE // rows):
        slot = tile * TILE + piece * rows
        entry = jnp.minimum(jax.lax.div(slot, page_size), max_pages - 1)
        page = page_table_ref[row, entry]
        offset = jax.lax.rem(slot, page_size)
        plgpu.copy_gmem_to_smem(cache_ref.at[page, pl.ds(offset, rows)], dst.at[pl.ds(piece * rows, rows)], barrier)


def copies_per_tile(page_size: int) -> int:
    return TILE // min(page_size, TILE)


def _indexer_kernel(q_ref, w_ref, key_ref, *refs, page_size: int, chunk_tiles: int, num_queries: int, fp8: bool):
    """One (token, chunk, row) program. q_ref [B * Q, Di, Hp], w_ref [B * Q, Hp] float32,
    key_ref [P, page, Di] (FP8 keys: e4m3, then their scales scale_ref [P, page] float32),
    page_table_ref [B, M], bound_ref [B, Q]; out_ref [B * Q, tiles * TILE]."""
    scale_ref, page_table_ref, bound_ref, out_ref = refs if fp8 else (None, *refs)
    token, chunk, row = jax.lax.axis_index("token"), jax.lax.axis_index("chunk"), jax.lax.axis_index("row")
    dim, heads = q_ref.shape[1], q_ref.shape[2]
    query = row * num_queries + token
    bound = bound_ref[row, token]
    lo = chunk * chunk_tiles
    # Tiles holding a visible slot; the rest of the chunk is -inf.
    seen = jnp.clip(jax.lax.div(bound + TILE - 1, TILE) - lo, 0, chunk_tiles)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def body(q_smem, w_smem, keys_smem, scores_smem, q_barrier, key_barriers, operand_smem, scales_smem):
        def fetch(tile, buffer):
            copy_tile(key_ref, page_table_ref, row, tile, keys_smem.at[buffer], key_barriers.at[buffer],
                      page_size=page_size)
            if fp8:
                copy_tile(scale_ref, page_table_ref, row, tile, scales_smem.at[buffer], key_barriers.at[buffer],
                          page_size=page_size)

        plgpu.copy_gmem_to_smem(q_ref.at[query], q_smem, q_barrier)
        plgpu.copy_gmem_to_smem(w_ref.at[query], w_smem, q_barrier)

        @pl.when(seen > 0)
        def _():
            fetch(lo, 0)

        plgpu.barrier_wait(q_barrier)
        weights = plgpu.layout_cast(w_smem[...], plgpu.Layout.WGMMA.reduce(0))

        @pl.loop(0, chunk_tiles)
        def _(step):
            slots = (lo + step) * TILE + plgpu.broadcasted_iota(jnp.int32, (TILE,), 0, layout=row_layout)

            @pl.when(step < seen)
            def _():
                buffer = jax.lax.rem(step, 2)

                # The other buffer's last reader (the previous step's wgmma) has finished: refill it.
                @pl.when(step + 1 < seen)
                def _():
                    fetch(lo + step + 1, 1 - buffer)

                plgpu.barrier_wait(key_barriers.at[buffer])
                keys = keys_smem.at[buffer]
                if fp8:
                    # e4m3 keys to the tensor cores as bfloat16, which holds every e4m3 value: the
                    # products are exact and sum in float32, as `indexer.score_keys` computes them.
                    # (e4m3 -> bfloat16 goes through float32: a direct conversion needs a newer ptxas.)
                    values = plgpu.layout_cast(keys[...], UPCAST_8BIT)
                    operand_smem[...] = values.astype(jnp.float32).astype(operand_smem.dtype)
                    plgpu.commit_smem()
                    keys = operand_smem

                def score(acc_ref):
                    plgpu.wgmma(acc_ref, keys, q_smem)
                    return acc_ref[...]

                logits = pl.run_scoped(score, plgpu.ACC((TILE, heads), jnp.float32))
                per_head = jnp.maximum(logits, 0.0) * jax.lax.broadcast_in_dim(weights, (TILE, heads), [1])
                scores = jnp.sum(per_head, axis=1)
                if fp8:  # the key's scale multiplies the head sum (`indexer.score_keys`)
                    scores = scores * plgpu.layout_cast(scales_smem[buffer], row_layout)
                scores_smem[pl.ds(step * TILE, TILE)] = jnp.where(slots < bound, scores, -jnp.inf)

            @pl.when(step >= seen)
            def _():
                scores_smem[pl.ds(step * TILE, TILE)] = plgpu.layout_cast(jnp.full((TILE,), -jnp.inf, jnp.float32),
                                                                          row_layout)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(scores_smem, out_ref.at[query, pl.ds(lo * TILE, chunk_tiles * TILE)])
        plgpu.wait_smem_to_gmem(0)

    copies = copies_per_tile(page_size) * (2 if fp8 else 1)
    pl.run_scoped(
        body,
        plgpu.SMEM((dim, heads), q_ref.dtype, transforms=SWIZZLED),
        plgpu.SMEM((heads,), jnp.float32),
        plgpu.SMEM((2, TILE, dim), key_ref.dtype, transforms=swizzled(key_ref.dtype, dim)),
        plgpu.SMEM((chunk_tiles * TILE,), jnp.float32),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=copies, num_barriers=2),
        plgpu.SMEM((TILE, dim), q_ref.dtype, transforms=SWIZZLED) if fp8 else None,
        plgpu.SMEM((2, TILE), jnp.float32) if fp8 else None,
    )


def pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """x zero-padded at the end of `axis` to a multiple of `multiple`."""
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def indexer_scores_mosaic(q_idx: jax.Array, weights: jax.Array, key_cache, page_table: jax.Array,
                          vis: VisibleSlots, *, interpret: bool = False) -> jax.Array:
    """`indexer_scores_reference` as a Mosaic GPU kernel.

    q_idx [B, Q, Hi, Di], weights [B, Q, Hi], key_cache [P, page, Di] or an `fp8_cache.Fp8Pool`
    of FP8 keys (values [P, page, Di] e4m3, scales [P, page, 1] float32; q_idx then e4m3 or
    bfloat16, `models.indexer`), page_table [B, max_pages], vis a `Visibility` or slot counts [B, Q]
    -> scores [B, Q, S] float32 (S = max_pages * page; -inf where not visible).
    interpret: run on the CPU simulator (`mosaic_gpu.interpreting`) instead of lowering for a GPU.
    """
    name = "indexer_scores_mosaic"
    page_size = key_cache.shape[1]
    if isinstance(key_cache, Fp8Pool):
        if jnp.dtype(key_cache.values.dtype) != jnp.dtype(E4M3) or key_cache.scales.shape[-1] != 1:
            raise ValueError(f"{name}: FP8 keys must be float8_e4m3fn with one scale per key, got "
                             f"{key_cache.values.dtype} with {key_cache.scales.shape[-1]} scales")
        if jnp.dtype(q_idx.dtype) not in (jnp.dtype(E4M3), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"{name}: q_idx.dtype={q_idx.dtype}: with FP8 keys it must be float8_e4m3fn or "
                             "bfloat16 (both reach the tensor cores exactly as bfloat16)")
        if page_size % FP8_MIN_PAGE:
            raise ValueError(f"{name}: page_size={page_size}: FP8 keys need a multiple of {FP8_MIN_PAGE} (a TMA "
                             f"copy moves a multiple of 128 bytes, and a page's key scales are 4 bytes a slot)")
    else:
        check_mosaic_operands(name, q_idx, key_cache)
    if page_size % 8 or (TILE % page_size and page_size % TILE):
        raise ValueError(f"{name}: page_size={page_size} must be a multiple of 8 that divides "
                         f"{TILE} or is a multiple of it")
    dim, key_dim = q_idx.shape[-1], key_cache.shape[-1]
    if key_dim != dim or dim % 64:
        raise ValueError(f"{name}: index_head_dim {dim} (keys {key_dim}) must match and be a "
                         "multiple of 64")
    if not interpret:
        return _indexer_scores(q_idx, weights, key_cache, page_table, vis, interpret=False)
    with interpreting():
        return _indexer_scores(q_idx, weights, key_cache, page_table, vis, interpret=True)


# `interpret` only keys the jit cache: a kernel traced for the simulator is never reused for a GPU.
@functools.partial(jax.jit, static_argnames=("interpret",))
def _indexer_scores(q_idx, weights, key_cache, page_table, vis, *, interpret: bool):
    del interpret
    batch, num_queries, heads, dim = q_idx.shape
    page_size = key_cache.shape[1]
    num_slots = page_table.shape[1] * page_size
    num_tiles = pl.cdiv(num_slots, TILE)
    chunk_tiles = min(CHUNK_TILES, num_tiles)
    chunks = pl.cdiv(num_tiles, chunk_tiles)
    fp8 = isinstance(key_cache, Fp8Pool)
    # The keys as the kernel reads them: the cache, or FP8 values and their scales [P, page].
    keys = (key_cache.values, key_cache.scales[..., 0]) if fp8 else (key_cache,)

    # Queries transposed per token, heads padded with zero weights: [B * Q, Di, Hp], in the dtype
    # the tensor cores read (bfloat16 for FP8 keys, exact for e4m3 queries).
    operand_dtype = jnp.bfloat16 if fp8 else key_cache.dtype
    q_t = pad_to(jnp.swapaxes(q_idx, 2, 3), 3, 64).reshape(batch * num_queries, dim, -1).astype(operand_dtype)
    w = pad_to(weights.astype(jnp.float32), 2, 64).reshape(batch * num_queries, -1)
    bound = kv_bound(vis, num_queries)

    out_type = jax.ShapeDtypeStruct((batch * num_queries, chunks * chunk_tiles * TILE), jnp.float32)
    kernel = plgpu.kernel(
        functools.partial(_indexer_kernel, page_size=page_size, chunk_tiles=chunk_tiles, num_queries=num_queries,
                          fp8=fp8),
        kernel_name="indexer_scores_mosaic",
        out_type=out_type, grid=(batch, chunks, num_queries), grid_names=("row", "chunk", "token"),
        compiler_params=compiler_params())
    tables = (page_table.astype(jnp.int32), bound)
    cost = indexer_cost(batch, num_queries, heads, num_slots, dim, cache_token_bytes(key_cache), q_t, w, *tables,
                        out_type)
    with stating(cost, "indexer_scores"):
        scores = kernel(q_t, w, *keys, *tables)
    scores = scores.reshape(batch, num_queries, -1)[:, :, :num_slots]
    tree_mask = tree_mask_of(vis)
    if tree_mask is None:
        return scores
    # Window slot prefix + j is visible to token q only if j is an ancestor of q.
    window = vis.prefix_len[:, None, None] + jnp.arange(num_queries, dtype=jnp.int32)
    hidden = jnp.where(tree_mask, num_slots, window)  # out of range -> dropped
    b, q = jnp.indices((batch, num_queries))
    return scores.at[b[..., None], q[..., None], hidden].set(-jnp.inf, mode="drop")


def indexer_topk_mosaic(q_idx: jax.Array, weights: jax.Array, key_cache: jax.Array, page_table: jax.Array,
                        vis: VisibleSlots, *, topk: int, interpret: bool = False) -> jax.Array:
    """`indexer_topk` with Mosaic GPU scores; same arguments and result as `indexer_topk_reference`.

    q_idx [B, Q, Hi, Di], weights [B, Q, Hi], key_cache [P, page, Di], page_table [B, max_pages]
    -> indices [B, Q, topk] int32, best first, -1 where fewer than topk slots are visible.
    """
    scores = indexer_scores_mosaic(q_idx, weights, key_cache, page_table, vis, interpret=interpret)
    return select_topk(scores, topk)
