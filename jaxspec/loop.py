"""The speculative decoding loop: prefill, then steps of draft -> verify -> accept -> commit -> catch up.

Bookkeeping, per row b (n = `target_cache.lengths[b]`):

* the target cache holds the committed tokens t_0 .. t_{n-1}; `last_token` t_n is emitted but not
  yet cached (it is the first token of the next verification window);
* the MTP cache holds the same n entries: entry i is the MTP block's state for the pair
  (target hidden h_i, token t_{i+1});
* `seed_token` is the MTP's prediction of t_{n+1} (draft d_1) and `seed_hidden` the MTP hidden
  state that produced it, from which the chain continues.

One step (k = `DecodeConfig.num_draft` >= 1):

1. draft: the one MTP layer, chained k-1 times from the seed, proposes d_1 .. d_k;
2. verify: one target call over the window [t_n, d_1 .. d_k] (positions n .. n+k) gives the
   target's argmax g_0 .. g_k;
3. accept: a = the number of leading drafts with d_{j+1} == g_j; the row emits g_0 .. g_a;
4. commit: lengths += a + 1 (t_n, d_1 .. d_a were just written at slots n .. n+a); last_token = g_a;
   output tokens appended; EOS and the token budget finish rows;
5. catch up: the MTP module runs over the a+1 new pairs (h_{n+j}, g_j), overwriting its draft
   entries; its output at pair a seeds the next step's d_1.

With k = 0 there is no MTP: the window is [t_n] and each step is one plain greedy decode step.
Finished rows ride along with an empty window (query_len 0): they write nothing and change nothing.
Everything runs inside one `jax.lax.while_loop` with no host round trip.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.acceptance import greedy_accept_chain
from jaxspec.cache import PagedCache
from jaxspec.config import DecodeConfig
from jaxspec.pallas_kernels import Visibility

PAD_TOKEN = -1  # fills the output buffer past a row's last emitted token


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The loop carry. Shapes: B rows, k drafts, D hidden, N = max_new_tokens + k + 1.

    target_cache / mtp_cache: PagedCache (mtp_cache is None when k == 0).
    last_token [B]: t_n, emitted, not yet in the target cache.
    seed_token [B], seed_hidden [B, D]: the MTP's d_1 and its hidden state (zeros when k == 0).
    drafts [B, k]: the drafts verified by the latest step (for inspection and tests).
    tokens [B, N]: emitted tokens, PAD_TOKEN after `num_generated`.
    num_generated [B], done [B]: per-row progress.
    target_calls [B]: verification steps each row took part in (prefill excluded).
    accepted [B]: drafts accepted in total; position_accepts [B, k]: steps whose draft j was accepted.
    """

    target_cache: PagedCache
    mtp_cache: PagedCache | None
    last_token: jax.Array
    seed_token: jax.Array
    seed_hidden: jax.Array
    drafts: jax.Array
    tokens: jax.Array
    num_generated: jax.Array
    done: jax.Array
    target_calls: jax.Array
    accepted: jax.Array
    position_accepts: jax.Array

    def replace(self, **changes) -> "DecodeState":
        return dataclasses.replace(self, **changes)


