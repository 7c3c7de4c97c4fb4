"""DeepSeek-V4 transformer with its MTP module, in Flax NNX (`model_type` "deepseek_v4").

The module tree mirrors transformers 5.23's `DeepseekV4ForCausalLM` (so checkpoint names map
mechanically, `jaxspec.checkpoint`): embed_tokens; layer i = attn_hc, input_layernorm, self_attn
(`V4Attention`: sliding / CSA / HCA by `layer_types[i]`), ffn_hc, post_attention_layernorm, mlp
(`MoE`, hash-routed in the "hash_moe" layers); hc_head; norm; lm_head. The residual is `hc_mult`
streams [B, Q, N, D] (`models.hyper_connections`): the embedding is copied into every stream, each
block reads their mHC collapse and is merged back, and `hc_head` collapses them before the final
norm. A call processes a window of tokens `[B, Q]` against a `V4Cache` (`jaxspec.cache_v4`) and
returns logits, the hidden state the MTP module reads, and the updated cache, like `DeepseekV3`.

The MTP module (`mtp`; transformers drops it, `jaxspec.checkpoint` loads DeepSeek's `mtp.0.*`),
wired as DeepSeek's V4 inference code (`MTPBlock`) and the engines serving V4 MTP wire it
(docs/model-interface.md gives the sources):

    streams'_i = h_proj(hnorm(H_i)) + e_proj(enorm(embed(t_{i+1})))    (broadcast to the N streams)
    streams''_i = block(streams'_i)           (a sliding-window layer with its own mHC, learned MoE)
    logits_i = lm_head(norm(hc_head(streams''_i)))                    (predicts t_{i+2})

where H_i are the target's residual streams after its last layer, before `hc_head` and the final
norm (unlike V3, whose MTP reads the post-norm state). So `hidden`, what a call returns for the
MTP, is the streams flattened, [B, Q, hc_mult * hidden_size]; chained drafting (k > 1) feeds the
MTP its own pre-hc_head output streams the same way. The embedding and LM head are the target's.
`DeepseekV4` implements `models.interface.DecoderModel`.

The decoder layers run as scans over stacked parameters (`models.stack`), one scan per run of a
repeating pattern: `layer_groups[k]` holds the k-th run, `repeats` copies of a unit of one layer or
of two (an `nnx.List`), stacked [repeats, ...]. Layers differ by attention kind (sliding, CSA, HCA:
different modules and caches) and MoE routing (hash or learned), and V4 alternates its kinds, so
runs of one kind would be one layer long; the pattern is what repeats: V4-Flash is [S/hash] x 2,
[C/hash] x 1, [H, C] x 20, V4-Pro [H/hash] x 2, [C/hash] x 1, [H, C] x 29 (`layer_runs`: the fewest runs
of units of one or two layers, `models.stack.repeating_runs`). Three scan bodies then compile,
whatever the depth. `layer(i)` gives layer i on its own; `unroll_layers=True` runs the same
stacks as python loops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache_v4 import V4Cache, init_v4_cache
from jaxspec.model_config import HCA, ModelConfig
from jaxspec.pallas_kernels import Visibility

from .hyper_connections import HyperConnection, HyperHead
from .interface import check_head_split, window_rows
from .layers import Linear, RMSNorm, compute_dtype, embedding, head_logits, per_position
from .moe import MoE, prefill_temp_bytes
from .stack import LayerRun, layer_slice, repeating_runs, run_layers, run_of, stack_layers
from .v4_attention import V4Attention

LAYER_GROUPS = "layer_groups"


@functools.cache  # the loaders ask once per checkpoint tensor (tens of thousands); the search takes 0.3 ms
def layer_runs(config: ModelConfig) -> tuple[LayerRun, ...]:
    """The stacks of a V4 decoder, in layer order: `layer_groups.{k}` holds the k-th of the fewest
    runs of a repeated unit of one or two layers (a layer's kind: its attention kind and routing)."""
    kinds = [(config.layer_type(i), config.is_hash_layer(i)) for i in range(config.num_hidden_layers)]
    return tuple(LayerRun(f"{LAYER_GROUPS}.{k}", start, period, repeats)
                 for k, (start, period, repeats) in enumerate(repeating_runs(kinds)))


class V4DecoderLayer(nnx.Module):
    """One V4 block around the N residual streams: attention then MoE, each behind its own mHC
    (transformers' DeepseekV4DecoderLayer). layer: the index into `config.layer_types`
    (num_hidden_layers: the MTP block, a sliding-window layer with learned routing)."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        dim = config.hidden_size
        self.attn_hc = HyperConnection(config, rngs=rngs)
        self.input_layernorm = RMSNorm(dim, eps=config.rms_norm_eps, dtype=dtype)
        self.self_attn = V4Attention(config, layer, rngs=rngs, dtype=dtype)
        self.ffn_hc = HyperConnection(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(dim, eps=config.rms_norm_eps, dtype=dtype)
        self.mlp = MoE(config, rngs=rngs, dtype=dtype, hash_routing=config.is_hash_layer(layer))

    def __call__(self, streams: jax.Array, tokens: jax.Array, positions: jax.Array, cache: V4Cache, cache_layer,
                 vis: Visibility, *, backend: str, window_invariant: bool = False) -> tuple[jax.Array, V4Cache]:
        """streams [B, Q, N, D], tokens / positions [B, Q] -> (streams [B, Q, N, D], cache).
        cache_layer: this layer's index in the cache (an int, or the layer scan's traced int32)."""
        each = functools.partial(per_position, enabled=window_invariant)

        def enter(hc, norm, streams):  # the block's input: its mHC weights and the normed collapse
            post, comb, collapsed = hc(streams, backend=backend)
            return post, comb, norm(collapsed)

        post, comb, x = each(functools.partial(enter, self.attn_hc, self.input_layernorm), streams)
        attn, cache = self.self_attn(x, positions, cache, cache_layer, vis, backend=backend,
                                     window_invariant=window_invariant)
        streams = each(HyperConnection.merge, post, comb, attn, streams)
        post, comb, x = each(functools.partial(enter, self.ffn_hc, self.post_attention_layernorm), streams)
        # Per position the MoE sees B tokens whatever Q is, so it also takes the same expert path.
        mlp = each(lambda h, t: self.mlp(h, backend=backend, token_ids=t), x, tokens)
        return each(HyperConnection.merge, post, comb, mlp, streams), cache


class V4MTPModule(nnx.Module):
    """DeepSeek-V4's MTP layer (`mtp.0.*`): enorm, hnorm, e_proj, h_proj, one sliding-window block,
    its own hc_head and final norm (module docstring)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        dim = config.hidden_size
        self.enorm = RMSNorm(dim, eps=config.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(dim, eps=config.rms_norm_eps, dtype=dtype)
        # FP8 in DeepSeek's V4 checkpoints (unlike V3's bf16 eh_proj), so they follow `dtype`.
        self.e_proj = Linear(dim, dim, rngs=rngs, dtype=dtype, scale_fmt=config.scale_fmt, names=("embed", None))
        self.h_proj = Linear(dim, dim, rngs=rngs, dtype=dtype, scale_fmt=config.scale_fmt, names=("embed", None))
        self.block = V4DecoderLayer(config, config.num_hidden_layers, rngs=rngs, dtype=dtype)
        self.hc_head = HyperHead(config, rngs=rngs)
        self.norm = RMSNorm(dim, eps=config.rms_norm_eps, dtype=dtype)


class DeepseekV4(nnx.Module):
    """The DeepSeek-V4 target model and, when `config.num_nextn_predict_layers > 0`, its MTP module.

    DeepseekV4(config, rngs=nnx.Rngs(seed), dtype=jnp.float32), a `models.interface.DecoderModel`
    like `DeepseekV3`, so the decoding loop drives either. dtype: of parameters
    and caches (`jnp.float8_e4m3fn`: DeepSeek's FP8 layout, see `models.layers.Linear`); the mHC
    parameters, sinks and router stay float32 as in transformers.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        if not config.is_v4:
            raise ValueError(f"config.model_type={config.model_type!r}: DeepseekV4 needs deepseek_v4 "
                             "(DeepseekV3 builds deepseek_v3 / deepseek_v32)")
        self.config = config
        self.dtype = compute_dtype(dtype)
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, rngs=rngs, dtype=self.dtype)
        self.layer_groups = nnx.List([stack_layers(functools.partial(self._unit, config, run, dtype=dtype),
                                                   run.repeats, rngs) for run in layer_runs(config)])
        self.hc_head = HyperHead(config, rngs=rngs)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, rngs=rngs, dtype=self.dtype,
                              names=("embed", "vocab"))
        self.mtp = V4MTPModule(config, rngs=rngs, dtype=dtype) if config.num_nextn_predict_layers > 0 else None

    @staticmethod
    def _unit(config: ModelConfig, run: LayerRun, rngs: nnx.Rngs, *, dtype) -> nnx.Module:
        """A run's unit: its first layer (period 1), or an `nnx.List` of its first `period` layers
        (every repeat has the same kinds)."""
        layers = [V4DecoderLayer(config, run.start + j, rngs=rngs, dtype=dtype) for j in range(run.period)]
        return layers[0] if run.period == 1 else nnx.List(layers)

    # -- caches ---------------------------------------------------------------------------------

    def init_cache(self, batch_size: int, capacity: int, *, page_size: int = 64, mtp: bool = False,
                   page_table=None, row_shards: int = 1, max_window: int | None = None,
                   lookback: int | None = None, cache_dtype: str | None = None) -> V4Cache:
        """An empty `V4Cache` for the target (or, with `mtp=True`, the one-layer MTP module).
        cache_dtype: None (the model's dtype) or "fp8" (the window and compressed entries in
        FlashMLA's MODEL1 token: `jaxspec.cache_v4`, docs/fp8-caches.md).
        max_window: the most tokens one call will process (prefill chunk, k + 1, tree size), which
        the rings leave room for; None = `capacity` (any call fits: the rings never wrap inside a
        call). lookback, page_table, row_shards: as `jaxspec.cache_v4.init_v4_cache`."""
        return init_v4_cache(self.config, batch_size, capacity, max_window=capacity if max_window is None else max_window,
                             lookback=lookback, page_size=page_size, mtp=mtp, page_table=page_table, row_shards=row_shards,
                             dtype=self.dtype, cache_dtype=cache_dtype)

    @property
    def hidden_width(self) -> int:
        """The hidden state's width: the hc_mult residual streams flattened, hc_mult * hidden_size."""
        return self.config.hc_mult * self.config.hidden_size

    def check_layout(self, *, head_split: int, page_table) -> None:
        """Heads split `head_split` ways must divide num_attention_heads and o_groups (the grouped
        output projection splits by groups); a user page table is refused (the caches' per-structure
        tables are `jaxspec.cache_v4.init_v4_cache`'s to give)."""
        c = self.config
        if page_table is not None:
            raise ValueError("page_table: a DeepSeek-V4 model's caches have one page table per structure (rings "
                             "sized by the widest call, entry pools by the capacity), which one [B, M] layout "
                             "cannot give; pass None (jaxspec.cache_v4.init_v4_cache takes per-structure tables)")
        check_head_split(c, head_split)
        if c.o_groups % head_split:
            raise ValueError(f"the plan splits attention heads {head_split} ways; a V4 output group spans "
                             f"several heads, so o_groups={c.o_groups} must be a multiple of {head_split}")

    def prefill_layer_bytes(self, *, rows: int, width: int, prompt_len: int, capacity: int, heads: int,
                            chunked: bool, backend: str, row_shards: int | None) -> int:
        """An estimate of the temporaries one layer holds on a device in a prefill call of rows x
        `width` tokens (`DecoderModel.prefill_layer_bytes`): each token's float32 scores over its
        sliding window and the most compressed entries one query sees (CSA's top-k, or HCA's
        count), whatever the backend, plus the feed-forward part (`moe.prefill_temp_bytes`). The
        attention term is not checked against a compile."""
        del prompt_len, chunked
        c = self.config
        keys = c.sliding_window + max(c.index_topk, capacity // dict(c.compress_rates)[HCA])
        tokens = rows * width
        feed_forward = prefill_temp_bytes(c, tokens, row_shards, jnp.dtype(self.dtype).itemsize, backend)
        return tokens * heads * keys * 4 + feed_forward

    # -- layers ---------------------------------------------------------------------------------

    @property
    def layer_runs(self) -> tuple[LayerRun, ...]:
        """Where each decoder layer's parameters are: `layer_runs(config)`."""
        return layer_runs(self.config)

    def layer(self, index: int) -> V4DecoderLayer:
        """Decoder layer `index` on its own (its rows of the stacked parameters), for inspection."""
        k, run = run_of(self.layer_runs, index, self.config.num_hidden_layers)
        unit = layer_slice(self.layer_groups[k], (index - run.start) // run.period)
        return unit if run.period == 1 else unit[(index - run.start) % run.period]

    # -- forward passes -------------------------------------------------------------------------

    def _streams(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, Q] -> the embedding copied into the hc_mult streams [B, Q, N, D]."""
        x = self.embed_tokens(tokens).astype(self.dtype)
        return jnp.broadcast_to(x[:, :, None], (*x.shape[:2], self.config.hc_mult, x.shape[-1]))

    def _logits(self, hc_head: HyperHead, norm: RMSNorm, streams: jax.Array, window_invariant: bool) -> jax.Array:
        """streams [B, Q, N, D] -> float32 logits [B, Q, V] of norm(hc_head(streams)) (`head_logits`)."""
        head = lambda s: head_logits(norm, self.lm_head, hc_head(s))[0]
        return per_position(head, streams, enabled=window_invariant)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: V4Cache, vis: Visibility, *,
                 form: str = "absorbed", backend: str = "auto", window_invariant: bool = False,
                 unroll_layers: bool = False,
                 logits_at: jax.Array | None = None) -> tuple[jax.Array, jax.Array, V4Cache]:
        """Target forward over a window.

        tokens, positions [B, Q] int32; vis: the window's visibility -> logits [B, Q, V] float32
        ([B, L, V] at the window positions `logits_at` [B, L] int32, when given),
        hidden [B, Q, hc_mult * D] (the residual streams before hc_head, flattened: the MTP's
        input), the updated cache. form: the interface's attention-form hint, which V4 ignores (its
        attention has one form). window_invariant: every token computed as if alone in a [B, 1] call.
        unroll_layers: run the layer stacks as python loops instead of scans (the same parameters and
        results; a debugging switch, `DecodeConfig.unroll_layers`).
        """
        if cache.layer_types != tuple(self.config.layer_types):
            raise ValueError(f"cache: holds layers {cache.layer_types}, the model has {tuple(self.config.layer_types)} "
                             "(build it with this model's init_cache)")
        streams = self._streams(tokens)
        for run, stack in zip(self.layer_runs, self.layer_groups):
            def body(unit, row, carry, run=run):
                streams, cache = carry
                for j, layer in enumerate([unit] if run.period == 1 else unit):
                    streams, cache = layer(streams, tokens, positions, cache, run.start + row * run.period + j, vis,
                                           backend=backend, window_invariant=window_invariant)
                return streams, cache
            streams, cache = run_layers(stack, body, (streams, cache), unroll=unroll_layers)
        logits = self._logits(self.hc_head, self.norm, window_rows(streams, logits_at), window_invariant)
        return logits, streams.reshape(*streams.shape[:2], -1), cache

    def draft(self, next_tokens: jax.Array, hidden: jax.Array, positions: jax.Array, cache: V4Cache,
              vis: Visibility, *, form: str = "absorbed", backend: str = "auto", logits_at: jax.Array | None = None):
        """MTP forward: next_tokens [B, Q] (t_{i+1}), hidden [B, Q, N * D] (the target's or the MTP's
        own pre-hc_head streams at i), positions [B, Q] (i) -> logits [B, Q, V] float32 (for
        t_{i+2}; [B, L, V] at `logits_at`), the MTP's pre-hc_head streams [B, Q, N * D] (to chain), cache."""
        if self.mtp is None:
            raise ValueError("this model has no MTP module (config.num_nextn_predict_layers == 0)")
        mtp, (batch, num_queries) = self.mtp, next_tokens.shape
        streams = hidden.astype(self.dtype).reshape(batch, num_queries, self.config.hc_mult, -1)
        embedded = mtp.e_proj(mtp.enorm(self.embed_tokens(next_tokens).astype(self.dtype)), backend=backend)
        streams = mtp.h_proj(mtp.hnorm(streams), backend=backend) + embedded[:, :, None]
        streams, cache = mtp.block(streams, next_tokens, positions, cache, 0, vis, backend=backend)
        logits = self._logits(mtp.hc_head, mtp.norm, window_rows(streams, logits_at), False)
        return logits, streams.reshape(batch, num_queries, -1), cache
