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
rotated), keeping the top `index_topk` visible entries.

Sources and how they differ. DeepSeek's own inference code (`inference/model.py` of the
DeepSeek-V4 release, `Compressor.forward` / `overlap_transform` / `Indexer.forward` /
`get_compress_topk_idxs`; read at github.com/Nicooo-Wang/DeepSeek-V4-Pro-code@0ec3a03, a copy of
it) and SGLang's V4 (`sglang/srt/models/deepseek_v4.py`: `Compressor.overlap_transform`, a state
of `seq_len % m + m` tail tokens per request for CSA) define exactly the pooling above: the same
Ca/Cb overlap, `ape` (= position_bias) added before the softmax, RoPE at `j m`, visibility
`j < (p + 1) // m` in prefill and decode. transformers 5.23 (`DeepseekV4CSACompressor`,
`DeepseekV4Indexer`) computes the same values. What issue 13 measured as transformers' CSA "not
causal, cached != recompute" is top-k tie-breaking: with few indexer heads, several entries score
exactly 0 (every head's relu(q . k) is 0) and `torch.topk` breaks the tie differently for score
rows of different lengths (17 vs 25 tokens, prefill vs decode). Probed here on a tiny model: with 2
indexer heads the 17-token prefix differs from the 25-token run from position 14 on, where entries
0 and 2 tie at 0.0; with 8 heads both runs and cached decode agree to 1e-6. Here ties go to the
lowest entry (`select_topk`, `lax.top_k` is stable) and invisible entries score -inf, so selection
depends only on the visible entries: causal by construction. Not reproduced (as transformers): the
FP8 / FP4 quantization DeepSeek simulates on the compressed keys and indexer queries (QAT), and its
Hadamard rotation of both (orthogonal: dot products unchanged without the quantization).

Why per-position projections in a ring rather than transformers' running buffer: the entry closed
at e_j is a pure function of the projections at positions `[e_j - span + 1, e_j]`, all of which
are committed or in the current call when e_j is processed, so a rejected draft can leave nothing
that a later output reads (`jaxspec.cache_v4`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache_v4 import ENTRY_TABLE, STATE_TABLE, V4Cache
from jaxspec.config import CSA, ModelConfig
from jaxspec.pallas_kernels import Visibility, gather_rows, query_valid, select_topk, write_slots
from jaxspec.pallas_kernels.indexer import score_keys

from .layers import Linear, RMSNorm, compute_dtype, param, per_position
from .rope import rope_angles, rotate_tail


class Compressor(nnx.Module):
    """One compressor of `kind` (CSA: two overlapping series, HCA: one) at entry width `width`.

    Parameters as transformers' `DeepseekV4HCACompressor` (and the compressor part of
    `DeepseekV4CSACompressor` / `DeepseekV4Indexer`): kv_proj, gate_proj [D, coff * width],
    position_bias [m, coff * width] float32, kv_norm [width]. The projections stay in the compute
    dtype under FP8 (DeepSeek ships them in bf16).
    """

    def __init__(self, config: ModelConfig, kind: str, width: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.kind = kind
        self.rate = dict(config.compress_rates)[kind]
        self.width = width
        self.overlap = kind == CSA
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
        gate + position_bias[p % m]."""
        xf = x.astype(jnp.float32)
        score = self.gate_proj(xf) + self.position_bias[...][positions % self.rate]
        return jnp.concatenate([self.kv_proj(xf), score], axis=-1)

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
        weights = jax.nn.softmax(jnp.where(present[..., None], score, -jnp.inf), axis=-2)
        entry = self.kv_norm(jnp.sum(kv * weights, axis=-2).astype(dtype))
        cos, sin = rope_angles(self.rope_config, start)
        return rotate_tail(entry, cos, sin)

    def update(self, cache: V4Cache, state: str, entries: str, layer: int, x: jax.Array, positions: jax.Array,
               slots: jax.Array, vis: Visibility, *, window_invariant: bool) -> V4Cache:
        """Write the call's projections to ring `state[layer]`, then close every block whose end
        lies in the call (chain: window tokens at slots [prefix_len, prefix_len + query_len)) into
        `entries[layer]`, before any query of the call attends. x [B, Q, D]; positions, slots [B, Q]
        (slots -1 for padding, which writes nothing)."""
        state_table, entry_table = STATE_TABLE[self.kind], ENTRY_TABLE[self.kind]
        rows = per_position(self.project, x, positions, enabled=window_invariant)
        cache = cache.write_ring(state, state_table, layer, slots, rows)

        m, num_queries = self.rate, x.shape[1]
        span = 2 * m if self.overlap else m
        block = vis.prefix_len[:, None] // m + jnp.arange(-(-num_queries // m), dtype=jnp.int32)[None]  # [B, N]
        closes = (block + 1) * m <= (vis.prefix_len + vis.query_len)[:, None]
        source = (block + 1)[..., None] * m - span + jnp.arange(span, dtype=jnp.int32)  # [B, N, span]
        present = source >= 0
        rows = cache.read_ring(state, state_table, layer, jnp.where(present & closes[..., None], source, -1))
        dtype = cache.window[layer].dtype
        pooled = per_position(lambda r, p, s: self.pool(r, p, s, dtype), rows, present, block * m,
                              enabled=window_invariant)
        written = write_slots(getattr(cache, entries)[layer], cache.page_table[entry_table],
                              jnp.where(closes, block, -1), pooled)
        return cache.set_layer(entries, layer, written)


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
        self.num_heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = Linear(config.q_lora_rank, config.index_n_heads * config.index_head_dim, rngs=rngs,
                               dtype=dtype, names=("q_lora", "index_heads"))
        self.scorer = IndexerScorer(config, rngs=rngs, dtype=dtype)

    def queries(self, x: jax.Array, q_residual: jax.Array, cos: jax.Array, sin: jax.Array):
        """x [B, Q, D], q_residual [B, Q, q_lora_rank], the layer's angles [B, Q, Dr / 2] ->
        (q [B, Q, Hi, Di] rotated, weights [B, Q, Hi] float32 with both scales folded in)."""
        batch, num_queries, _ = x.shape
        q = self.q_b_proj(q_residual).reshape(batch, num_queries, self.num_heads, self.width)
        weights = self.scorer.weights_proj(x.astype(jnp.float32)) * (self.width ** -0.5 * self.num_heads ** -0.5)
        return rotate_tail(q, cos, sin), weights

    def select(self, cache: V4Cache, layer: int, x, q_residual, cos, sin, positions: jax.Array, vis: Visibility, *,
               window_invariant: bool) -> jax.Array:
        """The top `index_topk` entries each token sees -> [B, Q, index_topk] int32, -1 padded
        (padding tokens: all -1). Entry j is visible to position p iff (j + 1) m - 1 <= p."""
        keys = gather_rows(cache.index_entries[layer], cache.page_table[ENTRY_TABLE[CSA]])  # [B, E, Di]
        entry = jnp.arange(keys.shape[1], dtype=jnp.int32)
        visible = ((entry[None, None] < ((positions + 1) // self.rate)[..., None])
                   & query_valid(vis, x.shape[1])[..., None])  # [B, Q, E]

        def choose(x, q_residual, cos, sin, visible):
            q, weights = self.queries(x, q_residual, cos, sin)
            return select_topk(score_keys(q, weights, keys, visible), self.topk)

        return per_position(choose, x, q_residual, cos, sin, visible, enabled=window_invariant)


class CSACompressor(Compressor):
    """transformers' `DeepseekV4CSACompressor`: the CSA compressor at head_dim plus its `indexer`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(config, CSA, config.head_dim, rngs=rngs, dtype=dtype)
        self.indexer = Indexer(config, rngs=rngs, dtype=dtype)
