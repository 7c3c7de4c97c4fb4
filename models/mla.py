"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

Per token: `kv_a_proj_with_mqa(x)` gives a latent [R = kv_lora_rank] (normalized by
`kv_a_layernorm`) and one RoPE key [Dr] shared by all heads; their concatenation is the cached entry.
`kv_b_proj` [R, H * (Dn + Dv)] up-projects the latent into per-head keys and values. Two equal forms:

* expanded (`form="expanded"`): up-project every visible entry into per-head K/V and run ordinary
  attention. Cheap when the window is long relative to the context (prefill).
* absorbed (`form="absorbed"`): fold the key up-projection into the query
  (`q_nope @ W_uk -> [R]`) and the value up-projection into the output, so attention runs directly
  on the cached latents (the `mla_attention` kernel). Cheap for short windows (decode, verify).

With DSA (V3.2), the indexer picks up to `index_topk` slots per token; the absorbed form runs
`sparse_mla_attention` over them, the expanded form masks everything else.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import PagedCache
from jaxspec.model_config import ModelConfig
from jaxspec.pallas_kernels import (Visibility, attend_latent, indexer_topk, mla_attention, select_topk,
                                    sparse_mla_attention, visible_mask, window_slots)
from jaxspec.pallas_kernels.backend import window_invariant_kernels
from jaxspec.pallas_kernels.fp8_cache import Fp8Pool, as_entries, gather_parts, key_rule, read_parts
from jaxspec.pallas_kernels.indexer import score_keys
from jaxspec.pallas_kernels.mla_attention import mla_attention_backend
from jaxspec.pallas_kernels.visibility import ancestor_slots
from jaxspec.sharding import current

from .indexer import Indexer
from .layers import Linear, RMSNorm, per_position
from .rope import apply_rope

FORMS = ("expanded", "absorbed")
# The query and KV latent norms use a fixed epsilon, not config.rms_norm_eps: DeepSeek's reference
# (`RMSNorm(q_lora_rank)`, `RMSNorm(kv_lora_rank)`) and transformers both build them with the default.
LATENT_NORM_EPS = 1e-6


def indices_to_mask(indices: jax.Array, num_slots: int) -> jax.Array:
    """indices [B, Q, K] (-1 = none) -> [B, Q, S] bool, True at the selected slots."""
    batch, num_queries, _ = indices.shape
    target = jnp.where(indices >= 0, indices, num_slots)
    b = jnp.arange(batch)[:, None, None]
    q = jnp.arange(num_queries)[None, :, None]
    return jnp.zeros((batch, num_queries, num_slots), bool).at[b, q, target].set(True, mode="drop")


def absorb_query(q_nope: jax.Array, w_uk: jax.Array) -> jax.Array:
    """q_nope [B, Q, H, Dn], w_uk [R, H, Dn] -> the absorbed query [B, Q, H, R] (q_nope's dtype).

    The optimization barrier keeps XLA's GPU compiler from fusing q_nope's producer (the q_b_proj
    output, reshaped) into this batched dot: fused, its Triton GEMM emitter finds no tiling for
    some row counts and the whole program fails to compile ("Couldn't find output tile sizes",
    jaxlib 0.10.2, sm_90a: B x Q = 96 or 24 at k = 2, 192 at k = 5; `tests/test_memory_plan.py`
    compiles k = 2). q_nope is materialized either way; the barrier only fixes where the fusion ends.
    """
    return jnp.einsum("bqhn,rhn->bqhr", jax.lax.optimization_barrier(q_nope), w_uk.astype(q_nope.dtype))


def attention_on_mosaic(backend: str, dense: bool, q_nope, q_rope, cache: PagedCache, layer, latent: int) -> bool:
    """Whether a window-invariant call on `backend` runs this layer's attention on the Mosaic
    kernels (`backend.window_invariant_kernels`), then given "mosaic" by name so that no op can
    fall back on its own: dense MLA (`dense`) with the operands it would get (q_nope [B, Q, H, Dn]
    absorbed to `latent` columns, the layer's pages), since "auto" keeps Triton for operands
    that kernel does not take (`mla_attention_backend`); else the indexer and sparse MLA."""
    if not dense:
        return window_invariant_kernels(backend, "indexer_topk", "sparse_mla_attention")
    absorbed = jax.ShapeDtypeStruct(q_nope.shape[:3] + (latent,), q_nope.dtype)
    pages = jax.eval_shape(lambda c, i: c.layer_pages(c.latent, i), cache, layer)  # shapes only: no ops traced
    return mla_attention_backend(backend, absorbed, q_rope, *pages) == "mosaic"


