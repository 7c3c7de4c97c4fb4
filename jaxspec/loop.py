"""The speculative decoding loop: prefill, then steps of draft -> verify -> accept -> commit -> catch up.

Bookkeeping, per row b (n = `target_cache.lengths[b]`):

* the target cache holds the committed tokens t_0 .. t_{n-1}; `last_token` t_n is emitted but not
  yet cached (it is the root of the next verification window);
* the MTP cache holds the same n entries: entry i is the MTP block's state for the pair
  (target hidden h_i, token t_{i+1});
* `seed_logits` are the MTP's logits for t_{n+1} (the root's children) and `seed_hidden` the MTP
  hidden state that produced them, from which drafting continues.

One step (`DecodeConfig.draft_tree`: a chain of k = num_draft drafts, or a tree of N - 1 draft
nodes and depth D; `jaxspec.drafting`):

1. draft: the MTP module fills the window [t_n, drafts] one depth at a time;
2. verify: one target call over the window, each node at position n + its depth, seeing the prefix
   and its ancestors (a tree passes the ancestor mask; dense MLA and the DSA indexer both obey it);
3. accept (`jaxspec.acceptance`): greedy (temperature 0), lossless rejection sampling (temperature
   > 0), or relaxed (opt-in, lossy) gives each row its accepted path of a drafts and a bonus token;
4. commit: a tree's accepted path is moved to the contiguous slots n .. n + a of the target cache
   (a chain's already is); lengths += a + 1; the path's tokens and the bonus are appended; EOS and
   the token budget finish rows; last_token = the bonus;
5. catch up: the MTP module runs over the a + 1 pairs (target hidden at path node j, emitted token
   j + 1), overwriting its draft entries; its output at pair a seeds the next step.

With num_draft = 0 there is no MTP: the window is [t_n] and each step is one plain decode step.
Sampling draws from one stream per row: a step's row keys are `row_keys(rng_key, s, B)` with s
the row's own step count (prefill is step 0), so a row's tokens depend on (seed, step, row) only;
on a mesh, row is the batch-wide index (`_row_keys`), so the draws do not depend on the mesh either.

With `DecodeConfig.prefill_in_loop` there is no prefill call: a row still in its prompt takes the
next D + 1 prompt tokens as its window in the same target call, commits them all, and runs the
catch-up over their pairs; the step that feeds its last prompt token emits the first token
(`_PromptWindow`). Rows in their prompts and rows decoding share every call.

On a mesh (`mesh=` of `init_state` / `step`, `jaxspec.generation.generate`) the same functions run
inside one `jax.shard_map` (`on_mesh`): each device decodes its own rows with its own share of
the caches, the routed experts exchange tokens inside the MoE, and the while loop stops when no
row of any device is left (`jaxspec.sharding.any_row`), so all devices take the same steps.
Finished rows ride along with an empty window (query_len 0): they write nothing and change nothing.
Everything runs inside one `jax.lax.while_loop`: no host code runs between steps (on a GPU, XLA's
runtime reads the loop's one-byte predicate once a step before it launches the next: docs/aot.md#loops).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.acceptance import (TreeAcceptance, emitted_tokens, greedy_accept_chain, greedy_accept_tree,
                                relaxed_accept_chain, relaxed_accept_tree, speculative_sample_chain,
                                speculative_sample_tree)
from jaxspec.batch import PreparedBatch, prepare
from jaxspec.decode_config import DecodeConfig
from jaxspec.drafting import Draft, draft
from jaxspec.models.interface import DecodeCache, DecoderModel, window_rows
from jaxspec.pallas_kernels import Visibility
from jaxspec.sampling import SamplingParams, base_key, processed_probs, row_keys, sample_tokens, sampling_params
from jaxspec.sharding import (DEFAULT_PLAN, any_row, cache_specs, on_mesh, param_specs, put,
                              row_block, row_spec, shard_params)
from jaxspec.trees import compact_slots

PAD_TOKEN = -1  # fills the output buffer past a row's last emitted token


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The loop carry. Shapes: B rows, N window nodes, D the tree's depth (k for a chain), H hidden,
    V vocabulary, T = the program's budget + D + 1 (`max_new_tokens`, or its bucket:
    `DecodeConfig.buckets`).

    target_cache / mtp_cache: the model's `DecodeCache`s (mtp_cache is None without drafts).
    last_token [B]: t_n, emitted, not yet in the target cache.
    seed_logits [B, V], seed_hidden [B, H]: the MTP's output for t_{n+1} (zeros without drafts).
    drafts [B, N - 1]: the draft nodes verified by the latest step, in window order (for
      inspection and tests).
    tokens [B, T]: emitted tokens, PAD_TOKEN after `num_generated`.
    num_generated [B], done [B]: per-row progress.
    target_calls [B]: verification steps each row took part in (prefill excluded).
    accepted [B]: drafts accepted in total; position_accepts [B, D]: steps whose accepted path
      reached depth j + 1 (for a chain: whose draft j was accepted).
    rng_key: the base PRNG key; steps []: loop iterations taken.
    sampling: the rows' settings (`jaxspec.sampling.SamplingParams`, each [B]): values the program
      reads at run time, not constants compiled into it, so one program serves every temperature
      > 0, top-k and top-p (unread when greedy) and every budget up to its buffer's: a row stops
      at its `max_new_tokens` (`DecodeConfig.program_config`).
    config: the `DecodeConfig` the state decodes with, as its programs take it
      (`DecodeConfig.program_config`: its budget the token buffer's, its sampling values
      placeholders; the rows' own are `sampling`). Static: part of the state's tree structure, not
      an array, so `step` needs no config and refuses one that would decode otherwise.
    prompts [B, P] int32, prompt_lens [B] int32: with `DecodeConfig.prefill_in_loop`, the prompts
      the loop feeds through its own calls, P their padded width (`jaxspec.batch.prompt_bucket`; a
      row is in its prompt while its target cache holds fewer than prompt_lens[b] tokens); None
      otherwise.
    mesh / plan: the `jax.sharding.Mesh` and `jaxspec.sharding` plan the state's arrays are laid
      out for (`init_state`'s; `step` runs on them), None for one device. Static, as `config`.
      Inside the loop's shard_map, where the arrays are one device's block, they are None: a
      device's page tables index its own pages, so a program of the whole mesh's rows must never
      read a mesh state as one device's (its tokens were wrong, silently).
    """

    target_cache: DecodeCache
    mtp_cache: DecodeCache | None
    last_token: jax.Array
    seed_logits: jax.Array
    seed_hidden: jax.Array
    drafts: jax.Array
    tokens: jax.Array
    num_generated: jax.Array
    done: jax.Array
    target_calls: jax.Array
    accepted: jax.Array
    position_accepts: jax.Array
    rng_key: jax.Array
    steps: jax.Array
    sampling: SamplingParams
    config: DecodeConfig = dataclasses.field(metadata=dict(static=True))
    prompts: jax.Array | None = None
    prompt_lens: jax.Array | None = None
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))
    plan: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    def replace(self, **changes) -> "DecodeState":
        return dataclasses.replace(self, **changes)


