"""`generate`: prefill plus the speculative while-loop as one jitted computation.

    result = generate(model, [[1, 2, 3], [4, 5]], DecodeConfig(num_draft=3, max_new_tokens=32))
    result.tokens            # [B, 32] emitted ids, PAD_TOKEN (-1) past each row's num_tokens
    result.mean_accepted_length, result.acceptance_per_position
    generate(model, prompts, DecodeConfig(tree="eagle", temperature=0.8, top_p=0.9), key=7)

Bad input raises `ValueError` before anything is traced (`jaxspec.batch.prepare`): empty prompts,
a prompt plus budget that does not fit the cache (or the model's positions), draft length out of
range, a model without an MTP module asked to draft, a tree asking for more candidates than the
vocabulary, more rows than a given page table holds (bad `DecodeConfig` values already raise when
it is built).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.batch import PreparedBatch, prepare
from jaxspec.decode_config import DecodeConfig
from jaxspec.loop import DecodeState, decode, mesh_program, prefill, prefill_body, program_inputs
from jaxspec.models.interface import DecodeCache, DecoderModel
from jaxspec.sampling import base_key
from jaxspec.sharding import DEFAULT_PLAN, put, shard_params


def _generate(graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, sampling,
              config) -> DecodeState:
    state = prefill(graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, config, sampling)
    return decode(graphdef, params, state, config)


def _generate_mesh(graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, sampling, config,
                   mesh, plan, num_rows) -> DecodeState:
    """`_generate` inside the loop's shard_map on `mesh` (`jaxspec.loop.mesh_program`); the rows
    past `num_rows` are padding, retired after prefill."""
    prefilled = prefill_body(graphdef, config, num_rows)

    def body(params, *args):
        return decode(graphdef, params, prefilled(params, *args), config)

    return mesh_program(body, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, sampling,
                        config=config, mesh=mesh, plan=plan)


# The caches are donated: the loop updates them in place (one copy of the cache on the device).
_generate_jit = jax.jit(_generate, static_argnames=("graphdef", "config"), donate_argnames=("target_cache", "mtp_cache"))
_generate_mesh_jit = jax.jit(_generate_mesh, static_argnames=("graphdef", "config", "mesh", "plan", "num_rows"),
                             donate_argnames=("target_cache", "mtp_cache"))


def _program(graphdef, params, batch: PreparedBatch, config: DecodeConfig, mesh: Mesh | None, plan: str):
    """The jitted generate program for `batch` and its arguments: (jitted fn, (params, the rows'
    sampling parameters and budgets), static args). Those values are a runtime argument; the
    program is built for the batch's budget bucket (`DecodeConfig.program_config`)."""
    program, sampling = program_inputs(config, batch, mesh, plan)
    if mesh is None:
        return _generate_jit, (params, sampling), (program,)
    return (_generate_mesh_jit, (shard_params(params, mesh, plan), sampling), (program, mesh, plan, batch.num_rows))


def _empty_cache(layout: DecodeCache | None) -> DecodeCache | None:
    """New empty buffers laid out as `layout` (arrays or ShapeDtypeStructs, each with its sharding
    when it has one) and a copy of its page table."""
    if layout is None:
        return None
    # device=: a sharded layout's buffers are created split (no device ever holds the whole cache).
    empty = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), layout.replace(page_table=None))
    # A page table may be one array or a tree of per-structure tables.
    return empty.replace(page_table=jax.tree.map(jnp.array, layout.page_table))