class MLA(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        dim, heads = config.hidden_size, config.num_attention_heads
        linear = functools.partial(Linear, rngs=rngs, dtype=dtype, scale_fmt=config.scale_fmt)
        if config.q_lora_rank is None:
            self.q_proj = linear(dim, heads * config.qk_head_dim, names=("embed", "heads"))
        else:
            self.q_a_proj = linear(dim, config.q_lora_rank, names=("embed", "q_lora"))
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype, name="q_lora")
            self.q_b_proj = linear(config.q_lora_rank, heads * config.qk_head_dim, names=("q_lora", "heads"))
        self.kv_a_proj_with_mqa = linear(dim, config.latent_dim, names=("embed", "kv_lora"))
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype, name="kv_lora")
        self.kv_b_proj = linear(config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim),
                                names=("kv_lora", "heads"))
        self.o_proj = linear(heads * config.v_head_dim, dim, names=("heads", "embed"))
        self.indexer = Indexer(config, rngs=rngs, dtype=dtype) if config.is_v32 else None

    def _up_projections(self) -> tuple[jax.Array, jax.Array]:
        """kv_b_proj split per head: W_uk [R, H, Dn], W_uv [R, H, Dv]. An FP8 kv_b_proj is dequantized
        here, once per layer and call (R x H x 256 values, 32 MiB in bfloat16 at DeepSeek's widths):
        both einsums and the expanded form read it whole, and it is small beside the layer's other
        weights."""
        c = self.config
        # -1 heads: under tensor parallelism (`jaxspec.sharding`, plan "tp") this device's heads only.
        w = self.kv_b_proj.dense_weight().reshape(c.kv_lora_rank, -1, c.qk_nope_head_dim + c.v_head_dim)
        return w[..., :c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: PagedCache, layer,
                 vis: Visibility, *, form: str, backend: str,
                 window_invariant: bool = False) -> tuple[jax.Array, PagedCache]:
        """x [B, Q, D], cos/sin [B, Q, Dr/2] -> (out [B, Q, D], cache with the window's entries written).
        layer: this layer's index in the cache's stacked pools (an int, or the scan's traced int32).

        window_invariant (absorbed form only): compute each token as if it were alone in its call
        (`per_position` for the token-local projections, `_attend_alone` for attention, or, where
        the backend runs the layer's attention ops on the Mosaic GPU kernels, those kernels:
        `_attend_invariant_kernel`), so its output is bit-identical whatever the window around it;
        see `DecodeConfig.window_invariant`.

        FP8 caches (`Fp8Pool` entries in `cache`) are read as such: the latent and the indexer keys
        are quantized as they are written, the indexer keys and queries rotated first (`Indexer`).
        """
        if form not in FORMS:
            raise ValueError(f"form={form!r}: must be one of {FORMS}")
        if window_invariant and form != "absorbed":
            raise ValueError(f"window_invariant=True needs form='absorbed', got form={form!r}")
        c = self.config
        batch, num_queries, _ = x.shape
        each = functools.partial(per_position, enabled=window_invariant)
        fp8_index = self.indexer is not None and isinstance(cache.index_keys, Fp8Pool)
        project = functools.partial(self._project, fp8_index=fp8_index, backend=backend)
        q_latent, q_nope, q_rope, entry, index_key = each(project, x, cos, sin)
        cache = cache.write(layer, window_slots(vis, num_queries), entry, index_key)

        w_uk, w_uv = self._up_projections()
        if window_invariant:
            index_queries = None
            if self.indexer is not None:
                queries = functools.partial(self.indexer.queries, key_rule=key_rule(cache.index_keys), backend=backend)
                index_queries = each(queries, x, q_latent, cos, sin)
            if attention_on_mosaic(backend, self.indexer is None, q_nope, q_rope, cache, layer, c.kv_lora_rank):
                out = self._attend_invariant_kernel(q_nope, q_rope, index_queries, cache, layer, vis, w_uk, w_uv,
                                                    "mosaic")
            else:
                out = self._attend_alone(q_nope, q_rope, index_queries, cache, layer, vis, w_uk, w_uv)
        else:
            indices = None
            if self.indexer is not None:
                indices = self.indexer.select(x, q_latent, cos, sin, *cache.layer_pages(cache.index_keys, layer), vis,
                                              backend=backend)
            latent_cache, page_table = cache.layer_pages(cache.latent, layer)
            if form == "absorbed":
                q_absorbed = absorb_query(q_nope, w_uk)
                if indices is None:
                    out_latent, _ = mla_attention(q_absorbed, q_rope, latent_cache, page_table, vis,
                                                  softmax_scale=c.softmax_scale, backend=backend)
                else:
                    out_latent, _ = sparse_mla_attention(q_absorbed, q_rope, latent_cache, page_table, indices,
                                                         softmax_scale=c.softmax_scale, backend=backend)
                out = jnp.einsum("bqhr,rhv->bqhv", out_latent, w_uv.astype(out_latent.dtype))
            else:
                out = self._expanded(q_nope, q_rope, as_entries(gather_parts(latent_cache, page_table)), vis,
                                     indices, w_uk, w_uv)
        out = each(lambda o: self.o_proj(o.reshape(o.shape[:2] + (-1,)), backend=backend), out)
        par = current()
        if par is not None and par.head_axes:  # tensor parallel: each device projected its heads' share
            out = jax.lax.psum(out, par.head_axes)
        return out, cache

    def _project(self, x: jax.Array, cos: jax.Array, sin: jax.Array, *, backend: str, fp8_index: bool = False):
        """The token-local part: x [B, Q, D] -> q_latent [B, Q, q_lora_rank] (None without q_lora_rank),
        q_nope [B, Q, H, Dn], rotated q_rope [B, Q, H, Dr], the cache entry [B, Q, R + Dr] and the
        indexer key [B, Q, Di] (None without DSA; Hadamard-rotated for an FP8 key cache)."""
        c = self.config
        batch, num_queries, _ = x.shape
        if c.q_lora_rank is None:
            q_latent, q = None, self.q_proj(x, backend=backend)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x, backend=backend))
            q = self.q_b_proj(q_latent, backend=backend)
        q = q.reshape(batch, num_queries, -1, c.qk_head_dim)  # [B, Q, H (this device's heads), Dqk]
        q_rope = apply_rope(q[..., c.qk_nope_head_dim:], cos, sin, interleaved=True)
        kv = self.kv_a_proj_with_mqa(x, backend=backend)
        latent = self.kv_a_layernorm(kv[..., :c.kv_lora_rank])
        k_rope = apply_rope(kv[..., c.kv_lora_rank:], cos, sin, interleaved=True)
        index_key = self.indexer.keys(x, cos, sin, backend=backend, fp8=fp8_index) if self.indexer is not None else None
        return q_latent, q[..., :c.qk_nope_head_dim], q_rope, jnp.concatenate([latent, k_rope], axis=-1), index_key

    def _attend_alone(self, q_nope, q_rope, index_queries, cache: PagedCache, layer, vis: Visibility,
                      w_uk, w_uv) -> jax.Array:
        """Absorbed attention, each window token on its own: q_nope [B, Q, H, Dn], q_rope [B, Q, H, Dr],
        index_queries (q_idx [B, Q, Hi, Di], weights [B, Q, Hi]) or None -> [B, Q, H, Dv].

        Token q reads the entries it sees in the order plain decoding would have stored them
        (`ancestor_slots`: the prefix, then its ancestors by depth), so a tree node meets the same
        numbers at the same positions as the token decoded alone, and every reduction adds them in
        the same order. It is the pure-jnp definition of the attention ops (`attend_latent`,
        `score_keys`, `select_topk`) whatever the backend: the Triton kernels tile a window's
        query rows together and are not window-invariant (the Mosaic ones are: `_attend_invariant_kernel`).
        """
        c = self.config
        slots = ancestor_slots(vis, q_nope.shape[1], cache.capacity)  # [B, Q, S]
        latent_cache, page_table = cache.layer_pages(cache.latent, layer)

        def alone(q_nope, q_rope, index_queries, slots):  # one window position: [B, 1, ...], slots [B, 1, S]
            visible = slots[:, 0]
            kv = as_entries(read_parts(latent_cache, page_table, visible))  # [B, S, R + Dr]
            mask = visible >= 0
            if index_queries is not None:
                keys = read_parts(*cache.layer_pages(cache.index_keys, layer), visible)
                chosen = select_topk(score_keys(*index_queries, keys, mask[:, None]), c.index_topk)[:, 0]  # [B, K]
                kv = jnp.take_along_axis(kv, jnp.maximum(chosen, 0)[..., None], axis=1)
                mask = chosen >= 0
            q_absorbed = absorb_query(q_nope, w_uk)
            out_latent, _ = attend_latent(q_absorbed, q_rope, kv[:, None], mask[:, None], c.softmax_scale)
            return jnp.einsum("bqhr,rhv->bqhv", out_latent, w_uv.astype(out_latent.dtype))

        return per_position(alone, q_nope, q_rope, index_queries, slots)

    def _attend_invariant_kernel(self, q_nope, q_rope, index_queries, cache: PagedCache, layer, vis: Visibility,
                                 w_uk, w_uv, backend: str) -> jax.Array:
        """Window-invariant absorbed attention on the Mosaic GPU kernels: q_nope [B, Q, H, Dn],
        q_rope [B, Q, H, Dr], index_queries (q_idx [B, Q, Hi, Di], weights [B, Q, Hi]) or None
        -> [B, Q, H, Dv], bit-identical to each token computed alone.

        The kernels are invariant by construction (`mla_attention_mosaic`, `indexer_mosaic`,
        `sparse_mla_attention_mosaic`): a query row's bits depend only on its query, the slots it
        sees (for sparse MLA, the slots it selected, in the order it selected them) and the cache's
        capacity, not on B, Q or its neighbours; the top-k between them is exact (ties to the
        lower slot). So a chain window runs as one call of each, as plain decoding does: token q
        sees slots [0, prefix + q], where plain decoding stored the same entries. A tree node sees
        its ancestors at scattered window slots, while decoded alone it met them contiguously, at
        other places in the kernels' tiles (and a tile's sums run in a fixed order over its slots),
        so each node gets its own calls over a copy of the row laid out in plain decoding's order
        (`ancestor_slots`, the layout `_attend_alone` reads; the indexer keys copied beside the
        latents), with the same capacity and page size. The order keeps the visible slots'
        relative order, so the indexer's ties break as they did alone too. The token-local query
        absorption and value projection run per position, as in plain decoding.
        """
        c = self.config
        each = functools.partial(per_position, enabled=True)
        q_absorbed = each(lambda q: absorb_query(q, w_uk), q_nope)

        def attend(q_absorbed, q_rope, index_queries, latent_cache, index_keys, page_table, vis):
            if index_queries is None:
                return mla_attention(q_absorbed, q_rope, latent_cache, page_table, vis, softmax_scale=c.softmax_scale,
                                     backend=backend)[0]
            indices = indexer_topk(*index_queries, index_keys, page_table, vis, topk=c.index_topk, backend=backend)
            return sparse_mla_attention(q_absorbed, q_rope, latent_cache, page_table, indices,
                                        softmax_scale=c.softmax_scale, backend=backend)[0]

        latent_cache, page_table = cache.layer_pages(cache.latent, layer)
        index_keys = None if index_queries is None else cache.layer_pages(cache.index_keys, layer)[0]
        if vis.tree_mask is None:
            out_latent = attend(q_absorbed, q_rope, index_queries, latent_cache, index_keys, page_table, vis)
        else:
            slots = ancestor_slots(vis, q_nope.shape[1], cache.capacity)  # [B, Q, S]
            batch, pages = cache.page_table.shape
            compact_table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)

            def compact(pool, visible):  # the row's visible entries in plain decoding's order, as a paged pool
                rows = read_parts(pool, page_table, visible)  # [B, S, width] (or its FP8 parts)
                return jax.tree.map(lambda part: part.reshape(batch * pages, cache.page_size, -1), rows)

            def alone(q_absorbed, q_rope, index_queries, slots):  # one window position: [B, 1, ...], slots [B, 1, S]
                visible = slots[:, 0]
                seen = jnp.sum(visible >= 0, axis=1, dtype=jnp.int32)
                alone_vis = Visibility(jnp.maximum(seen - 1, 0), (seen > 0).astype(jnp.int32))
                keys = None if index_queries is None else compact(index_keys, visible)
                return attend(q_absorbed, q_rope, index_queries, compact(latent_cache, visible), keys, compact_table,
                              alone_vis)

            out_latent = each(alone, q_absorbed, q_rope, index_queries, slots)
        return each(lambda o: jnp.einsum("bqhr,rhv->bqhv", o, w_uv.astype(o.dtype)), out_latent)

    def _expanded(self, q_nope, q_rope, rows, vis, indices, w_uk, w_uv):
        """Ordinary attention over up-projected entries. rows [B, S, R + Dr] -> [B, Q, H, Dv]."""
        c = self.config
        num_queries, num_slots = q_nope.shape[1], rows.shape[1]
        rows = rows.astype(jnp.float32)
        keys_nope = jnp.einsum("bsr,rhn->bshn", rows[..., :c.kv_lora_rank], w_uk.astype(jnp.float32))
        values = jnp.einsum("bsr,rhv->bshv", rows[..., :c.kv_lora_rank], w_uv.astype(jnp.float32))
        scores = (jnp.einsum("bqhn,bshn->bqhs", q_nope.astype(jnp.float32), keys_nope)
                  + jnp.einsum("bqhd,bsd->bqhs", q_rope.astype(jnp.float32), rows[..., c.kv_lora_rank:]))
        mask = visible_mask(vis, num_queries, num_slots) if indices is None else indices_to_mask(indices, num_slots)
        mask = mask[:, :, None, :]
        # A large finite fill (not -inf) keeps rows that see nothing (padding) NaN-free: their
        # softmax is uniform and the mask then zeroes it.
        probs = jax.nn.softmax(jnp.where(mask, scores * c.softmax_scale, -1e30), axis=-1) * mask
        return jnp.einsum("bqhs,bshv->bqhv", probs, values).astype(q_nope.dtype)