def _argmax(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _row_keys(rng_key: jax.Array, step: jax.Array | int, batch: int) -> jax.Array:
    """[batch] keys of this device's rows at `step` ([] or each row's own, [batch]): `row_keys` taken
    at their batch-wide indices, so a row's stream is the same on one device and on any mesh."""
    block = row_block(batch)
    return row_keys(rng_key, step, batch, rows=None if block is None else block[0])


def row_sampling(config: DecodeConfig, batch: int, mesh: Mesh | None = None, plan: str = DEFAULT_PLAN
                 ) -> SamplingParams:
    """`config`'s temperature, top-k, top-p and max_new_tokens for each of `batch` rows ([B] arrays;
    on `mesh` split by rows under `plan`): the runtime argument that goes with
    `config.program_config(...)`."""
    sampling = sampling_params(batch, config.temperature, config.top_k, config.top_p, config.max_new_tokens)
    if mesh is None:
        return sampling
    rows = NamedSharding(mesh, row_spec(plan))
    return jax.tree.map(lambda values: put(values, rows), sampling)


def program_inputs(config: DecodeConfig, batch: PreparedBatch, mesh: Mesh | None = None, plan: str = DEFAULT_PLAN
                   ) -> tuple[DecodeConfig, SamplingParams]:
    """What a generate or prefill program of `batch` takes besides its arrays, as one pair, so the
    two never drift apart: its static config, built for the batch's budget bucket with the values
    it reads at run time normalized (`DecodeConfig.program_config`), and those values for each of
    the batch's rows (`row_sampling`)."""
    return (config.program_config(batch.max_new_tokens),
            row_sampling(config, batch.prompts.shape[0], mesh, plan))


def _emit(state: DecodeState, new_tokens: jax.Array, count: jax.Array, config: DecodeConfig):
    """Append `new_tokens[b, :count[b]]` ([B, W]) to each row, cut at EOS and at the row's budget
    (`state.sampling.max_new_tokens`: at most the buffer's, `DecodeConfig.program_config`).

    Returns (tokens, num_generated, done).
    """
    width = new_tokens.shape[1]
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    budget = state.sampling.max_new_tokens
    count = jnp.minimum(count, budget - state.num_generated)
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
    done = state.done | hit_eos | (num_generated >= budget)
    return tokens, num_generated, done


def _first_token(last_logits: jax.Array, keys: jax.Array, config: DecodeConfig, sampling: SamplingParams
                 ) -> jax.Array:
    """The token after each row's prompt from the target's logits there ([B, V] -> [B]): argmax, or
    a draw with `keys` [B] (step 0 of the rows' streams) under the rows' `sampling`."""
    if config.temperature > 0:
        return sample_tokens(keys, processed_probs(last_logits, sampling))
    return _argmax(last_logits)


def _prefill_one_call(graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key,
                      config: DecodeConfig, sampling: SamplingParams):
    """The whole padded prompt [B, P] in one target call (expanded attention form), then one MTP
    call over its pairs -> (first_token [B], seed_logits [B, V], seed_hidden [B, H], caches);
    seeds are zeros without drafts."""
    model = nnx.merge(graphdef, params)
    batch, prompt_width = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(prompt_width, dtype=jnp.int32), (batch, prompt_width))
    vis = Visibility(prefix_len=jnp.zeros((batch,), jnp.int32), query_len=prompt_lens)
    last = prompt_lens - 1
    logits, hidden, target_cache = model(prompts, positions, target_cache, vis, form="expanded",
                                         backend=config.backend, unroll_layers=config.unroll_layers,
                                         logits_at=last[:, None])
    last_logits = logits[:, 0]
    first_token = _first_token(last_logits, _row_keys(rng_key, 0, batch), config, sampling)

    seed_logits = jnp.zeros_like(last_logits)
    seed_hidden = jnp.zeros((batch, hidden.shape[-1]), hidden.dtype)
    if config.draft_tree is not None:
        # MTP pair i is (h_i, t_{i+1}): the prompt shifted left, the first generated token last.
        shifted = jnp.concatenate([prompts[:, 1:], jnp.zeros((batch, 1), prompts.dtype)], axis=1)
        next_tokens = shifted.at[jnp.arange(batch), last].set(first_token)
        mtp_logits, mtp_hidden, mtp_cache = model.draft(next_tokens, hidden, positions, mtp_cache, vis,
                                                        form="expanded", backend=config.backend,
                                                        logits_at=last[:, None])
        seed_logits = mtp_logits[:, 0]
        seed_hidden = window_rows(mtp_hidden, last[:, None])[:, 0]
    return first_token, seed_logits, seed_hidden, target_cache, mtp_cache


