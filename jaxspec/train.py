"""Training the target and its MTP module jointly (DeepSeek-V3 section 2.2), for small models.

    loss = CE(target logits_i, t_{i+1}) + mtp_weight * CE(MTP logits_i, t_{i+2})

The MTP module sees the target's hidden states without a stop-gradient, as DeepSeek trains it.
Sequences run through the same cached forward the decoder uses (an empty cache, the expanded MLA
form), so training and inference share one code path. The DSA indexer's selection is not
differentiable; its weights stay as initialized (DeepSeek trains them with a separate KL loss).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxspec.pallas_kernels import Visibility


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def losses(model, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """tokens [B, L] int32 -> (target next-token loss, MTP next-next-token loss), scalars."""
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    vis = Visibility(prefix_len=jnp.zeros((batch,), jnp.int32), query_len=jnp.full((batch,), length, jnp.int32))
    cache = model.init_cache(batch, length, page_size=length)
    logits, hidden, _ = model(tokens, positions, cache, vis, form="expanded", backend="xla")
    target_loss = _cross_entropy(logits[:, :-1], tokens[:, 1:])
    if model.mtp is None:
        return target_loss, jnp.zeros(())
    mtp_vis = vis._replace(query_len=vis.query_len - 1)
    mtp_cache = model.init_cache(batch, length, page_size=length, mtp=True)
    mtp_logits, _, _ = model.draft(tokens[:, 1:], hidden[:, :-1], positions[:, :-1], mtp_cache, mtp_vis,
                                   form="expanded", backend="xla")
    return target_loss, _cross_entropy(mtp_logits[:, :-1], tokens[:, 2:])


def train(model, batches: Iterator[np.ndarray], *, steps: int, learning_rate: float = 3e-3,
          mtp_weight: float = 0.3, warmup: int = 20, log_every: int = 0,
          log: Callable[[str], None] = print) -> list[tuple[float, float]]:
    """Train `model` in place with AdamW (cosine schedule) on `steps` batches of [B, L] token ids.

    Returns the (target loss, MTP loss) of every step. With `log_every`, prints progress (losses and
    tokens/s) every that many steps.
    """
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, warmup + 1))
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)),
                              wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        def loss_fn(model):
            target_loss, mtp_loss = losses(model, tokens)
            return target_loss + mtp_weight * mtp_loss, (target_loss, mtp_loss)

        grads, aux = nnx.grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return aux

    history = []
    start, seen = time.perf_counter(), 0
    for i in range(steps):
        tokens = jnp.asarray(next(batches), jnp.int32)
        target_loss, mtp_loss = train_step(model, optimizer, tokens)
        seen += tokens.size
        if log_every and ((i + 1) % log_every == 0 or i + 1 == steps):
            target_loss, mtp_loss = float(target_loss), float(mtp_loss)
            log(f"step {i + 1:5d}/{steps}  loss {target_loss:.4f}  mtp {mtp_loss:.4f}  "
                f"{seen / (time.perf_counter() - start):,.0f} tok/s")
        history.append((target_loss, mtp_loss))
    return [(float(a), float(b)) for a, b in history]