def _argmax(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _row_gather(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, Q, ...], index [B] -> x[b, index[b]] [B, ...]."""
    return jax.vmap(lambda row, i: row[i])(x, index)


def _emit(state: DecodeState, new_tokens: jax.Array, count: jax.Array, config: DecodeConfig):
    """Append `new_tokens[b, :count[b]]` ([B, W]) to each row, cut at EOS and at the budget.

    Returns (tokens, num_generated, done).
    """
    width = new_tokens.shape[1]
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    count = jnp.minimum(count, config.max_new_tokens - state.num_generated)
    if config.eos_token_id is not None:
        is_eos = (new_tokens == config.eos_token_id) & (j < count[:, None])
        first_eos = jnp.min(jnp.where(is_eos, j, width), axis=1)
        count = jnp.minimum(count, first_eos + 1)
        hit_eos = first_eos < width
    else:
        hit_eos = jnp.zeros_like(state.done)
    dest = jnp.where(j < count[:, None], state.num_generated[:, None] + j, state.tokens.shape[1])
    rows = jnp.arange(new_tokens.shape[0])[:, None]
    tokens = state.tokens.at[rows, dest].set(new_tokens, mode="drop")
    num_generated = state.num_generated + count
    done = state.done | hit_eos | (num_generated >= config.max_new_tokens)
    return tokens, num_generated, done


def prefill(graphdef: nnx.GraphDef, params: nnx.State, prompts: jax.Array, prompt_lens: jax.Array,
            target_cache: PagedCache, mtp_cache: PagedCache | None, config: DecodeConfig) -> DecodeState:
    """Run the prompts through the target (and the MTP module) and emit the first token.

    prompts [B, P] int32 (right-padded), prompt_lens [B] int32 in [1, P]. Caches empty.
    """
    model = nnx.merge(graphdef, params)
    batch, prompt_width = prompts.shape
    k = config.num_draft
    positions = jnp.broadcast_to(jnp.arange(prompt_width, dtype=jnp.int32), (batch, prompt_width))
    vis = Visibility(prefix_len=jnp.zeros((batch,), jnp.int32), query_len=prompt_lens)
    logits, hidden, target_cache = model(prompts, positions, target_cache, vis, form="expanded",
                                         backend=config.backend)
    last = prompt_lens - 1
    first_token = _argmax(_row_gather(logits, last))
    target_cache = target_cache.replace(lengths=prompt_lens)

    seed_token = jnp.zeros((batch,), jnp.int32)
    seed_hidden = jnp.zeros((batch, hidden.shape[-1]), hidden.dtype)
    if k > 0:
        # MTP pair i is (h_i, t_{i+1}): the prompt shifted left, the first generated token last.
        shifted = jnp.concatenate([prompts[:, 1:], jnp.zeros((batch, 1), prompts.dtype)], axis=1)
        next_tokens = shifted.at[jnp.arange(batch), last].set(first_token)
        mtp_logits, mtp_hidden, mtp_cache = model.draft(next_tokens, hidden, positions, mtp_cache, vis,
                                                        form="expanded", backend=config.backend)
        mtp_cache = mtp_cache.replace(lengths=prompt_lens)
        seed_token = _argmax(_row_gather(mtp_logits, last))
        seed_hidden = _row_gather(mtp_hidden, last)

    state = DecodeState(
        target_cache=target_cache, mtp_cache=mtp_cache, last_token=first_token, seed_token=seed_token,
        seed_hidden=seed_hidden, drafts=jnp.zeros((batch, k), jnp.int32),
        tokens=jnp.full((batch, config.max_new_tokens + k + 1), PAD_TOKEN, jnp.int32),
        num_generated=jnp.zeros((batch,), jnp.int32), done=jnp.zeros((batch,), bool),
        target_calls=jnp.zeros((batch,), jnp.int32), accepted=jnp.zeros((batch,), jnp.int32),
        position_accepts=jnp.zeros((batch, k), jnp.int32))
    tokens, num_generated, done = _emit(state, first_token[:, None], jnp.ones((batch,), jnp.int32), config)
    return state.replace(tokens=tokens, num_generated=num_generated, done=done)


def draft_chain(model, state: DecodeState, config: DecodeConfig) -> tuple[jax.Array, PagedCache]:
    """d_1 .. d_k [B, k] from the seed, chaining the one MTP layer k-1 times.

    Draft j >= 2 is the MTP's prediction for the pair (its own hidden, d_{j-1}) at position
    n + j - 2; those entries go to the MTP cache past its committed length and are overwritten by
    the next catch-up.
    """
    active = ~state.done
    n = state.target_cache.lengths
    drafts = [state.seed_token]
    token, hidden, mtp_cache = state.seed_token, state.seed_hidden, state.mtp_cache
    for j in range(1, config.num_draft):
        position = n + j - 1
        vis = Visibility(prefix_len=position, query_len=active.astype(jnp.int32))
        logits, out_hidden, mtp_cache = model.draft(token[:, None], hidden[:, None], position[:, None], mtp_cache,
                                                    vis, form="absorbed", backend=config.backend)
        token, hidden = _argmax(logits[:, 0]), out_hidden[:, 0]
        drafts.append(token)
    return jnp.stack(drafts, axis=1), mtp_cache


def _step(graphdef: nnx.GraphDef, params: nnx.State, state: DecodeState, config: DecodeConfig) -> DecodeState:
    model = nnx.merge(graphdef, params)
    k = config.num_draft
    batch = state.last_token.shape[0]
    active = ~state.done
    n = state.target_cache.lengths
    window_len = jnp.where(active, k + 1, 0).astype(jnp.int32)

    # 1. draft
    mtp_cache = state.mtp_cache
    if k > 0:
        drafts, mtp_cache = draft_chain(model, state, config)
    else:
        drafts = jnp.zeros((batch, 0), jnp.int32)

    # 2. verify: one target call over [t_n, d_1 .. d_k]
    window = jnp.concatenate([state.last_token[:, None], drafts], axis=1)
    positions = n[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    vis = Visibility(prefix_len=n, query_len=window_len)
    logits, hidden, target_cache = model(window, positions, state.target_cache, vis, form="absorbed",
                                         backend=config.backend)
    target_tokens = _argmax(logits)  # g_0 .. g_k

    # 3. accept
    accepted, bonus = greedy_accept_chain(drafts, target_tokens)
    accepted = jnp.where(active, accepted, 0)

    # 4. commit
    tokens, num_generated, done = _emit(state, target_tokens, jnp.where(active, accepted + 1, 0), config)
    new_len = jnp.where(active, n + accepted + 1, n)
    target_cache = target_cache.replace(lengths=new_len)
    position_accepts = state.position_accepts + (
        (jnp.arange(k)[None, :] < accepted[:, None]) & active[:, None]).astype(jnp.int32)

    # 5. catch up: MTP over the pairs (h_{n+j}, g_j), j <= a; its output at pair a seeds d_1.
    seed_token, seed_hidden = state.seed_token, state.seed_hidden
    if k > 0:
        catch_vis = Visibility(prefix_len=n, query_len=jnp.where(active, accepted + 1, 0).astype(jnp.int32))
        mtp_logits, mtp_hidden, mtp_cache = model.draft(target_tokens, hidden, positions, mtp_cache, catch_vis,
                                                        form="absorbed", backend=config.backend)
        mtp_cache = mtp_cache.replace(lengths=new_len)
        seed_token = jnp.where(active, _argmax(_row_gather(mtp_logits, accepted)), seed_token)
        seed_hidden = jnp.where(active[:, None], _row_gather(mtp_hidden, accepted), seed_hidden)

    return state.replace(
        target_cache=target_cache, mtp_cache=mtp_cache, last_token=jnp.where(active, bonus, state.last_token),
        seed_token=seed_token, seed_hidden=seed_hidden, drafts=drafts, tokens=tokens, num_generated=num_generated,
        done=done, target_calls=state.target_calls + active.astype(jnp.int32),
        accepted=state.accepted + accepted, position_accepts=position_accepts)


def decode(graphdef: nnx.GraphDef, params: nnx.State, state: DecodeState, config: DecodeConfig) -> DecodeState:
    """Run steps in a `jax.lax.while_loop` until every row is done.

    Every step emits at least one token per active row, so `max_new_tokens` steps always suffice;
    the bound only guards against a bug turning into a hang.
    """

    def cond(carry):
        iteration, state = carry
        return jnp.any(~state.done) & (iteration < config.max_new_tokens)

    def body(carry):
        iteration, state = carry
        return iteration + 1, _step(graphdef, params, state, config)

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


_prefill_jit = jax.jit(prefill, static_argnames=("graphdef", "config"))
_step_jit = jax.jit(_step, static_argnames=("graphdef", "config"))


def init_state(model: nnx.Module, prompts, config: DecodeConfig, *, prompt_lens=None) -> DecodeState:
    """Prefill `prompts` and return the loop state after the first emitted token (jitted).

    `prompts` is a list of token-id sequences or a right-padded [B, P] array with `prompt_lens`.
    Validation and cache sizing are those of `jaxspec.generate.generate`.
    """
    from jaxspec.generate import prepare

    batch = prepare(model, prompts, config, prompt_lens=prompt_lens)
    graphdef, params = nnx.split(model)
    return _prefill_jit(graphdef, params, batch.prompts, batch.prompt_lens, batch.target_cache, batch.mtp_cache,
                        config)


def step(model: nnx.Module, state: DecodeState, config: DecodeConfig) -> DecodeState:
    """One speculative step (draft, verify, accept, commit, catch up) on every unfinished row (jitted)."""
    graphdef, params = nnx.split(model)
    return _step_jit(graphdef, params, state, config)