def _chunk_visibility(start: jax.Array, ends: jax.Array, chunk: int) -> Visibility:
    """The chunk of positions [start, start + chunk) of rows whose tokens end at `ends` [B]
    (exclusive): each row sees what it committed before the chunk and writes its tokens in it;
    a row whose tokens ended before the chunk has query_len 0 (writes nothing)."""
    return Visibility(prefix_len=jnp.minimum(ends, start), query_len=jnp.clip(ends - start, 0, chunk))


def _prefill_chunked(graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key,
                     config: DecodeConfig, sampling: SamplingParams):
    """`_prefill_one_call`'s results from ceil(P / C) calls of C = `config.prefill_width(P)` tokens.

    Chunk j (a `jax.lax.fori_loop`, so the program holds one [B, C] target call and one MTP call)
    runs positions [jC, (j + 1) C) through the target (absorbed form, window-invariant when the
    config says so), keeps the logits and hidden state of each row's last prompt position when the
    chunk holds it (the target computes that position's logits only: `logits_at`), and runs the MTP over the chunk's pairs (h_i, t_{i+1}) for every i below the
    row's last position. The last pair needs the first generated token, known after the loop: one
    width-1 MTP call (h_last, first token) at the last position completes the MTP cache and gives
    the seeds.
    """
    batch, prompt_width = prompts.shape
    chunk = config.prefill_width(prompt_width)
    num_chunks = -(-prompt_width // chunk)
    drafting = config.draft_tree is not None
    # Padded to whole chunks plus one column: the MTP's pair i reads token i + 1.
    tokens = jnp.pad(prompts, ((0, 0), (0, num_chunks * chunk + 1 - prompt_width)))
    last = prompt_lens - 1
    offsets = jnp.arange(chunk, dtype=jnp.int32)

    def run_chunk(j, index, target_cache, mtp_cache):
        """Chunk j through the target and the MTP -> (logits [B, 1, V] at each row's chunk position
        `index` [B], hidden [B, C, H], caches)."""
        model = nnx.merge(graphdef, params)
        start = j * chunk
        positions = jnp.broadcast_to(start + offsets, (batch, chunk))
        logits, hidden, target_cache = model(
            jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1), positions, target_cache,
            _chunk_visibility(start, prompt_lens, chunk), form="absorbed", backend=config.backend,
            window_invariant=config.window_invariant, unroll_layers=config.unroll_layers,
            logits_at=index[:, None])
        if drafting:
            _, _, mtp_cache = model.draft(jax.lax.dynamic_slice_in_dim(tokens, start + 1, chunk, axis=1), hidden,
                                          positions, mtp_cache, _chunk_visibility(start, last, chunk),
                                          form="absorbed", backend=config.backend)
        return logits, hidden, target_cache, mtp_cache

    def body(j, carry):
        last_logits, last_hidden, target_cache, mtp_cache = carry
        # Whether each row's last prompt position falls in this chunk, and where (clipped into the
        # chunk where it does not).
        here = ((last >= j * chunk) & (last < (j + 1) * chunk))[:, None]
        index = jnp.clip(last - j * chunk, 0, chunk - 1)
        logits, hidden, target_cache, mtp_cache = run_chunk(j, index, target_cache, mtp_cache)
        return (jnp.where(here, logits[:, 0], last_logits),
                jnp.where(here, window_rows(hidden, index[:, None])[:, 0], last_hidden), target_cache, mtp_cache)

    # The carried rows' shapes and dtypes are the model's outputs' (V4's hidden state is its
    # hyper-connection streams, flattened), taken from an abstract trace of one chunk.
    logits_shape, hidden_shape, _, _ = jax.eval_shape(run_chunk, 0, last, target_cache, mtp_cache)
    init = (jnp.zeros((batch, logits_shape.shape[-1]), logits_shape.dtype),
            jnp.zeros((batch, hidden_shape.shape[-1]), hidden_shape.dtype), target_cache, mtp_cache)
    last_logits, last_hidden, target_cache, mtp_cache = jax.lax.fori_loop(0, num_chunks, body, init)
    first_token = _first_token(last_logits, _row_keys(rng_key, 0, batch), config, sampling)

    seed_logits, seed_hidden = jnp.zeros_like(last_logits), jnp.zeros_like(last_hidden)
    if drafting:
        model = nnx.merge(graphdef, params)
        mtp_logits, mtp_hidden, mtp_cache = model.draft(
            first_token[:, None], last_hidden[:, None], last[:, None], mtp_cache,
            Visibility(prefix_len=last, query_len=jnp.ones_like(last)), form="absorbed", backend=config.backend)
        seed_logits, seed_hidden = mtp_logits[:, 0], mtp_hidden[:, 0]
    return first_token, seed_logits, seed_hidden, target_cache, mtp_cache


