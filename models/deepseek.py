"""DeepSeek-V3 / V3.2 transformer with its MTP (multi-token prediction) module, in Flax NNX.

A call processes a window of tokens `[B, Q]` against a `PagedCache`: it writes the window's cache
entries and returns logits, the final hidden states and the updated cache. Once split
(`graphdef, params = nnx.split(model)`) the model is a pure function of params, tokens and cache.

The MTP module (DeepSeek-V3 section 2.2) drafts the token after next. For window token i it takes
the target's hidden state h_i and the embedding of token t_{i+1}:

    h'_i = block(eh_proj(concat[enorm(embed(t_{i+1})), hnorm(h_i)]))
    logits_i = lm_head(shared_head_norm(h'_i))       (predicts t_{i+2})

`h_i` is the target's hidden state after its final norm (the input of its LM head), and chained
drafting (k > 1) feeds the MTP its own output after `shared_head_norm`: the states the code that
trains and serves these weights uses (docs/model-interface.md gives the sources;
`tests/test_hf_parity.py` pins both against transformers' MTP layer). The embedding and LM head are
the target's (shared, as DeepSeek specifies). `DeepseekV3` implements `models.interface.DecoderModel`.

The decoder layers are two stacks (`models.stack`): `dense_layers`, the first
`first_k_dense_replace` layers (a SwiGLU MLP), and `moe_layers`, the rest (MoE), each run as one
`jax.lax.scan` over parameters stacked [n, ...] (`layer_runs` says which layers each holds;
`layer(i)` gives layer i on its own). The caches stack all layers' pools [L, ...] in the same order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import PagedCache, init_cache
from jaxspec.model_config import ModelConfig
from jaxspec.pallas_kernels import Visibility
from jaxspec.pallas_kernels.fp8_cache import check_fp8_widths

from .interface import check_head_split
from .layers import MLP, Linear, RMSNorm, compute_dtype, embedding, head_logits, per_position
from .mla import MLA
from .moe import MoE, prefill_temp_bytes
from .rope import rope_angles
from .stack import LayerRun, layer_slice, run_layers, run_of, stack_layers


def layer_runs(config: ModelConfig) -> tuple[LayerRun, ...]:
    """The stacks of a V3 / V3.2 decoder, in layer order: `dense_layers` (the first
    first_k_dense_replace layers) and `moe_layers` (the rest), an empty one left out."""
    dense = min(config.first_k_dense_replace, config.num_hidden_layers)
    runs = (LayerRun("dense_layers", 0, 1, dense), LayerRun("moe_layers", dense, 1, config.num_hidden_layers - dense))
    return tuple(run for run in runs if run.repeats)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + MLA(norm(x)), then + MLP-or-MoE(norm(.))."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.self_attn = MLA(config, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.mlp = (MoE(config, rngs=rngs, dtype=dtype) if config.is_moe_layer(layer)
                    else MLP(config.hidden_size, config.intermediate_size, rngs=rngs, dtype=dtype,
                             scale_fmt=config.scale_fmt))

    def __call__(self, x, cos, sin, cache: PagedCache, cache_layer, vis: Visibility, *, form, backend,
                 window_invariant: bool = False):
        each = functools.partial(per_position, enabled=window_invariant)
        attn, cache = self.self_attn(each(self.input_layernorm, x), cos, sin, cache, cache_layer, vis,
                                     form=form, backend=backend, window_invariant=window_invariant)
        x = x + attn
        h = each(self.post_attention_layernorm, x)
        # Per position, the MoE sees B tokens whatever Q is, so it also takes the same expert path.
        return x + each(lambda h: self.mlp(h, backend=backend), h), cache


class MTPModule(nnx.Module):
    """DeepSeek's MTP layer: enorm, hnorm, eh_proj, one decoder block, shared_head_norm."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        dim = config.hidden_size
        self.enorm = RMSNorm(dim, eps=config.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(dim, eps=config.rms_norm_eps, dtype=dtype)
        # Not quantized in DeepSeek's FP8 checkpoints (jaxspec.fp8), nor the embedding and LM head.
        self.eh_proj = Linear(2 * dim, dim, rngs=rngs, dtype=compute_dtype(dtype), names=(None, "embed"))
        # The MTP block sits at layer index num_hidden_layers, past first_k_dense_replace: it is MoE.
        self.block = DecoderLayer(config, config.num_hidden_layers, rngs=rngs, dtype=dtype)
        self.shared_head_norm = RMSNorm(dim, eps=config.rms_norm_eps, dtype=dtype)


class DeepseekV3(nnx.Module):
    """The target model (DeepSeek-V3 or V3.2 by `config.model_type`) and, when
    `config.num_nextn_predict_layers > 0`, its MTP draft module (`self.mtp`).

    DeepseekV3(config, rngs=nnx.Rngs(seed), dtype=jnp.float32): config is a `ModelConfig`
    (`preset(name)` or `ModelConfig.from_hf(path)`); rngs seeds the random initial weights; dtype
    is the parameters' and caches' dtype (`jnp.float8_e4m3fn`: DeepSeek's FP8 layout, the linear
    layers `jaxspec.fp8` lists in FP8 with block scales, all else and the computation in bfloat16;
    see `models.layers.Linear`). Trained weights come from `restore_model(dir)` or
    `jaxspec.checkpoint.load_model(dir)` (a Hugging Face or orbax directory) instead. Calls take
    a `[B, Q]` token window (see `__call__` and `draft`); `generate` and `init_state` / `step`
    drive them.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        self.dtype = compute_dtype(dtype)
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, rngs=rngs, dtype=self.dtype)
        for run in layer_runs(config):
            setattr(self, run.name, stack_layers(
                lambda rngs, start=run.start: DecoderLayer(config, start, rngs=rngs, dtype=dtype), run.repeats, rngs))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, rngs=rngs, dtype=self.dtype,
                              names=("embed", "vocab"))
        self.mtp = MTPModule(config, rngs=rngs, dtype=dtype) if config.num_nextn_predict_layers > 0 else None

    # -- caches ---------------------------------------------------------------------------------

    def init_cache(self, batch_size: int, capacity: int, *, page_size: int = 64, mtp: bool = False,
                   page_table: jax.Array | None = None, row_shards: int = 1, max_window: int | None = None,
                   lookback: int | None = None, cache_dtype: str | None = None) -> PagedCache:
        """An empty cache for the target (or, with `mtp=True`, for the one-layer MTP module);
        row_shards: laid out for a mesh splitting the rows into that many blocks (`jaxspec.cache.init_cache`).
        max_window and lookback are unused: a paged cache holds every slot up to its capacity, so
        the widest call does not size it. cache_dtype: None (the compute dtype) or "fp8" (the
        latent in FlashMLA's FP8 token, indexer keys rotated and in FP8: `jaxspec.pallas_kernels.fp8_cache`;
        ValueError where the widths do not fit, `check_fp8_widths`)."""
        del max_window, lookback
        c = self.config
        index_dim = c.index_head_dim if c.is_v32 else 0
        if cache_dtype == "fp8":
            check_fp8_widths(kv_lora_rank=c.kv_lora_rank, index_head_dim=index_dim)
        return init_cache(num_layers=1 if mtp else c.num_hidden_layers, batch_size=batch_size, capacity=capacity,
                          latent_dim=c.latent_dim, index_dim=index_dim, page_size=page_size, dtype=self.dtype,
                          page_table=page_table, row_shards=row_shards, rope_dim=c.qk_rope_head_dim,
                          cache_dtype=cache_dtype, scale_fmt=c.scale_fmt)

    @property
    def hidden_width(self) -> int:
        """The hidden state's width: hidden_size (the post-norm state the MTP reads)."""
        return self.config.hidden_size

    def check_layout(self, *, head_split: int, page_table) -> None:
        """Heads split `head_split` ways must divide num_attention_heads; any page table is welcome."""
        del page_table
        check_head_split(self.config, head_split)

    def prefill_layer_bytes(self, *, rows: int, width: int, prompt_len: int, capacity: int, heads: int,
                            chunked: bool, backend: str, row_shards: int | None) -> int:
        """An estimate, erring high, of the temporaries one decoder layer holds on a device in one
        prefill call (`DecoderModel.prefill_layer_bytes`): attention plus the feed-forward part
        (`moe.prefill_temp_bytes`), for T = rows x width tokens (width = prompt_len in one call),
        S = capacity slots a row, K = index_topk, in float32 unless said otherwise. An "entry" is a
        gathered latent [R + Dr] as stored, in the compute dtype and in float32.

        * With DSA, on every backend: the indexer's scores [S] a token, the top-k's sorted copy with
          its int32 slots (XLA sorts a row to take its top k), and the chosen slots [K]; on "xla"
          (its reference) also the per-head scores [Hi, S] a token and the keys gathered [S, Di] a
          row in the compute dtype.
        * One call (expanded form, pure jnp on every backend): the scores, their masked copy and
          the probabilities [H, S] a token; the entries [S] and the keys and values up-projected
          [S, H, Dn + Dv] a row.
        * A chunk (absorbed form): the queries [H, Dn + Dr], the absorbed query [H, R] and the
          values [H, Dv] a token in the compute dtype, and the attention's latent output [H, R]
          (float32: the kernels' split-KV partials are). The kernels ("pallas", "mosaic") stream
          the cache and make nothing more; the references ("xla") make the scores, their masked
          copy and the probabilities [H, S] (DSA: [H, K]) a token, and the entries [S] a row
          (DSA: a token's chosen [K]).
        Checked against sm_90a and XLA CPU compiles in docs/model-interface.md."""
        c, f32, act = self.config, 4, jnp.dtype(self.dtype).itemsize
        entry = c.latent_dim * (2 * act + f32)
        kernels = backend != "xla"
        per_token = per_row = 0
        if c.is_v32:
            per_token += 3 * capacity * f32 + c.index_topk * f32
            if not kernels:
                per_token += c.index_n_heads * capacity * f32
                per_row += capacity * c.index_head_dim * act
        if not chunked:
            per_token += 3 * heads * capacity * f32
            per_row += capacity * (entry + heads * (c.qk_nope_head_dim + c.v_head_dim) * f32)
        else:
            per_token += (act * heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.kv_lora_rank + c.v_head_dim)
                          + f32 * heads * c.kv_lora_rank)
            if not kernels and c.is_v32:
                per_token += 3 * heads * c.index_topk * f32 + c.index_topk * entry
            elif not kernels:
                per_token += 3 * heads * capacity * f32
                per_row += capacity * entry
        tokens = rows * width
        return tokens * per_token + rows * per_row + prefill_temp_bytes(c, tokens, row_shards, act, backend)

    # -- layers ---------------------------------------------------------------------------------

    @property
    def layer_runs(self) -> tuple[LayerRun, ...]:
        """Where each decoder layer's parameters are: `layer_runs(config)`."""
        return layer_runs(self.config)

    def layer(self, index: int) -> DecoderLayer:
        """Decoder layer `index` on its own (its rows of the stacked parameters), for inspection."""
        _, run = run_of(self.layer_runs, index, self.config.num_hidden_layers)
        return layer_slice(getattr(self, run.name), index - run.start)

    # -- forward passes -------------------------------------------------------------------------

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: PagedCache, vis: Visibility, *,
                 form: str = "absorbed", backend: str = "auto", window_invariant: bool = False,
                 unroll_layers: bool = False,
                 logits_at: jax.Array | None = None) -> tuple[jax.Array, jax.Array, PagedCache]:
        """Target forward over a window.

        tokens, positions [B, Q] int32; vis: the window's visibility (`jaxspec.pallas_kernels.Visibility`)
        -> logits [B, Q, V] float32 ([B, L, V] at the window positions `logits_at` [B, L] int32,
        when given), hidden [B, Q, D] (after the final norm), the updated cache.
        form: "expanded" (prefill over an empty cache: keys and values up-projected) or "absorbed"
        (attention in the latent space, as cached steps run it). window_invariant: every token's
        logits and hidden state are bit-identical to what the same token gets alone in a [B, 1]
        call on the same cache (`DecodeConfig.window_invariant`; absorbed form only). unroll_layers:
        run the layer stacks as python loops instead of scans (the same parameters and results; a
        debugging switch, `DecodeConfig.unroll_layers`).
        """
        if cache.num_layers != self.config.num_hidden_layers:
            raise ValueError(f"cache: holds {cache.num_layers} layers, the model has {self.config.num_hidden_layers} "
                             "(build it with this model's init_cache)")
        cos, sin = rope_angles(self.config, positions)
        x = self.embed_tokens(tokens).astype(self.dtype)
        for run in self.layer_runs:
            def body(layer, row, carry, start=run.start):
                x, cache = carry
                return layer(x, cos, sin, cache, start + row, vis, form=form, backend=backend,
                             window_invariant=window_invariant)
            x, cache = run_layers(getattr(self, run.name), body, (x, cache), unroll=unroll_layers)
        logits, hidden = head_logits(self.norm, self.lm_head, x, logits_at, per_token=window_invariant)
        return logits, hidden, cache

    def draft(self, next_tokens: jax.Array, hidden: jax.Array, positions: jax.Array, cache: PagedCache,
              vis: Visibility, *, form: str = "absorbed", backend: str = "auto", logits_at: jax.Array | None = None):
        """MTP forward: next_tokens [B, Q] (t_{i+1}), hidden [B, Q, D] (h_i), positions [B, Q] (i)
        -> logits [B, Q, V] float32 (for t_{i+2}; [B, L, V] at `logits_at`), the MTP's own hidden
        [B, Q, D] (to chain), cache."""
        if self.mtp is None:
            raise ValueError("this model has no MTP module (config.num_nextn_predict_layers == 0)")
        mtp = self.mtp
        cos, sin = rope_angles(self.config, positions)
        embedded = mtp.enorm(self.embed_tokens(next_tokens).astype(self.dtype))
        x = mtp.eh_proj(jnp.concatenate([embedded, mtp.hnorm(hidden.astype(self.dtype))], axis=-1), backend=backend)
        x, cache = mtp.block(x, cos, sin, cache, 0, vis, form=form, backend=backend)
        logits, out_hidden = head_logits(mtp.shared_head_norm, self.lm_head, x, logits_at)
        return logits, out_hidden, cache
