"""What an op's reference and its Pallas kernels must share: argument checks, the log-sum-exp of
a row that sees nothing, top-k selection with its tie rule, and the form V4 attention reads its
extra keys in.

Each op's module (`mla_attention`, `indexer`, `grouped_matmul`, `sliding_compressed_attention`)
loads its Pallas kernels lazily, so the kernels read these from here rather than from the op's
module: the package's imports then form no cycle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import block_fp8, ranks
from .fp8_cache import Fp8Pool, as_stored
from .visibility import Visibility

# Log-sum-exp of a query that sees nothing: finite (no NaN or inf leaves a padding row), and
# exp(EMPTY_LSE - m) == 0 for any real m, so a split-KV combine weights it out.
EMPTY_LSE = -1e30

# Score comparisons (rows x S x S) a `select_topk` call may count before it sorts instead: up to
# 7 tokens a call (B x Q) at a 4,096-token context (S = 4,160 slots, 65 pages of 64), so that the
# main job's k = 3 window counts, and one token up to an 8,192-token context. Why: on an H200
# XLA's sort of one row of 4,096 took 37 us (a decode step's profile, one sort a layer), where
# counting is two fused reductions over [S, S] and [topk, S] (2.6 x 10^7 comparisons a row at
# top-2048, 1.5 x 10^8 of XLA's flops, a few microseconds spread over the SMs). The sort's rows
# run side by side, one block each, so its time barely grows with the rows where the count's
# grows linearly: past a few rows the sort is the faster. The bound is a projection from that one
# measured sort; `benchmarks/attention_kernels.py` times both ("rank count" beside "lax.top_k",
# at B 1 and 8, Q 1 and 4) on a GPU, which is where it gets measured.
SELECT_COUNT_LIMIT = 1 << 27
# Rows of at most this many scores keep the sort: compiled for sm_90a, XLA sorts them (with their
# indices) in one kernel, one block's shared memory, where the count takes three (the keys and
# its two reductions); a row of 4,160 took the sort three passes. V4's compressed entries at a
# 4,096-token context (1,024 a row) stay sorted.
SELECT_SORT_ONE_PASS = 4096


def select_topk(scores: jax.Array, topk: int) -> jax.Array:
    """scores [B, Q, S] (-inf = invisible) -> indices [B, Q, topk] int32, best first, -1 padded.

    The order is `lax.top_k`'s (IEEE total order, ties to the lower slot), so kernels and
    reference agree exactly. Counted (`ranks.top_k_indices`) where a row is longer than
    `SELECT_SORT_ONE_PASS` and the call's comparisons are at most `SELECT_COUNT_LIMIT`, else
    sorted: the same integers either way, so a token's selection does not depend on how many rows
    share the call.
    """
    num_slots = scores.shape[-1]
    k = min(topk, num_slots)
    if SELECT_SORT_ONE_PASS < num_slots and scores.size * num_slots <= SELECT_COUNT_LIMIT:
        labels = jnp.where(scores > -jnp.inf, jnp.arange(num_slots, dtype=jnp.int32), -1)
        indices = ranks.top_k_indices(scores, k, limit=SELECT_COUNT_LIMIT, labels=labels)
    else:  # sorted on the floats themselves: XLA's sort keys them in the same total order
        values, indices = jax.lax.top_k(scores, k)
        indices = jnp.where(values > -jnp.inf, indices, -1).astype(jnp.int32)
    if k < topk:
        indices = jnp.pad(indices, ((0, 0), (0, 0), (0, topk - k)), constant_values=-1)
    return indices


def check_grouped_matmul_args(lhs, rhs, group_sizes, rhs_scale_inv=None) -> None:
    """ValueError naming the argument unless lhs [M, K], rhs [G, K, N], group_sizes [G] integer, and
    rhs_scale_inv is None with a float rhs or [G, ceil(K / 128), ceil(N / 128)] float32 with an FP8 one."""
    if lhs.ndim != 2:
        raise ValueError(f"lhs: must be [M, K], got shape {lhs.shape}")
    if rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"rhs: must be [G, K, N] with K = lhs.shape[1] = {lhs.shape[1]}, got shape {rhs.shape}")
    if group_sizes.shape != rhs.shape[:1] or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes: must be integer [G] with G = rhs.shape[0] = {rhs.shape[0]}, "
                         f"got {group_sizes.dtype}{list(group_sizes.shape)}")
    fp8 = rhs.dtype == block_fp8.FP8
    if fp8 != (rhs_scale_inv is not None):
        raise ValueError(f"rhs_scale_inv: must be given exactly when rhs is float8_e4m3fn (rhs is {rhs.dtype}, "
                         f"rhs_scale_inv is {'None' if rhs_scale_inv is None else 'given'})")
    if fp8 and (tuple(rhs_scale_inv.shape) != block_fp8.scale_shape(rhs.shape) or rhs_scale_inv.dtype != jnp.float32):
        raise ValueError(f"rhs_scale_inv: must be float32 {list(block_fp8.scale_shape(rhs.shape))} for rhs "
                         f"{list(rhs.shape)} in 128x128 blocks, got {rhs_scale_inv.dtype}{list(rhs_scale_inv.shape)}")


def _check_shape(name: str, array, shape: tuple, *, integer: bool = False, boolean: bool = False):
    """ValueError naming `name` unless `array.shape == shape` (None in `shape` = any extent)."""
    if array.ndim != len(shape) or any(want is not None and got != want for got, want in zip(array.shape, shape)):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} has shape {tuple(array.shape)}: must be {wanted}")
    if integer and not jnp.issubdtype(array.dtype, jnp.integer):
        raise ValueError(f"{name} has dtype {array.dtype}: must be an integer type")
    if boolean and array.dtype != jnp.bool_:
        raise ValueError(f"{name} has dtype {array.dtype}: must be bool")


def check_arguments(q, window_kv, window_pages, positions, vis: Visibility, sinks, *, sliding_window: int,
                    compressed_kv=None, compressed_pages=None, compressed_indices=None, compressed_count=None,
                    extra_kv=None, extra_valid=None) -> None:
    """Every shape and option rule of `sliding_compressed_attention`, checked from static shapes
    (so before tracing); ValueError naming the argument otherwise."""
    if q.ndim != 4:
        raise ValueError(f"q has shape {tuple(q.shape)}: must be [B, Q, H, D]")
    batch, num_queries, heads, dim = q.shape
    _check_shape("window_kv", window_kv, (None, None, dim))
    _check_shape("window_pages", window_pages, (batch, None), integer=True)
    _check_shape("positions", positions, (batch, num_queries), integer=True)
    _check_shape("vis.prefix_len", vis.prefix_len, (batch,), integer=True)
    _check_shape("vis.query_len", vis.query_len, (batch,), integer=True)
    if vis.tree_mask is not None:
        _check_shape("vis.tree_mask", vis.tree_mask, (batch, num_queries, num_queries), boolean=True)
    _check_shape("sinks", sinks, (heads,))
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window!r}: must be an int >= 1")
    ring = window_pages.shape[1] * window_kv.shape[1]
    if ring < sliding_window - 1 + num_queries:
        raise ValueError(f"ring capacity R = window_pages.shape[1] * page = {ring}: must be >= sliding_window - 1 "
                         f"+ Q = {sliding_window - 1 + num_queries} (room for a whole window and a call's tokens)")
    if compressed_kv is None:
        if compressed_pages is not None or compressed_indices is not None or compressed_count is not None:
            raise ValueError("compressed_pages / compressed_indices / compressed_count given without compressed_kv")
    else:
        if (compressed_indices is None) == (compressed_count is None):
            raise ValueError("with compressed_kv, give exactly one of compressed_indices (CSA) and "
                             "compressed_count (HCA)")
        if compressed_pages is None:
            raise ValueError("compressed_kv needs compressed_pages [B, E // page]")
        _check_shape("compressed_kv", compressed_kv, (None, None, dim))
        _check_shape("compressed_pages", compressed_pages, (batch, None), integer=True)
        if compressed_indices is not None:
            _check_shape("compressed_indices", compressed_indices, (batch, num_queries, None), integer=True)
        else:
            _check_shape("compressed_count", compressed_count, (batch, num_queries), integer=True)
    if (extra_kv is None) != (extra_valid is None):
        raise ValueError("give extra_kv and extra_valid together")
    if extra_kv is not None:
        _check_shape("extra_kv", extra_kv, (batch, num_queries, None, dim))
        _check_shape("extra_valid", extra_valid, (batch, num_queries, extra_kv.shape[2]), boolean=True)


def extra_key_pool(window_kv, compressed_kv):
    """The pool whose storage `sliding_compressed_attention` reads its extra keys as: the compressed
    entries' (extra keys are entries a tree's branch closes inside the window), the ring's for a
    layer without."""
    return window_kv if compressed_kv is None else compressed_kv


def stored_extra_keys(extra_kv: jax.Array, window_kv, compressed_kv) -> jax.Array:
    """extra_kv [B, Q, X, D] as every backend of `sliding_compressed_attention` reads them: with an
    FP8 pool (`extra_key_pool`), as that pool would store them (`fp8_cache.as_stored`), so a
    tree's branch sees the bits a chain call reads back and the Mosaic kernel can take them in the
    pool's own token, as FlashMLA takes a call's extra keys; with a plain pool, as given."""
    pool = extra_key_pool(window_kv, compressed_kv)
    return as_stored(pool, extra_kv) if isinstance(pool, Fp8Pool) else extra_kv