def prefill(graphdef: nnx.GraphDef, params: nnx.State, prompts: jax.Array, prompt_lens: jax.Array,
            target_cache: DecodeCache, mtp_cache: DecodeCache | None, rng_key: jax.Array,
            config: DecodeConfig, sampling: SamplingParams | None = None) -> DecodeState:
    """Run the prompts through the target (and the MTP module) and emit the first token.

    prompts [B, P] int32 (right-padded), prompt_lens [B] int32 in [1, P]. Caches empty. rng_key: the
    base PRNG key (used when sampling). sampling: the rows' sampling parameters, a runtime argument
    (`row_sampling`; the state carries them to the steps); None: `config`'s values, compiled in.
    `config.prefill_chunk` None: one call over the whole prompt
    (`_prefill_one_call`); C: calls of C tokens in a loop (`_prefill_chunked`), whose caches hold
    the same entries (up to rounding; bit for bit across chunk sizes with window_invariant).
    `config.prefill_in_loop`: no model call here; the state holds the prompts for the loop
    (`_loop_start`) and nothing is emitted yet.
    """
    batch = prompts.shape[0]
    sampling = row_sampling(config, batch) if sampling is None else sampling
    if config.prefill_in_loop:
        return _loop_start(graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, config,
                           sampling)
    run = _prefill_one_call if config.prefill_chunk is None else _prefill_chunked
    first_token, seed_logits, seed_hidden, target_cache, mtp_cache = run(
        graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, config, sampling)
    target_cache = target_cache.commit(prompt_lens)
    if mtp_cache is not None:
        mtp_cache = mtp_cache.commit(prompt_lens)

    state = _initial_state(target_cache, mtp_cache, first_token, seed_logits, seed_hidden, rng_key, sampling, config)
    tokens, num_generated, done = _emit(state, first_token[:, None], jnp.ones((batch,), jnp.int32), config)
    return state.replace(tokens=tokens, num_generated=num_generated, done=done)


def _initial_state(target_cache, mtp_cache, last_token, seed_logits, seed_hidden, rng_key,
                   sampling: SamplingParams, config: DecodeConfig, **fields) -> DecodeState:
    """A `DecodeState` before its first step: nothing emitted, no statistics; `fields` the rest."""
    batch, depth = last_token.shape[0], config.max_depth
    zeros = jnp.zeros((batch,), jnp.int32)
    return DecodeState(
        target_cache=target_cache, mtp_cache=mtp_cache, last_token=last_token, seed_logits=seed_logits,
        seed_hidden=seed_hidden, drafts=jnp.zeros((batch, config.window_size - 1), jnp.int32),
        tokens=jnp.full((batch, config.max_new_tokens + depth + 1), PAD_TOKEN, jnp.int32),
        num_generated=zeros, done=jnp.zeros((batch,), bool), target_calls=zeros, accepted=zeros,
        position_accepts=jnp.zeros((batch, depth), jnp.int32), rng_key=rng_key, steps=jnp.zeros((), jnp.int32),
        sampling=sampling, config=config, **fields)


def _loop_start(graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key,
                config: DecodeConfig, sampling: SamplingParams) -> DecodeState:
    """The state `DecodeConfig.prefill_in_loop` starts from: empty caches and the prompts, which
    the loop's steps feed through the model (`_prompt_window`). The seeds are zeros shaped as the
    outputs the step replaces them with (the catch-up MTP call's, or the target's without drafts),
    taken from an abstract call: nothing runs here."""
    batch = prompts.shape[0]
    zeros = jnp.zeros((batch,), jnp.int32)
    vis = Visibility(prefix_len=zeros, query_len=zeros + 1)

    def outputs():
        model = nnx.merge(graphdef, params)
        logits, hidden, _ = model(prompts[:, :1], zeros[:, None], target_cache, vis, form="absorbed",
                                  backend=config.backend)
        if config.draft_tree is not None:
            logits, hidden, _ = model.draft(prompts[:, :1], jnp.zeros(hidden.shape, hidden.dtype), zeros[:, None],
                                            mtp_cache, vis, form="absorbed", backend=config.backend)
        return logits[:, 0], hidden[:, 0]

    logits, hidden = jax.eval_shape(outputs)
    return _initial_state(target_cache, mtp_cache, zeros, jnp.zeros(logits.shape, logits.dtype),
                          jnp.zeros(hidden.shape, hidden.dtype), rng_key, sampling, config, prompts=prompts,
                          prompt_lens=prompt_lens)


def _chain_acceptance(accepted: jax.Array, bonus: jax.Array, num_draft: int) -> TreeAcceptance:
    """A chain's (accepted [B], bonus [B]) as a TreeAcceptance: the path is nodes 0 .. accepted."""
    nodes = jnp.arange(num_draft + 1, dtype=jnp.int32)
    return TreeAcceptance(jnp.where(nodes <= accepted[:, None], nodes, -1), accepted, bonus)


