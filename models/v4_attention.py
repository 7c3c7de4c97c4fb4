"""DeepSeek-V4 attention: shared-KV multi-query attention over a sliding window, plus compressed
entries (CSA: the indexer's top-k; HCA: all of them), with per-head sinks and a grouped output.

Per token (names as transformers 5.23's `DeepseekV4Attention`):

  q_residual = q_a_norm(q_a_proj(x))                        [B, Q, q_lora_rank]
  q          = rms(q_b_proj(q_residual))  (q_b_norm: no weight) [B, Q, H, D], last Dr dims rotated
  kv         = kv_norm(kv_proj(x))                           [B, Q, D], last Dr dims rotated; K = V
  out        = attention(q; window ring, compressed entries; sinks) with the inverse rotation of its
               last Dr dims, then o_b_proj(o_a_proj per group)  (o_groups groups of H / G heads)

RoPE is interleaved on the last `qk_rope_head_dim` dims: the "main" rope (rope_theta, no scaling)
in sliding-window layers, the "compress" rope (compress_rope_theta with YaRN, cos/sin magnitude 1)
in CSA and HCA layers, for queries, window keys, compressed entries and indexer alike (DeepSeek's
`Attention.__init__`: `original_seq_len, rope_theta = 0, args.rope_theta` for pure sliding layers).
The softmax scale is head_dim^-0.5. The compressors and their semantics (and how they differ from
transformers) are in `models/compressor.py`; the caches in `jaxspec/cache_v4.py`; the attention op
is `jaxspec.pallas_kernels.sliding_compressed_attention`.

One call, chain (tree_mask None: prefill, plain decode, chain verification, MTP catch-up): the
window's K=V entries go to the ring and its compressor projections to the projection rings; every
block whose end lies in the call is closed from the rings and written to its entry slot; then the
attention runs. Padding tokens (q >= query_len) write nothing and return finite values (0 from the
op, then the output projections).

A tree call (tree_mask given; positions = prefix_len + depth, window token q at slot prefix_len +
q) writes its ring rows the same way but no entry: the entries a query's branch closes inside the
window reach the op as its extra keys (`Compressor.branch_entries`; for CSA the indexer ranks them
after the cached entries). After the loop made the accepted path contiguous (`V4Cache.move`), the
next call closes its blocks from the rings.

window_invariant=True: a chain call computes each token's projections, CSA selection and
attention alone (`per_position`, `_attend_alone`); the selection (`indexer_topk`) and the attention
run as one call each where their op is on its Mosaic GPU kernel, which is window-invariant by
construction. A tree call writes what a tree call writes (its tokens' ring rows,
computed alone), then runs each node as a one-token chain call at its position on a view of the
cache where its ancestors' ring rows sit at the slots plain decoding gives them (`_tree_alone`).

Interface (what `models/deepseek_v4.py` calls):
  V4Attention(config, layer, *, rngs, dtype)   layer: index into config.layer_types
                                                (num_hidden_layers: the MTP block's layer)
  __call__(x [B, Q, D], positions [B, Q], cache: V4Cache, layer: the layer's index in the cache
           (an int, or the layer scan's traced int32),
           vis, *, backend="auto", window_invariant=False) -> (out [B, Q, D], cache)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache_v4 import V4Cache
from jaxspec.model_config import CSA, HCA, SLIDING, ModelConfig
from jaxspec.pallas_kernels import Visibility, query_valid, sliding_compressed_attention, window_slots
from jaxspec.pallas_kernels.backend import window_invariant_kernels
from jaxspec.sharding import current

from .compressor import Compressor, CSACompressor, branch_slots
from .layers import Linear, RMSNorm, param, per_position, unit_rms_norm
from .rope import rope_angles, rotate_tail


class V4Attention(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        self.kind = config.layer_type(layer)
        self.rope_config = config.rope_for("main" if self.kind == SLIDING else "compress")
        dim, heads, head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
        linear = functools.partial(Linear, rngs=rngs, dtype=dtype, scale_fmt=config.scale_fmt)
        self.q_a_proj = linear(dim, config.q_lora_rank, names=("embed", "q_lora"))
        self.q_a_norm = RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps, dtype=dtype, name="q_lora")
        self.q_b_proj = linear(config.q_lora_rank, heads * head_dim, names=("q_lora", "heads"))
        self.kv_proj = linear(dim, head_dim, names=("embed", None))
        self.kv_norm = RMSNorm(head_dim, eps=config.rms_norm_eps, dtype=dtype, name=None)
        # transformers' DeepseekV4GroupedLinear, stored [in, out] like every Linear: group g
        # multiplies its heads' [H / G * D] outputs by columns [g * o_lora_rank, (g + 1) * o_lora_rank).
        self.o_a_proj = linear(heads * head_dim // config.o_groups, config.o_groups * config.o_lora_rank,
                               names=(None, "heads"))
        self.o_b_proj = linear(config.o_groups * config.o_lora_rank, dim, names=("heads", "embed"))
        self.sinks = param(jnp.zeros((heads,), jnp.float32), "heads")
        if self.kind == CSA:
            self.compressor = CSACompressor(config, rngs=rngs, dtype=dtype)
        elif self.kind == HCA:
            self.compressor = Compressor(config, HCA, head_dim, rngs=rngs, dtype=dtype)
        else:
            self.compressor = None

    def __call__(self, x: jax.Array, positions: jax.Array, cache: V4Cache, layer, vis: Visibility, *,
                 backend: str = "auto", window_invariant: bool = False) -> tuple[jax.Array, V4Cache]:
        """x [B, Q, D] (the input-normed, collapsed mHC stream), positions [B, Q] -> (out [B, Q, D],
        cache with the call's ring rows and closed entries written). window_invariant: each token
        computed as if alone in its call (`per_position`), bit for bit whatever the window."""
        if x.shape[1] > cache.max_window:
            raise ValueError(f"x has {x.shape[1]} tokens per row: the cache's rings leave room for "
                             f"max_window={cache.max_window} (init_v4_cache)")
        tree = vis.tree_mask is not None
        if isinstance(layer, int) and cache.layer_types[layer] != self.kind:
            raise ValueError(f"layer={layer}: the cache holds a {cache.layer_types[layer]} layer there, "
                             f"this attention is {self.kind}")
        c = self.config
        num_queries = x.shape[1]
        each = functools.partial(per_position, enabled=window_invariant)
        cos, sin = rope_angles(self.rope_config, positions)
        q_residual, q, kv = each(functools.partial(self._project, backend=backend), x, cos, sin)
        slots = window_slots(vis, num_queries)
        cache = cache.write_ring("window", layer, slots, kv)
        if self.compressor is not None:
            cache = self.compressor.update(cache, layer, x, positions, slots, vis, window_invariant=window_invariant)
        if self.kind == CSA:
            cache = self.compressor.indexer.update(cache, layer, x, positions, slots, vis,
                                                   window_invariant=window_invariant)
        if tree and window_invariant:
            return self._tree_alone(x, positions, cache, layer, vis, backend=backend), cache

        compressed = {}
        if self.compressor is not None:
            compressed_kv, compressed_pages = cache.layer_pages(self.compressor.entry_pool, layer)
            compressed = dict(compressed_kv=compressed_kv, compressed_pages=compressed_pages)
            if tree:  # entries closed inside the window: per query, along its branch, not cached
                compressed["extra_kv"], closed = self.compressor.branch_entries(cache, layer, positions, vis)
            if self.kind == CSA:
                indexer = self.compressor.indexer
                if tree:
                    keys, keys_closed = indexer.branch_entries(cache, layer, positions, vis)
                    compressed["compressed_indices"], compressed["extra_valid"] = indexer.select(
                        cache, layer, x, q_residual, cos, sin, positions, vis, backend=backend,
                        window_invariant=False, extra_keys=keys, extra_closed=keys_closed)
                else:
                    compressed["compressed_indices"] = indexer.select(
                        cache, layer, x, q_residual, cos, sin, positions, vis, backend=backend,
                        window_invariant=window_invariant)
            else:
                rate = self.compressor.rate
                visible = (jnp.broadcast_to(vis.prefix_len[:, None], positions.shape) if tree else positions + 1) // rate
                compressed["compressed_count"] = jnp.where(query_valid(vis, num_queries), visible, 0)
                if tree:
                    compressed["extra_valid"] = closed

        attend = functools.partial(sliding_compressed_attention, sliding_window=c.sliding_window,
                                   scale=c.head_dim ** -0.5, backend=backend)
        # On the window-invariant Mosaic kernel a chain window runs as one call, as plain decoding
        # does; elsewhere attention runs once per window token.
        if window_invariant and not window_invariant_kernels(backend, "sliding_compressed_attention"):
            out = self._attend_alone(attend, q, cache, layer, positions, vis, compressed)
        else:
            out = attend(q, *cache.layer_pages("window", layer), positions, vis, self.sinks[...], **compressed)
        out = each(lambda o, cos, sin: self._output(rotate_tail(o, cos, -sin), backend=backend), out, cos, sin)
        par = current()
        if par is not None and par.head_axes:  # tensor parallel: each device projected its heads' share
            out = jax.lax.psum(out, par.head_axes)
        return out, cache

    def _project(self, x: jax.Array, cos: jax.Array, sin: jax.Array, *, backend: str):
        """The token-local part: x [B, Q, D] -> q_residual [B, Q, q_lora_rank], q [B, Q, H, D] and
        kv [B, Q, D], both normed and rotated."""
        c = self.config
        batch, num_queries, _ = x.shape
        q_residual = self.q_a_norm(self.q_a_proj(x, backend=backend))
        # -1 heads: under tensor parallelism (`jaxspec.sharding`, plan "tp") this device's heads only.
        q = self.q_b_proj(q_residual, backend=backend).reshape(batch, num_queries, -1, c.head_dim)
        q = rotate_tail(unit_rms_norm(q, c.rms_norm_eps), cos, sin)
        kv = rotate_tail(self.kv_norm(self.kv_proj(x, backend=backend)), cos, sin)
        return q_residual, q, kv

    def _output(self, o: jax.Array, *, backend: str) -> jax.Array:
        """o [B, Q, H, D] un-rotated -> o_b_proj(o_a_proj per group) [B, Q, hidden_size]."""
        c = self.config
        batch, num_queries = o.shape[:2]
        per_group = c.num_attention_heads * c.head_dim // c.o_groups
        grouped = o.reshape(batch, num_queries, -1, per_group)  # [B, Q, G (this device's), H / G * D]
        w = self.o_a_proj.dense_weight().reshape(per_group, -1, c.o_lora_rank).astype(o.dtype)
        mixed = jnp.einsum("bqgi,igr->bqgr", grouped, w)
        return self.o_b_proj(mixed.reshape(batch, num_queries, -1), backend=backend)

    def _tree_alone(self, x: jax.Array, positions: jax.Array, cache: V4Cache, layer, vis: Visibility, *,
                    backend: str) -> jax.Array:
        """A window-invariant tree call's outputs [B, Q, D], `cache` holding the call's writes.

        Node q at depth d runs as a one-token chain call at position prefix_len + d (a
        `per_position` loop over the nodes) on a view of `cache` in which the ring rows of its
        ancestors (itself included) are copied to slots prefix_len .. prefix_len + d
        (`V4Cache.move_layer`), where plain decoding of its branch would have written them. The chain
        call then closes its branch's blocks from those rows and attends exactly as the token
        decoded alone would: the same rows, entries and shapes, so the same bits. Nothing a view
        holds is kept: the window's other nodes' rows in it sit at ring indices no token of the
        branch can see (the rings leave room for max_window tokens past the sliding window and
        the blocks being closed), and the call's own writes are the tree call's.
        """
        num_queries = x.shape[1]
        ancestors = branch_slots(positions, vis)  # [B, Q, Q]: slot of node q's ancestor at depth d, or -1
        chain = jnp.broadcast_to(vis.prefix_len[:, None] + jnp.arange(num_queries, dtype=jnp.int32), positions.shape)
        valid = query_valid(vis, num_queries).astype(jnp.int32)

        def node(x, position, ancestors, valid):  # one node: [B, 1, ...]
            view = cache.move_layer(ancestors[:, 0], chain, layer, self.kind)
            alone = Visibility(position[:, 0], valid[:, 0])  # prefix_len + depth tokens before it on its branch
            out, _ = self(x, position, view, layer, alone, backend=backend, window_invariant=True)
            return out

        return per_position(node, x, positions, ancestors, valid)

    def _attend_alone(self, attend, q, cache: V4Cache, layer, positions, vis: Visibility, compressed):
        """The attention op once per window token, as token q alone in a call: prefix_len + q
        committed before it (the ring rows and entries of the tokens before it in this call are
        already written, and the ring leaves room for the whole window, so what it reads is what
        a one-token call would read)."""
        per_query = {k: v for k, v in compressed.items() if k in ("compressed_indices", "compressed_count")}
        shared = {k: v for k, v in compressed.items() if k not in per_query}
        offsets = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32)[None], positions.shape)
        valid = query_valid(vis, q.shape[1])
        window = cache.layer_pages("window", layer)

        def alone(q, positions, offset, valid, per_query):  # [B, 1, ...]
            one = Visibility(vis.prefix_len + offset[:, 0], valid[:, 0].astype(jnp.int32))
            return attend(q, *window, positions, one, self.sinks[...], **shared, **per_query)

        return per_position(alone, q, positions, offsets, valid, per_query)
