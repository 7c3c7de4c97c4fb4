"""DeepSeek-V3 / V3.2 transformer with its MTP (multi-token prediction) module, in Flax NNX.

A call processes a window of tokens `[B, Q]` against a `PagedCache`: it writes the window's cache
entries and returns logits, the final hidden states and the updated cache. Once split
(`graphdef, params = nnx.split(model)`) the model is a pure function of params, tokens and cache.

The MTP module (DeepSeek-V3 section 2.2) drafts the token after next. For window token i it takes
the target's hidden state h_i and the embedding of token t_{i+1}:

    h'_i = block(eh_proj(concat[enorm(embed(t_{i+1})), hnorm(h_i)]))
    logits_i = lm_head(shared_head_norm(h'_i))       (predicts t_{i+2})

`h_i` is the target's hidden state *after* its final norm, the input of its LM head. DeepSeek's
report says only "the representation given by the main model" and DeepSeek's inference code has
no MTP (the question, deepseek-ai/DeepSeek-V3#839, went unanswered), so the evidence is the code
that trains or serves these weights, which all takes the post-norm state:
  * transformers 5.23 `generate(use_mtp=True)`: `MTPCandidateGenerator` feeds `hidden_states[-1]`,
    which `capture_outputs` replaces by `last_hidden_state`, i.e. after `self.norm`;
  * vLLM `DeepSeekMTP` and SGLang `deepseek_nextn`: the target model returns `self.norm(...)`;
  * Megatron-LM's `MultiTokenPredictionLayer` (DeepSeek-V3-style training) receives the decoder
    block's output after its `final_layernorm`;
  * the `modeling_deepseek.py` shipped with AMD's DeepSeek-R1-0528-MXFP4-MTP passes the normed
    output as `previous_hidden_states` (quoted in ROCm/ATOM#1764).
Chained drafting (k > 1) feeds the MTP module its own output the same way, after
`shared_head_norm` (the input of the shared head): transformers' `MtpLayer` returns
`post_norm(...)` for the next depth, SGLang's `deepseek_nextn` returns the normed state, Megatron
chains `final_layernorm` outputs; vLLM chained the pre-norm block output until
vllm-project/vllm#45895, and ROCm/ATOM measured DeepSeek-R1 MTP acceptance rise from 61.4% to 64.6%
when it made the same switch (ROCm/ATOM#1764). `tests/test_hf_parity.py` pins both hidden states
against transformers' MTP layer. The embedding and LM head are the target's (shared, as DeepSeek
specifies; the checkpoint's copies in the MTP layer are duplicates).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import PagedCache, init_cache
from jaxspec.model_config import ModelConfig
from jaxspec.pallas_kernels import Visibility

from .layers import MLP, Linear, RMSNorm, compute_dtype, embedding, head_logits, per_position
from .mla import MLA
from .moe import MoE
from .rope import rope_angles


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + MLA(norm(x)), then + MLP-or-MoE(norm(.))."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.self_attn = MLA(config, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.mlp = (MoE(config, rngs=rngs, dtype=dtype) if config.is_moe_layer(layer)
                    else MLP(config.hidden_size, config.intermediate_size, rngs=rngs, dtype=dtype))

    def __call__(self, x, cos, sin, cache: PagedCache, cache_layer: int, vis: Visibility, *, form, backend,
                 window_invariant: bool = False):
        each = functools.partial(per_position, enabled=window_invariant)
        attn, cache = self.self_attn(each(self.input_layernorm, x), cos, sin, cache, cache_layer, vis,
                                     form=form, backend=backend, window_invariant=window_invariant)
        x = x + attn
        h = each(self.post_attention_layernorm, x)
        # Per position, the MoE sees B tokens whatever Q is, so it also takes the same expert path.
        mlp = (lambda h: self.mlp(h, backend=backend)) if isinstance(self.mlp, MoE) else self.mlp
        return x + each(mlp, h), cache


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
        self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs, dtype=dtype)
                                for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, rngs=rngs, dtype=self.dtype,
                              names=("embed", "vocab"))
        self.mtp = MTPModule(config, rngs=rngs, dtype=dtype) if config.num_nextn_predict_layers > 0 else None

    # -- caches ---------------------------------------------------------------------------------

    def init_cache(self, batch_size: int, capacity: int, *, page_size: int = 64, mtp: bool = False,
                   page_table: jax.Array | None = None, row_shards: int = 1) -> PagedCache:
        """An empty cache for the target (or, with `mtp=True`, for the one-layer MTP module);
        row_shards: laid out for a mesh splitting the rows into that many blocks (`jaxspec.cache.init_cache`)."""
        c = self.config
        return init_cache(num_layers=1 if mtp else c.num_hidden_layers, batch_size=batch_size, capacity=capacity,
                          latent_dim=c.latent_dim, index_dim=c.index_head_dim if c.is_v32 else 0,
                          page_size=page_size, dtype=self.dtype, page_table=page_table, row_shards=row_shards)

    # -- forward passes -------------------------------------------------------------------------

    def _head(self, norm: RMSNorm, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, Q, D] -> (logits [B, Q, V] float32, norm(x) [B, Q, D]): `layers.head_logits`."""
        return head_logits(norm, self.lm_head, x)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: PagedCache, vis: Visibility, *,
                 form: str = "absorbed", backend: str = "auto",
                 window_invariant: bool = False) -> tuple[jax.Array, jax.Array, PagedCache]:
        """Target forward over a window.

        tokens, positions [B, Q] int32; vis: the window's visibility (`jaxspec.pallas_kernels.Visibility`)
        -> logits [B, Q, V] float32, hidden [B, Q, D] (after the final norm), the updated cache.
        window_invariant: every token's logits and hidden state are bit-identical to what the same
        token gets alone in a [B, 1] call on the same cache (`DecodeConfig.window_invariant`;
        absorbed form only).
        """
        cos, sin = rope_angles(self.config, positions)
        x = self.embed_tokens(tokens).astype(self.dtype)
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, cos, sin, cache, i, vis, form=form, backend=backend, window_invariant=window_invariant)
        logits, hidden = per_position(functools.partial(self._head, self.norm), x, enabled=window_invariant)
        return logits, hidden, cache

    def draft(self, next_tokens: jax.Array, hidden: jax.Array, positions: jax.Array, cache: PagedCache,
              vis: Visibility, *, form: str = "absorbed", backend: str = "auto"):
        """MTP forward: next_tokens [B, Q] (t_{i+1}), hidden [B, Q, D] (h_i), positions [B, Q] (i)
        -> logits [B, Q, V] float32 (for t_{i+2}), the MTP's own hidden [B, Q, D] (to chain), cache."""
        if self.mtp is None:
            raise ValueError("this model has no MTP module (config.num_nextn_predict_layers == 0)")
        mtp = self.mtp
        cos, sin = rope_angles(self.config, positions)
        embedded = mtp.enorm(self.embed_tokens(next_tokens).astype(self.dtype))
        x = mtp.eh_proj(jnp.concatenate([embedded, mtp.hnorm(hidden.astype(self.dtype))], axis=-1))
        x, cache = mtp.block(x, cos, sin, cache, 0, vis, form=form, backend=backend)
        logits, out_hidden = self._head(mtp.shared_head_norm, x)
        return logits, out_hidden, cache