def accept(window: Draft, logits: jax.Array, config: DecodeConfig, keys: jax.Array,
           params: SamplingParams) -> TreeAcceptance:
    """logits [B, N, V] (the target's output at each window node), keys [B] the step's row keys
    -> each row's accepted path (root first, [B, D + 1]), accepted count and bonus token, by the
    rule the config selects (relaxed, greedy or rejection sampling; chain or tree form)."""
    chain = window.tree_mask is None
    drafts = window.tokens[:, 1:]
    num_draft, depth = drafts.shape[1], config.max_depth
    if config.relaxed is not None:
        top_k, delta = config.relaxed
        probs = jax.nn.softmax(logits, axis=-1)  # the raw target distribution the rule is stated in
        if chain:
            return _chain_acceptance(*relaxed_accept_chain(drafts, probs, top_k, delta), num_draft)
        return relaxed_accept_tree(window.tokens, window.parents, probs, top_k, delta, depth)
    if config.temperature == 0:
        target_tokens = _argmax(logits)
        if chain:
            return _chain_acceptance(*greedy_accept_chain(drafts, target_tokens), num_draft)
        return greedy_accept_tree(window.tokens, window.parents, target_tokens, depth)
    probs = processed_probs(logits, params)
    if num_draft == 0:  # plain sampling
        return _chain_acceptance(jnp.zeros(keys.shape, jnp.int32), sample_tokens(keys, probs[:, 0]), 0)
    if chain:
        return _chain_acceptance(*speculative_sample_chain(keys, drafts, probs, window.draft_probs[:, :-1]),
                                 num_draft)
    return speculative_sample_tree(keys, window.tokens, window.parents, probs, window.draft_probs, depth)


class _PromptWindow(NamedTuple):
    """What a step feeds the rows still in their prompts (`DecodeConfig.prefill_in_loop`), D + 1
    prompt tokens per row and step (the catch-up's width). B rows, N window nodes, D depth.

    rows [B] bool: the row is in its prompt (active, fewer than prompt_lens cached).
    length [B] int32: prompt tokens fed this step (0 for the other rows).
    tokens [B, N] int32: the next prompt tokens from the committed length on (padding past `length`).
    next_tokens [B, D + 1] int32: the token after each of them (the MTP pairs' second halves),
      the first generated token's place left to the step.
    last [B] bool: this step feeds the row's last prompt token (its logits give the first token).
    """

    rows: jax.Array
    length: jax.Array
    tokens: jax.Array
    next_tokens: jax.Array
    last: jax.Array


def _prompt_window(state: DecodeState, config: DecodeConfig) -> _PromptWindow:
    """This step's `_PromptWindow` of `state` (which holds prompts: `_loop_start`)."""
    n, prompts = state.target_cache.lengths, state.prompts
    rows = ~state.done & (n < state.prompt_lens)
    length = jnp.where(rows, jnp.minimum(state.prompt_lens - n, config.max_depth + 1), 0)
    offsets = jnp.arange(max(config.window_size, config.max_depth + 2), dtype=jnp.int32)
    # Indices past the prompt read its last column: padding, which `length` keeps out of every call.
    ahead = jnp.take_along_axis(prompts, jnp.minimum(n[:, None] + offsets, prompts.shape[1] - 1), axis=1)
    return _PromptWindow(rows=rows, length=length, tokens=ahead[:, :config.window_size],
                         next_tokens=ahead[:, 1:config.max_depth + 2], last=rows & (n + length == state.prompt_lens))


