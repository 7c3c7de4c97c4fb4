"""DeepSeek-V4's KV compressors (CSA and HCA) and CSA's lightning indexer, over `V4Cache` rings.

A compressor pools every m consecutive tokens into one entry. Per token t it projects
`kv_t = kv_proj(x_t)` and `score_t = gate_proj(x_t) + position_bias[t % m]` (float32, as
DeepSeek's reference computes its compressor), kept in the layer's projection ring. Entry j
closes at position `e_j = (j + 1) m - 1`:

  HCA (m' = 128):  C_j = kv_norm(sum_t softmax_t(score_t) * kv_t) over t in [j m, (j + 1) m)
  CSA (m = 4):     the same over 2m slots, the previous block's first series then this block's
                   second: t in [(j - 1) m, j m) read `[..., :w]` (Ca), t in [j m, (j + 1) m) read
                   `[..., w:]` (Cb) of both kv and score; slots before position 0 are absent
                   (weight 0). The softmax runs per channel over the 2m (or m) slots.

then RoPE ("compress" rope, interleaved, last qk_rope_head_dim dims) at position `j m`, and the
entry is written to slot j. Query p sees entry j iff `e_j <= p`. The lightning indexer runs the same
CSA compressor at index_head_dim for its keys, and scores entry j for query p as
`sum_h w_h relu(q_h . K_j)` (w = weights_proj(x) * Hi^-0.5 * Di^-0.5, q = q_b_proj(q_residual)
rotated), keeping the top `index_topk` visible entries: V3.2's `indexer_topk` op over the entry
pool, its kernels included, with the visible entries given as per-token counts.

This is the pooling DeepSeek's V4 inference code and SGLang define; transformers 5.23 computes the
same values. Top-k ties go to the lowest entry (`select_topk`: `lax.top_k` is stable) and
invisible entries score -inf, so selection depends only on the visible entries: causal by
construction. Not reproduced (as in transformers): the FP8 / FP4 quantization DeepSeek simulates
on the compressed keys and indexer queries, and their Hadamard rotation. docs/model-interface.md
gives the sources and how they differ.

Trees: a tree call writes its tokens' projections but no entry, since a
block closed inside the window depends on the branch; each query gets the entries its own branch
closes as extra keys (`branch_entries`), and the next call closes the committed path's blocks from
the rings once `V4Cache.move` has made the path contiguous.

Why per-position projections in a ring rather than transformers' running buffer: the entry closed
at e_j is a pure function of the projections at positions `[e_j - span + 1, e_j]`, all of which
are committed or in the current call when e_j is processed, so a rejected draft can leave nothing
that a later output reads (`jaxspec.cache_v4`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache_v4 import ENTRIES, INDEX_ENTRIES, INDEX_STATE, STATE, V4Cache
from jaxspec.model_config import CSA, ModelConfig
from jaxspec.pallas_kernels import Visibility, indexer_scores, indexer_topk, query_valid, select_topk
from jaxspec.pallas_kernels.backend import window_invariant_kernels
from jaxspec.pallas_kernels.fp8_cache import entry_dtype
from jaxspec.pallas_kernels.indexer import score_keys

from .layers import Linear, RMSNorm, compute_dtype, param, per_position
from .rope import rope_angles, rotate_tail


class Compressor(nnx.Module):
    """One compressor of `kind` (CSA: two overlapping series, HCA: one) at entry width `width`.

    Parameters as transformers' `DeepseekV4HCACompressor` (and the compressor part of
    `DeepseekV4CSACompressor` / `DeepseekV4Indexer`): kv_proj, gate_proj [D, coff * width],
    position_bias [m, coff * width] float32, kv_norm [width]. The projections stay in the compute
    dtype under FP8 (DeepSeek ships them in bf16). Its ring and entries are the cache pools
    `state_pool` and `entry_pool` (`jaxspec.cache_v4`).
    """

    def __init__(self, config: ModelConfig, kind: str, width: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.kind = kind
        self.rate = dict(config.compress_rates)[kind]
        self.width = width
        self.overlap = kind == CSA
        self.state_pool, self.entry_pool = STATE[kind], ENTRIES[kind]
        coff = 2 if self.overlap else 1
        self.rope_config = config.rope_for("compress")
        self.kv_proj = Linear(config.hidden_size, coff * width, rngs=rngs, dtype=compute_dtype(dtype),
                              names=("embed", None))
        self.gate_proj = Linear(config.hidden_size, coff * width, rngs=rngs, dtype=compute_dtype(dtype),
                                names=("embed", None))
        self.position_bias = param(jnp.zeros((self.rate, coff * width), jnp.float32), None, None)
        self.kv_norm = RMSNorm(width, eps=config.rms_norm_eps, dtype=dtype, name=None)

    def project(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [B, Q, D], positions [B, Q] -> ring rows [B, Q, 2 * coff * width] float32: kv then
        gate + position_bias[p % m]. Both multiply float32 inputs, which only XLA's dot takes (`Linear`)."""
        xf = x.astype(jnp.float32)
        score = self.gate_proj(xf, backend="xla") + self.position_bias[...][positions % self.rate]
        return jnp.concatenate([self.kv_proj(xf, backend="xla"), score], axis=-1)

    def pool(self, rows: jax.Array, present: jax.Array, start: jax.Array, dtype) -> jax.Array:
        """One entry per block: rows [B, N, span, 2 * coff * width] float32 (the block's source
        slots in order: span = 2m for CSA, the previous block first; m for HCA), present [B, N, span]
        (False before position 0), start [B, N] the block's first position (its RoPE position)
        -> entries [B, N, width] in `dtype`."""
        kv, score = jnp.split(rows, 2, axis=-1)
        if self.overlap:
            m, w = self.rate, self.width
            kv = jnp.concatenate([kv[..., :m, :w], kv[..., m:, w:]], axis=-2)
            score = jnp.concatenate([score[..., :m, :w], score[..., m:, w:]], axis=-2)
        score = jnp.where(present[..., None], score, -jnp.inf)
        # A block wholly before position 0 (never written: `update` closes blocks >= 0 only) would
        # pool 0 / 0; finite weights there keep training's gradients through the masked write finite.
        score = jnp.where(present.any(-1)[..., None, None], score, 0.0)
        weights = jax.nn.softmax(score, axis=-2)
        entry = self.kv_norm(jnp.sum(kv * weights, axis=-2).astype(dtype))
        cos, sin = rope_angles(self.rope_config, start)
        return rotate_tail(entry, cos, sin)

    def update(self, cache: V4Cache, layer, x: jax.Array, positions: jax.Array, slots: jax.Array, vis: Visibility, *,
               window_invariant: bool) -> V4Cache:
        """Write the call's projections to layer `layer`'s ring (an int or a traced int32) at `slots`
        [B, Q] (-1: padding, which writes nothing), then close into its entries, before any query of the call attends,
        every block that ended in the W = `cache.lookback` slots before the call (a tree call
        committed them without writing; for a chain they are rewritten with the same values) and,
        for a chain, every block whose end lies in the call. x [B, Q, D]; positions [B, Q]."""
        rows = per_position(self.project, x, positions, enabled=window_invariant)
        cache = cache.write_ring(self.state_pool, layer, slots, rows)

        m, num_queries, back = self.rate, x.shape[1], cache.lookback
        span = 2 * m if self.overlap else m
        count = -(-(back + num_queries) // m)  # blocks that can end in [prefix_len - W, prefix_len + Q)
        block = (vis.prefix_len[:, None] - back) // m + jnp.arange(count, dtype=jnp.int32)[None]  # [B, N]
        end = (block + 1) * m - 1
        in_call = vis.query_len if vis.tree_mask is None else 0
        closes = (block >= 0) & (end >= vis.prefix_len[:, None] - back) & (end < (vis.prefix_len + in_call)[:, None])
        source = (block + 1)[..., None] * m - span + jnp.arange(span, dtype=jnp.int32)  # [B, N, span]
        present = source >= 0
        rows = cache.read_ring(self.state_pool, layer, jnp.where(present & closes[..., None], source, -1))
        dtype = entry_dtype(getattr(cache, self.entry_pool))
        pooled = per_position(lambda r, p, s: self.pool(r, p, s, dtype), rows, present, block * m,
                              enabled=window_invariant)
        return cache.write_pages(self.entry_pool, layer, jnp.where(closes, block, -1), pooled)

    def branch_entries(self, cache: V4Cache, layer, positions: jax.Array, vis: Visibility):
        """Tree calls: the entries each query's own branch closes inside the window, which the call
        does not write. Query q at position p gets blocks j = prefix_len // m + x (x < X = ceil(Q / m))
        with `prefix_len <= e_j <= p`, pooled from committed ring rows and its ancestors' rows
        -> (entries [B, Q, X, width], closed [B, Q, X] bool)."""
        m, num_queries = self.rate, positions.shape[1]
        span = 2 * m if self.overlap else m
        prefix = vis.prefix_len[:, None, None]
        block = prefix // m + jnp.arange(-(-num_queries // m), dtype=jnp.int32)[None, None]  # [B, 1, X]
        closed = (((block + 1) * m - 1 <= positions[..., None])
                  & query_valid(vis, num_queries)[..., None])  # [B, Q, X]
        source = (block + 1)[..., None] * m - span + jnp.arange(span, dtype=jnp.int32)  # [B, 1, X, span]
        depth = source - prefix[..., None]
        ancestors = branch_slots(positions, vis)  # [B, Q, depth]
        shape = closed.shape + (span,)
        from_branch = jnp.take_along_axis(ancestors, jnp.broadcast_to(jnp.clip(depth, 0, num_queries - 1),
                                                                      shape).reshape(shape[0], num_queries, -1), axis=2)
        slot = jnp.where(depth >= 0, from_branch.reshape(shape), source)
        present = jnp.broadcast_to(source >= 0, shape)
        slot = jnp.where(present & closed[..., None], slot, -1)
        batch = positions.shape[0]
        rows = cache.read_ring(self.state_pool, layer, slot.reshape(batch, -1))
        rows = rows.reshape(batch, -1, span, rows.shape[-1])  # [B, Q * X, span, W]
        start = jnp.broadcast_to(block * m, closed.shape).reshape(batch, -1)
        entries = getattr(cache, self.entry_pool)
        pooled = self.pool(rows, present.reshape(batch, -1, span), start, entry_dtype(entries))
        # Raw: the attention op reads them as the entries' pool would store them
        # (`contracts.stored_extra_keys`), so a tree's branch sees the bits a chain call reads back.
        return pooled.reshape(*closed.shape, -1), closed


def branch_slots(positions: jax.Array, vis: Visibility) -> jax.Array:
    """[B, Q, Q]: the slot of query q's ancestor (itself included) at depth d, i.e. the window token
    at position prefix_len + d on its branch; -1 where it has none (d beyond its own depth)."""
    num_queries = positions.shape[1]
    depth = positions - vis.prefix_len[:, None]  # [B, Q]
    if vis.tree_mask is None:
        q = jnp.arange(num_queries)
        ancestor = jnp.broadcast_to(q[None, :] <= q[:, None], (positions.shape[0], num_queries, num_queries))
    else:
        ancestor = vis.tree_mask
    at_depth = ancestor[..., None] & (depth[:, None, :, None] == jnp.arange(num_queries)[None, None, None])
    index = jnp.argmax(at_depth, axis=2).astype(jnp.int32)  # [B, Q, depth]
    return jnp.where(at_depth.any(axis=2), vis.prefix_len[:, None, None] + index, -1)


class IndexerScorer(nnx.Module):
    """transformers' `DeepseekV4IndexerScorer`: the per-head weights `weights_proj(x)` [D, Hi]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.weights_proj = Linear(config.hidden_size, config.index_n_heads, rngs=rngs, dtype=compute_dtype(dtype),
                                   names=("embed", "index_heads"))


class Indexer(Compressor):
    """CSA's lightning indexer (transformers' `DeepseekV4Indexer`): a CSA compressor at
    index_head_dim for its keys, q_b_proj [q_lora_rank, Hi * Di] for its queries, `scorer`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(config, CSA, config.index_head_dim, rngs=rngs, dtype=dtype)
        self.state_pool, self.entry_pool = INDEX_STATE, INDEX_ENTRIES
        self.num_heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = Linear(config.q_lora_rank, config.index_n_heads * config.index_head_dim, rngs=rngs,
                               dtype=dtype, scale_fmt=config.scale_fmt, names=("q_lora", "index_heads"))
        self.scorer = IndexerScorer(config, rngs=rngs, dtype=dtype)

    def queries(self, x: jax.Array, q_residual: jax.Array, cos: jax.Array, sin: jax.Array, *, backend: str):
        """x [B, Q, D], q_residual [B, Q, q_lora_rank], the layer's angles [B, Q, Dr / 2] ->
        (q [B, Q, Hi, Di] rotated, weights [B, Q, Hi] float32 with both scales folded in). backend:
        the model call's, for `q_b_proj`; `weights_proj` multiplies float32 inputs (XLA's dot)."""
        batch, num_queries, _ = x.shape
        q = self.q_b_proj(q_residual, backend=backend).reshape(batch, num_queries, self.num_heads, self.width)
        weights = (self.scorer.weights_proj(x.astype(jnp.float32), backend="xla")
                   * (self.width ** -0.5 * self.num_heads ** -0.5))
        return rotate_tail(q, cos, sin), weights

    def select(self, cache: V4Cache, layer, x, q_residual, cos, sin, positions: jax.Array, vis: Visibility, *,
               backend: str, window_invariant: bool, extra_keys: jax.Array | None = None,
               extra_closed: jax.Array | None = None):
        """The top `index_topk` entries each token sees -> [B, Q, index_topk] int32, -1 padded
        (padding tokens: all -1). Entry j is visible to position p iff (j + 1) m - 1 <= p.

        The scores are the `indexer_topk` op's over the entry pool (`indexer_scores` for a tree),
        the visible entries given as slot counts, on `backend`'s kernel. window_invariant: each
        token selects alone (`per_position`), unless the op runs on its Mosaic kernel, which is
        window-invariant by construction: then a chain window is one call, as plain decoding is.

        Trees: the cache holds the entries ending before prefix_len only; extra_keys [B, Q, X, Di]
        (valid where extra_closed [B, Q, X]) are the index keys of the entries j = prefix_len // m
        + x the query's branch closed. They are ranked after the cached ones (entry order, so ties go
        to the lowest entry as in a chain) and returned as (indices into the cache, -1 padded;
        extra_selected [B, Q, X] bool)."""
        keys, pages = cache.layer_pages(self.entry_pool, layer)
        valid = query_valid(vis, x.shape[1])
        if extra_keys is None:
            counts = jnp.where(valid, (positions + 1) // self.rate, 0)

            def choose(x, q_residual, cos, sin, counts):
                q, weights = self.queries(x, q_residual, cos, sin, backend=backend)
                return indexer_topk(q, weights, keys, pages, counts, topk=self.topk, backend=backend)

            alone = window_invariant and not window_invariant_kernels(backend, "indexer_topk")
            return per_position(choose, x, q_residual, cos, sin, counts, enabled=alone)
        counts = jnp.where(valid, (vis.prefix_len // self.rate)[:, None], 0)
        q, weights = self.queries(x, q_residual, cos, sin, backend=backend)
        scores = indexer_scores(q, weights, keys, pages, counts, backend=backend)
        per_query = jax.vmap(lambda q, w, k, ok: score_keys(q[:, None], w[:, None], k, ok[:, None])[:, 0],
                             in_axes=1, out_axes=1)
        num_cached = scores.shape[-1]
        scores = jnp.concatenate([scores, per_query(q, weights, extra_keys, extra_closed)], axis=-1)
        chosen = select_topk(scores, self.topk)
        extra = num_cached + jnp.arange(extra_keys.shape[2], dtype=jnp.int32)
        selected = jnp.any(chosen[..., None] == extra, axis=-2) & extra_closed
        return jnp.where(chosen < num_cached, chosen, -1), selected


class CSACompressor(Compressor):
    """transformers' `DeepseekV4CSACompressor`: the CSA compressor at head_dim plus its `indexer`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(config, CSA, config.head_dim, rngs=rngs, dtype=dtype)
        self.indexer = Indexer(config, rngs=rngs, dtype=dtype)
