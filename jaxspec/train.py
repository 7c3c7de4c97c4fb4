"""Training the target and its MTP module jointly (DeepSeek-V3 section 2.2), for small models.

    loss = CE(target logits_i, t_{i+1}) + mtp_weight * CE(MTP logits_i, t_{i+2})

The MTP module sees the target's hidden states without a stop-gradient, as DeepSeek trains it.
Sequences run through the same cached forward the decoder uses (an empty cache, the expanded MLA
form), so training and inference share one code path, on the reference ops (backend "xla": the
Pallas kernels define no gradients).

The DSA indexer's top-k selection is not differentiable, so the LM loss never reaches the indexer.
With `indexer_kl_weight > 0` it is trained as DeepSeek-V3.2 trains it (`indexer_kl_loss`): towards
the main attention's distribution, by a KL term that reaches only the indexer. Off by default, the
indexer then keeps its initial weights.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxspec.models.rope import apply_rope, rope_angles
from jaxspec.models.stack import run_layers
from jaxspec.pallas_kernels import Visibility, indexer_scores_reference, visible_mask


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def losses(model, tokens: jax.Array, *, mtp_depth: int = 1) -> tuple[jax.Array, jax.Array]:
    """tokens [B, L] int32 -> (target next-token loss, MTP loss), scalars.

    The MTP loss is DeepSeek-V3's `1/D sum_d CE_d` over `mtp_depth` = D chained applications of the
    one MTP module, each predicting the token after next from where the previous left off: depth 1
    at position p takes (the target's h_p, t_{p+1}); depth d > 1 takes (depth d-1's output hidden at
    p-1, t_{p+1}), exactly what the decoding loop feeds the module when it chains drafts 2..k. Each
    depth attends causally over its own entries (in decoding, a chained draft sees the depth-1
    entries of earlier positions), so the deeper terms are an approximation that teaches the
    module to read its own hidden states. D = 1 is plain DeepSeek-V3 MTP training.
    """
    if mtp_depth < 1:
        raise ValueError(f"mtp_depth={mtp_depth}: must be >= 1")
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    vis = Visibility(prefix_len=jnp.zeros((batch,), jnp.int32), query_len=jnp.full((batch,), length, jnp.int32))
    cache = model.init_cache(batch, length, page_size=length)
    logits, hidden, _ = model(tokens, positions, cache, vis, form="expanded", backend="xla")
    target_loss = _cross_entropy(logits[:, :-1], tokens[:, 1:])
    if model.mtp is None:
        return target_loss, jnp.zeros(())
    mtp_losses = []
    for depth in range(1, mtp_depth + 1):
        # Depth d covers positions p = d-1 .. L-2: inputs (hidden[p - d + 1 in its own array], t_{p+1}),
        # target t_{p+2} (known for p <= L-3).
        span = length - depth
        mtp_vis = vis._replace(query_len=jnp.full((batch,), span, jnp.int32))
        mtp_cache = model.init_cache(batch, span, page_size=span, mtp=True)
        mtp_logits, hidden, _ = model.draft(tokens[:, depth:], hidden[:, :span], positions[:, depth - 1:length - 1],
                                            mtp_cache, mtp_vis, form="expanded", backend="xla")
        mtp_losses.append(_cross_entropy(mtp_logits[:, :-1], tokens[:, depth + 1:]))
    return target_loss, jnp.mean(jnp.stack(mtp_losses))


def _attention_kl(attn, x: jax.Array, cos: jax.Array, sin: jax.Array, vis: Visibility) -> jax.Array:
    """One MLA layer's indexer loss. x [B, L, D]: the attention input (the layer's normed input).

    p = the layer's dense attention probabilities summed over heads and L1-normalized (the mean over
    heads), q = softmax of the indexer scores over the same visible slots; returns the mean over
    tokens of KL(p || q). p and the indexer's inputs are gradient-stopped (DeepSeek-V3.2 detaches
    the indexer input), so only the indexer's own weights learn from it.
    """
    c = attn.config
    batch, length, _ = x.shape
    x = jax.lax.stop_gradient(x)
    q_latent = attn.q_a_layernorm(attn.q_a_proj(x, backend="xla"))
    q = attn.q_b_proj(q_latent, backend="xla").reshape(batch, length, c.num_attention_heads, c.qk_head_dim)
    q_rope = apply_rope(q[..., c.qk_nope_head_dim:], cos, sin, interleaved=True)
    kv = attn.kv_a_proj_with_mqa(x, backend="xla")
    latent = attn.kv_a_layernorm(kv[..., :c.kv_lora_rank])
    k_rope = apply_rope(kv[..., c.kv_lora_rank:], cos, sin, interleaved=True)
    w_uk, _ = attn._up_projections()
    scores = (jnp.einsum("bqhn,bshn->bqhs", q[..., :c.qk_nope_head_dim], jnp.einsum("bsr,rhn->bshn", latent, w_uk))
              + jnp.einsum("bqhd,bsd->bqhs", q_rope, k_rope)) * c.softmax_scale
    mask = visible_mask(vis, length, length)
    probs = jax.nn.softmax(jnp.where(mask[:, :, None, :], scores.astype(jnp.float32), -1e30), axis=-1)
    target = jax.lax.stop_gradient(jnp.mean(probs, axis=2))  # [B, L, S]

    indexer = attn.indexer
    q_idx, weights = indexer.queries(x, jax.lax.stop_gradient(q_latent), cos, sin, backend="xla")
    # One page per row: the window's keys are the whole key cache.
    page_table = jnp.arange(batch, dtype=jnp.int32)[:, None]
    index_scores = indexer_scores_reference(q_idx, weights, indexer.keys(x, cos, sin, backend="xla"), page_table, vis)
    log_q = jax.nn.log_softmax(jnp.where(mask, index_scores, -1e30), axis=-1)
    kl = jnp.where(mask, jax.scipy.special.xlogy(target, target) - target * log_q, 0.0)
    return jnp.mean(jnp.sum(kl, axis=-1))


def indexer_kl_loss(model, tokens: jax.Array) -> jax.Array:
    """tokens [B, L] int32 -> DeepSeek-V3.2's indexer loss, averaged over every DSA layer (the MTP
    block's included): KL(main attention || indexer) per token, see `_attention_kl`.

    It runs its own forward pass (expanded form, as `losses`) to reach each layer's input, and the
    MTP block sees the same pairs (h_i, t_{i+1}) as in `losses`. Needs a deepseek_v32 model.
    """
    if not model.config.is_v32:
        raise ValueError("indexer_kl_loss needs a deepseek_v32 model (one with the DSA indexer)")
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    vis = Visibility(prefix_len=jnp.zeros((batch,), jnp.int32), query_len=jnp.full((batch,), length, jnp.int32))
    cos, sin = rope_angles(model.config, positions)
    cache = model.init_cache(batch, length, page_size=length)
    x = model.embed_tokens(tokens).astype(model.dtype)
    # Each layer's loss goes into its entry of one array carried through the stacks' scans.
    kls = jnp.zeros((model.config.num_hidden_layers,), jnp.float32)
    for run in model.layer_runs:
        def body(layer, row, carry, start=run.start):
            x, cache, kls = carry
            kls = kls.at[start + row].set(_attention_kl(layer.self_attn, layer.input_layernorm(x), cos, sin, vis))
            x, cache = layer(x, cos, sin, cache, start + row, vis, form="expanded", backend="xla")
            return x, cache, kls
        x, cache, kls = run_layers(getattr(model, run.name), body, (x, cache, kls))
    layer_losses = [kls]
    if model.mtp is not None:
        mtp = model.mtp
        hidden = model.norm(x)[:, :-1]
        embedded = mtp.enorm(model.embed_tokens(tokens[:, 1:]).astype(model.dtype))
        mtp_in = mtp.eh_proj(jnp.concatenate([embedded, mtp.hnorm(hidden)], axis=-1), backend="xla")
        mtp_vis = vis._replace(query_len=vis.query_len - 1)
        layer_losses.append(_attention_kl(mtp.block.self_attn, mtp.block.input_layernorm(mtp_in),
                                          cos[:, :-1], sin[:, :-1], mtp_vis)[None])
    return jnp.mean(jnp.concatenate(layer_losses))


def train(model, batches: Iterator[np.ndarray], *, steps: int, learning_rate: float = 3e-3,
          mtp_weight: float = 0.3, warmup: int = 20, log_every: int = 0,
          log: Callable[[str], None] = print, indexer_kl_weight: float = 0.0,
          mtp_depth: int = 1) -> list[tuple[float, float]]:
    """Train `model` in place with AdamW (cosine schedule) on `steps` batches of [B, L] token ids.

    Returns the (target loss, MTP loss) of every step. With `log_every`, prints progress (losses and
    tokens/s) every that many steps. `indexer_kl_weight > 0` (deepseek_v32 models) adds
    `indexer_kl_weight * indexer_kl_loss` over the first quarter of each batch's rows (logged as `kl`),
    which trains the DSA indexer. `mtp_depth > 1` also trains the MTP module chained that many times
    (see `losses`), as decoding with k > 1 draft tokens uses it.
    """
    train_indexer = indexer_kl_weight > 0
    if train_indexer and not model.config.is_v32:
        raise ValueError("indexer_kl_weight > 0 needs a deepseek_v32 model (one with the DSA indexer)")
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, warmup + 1))
    # Integer parameters (V4's hash-routing tables `tid2eid`) are fixed: only float ones train.
    trainable = nnx.All(nnx.Param, lambda path, x: jnp.issubdtype(x.dtype, jnp.inexact))
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)),
                              wrt=trainable)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        def loss_fn(model):
            target_loss, mtp_loss = losses(model, tokens, mtp_depth=mtp_depth)
            # The indexer is small: a quarter of the rows trains it, sparing most of its extra forward pass.
            kl = indexer_kl_loss(model, tokens[:max(1, tokens.shape[0] // 4)]) if train_indexer else jnp.zeros(())
            return target_loss + mtp_weight * mtp_loss + indexer_kl_weight * kl, (target_loss, mtp_loss, kl)

        grads, aux = nnx.grad(loss_fn, argnums=nnx.DiffState(0, trainable), has_aux=True)(model)
        optimizer.update(model, grads)
        return aux

    history = []
    start, seen = time.perf_counter(), 0
    for i in range(steps):
        tokens = jnp.asarray(next(batches), jnp.int32)
        target_loss, mtp_loss, kl = train_step(model, optimizer, tokens)
        seen += tokens.size
        if log_every and ((i + 1) % log_every == 0 or i + 1 == steps):
            target_loss, mtp_loss = float(target_loss), float(mtp_loss)
            kl_text = f"  kl {float(kl):.4f}" if train_indexer else ""
            log(f"step {i + 1:5d}/{steps}  loss {target_loss:.4f}  mtp {mtp_loss:.4f}{kl_text}  "
                f"{seen / (time.perf_counter() - start):,.0f} tok/s")
        history.append((target_loss, mtp_loss))
    return [(float(a), float(b)) for a, b in history]