def _step(graphdef: nnx.GraphDef, params: nnx.State, state: DecodeState, config: DecodeConfig) -> DecodeState:
    model = nnx.merge(graphdef, params)
    batch = state.last_token.shape[0]
    active = ~state.done
    n = state.target_cache.lengths
    sampling = state.sampling
    prompt = None if state.prompts is None else _prompt_window(state, config)
    # Rows past their prompts speculate; rows in them (prefill_in_loop) run their prompt tokens
    # through the same target and catch-up calls, and draw their first token with step 0's keys
    # (a row's step index is its own count of verification steps, so its draws do not depend on
    # when its prompt ended).
    decoding = active if prompt is None else active & ~prompt.rows
    keys = _row_keys(state.rng_key, jnp.where(decoding, state.target_calls + 1, 0), batch)

    # 1. draft (the rows in their prompts as if done: they draft nothing and write nothing)
    window = draft(model, state if prompt is None else state.replace(done=~decoding), config, keys, sampling)

    # 2. verify: one target call over the window (or the prompt tokens)
    tokens, depths, tree_mask = window.tokens, window.depths, window.tree_mask
    query_len = jnp.where(decoding, config.window_size, 0).astype(jnp.int32)
    if prompt is not None:
        tokens = jnp.where(prompt.rows[:, None], prompt.tokens, tokens)
        depths = jnp.where(prompt.rows[:, None], jnp.arange(config.window_size, dtype=jnp.int32), depths)
        if tree_mask is not None:  # prompt tokens are a chain
            tree_mask = jnp.where(prompt.rows[:, None, None], jnp.tri(config.window_size, dtype=bool), tree_mask)
        query_len = jnp.where(prompt.rows, prompt.length, query_len)
    vis = Visibility(prefix_len=n, query_len=query_len, tree_mask=tree_mask)
    logits, hidden, target_cache = model(tokens, n[:, None] + depths, state.target_cache, vis,
                                         form="absorbed", backend=config.backend,
                                         window_invariant=config.window_invariant, unroll_layers=config.unroll_layers)

    # 3. accept
    result = accept(window, logits, config, keys, sampling)
    accepted = jnp.where(decoding, result.accepted, 0)
    path_len = jnp.where(decoding, accepted + 1, 0)
    path, bonus = result.path, result.bonus
    emitted = emitted_tokens(window.tokens, result)  # [B, D + 1]: the path's drafts, the bonus, -1
    out_tokens, out_count = emitted, path_len
    if prompt is not None:
        # A prompt's tokens are all committed in window order; the step emits the first token
        # after its last one, which also completes the last MTP pair.
        last_fed = jnp.maximum(prompt.length - 1, 0)
        first = _first_token(window_rows(logits, last_fed[:, None])[:, 0], keys, config, sampling)
        node = jnp.arange(config.max_depth + 1, dtype=jnp.int32)[None, :]
        fed = node < prompt.length[:, None]
        pairs = jnp.where(prompt.last[:, None] & (node == prompt.length[:, None] - 1), first[:, None],
                          prompt.next_tokens)
        emitted = jnp.where(prompt.rows[:, None], jnp.where(fed, pairs, -1), emitted)
        path = jnp.where(prompt.rows[:, None], jnp.where(fed, node, -1), path)
        path_len = jnp.where(prompt.rows, prompt.length, path_len)
        out_tokens = jnp.where(prompt.rows[:, None], first[:, None], out_tokens)
        out_count = jnp.where(prompt.rows, prompt.last.astype(jnp.int32), out_count)
        bonus = jnp.where(prompt.rows, first, bonus)

    # 4. commit
    tokens, num_generated, done = _emit(state, out_tokens, out_count, config)
    if window.tree_mask is not None:  # a chain's path already sits at slots n .. n + a
        target_cache = target_cache.move(*compact_slots(n, path, path_len))
    new_len = n + path_len
    target_cache = target_cache.commit(new_len)
    position_accepts = state.position_accepts + (
        jnp.arange(config.max_depth)[None, :] < accepted[:, None]).astype(jnp.int32)

    # 5. catch up: MTP over the pairs (target hidden at path node j, emitted token j + 1), j <= a;
    #    its output at pair a seeds the next step.
    mtp_cache, seed_logits, seed_hidden = window.mtp_cache, state.seed_logits, state.seed_hidden
    if config.draft_tree is not None:
        path_hidden = jnp.take_along_axis(hidden, jnp.maximum(path, 0)[..., None], axis=1)
        positions = n[:, None] + jnp.arange(config.max_depth + 1, dtype=jnp.int32)[None, :]
        catch_vis = Visibility(prefix_len=n, query_len=path_len)
        last_pair = jnp.maximum(path_len - 1, 0)
        mtp_logits, mtp_hidden, mtp_cache = model.draft(jnp.maximum(emitted, 0), path_hidden, positions, mtp_cache,
                                                        catch_vis, form="absorbed", backend=config.backend,
                                                        logits_at=last_pair[:, None])
        mtp_cache = mtp_cache.commit(new_len)
        seed_logits = jnp.where(active[:, None], mtp_logits[:, 0], seed_logits)
        seed_hidden = jnp.where(active[:, None], window_rows(mtp_hidden, last_pair[:, None])[:, 0], seed_hidden)

    # A row's last token changes when it emits: a verification's bonus, or its prompt's first token.
    emits = decoding if prompt is None else decoding | prompt.last
    return state.replace(
        target_cache=target_cache, mtp_cache=mtp_cache, last_token=jnp.where(emits, bonus, state.last_token),
        seed_logits=seed_logits, seed_hidden=seed_hidden, drafts=window.tokens[:, 1:], tokens=tokens,
        num_generated=num_generated, done=done, target_calls=state.target_calls + decoding.astype(jnp.int32),
        accepted=state.accepted + accepted, position_accepts=position_accepts, steps=state.steps + 1)