def _layout(cache: DecodeCache | None) -> DecodeCache | None:
    """`cache` as ShapeDtypeStructs, except its page table (kept as an array)."""
    if cache is None:
        return None
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          cache.replace(page_table=None))
    return shapes.replace(page_table=cache.page_table)


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """Emitted tokens and speculative statistics (arrays; device or host).

    tokens [B, max_new_tokens] int32, PAD_TOKEN (-1) past `num_tokens[b]`.
    target_calls [B]: verification steps per row; accepted [B]: drafts accepted per row;
    position_accepts [B, D]: steps per row whose accepted path reached depth j + 1 (D = k for a
    chain, the tree's depth for a tree; for a chain, the steps whose draft j was accepted).
    """

    tokens: jax.Array
    num_tokens: jax.Array
    target_calls: jax.Array
    accepted: jax.Array
    position_accepts: jax.Array

    @property
    def steps(self) -> int:
        """Loop iterations: the most verification steps any row took."""
        return int(np.max(self.target_calls))

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target verification call (accepted drafts + the bonus), over all rows."""
        calls = int(np.sum(self.target_calls))
        return (int(np.sum(self.accepted)) + calls) / max(calls, 1)

    @property
    def acceptance_per_position(self) -> np.ndarray:
        """[D]: fraction of verification steps whose accepted path reached depth j + 1 (for a chain:
        whose draft j, 0-based, was accepted)."""
        calls = max(int(np.sum(self.target_calls)), 1)
        return np.asarray(self.position_accepts).sum(axis=0) / calls

    def row_tokens(self, row: int) -> list[int]:
        """The ids row `row` emitted, without padding. (Read on the host: indexing the device arrays
        would compile a program for each row and length.)"""
        return np.asarray(self.tokens)[row, : int(np.asarray(self.num_tokens)[row])].tolist()


def result_from_state(state: DecodeState, config: DecodeConfig, num_rows: int | None = None) -> GenerateResult:
    """The result of a finished loop state; num_rows: keep the first rows only (a mesh's padding dropped)."""
    rows = slice(num_rows)
    return GenerateResult(tokens=state.tokens[rows, :config.max_new_tokens], num_tokens=state.num_generated[rows],
                          target_calls=state.target_calls[rows], accepted=state.accepted[rows],
                          position_accepts=state.position_accepts[rows])


def generate(model: DecoderModel, prompts, config: DecodeConfig = DecodeConfig(), *, prompt_lens=None,
             page_table: jax.Array | None = None, key=0, mesh: Mesh | None = None,
             plan: str = DEFAULT_PLAN) -> GenerateResult:
    """Speculative decoding of `prompts` with the model's MTP module as the drafter (a chain or a
    tree, `config`).

    One jitted computation (prefill, then a `jax.lax.while_loop` of speculative steps), compiled
    once per (model structure, config, prompt width, batch size), where the width is the longest
    prompt's bucket and `max_new_tokens` counts by its bucket (`DecodeConfig.buckets`), and the
    config's temperature, top_k and top_p count only as greedy or sampling
    (`DecodeConfig.program_config`). Inside a user's `jax.jit`,
    pass `prompts` as a [B, P] array (with `prompt_lens`); the checks that need concrete values
    are then skipped. With temperature 0 the output equals plain greedy decoding (`num_draft=0`) token
    for token; with temperature > 0 it is distributed as plain sampling's. `key` (an int seed or a
    `jax.random.key`) is a runtime argument: changing it does not recompile. Row b's draws depend
    on (key, step, b) only. Relaxed acceptance (`config.relaxed`) is the one lossy mode.

    model: a `jaxspec.models.interface.DecoderModel` (`DeepseekV3`, `DeepseekV4`), with an MTP
      module unless `config.num_draft == 0`.
    prompts: a list of B token-id sequences (lengths may differ; ids in [0, vocab_size)), or a
      right-padded [B, P] int array with `prompt_lens` [B] (None: every row is P long).
    config: a `DecodeConfig` (draft length or tree, sampling, budget, cache geometry, backend).
    page_table: optional [B', M] int32 page layout shared by the target and MTP caches (B' >= B,
      M pages of `config.page_size` slots per row), for a model whose caches take one (DeepSeek-V4's
      do not); by default each row gets consecutive pages.
    key: an int seed or a `jax.random.key` for sampling (ignored when greedy).
    mesh: None (one device, the default) or a `jax.sharding.Mesh` with axes ("data", "model")
      (`jaxspec.sharding.make_mesh`): the whole computation runs sharded on it, prefill and the
      while loop inside one `shard_map` with the caches split by rows and donated; any B works
      (padded to a multiple of the row shards with rows that are dropped again). Greedy output and
      a sampled run's output (same key) equal the one-device run's: row keys use batch-wide row indices.
    plan: the `jaxspec.sharding` plan on the mesh: "dp" (default; rows over all devices, attention
      replicated) or "tp" (rows over "data", attention heads over "model"); experts are split
      over all devices in both.
    Returns a `GenerateResult`: tokens [B, max_new_tokens] int32 (-1 past num_tokens[b]) and the
    per-row statistics. Raises ValueError (before tracing) for: an empty batch or an empty row,
    a prompt that is not a sequence of integer ids (a flat list of ids is one prompt per id:
    refused), token ids outside the vocabulary, `prompt_lens` with a list of prompts, of the wrong
    shape or longer than P, an `eos_token_id` outside the vocabulary, a `key` that is neither an
    int64 seed nor a PRNG key, a prompt
    plus budget plus draft window over `max_position_embeddings` or `config.max_cache_len`, a
    `page_table` that is not [B, M] integers, has too few rows or slots, or names a page twice or
    one outside the cache (checked where concrete), drafting (`num_draft > 0` or a tree) with a
    model that has no MTP module, a tree whose top_k exceeds the vocabulary, a mesh without the
    axes ("data", "model"), an unknown plan, a page_table with a mesh or with a DeepSeek-V4 model.
    """
    rng_key = base_key(key)
    batch = prepare(model, prompts, config, prompt_lens=prompt_lens, page_table=page_table, mesh=mesh, plan=plan)
    graphdef, params = nnx.split(model)
    fn, (params, sampling), static = _program(graphdef, params, batch, config, mesh, plan)
    state = fn(graphdef, params, batch.prompts, batch.prompt_lens, batch.target_cache, batch.mtp_cache,
               rng_key, sampling, *static)
    return result_from_state(state, config, batch.num_rows)


def compile_generate(model: DecoderModel, prompts, config: DecodeConfig = DecodeConfig(), *, prompt_lens=None,
                     page_table: jax.Array | None = None, key=0, mesh: Mesh | None = None,
                     plan: str = DEFAULT_PLAN) -> Callable[[], GenerateResult]:
    """`generate` for these exact inputs, compiled ahead of time: returns `run`, which only executes.

    This splits what the first `generate` call does, so a caller can time compilation apart from
    decoding: here the inputs are checked (the same `ValueError`s), prepared and compiled; each
    `run()` executes the compiled computation on that prepared batch and the model's parameters as
    they are now (later changes to the model are not seen), with no tracing, and returns the same
    result `generate` would. Its arrays are dispatched asynchronously: block on them
    (`jax.block_until_ready(result.tokens)`) before reading a clock.

    model, prompts, config, prompt_lens, page_table, key, mesh, plan: as for `generate` (and the
    same ValueErrors, raised here, before compiling). Returns `run() -> GenerateResult`.
    """
    rng_key = base_key(key)
    batch = prepare(model, prompts, config, prompt_lens=prompt_lens, page_table=page_table, mesh=mesh, plan=plan)
    graphdef, params = nnx.split(model)
    if mesh is not None:  # a compiled program takes its arguments exactly where it was compiled for
        rng_key = put(rng_key, NamedSharding(mesh, PartitionSpec()))
    fn, (params, sampling), static = _program(graphdef, params, batch, config, mesh, plan)
    compiled = fn.lower(graphdef, params, batch.prompts, batch.prompt_lens, batch.target_cache, batch.mtp_cache,
                        rng_key, sampling, *static).compile()
    # The computation consumes (donates) its caches, so every run gets new empty ones; only their
    # layout and page tables are kept here, not a second copy of the caches.
    target_layout, mtp_layout = _layout(batch.target_cache), _layout(batch.mtp_cache)
    prompts, prompt_lens, num_rows = batch.prompts, batch.prompt_lens, batch.num_rows
    del batch

    def run() -> GenerateResult:
        return result_from_state(compiled(params, prompts, prompt_lens, _empty_cache(target_layout),
                                          _empty_cache(mtp_layout), rng_key, sampling), config, num_rows)

    return run
