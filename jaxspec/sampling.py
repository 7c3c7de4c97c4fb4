"""Per-row sampling: logits processing (temperature, top-k, top-p), per-row RNG streams, draws.

Every row carries its own parameters, so greedy and sampled rows share one batch. Both the target's
and the draft's logits go through `processed_probs` with the row's parameters: the rejection
sampler (`jaxspec.acceptance`) then emits tokens distributed exactly as the processed target
distribution, whatever the draft distribution is. A row with temperature 0 is greedy: its processed
distribution is one-hot on the argmax, under which the rejection sampler reduces to greedy
acceptance.

Randomness is one stream per row: `row_keys(key, step, B)` folds the step and the row index into a
base key, so a row's draws depend on (seed, step, row) only, not on the batch around it. Consumers
fold their own stream tag into the row key (`DRAFT_STREAM`, `ACCEPT_STREAM`), so the loop passes
the same `keys [B]` to the drafter and to the acceptance step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DRAFT_STREAM = 0
ACCEPT_STREAM = 1


class SamplingParams(NamedTuple):
    """A row's generation settings that a program reads at run time: temperature [B] float32
    (<= 0: greedy), top_k [B] int32 (<= 0: off), top_p [B] float32 in (0, 1] (1: off), and (as
    vLLM's SamplingParams carries max_tokens) max_new_tokens [B] int32, the row's budget of
    generated tokens, or None where nothing decodes (the acceptance rules read only the filters).
    Filters apply in the order temperature, top-k, top-p; the top token is always kept, and tokens
    tied with the last kept logit are kept too."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    max_new_tokens: jax.Array | None = None


def sampling_params(num_rows: int, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=None) -> SamplingParams:
    """SamplingParams with each field broadcast to [num_rows] (scalars or per-row sequences)."""
    return SamplingParams(
        temperature=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (num_rows,)),
        top_k=jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (num_rows,)),
        top_p=jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (num_rows,)),
        max_new_tokens=None if max_new_tokens is None else jnp.broadcast_to(jnp.asarray(max_new_tokens, jnp.int32),
                                                                            (num_rows,)),
    )


def _filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """scaled [..., V] logits, top_k / top_p broadcastable to [..., 1] -> logits with filtered tokens
    at -inf. One descending sort serves both filters: the kept set is a prefix of it."""
    descending = jnp.sort(scaled, axis=-1, descending=True)
    rank = jnp.arange(scaled.shape[-1])
    in_top_k = (rank < top_k) | (top_k <= 0)
    sorted_probs = jax.nn.softmax(jnp.where(in_top_k, descending, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    # top_p >= 1 must keep the tail whose mass rounds away in float32 cumsums
    keep = (rank == 0) | (in_top_k & ((mass_before < top_p) | (top_p >= 1)))
    threshold = jnp.min(jnp.where(keep, descending, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def processed_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [B, ..., V] -> [B, ..., V] float32: the distribution a row samples from.

    Greedy rows get a one-hot argmax (of the raw logits). The sort behind top-k / top-p runs only
    when some row uses them."""
    per_row = lambda values: values.reshape(values.shape + (1,) * (logits.ndim - 1))
    temperature, top_k, top_p = per_row(params.temperature), per_row(params.top_k), per_row(params.top_p)
    greedy = temperature <= 0
    scaled = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, temperature)
    filtering = jnp.any(params.top_k > 0) | jnp.any(params.top_p < 1)
    scaled = jax.lax.cond(filtering, _filter_top_k_top_p, lambda scaled, *_: scaled, scaled, top_k, top_p)
    argmax = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy, argmax, jax.nn.softmax(scaled, axis=-1))


def base_key(seed_or_key) -> jax.Array:
    """An int seed (or a [] integer array, possibly traced) or a `jax.random.key` -> a PRNG key.
    Anything else, or a seed outside int64, is a ValueError naming `key` (`generate`'s argument)."""
    if isinstance(seed_or_key, jax.Array) and jnp.issubdtype(seed_or_key.dtype, jax.dtypes.prng_key):
        return seed_or_key
    integer = (isinstance(seed_or_key, (int, np.integer)) and not isinstance(seed_or_key, bool)) or (
        isinstance(seed_or_key, (jax.Array, np.ndarray)) and seed_or_key.ndim == 0
        and jnp.issubdtype(seed_or_key.dtype, jnp.integer))
    if not integer:
        raise ValueError(f"key={seed_or_key!r}: must be an int seed, a [] integer array or a jax.random.key")
    try:
        return jax.random.key(seed_or_key)
    except OverflowError:
        raise ValueError(f"key={seed_or_key}: an int seed must be in [-2**63, 2**63)") from None


def row_keys(key: jax.Array, step: jax.Array | int, num_rows: int, rows: jax.Array | None = None) -> jax.Array:
    """key (a base PRNG key), step [] int (or each row's own, [B]) -> [B] keys, one stream per
    (step, row): fold_in(fold_in(key, step), row) for rows 0 .. B - 1 (or the indices `rows` [B])."""
    rows = jnp.arange(num_rows) if rows is None else rows
    steps = jnp.broadcast_to(jnp.asarray(step), rows.shape)
    return jax.vmap(lambda step, row: jax.random.fold_in(jax.random.fold_in(key, step), row))(steps, rows)


def stream_keys(keys: jax.Array, *tags: jax.Array | int) -> jax.Array:
    """keys [B] -> [B]: each row key with `tags` folded in, for an independent sub-stream."""

    def fold(key):
        for tag in tags:
            key = jax.random.fold_in(key, tag)
        return key

    return jax.vmap(fold)(keys)


def sample_tokens(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """keys [B], probs [B, V] -> [B] int32: one draw per row (zero-probability tokens never drawn)."""
    draw = lambda key, row_probs: jax.random.categorical(key, jnp.log(row_probs))
    return jax.vmap(draw)(keys, probs).astype(jnp.int32)


def draft_candidates(
    keys: jax.Array, depth: jax.Array | int, draft_logits: jax.Array, params: SamplingParams, num_candidates: int
) -> tuple[jax.Array, jax.Array]:
    """The drafter's candidates at M nodes of one draft depth.

    keys [B] row keys, depth [] int (folded in, so each depth draws afresh), draft_logits [B, M, V]
    -> candidates [B, M, C] int32, draft_probs [B, M, V] float32 (processed).

    Greedy rows take the top-C tokens of the raw logits. Sampled rows take C independent draws from
    draft_probs: the form `speculative_sample_tree` needs when it is given `draft_probs` (with
    `draft_probs=None` it accepts any candidates, so top-C is lossless too, with fewer acceptances).
    """
    num_nodes, vocab = draft_logits.shape[1:]
    if not 1 <= num_candidates <= vocab:
        raise ValueError(f"draft_candidates: num_candidates={num_candidates} must be in [1, {vocab}]")
    draft_probs = processed_probs(draft_logits, params)
    _, top_tokens = jax.lax.top_k(draft_logits, num_candidates)

    def draw(key, row_probs):
        return jax.random.categorical(key, jnp.log(row_probs), shape=(num_candidates, num_nodes)).T

    drawn = jax.vmap(draw)(stream_keys(keys, DRAFT_STREAM, depth), draft_probs)
    greedy = (params.temperature <= 0)[:, None, None]
    return jnp.where(greedy, top_tokens, drawn).astype(jnp.int32), draft_probs