def decode(graphdef: nnx.GraphDef, params: nnx.State, state: DecodeState, config: DecodeConfig) -> DecodeState:
    """Run steps in a `jax.lax.while_loop` until every row is done.

    Every step emits at least one token per active row past its prompt, so `max_new_tokens` steps
    always suffice (plus ceil(P / (D + 1)) for prompts fed through the loop); the bound only guards
    against a bug turning into a hang.
    """

    # A prompt fed through the loop takes ceil(P / (D + 1)) more steps.
    limit = config.max_new_tokens + (0 if state.prompts is None else -(-state.prompts.shape[1] // (config.max_depth + 1)))

    def cond(state):
        return any_row(~state.done) & (state.steps < limit)

    return jax.lax.while_loop(cond, lambda state: _step(graphdef, params, state, config), state)


def state_specs(target_cache: DecodeCache, mtp_cache: DecodeCache | None, config: DecodeConfig,
                plan: str = DEFAULT_PLAN) -> DecodeState:
    """The `PartitionSpec`s of a `DecodeState` of the program config `config` holding caches laid
    out as `target_cache` and `mtp_cache` (real or abstract) on a mesh under `plan`, a pytree
    prefix: every per-row array split by rows (the rows' sampling parameters too), the caches as
    they say (`jaxspec.sharding.cache_specs`), the key and step counter replicated."""
    rows = row_spec(plan)
    fields = {field.name: rows for field in dataclasses.fields(DecodeState) if not field.metadata.get("static")}
    return DecodeState(**{**fields, "target_cache": cache_specs(target_cache, plan),
                          "mtp_cache": cache_specs(mtp_cache, plan), "rng_key": PartitionSpec(),
                          "steps": PartitionSpec(), "config": config})


def retire_padding(state: DecodeState, num_rows: int) -> DecodeState:
    """`state` with the rows past `num_rows` (batch-wide index) marked done: the rows a mesh's
    batch was padded with (`jaxspec.batch.prepare`) then ride along with empty windows,
    writing nothing and never holding the loop up."""
    block = row_block(state.done.shape[0])
    if block is None:
        return state
    return state.replace(done=state.done | (block[0] >= num_rows))


def mesh_program(body, params: nnx.State, prompts: jax.Array, prompt_lens: jax.Array, target_cache: DecodeCache,
                 mtp_cache: DecodeCache | None, rng_key: jax.Array, sampling: SamplingParams, *,
                 config: DecodeConfig, mesh: Mesh, plan: str) -> DecodeState:
    """`body(params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, sampling)` ->
    DecodeState of the program config `config`, run inside the loop's shard_map on `mesh` (call it
    inside `jax.jit`): params placed by `plan`'s rules, prompts and the rows' sampling parameters
    split by rows, the caches as they say (`cache_specs`), the base PRNG key replicated; the result
    split by `state_specs`."""
    rows = row_spec(plan)
    args = (prompts, prompt_lens, target_cache, mtp_cache, rng_key, sampling)
    in_specs = (param_specs(params, plan), rows, rows, cache_specs(target_cache, plan), cache_specs(mtp_cache, plan),
                PartitionSpec(), rows)
    return on_mesh(body, mesh, plan, in_specs, state_specs(target_cache, mtp_cache, config, plan))(params, *args)


def prefill_body(graphdef, config: DecodeConfig, num_rows: int):
    """`prefill` as `mesh_program`'s body, the rows past `num_rows` (a mesh's padding) retired."""
    def body(params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, sampling):
        state = prefill(graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, config, sampling)
        return retire_padding(state, num_rows)

    return body


def _prefill_mesh(graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, sampling, config, mesh,
                  plan, num_rows):
    return mesh_program(prefill_body(graphdef, config, num_rows), params, prompts, prompt_lens, target_cache,
                        mtp_cache, rng_key, sampling, config=config, mesh=mesh, plan=plan)


def _step_mesh(graphdef, params, state, config, mesh, plan):
    specs = state_specs(state.target_cache, state.mtp_cache, state.config, plan)
    return on_mesh(lambda params, state: _step(graphdef, params, state, config), mesh, plan,
                   (param_specs(params, plan), specs), specs)(params, state)


# The caches and the loop state are donated at the jit boundary: XLA aliases them to the outputs,
# so a step updates the cache in place instead of writing a second one (`jaxspec.aot.memory`
# shows the aliased bytes). `step`'s state argument is consumed.
_prefill_jit = jax.jit(prefill, static_argnames=("graphdef", "config"), donate_argnames=("target_cache", "mtp_cache"))
_step_jit = jax.jit(_step, static_argnames=("graphdef", "config"), donate_argnames=("state",))
_MESH_STATIC = ("graphdef", "config", "mesh", "plan")
_prefill_mesh_jit = jax.jit(_prefill_mesh, static_argnames=_MESH_STATIC + ("num_rows",),
                            donate_argnames=("target_cache", "mtp_cache"))
_step_mesh_jit = jax.jit(_step_mesh, static_argnames=_MESH_STATIC, donate_argnames=("state",))


def init_state(model: DecoderModel, prompts, config: DecodeConfig, *, prompt_lens=None, key=0,
               mesh: Mesh | None = None, plan: str = DEFAULT_PLAN) -> DecodeState:
    """Prefill `prompts` and return the loop state after the first emitted token (jitted).

    `prompts` is a list of token-id sequences or a right-padded [B, P] array with `prompt_lens`;
    `key` an int seed or a `jax.random.key` (used when sampling). Validation and cache sizing are
    those of `jaxspec.generation.generate` (`jaxspec.batch.prepare`).

    model: a `jaxspec.models.interface.DecoderModel`; config: a `DecodeConfig`, which the state
    holds for every later `step` (`DecodeState.config`; the rows' temperature, top-k, top-p and
    budget: `DecodeState.sampling`).
    mesh / plan: run on a `jax.sharding.Mesh` with axes ("data", "model") under a
    `jaxspec.sharding` plan ("dp" or "tp"), as `generate` does; None = one device. The state holds
    them (`DecodeState.mesh` / `plan`): every `step` runs there. On a mesh the state holds B rounded
    up to a multiple of the row shards (`jaxspec.sharding.row_shards`); the rows past B are
    padding, done from the start.
    Returns a `DecodeState` (tokens [B, T] so far, T = the budget's bucket + depth + 1: the first
    `max_new_tokens` are the row's; `done` [B], statistics). Raises the ValueErrors `generate`
    raises, before tracing.
    """
    rng_key = base_key(key)
    batch = prepare(model, prompts, config, prompt_lens=prompt_lens, mesh=mesh, plan=plan)
    graphdef, params = nnx.split(model)
    args = (batch.prompts, batch.prompt_lens, batch.target_cache, batch.mtp_cache, rng_key)
    program, sampling = program_inputs(config, batch, mesh, plan)
    if mesh is None:
        return _prefill_jit(graphdef, params, *args, program, sampling)
    state = _prefill_mesh_jit(graphdef, shard_params(params, mesh, plan), *args, sampling, program, mesh, plan,
                              batch.num_rows)
    return state.replace(mesh=mesh, plan=plan)


def check_step_config(state: DecodeState, config: DecodeConfig) -> None:
    """ValueError, before tracing, where `config` would decode otherwise than the config `state`
    holds (`init_state`'s, as its programs take it: `DecodeState.config`), naming each field that
    differs. Only what a program reads at run time may differ: the budget (each row's is the
    state's, set by `init_state`) and, when sampling, temperature, top-k and top-p (the state's
    rows keep theirs)."""
    given = config.program_config(state.config.max_new_tokens)
    if given != state.config:
        differ = ", ".join(f"{field.name}={getattr(given, field.name)!r} (the state's: "
                           f"{getattr(state.config, field.name)!r})" for field in dataclasses.fields(DecodeConfig)
                           if getattr(given, field.name) != getattr(state.config, field.name))
        raise ValueError(f"config: decodes with {differ}; step takes the DecodeConfig the state's init_state "
                         "was given, or none (the state holds it)")


# `check_step_model`'s expected cache class and leading axes, by model class, config and geometry.
_CACHE_LAYOUTS: dict[tuple, tuple[type, list[int]]] = {}


def check_step_model(model: DecoderModel, state: DecodeState) -> None:
    """ValueError, before tracing, where `model` is not the model `state` was made for: another
    hidden width or vocabulary than the state's seeds, or caches of another family or depth than
    the state's (compared by class and each array's leading, layer, axis: the rest depends on the
    geometry the state's caches already have). A wrong model failed deep inside the trace."""
    hidden, vocab = state.seed_hidden.shape[-1], state.seed_logits.shape[-1]
    if (model.hidden_width, model.config.vocab_size) != (hidden, vocab):
        raise ValueError(f"model: hidden width {model.hidden_width} and vocabulary {model.config.vocab_size}, the "
                         f"state's {hidden} and {vocab}; step takes the model init_state was given")
    cache = state.target_cache
    layers = lambda c: [leaf.shape[0] for leaf in jax.tree.leaves(c) if leaf.ndim]
    key = (type(model), model.config, cache.batch_size, cache.page_size, state.config.cache_dtype)
    if key not in _CACHE_LAYOUTS:  # an abstract init_cache costs milliseconds: once, not every step
        made = jax.eval_shape(lambda: model.init_cache(cache.batch_size, cache.page_size, page_size=cache.page_size,
                                                       cache_dtype=state.config.cache_dtype))
        _CACHE_LAYOUTS[key] = (type(made), layers(made))
    kind, leading = _CACHE_LAYOUTS[key]
    if kind is not type(cache) or leading != layers(cache):
        raise ValueError(f"model: its caches are a {kind.__name__} of leading axes {leading}, the state's "
                         f"a {type(cache).__name__} of {layers(cache)}; step takes the model init_state was given")


def step(model: DecoderModel, state: DecodeState, config: DecodeConfig | None = None, *,
         mesh: Mesh | None = None, plan: str | None = None) -> DecodeState:
    """One speculative step (draft, verify, accept, commit, catch up) on every unfinished row (jitted;
    `state` is donated: its arrays are consumed, use the returned state).

    model: the model that `init_state` was given (its parameters as they are now); state:
    the `DecodeState` from `init_state` or the previous `step`, which decodes with the config it
    holds (`DecodeState.config`) on the mesh it holds (`DecodeState.mesh` / `plan`, None: one
    device); config, mesh, plan: None, or what `init_state` was given, to check (the rows' budgets
    and sampling values are the state's, set by `init_state`).
    Returns the next `DecodeState`; rows with `state.done` set are left unchanged. Loop with
    `while not state.done.all(): state = step(model, state)`, then read
    `state.tokens[b, :state.num_generated[b]]`.
    Raises ValueError, before tracing, for a config that would decode otherwise than the state's
    (`check_step_config`), a model other than the state's (`check_step_model`), or a mesh or plan
    other than the state's.
    """
    if config is not None:
        check_step_config(state, config)
    check_step_model(model, state)
    for name, given, held in (("mesh", mesh, state.mesh), ("plan", plan, state.plan)):
        if given is not None and given != held:
            made = "on one device" if state.mesh is None else f"with {name}={held!r}"
            raise ValueError(f"{name}={given!r}: the state was made {made} (init_state's) and steps there; pass "
                             f"no {name}, or the state's")
    graphdef, params = nnx.split(model)
    if state.mesh is None:
        return _step_jit(graphdef, params, state, state.config)
    # The mesh program takes the state as one device's block sees it (no mesh), then it is the
    # mesh's again.
    mesh, plan = state.mesh, state.plan
    inner = state.replace(mesh=None, plan=None)
    return _step_mesh_jit(graphdef, shard_params(params, mesh, plan), inner, state.config, mesh,
                          plan).replace(mesh=mesh, plan=plan)
