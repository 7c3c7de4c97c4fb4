"""`generate`: prefill plus the speculative while-loop as one jitted computation, and its inputs' checks.

    result = generate(model, [[1, 2, 3], [4, 5]], DecodeConfig(num_draft=3, max_new_tokens=32))
    result.tokens            # [B, 32] emitted ids, PAD_TOKEN (-1) past each row's num_tokens
    result.mean_accepted_length, result.acceptance_per_position
    generate(model, prompts, DecodeConfig(tree="eagle", temperature=0.8, top_p=0.9), key=7)

Bad input raises `ValueError` before anything is traced: empty prompts, a prompt plus budget that
does not fit the cache (or the model's positions), draft length out of range, a model without an
MTP module asked to draft, a tree asking for more candidates than the vocabulary, more rows than a
given page table holds (bad `DecodeConfig` values already raise when it is built).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.cache import PagedCache
from jaxspec.decode_config import DecodeConfig
from jaxspec.drafting import mtp_draft_slots
from jaxspec.loop import DecodeState, decode, mesh_program, prefill, retire_padding
from jaxspec.model_config import ModelConfig
from jaxspec.sampling import base_key
from jaxspec.sharding import (DEFAULT_PLAN, HEAD_AXES, cache_shardings, check_mesh, check_plan, put, row_shards,
                              row_spec, shard_params)


class PreparedBatch(NamedTuple):
    prompts: jax.Array       # [B, P] int32, right-padded with 0 (on a mesh: B padded, see `prepare`)
    prompt_lens: jax.Array   # [B] int32
    target_cache: PagedCache
    mtp_cache: PagedCache | None
    num_rows: int            # the caller's rows: B without a mesh's padding rows


def required_capacity(prompt_width: int, config: DecodeConfig) -> int:
    """Slots a row needs: the prompt, the budget and one step's writes past the last commit (the
    verification window, or the MTP's draft window when a dynamic tree's is wider)."""
    return prompt_width + config.max_new_tokens + max(config.window_size, mtp_draft_slots(config)) - 1


def default_capacity(prompt_width: int, config: DecodeConfig) -> int:
    """Slots per row when `DecodeConfig.max_cache_len` is None: whole pages for the prompt and the
    budget, plus whole pages (at least one) for one step's writes past the last commit.

    Why whole pages for the step's writes, even for plain decoding: attention reduces over the
    cache's capacity (masked slots add exact zeros), and on a GPU the order of that reduction
    depends on its length. Sized exactly, a plain run and a k = 3 run at the same prompt and budget
    can differ by a page, and then compute even the shared prefill with a different rounding
    (issue 14: a row departing at its first token on an H100). With this rounding every draft
    setting whose step writes at most a page (chains up to k = page_size - 1, trees up to
    page_size nodes) gets the same capacity as plain decoding.
    """
    pages = lambda slots: -(-slots // config.page_size)
    step_slots = required_capacity(prompt_width, config) - prompt_width - config.max_new_tokens
    return (pages(prompt_width + config.max_new_tokens) + max(1, pages(step_slots))) * config.page_size


def ring_window(prompt_width: int, config: DecodeConfig) -> int:
    """The widest call either cache sees: a prefill call (the padded prompt, or one chunk of it with
    `DecodeConfig.prefill_chunk`), the verification window, the MTP's catch-up (at most the window)
    and its drafting calls (each within the `mtp_draft_slots` it writes past the committed length)."""
    return max(config.prefill_width(prompt_width), config.window_size, mtp_draft_slots(config))


def cache_kwargs(model_config: ModelConfig, prompt_width: int, config: DecodeConfig) -> dict:
    """Extra `init_cache` arguments by model kind. A model whose caches hold rings (DeepSeek-V4's
    sliding windows and compressor states, `jaxspec.cache_v4`) takes `max_window`, the widest call,
    and sizes its rings from it rather than from the capacity: a ring of sliding_window - 1 +
    max_window slots never lets one call overwrite what a committed query still sees; and
    `lookback`, the verification window: the widest tree call, whose committed blocks the next
    call closes (the prefill's calls are chains and close their own). Paged MLA caches
    (DeepSeek-V3) take no such argument."""
    if model_config.is_v4:
        return {"max_window": ring_window(prompt_width, config), "lookback": config.window_size}
    return {}


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def prepare(model: nnx.Module, prompts, config: DecodeConfig, *, prompt_lens=None,
            page_table: jax.Array | None = None, mesh: Mesh | None = None, plan: str = DEFAULT_PLAN) -> PreparedBatch:
    """Check the inputs, pad the prompts and build empty caches. Raises ValueError on bad input.

    prompts: a sequence of token-id sequences, or a [B, P] int array (then `prompt_lens` [B] gives
    each row's length; None means every row is P long). page_table: an optional [B, M] page layout
    for both caches (M pages per row); by default rows get consecutive pages. mesh / plan: lay the
    batch out for a mesh (`jaxspec.sharding`): B is padded to a multiple of the row shards with
    one-token rows (retired after prefill), and the caches are created split by rows on the mesh,
    each device's page table numbering its own pages (so no user page_table).
    """
    check_plan(plan)
    mconf = model.config
    if mconf.is_v4 and page_table is not None:
        raise ValueError("page_table: a DeepSeek-V4 model's caches have one page table per structure (rings sized "
                         "by the widest call, entry pools by the capacity), which one [B, M] layout cannot give; "
                         "pass None (jaxspec.cache_v4.init_v4_cache takes per-structure tables)")
    if mesh is not None:
        check_mesh(mesh, plan)
        if page_table is not None:
            raise ValueError("page_table: not supported with a mesh (each device numbers the pages of its own rows)")
        split = int(np.prod([mesh.shape[axis] for axis in HEAD_AXES[plan]]))
        if mconf.num_attention_heads % split:
            raise ValueError(f"plan={plan!r} splits attention heads {split} ways; num_attention_heads="
                             f"{mconf.num_attention_heads} is not a multiple")
        if mconf.is_v4 and mconf.o_groups % split:  # V4's grouped output projection splits by groups
            raise ValueError(f"plan={plan!r} splits attention heads {split} ways; a V4 output group spans "
                             f"several heads, so o_groups={mconf.o_groups} must be a multiple of {split}")
    if config.draft_tree is not None and getattr(model, "mtp", None) is None:
        raise ValueError(f"{'tree' if config.tree else f'num_draft={config.num_draft}'} needs an MTP module, "
                         "but the model has none (num_nextn_predict_layers == 0); use num_draft=0")
    if config.tree is not None and config.tree.top_k > mconf.vocab_size:
        raise ValueError(f"DecodeConfig.tree top_k={config.tree.top_k} exceeds the vocabulary ({mconf.vocab_size})")

    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts: empty batch; pass at least one prompt")
        rows = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
        lengths = np.array([len(r) for r in rows], np.int32)
        width = int(lengths.max())
        padded = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            padded[i, :len(r)] = r
        prompts_arr, lens_arr = jnp.asarray(padded), jnp.asarray(lengths)
    else:
        prompts_arr = jnp.asarray(prompts, jnp.int32)
        if prompts_arr.ndim != 2:
            raise ValueError(f"prompts: expected [B, P] token ids, got shape {prompts_arr.shape}")
        width = prompts_arr.shape[1]
        lens_arr = (jnp.full((prompts_arr.shape[0],), width, jnp.int32) if prompt_lens is None
                    else jnp.asarray(prompt_lens, jnp.int32))
        if lens_arr.shape != (prompts_arr.shape[0],):
            raise ValueError(f"prompt_lens: expected shape ({prompts_arr.shape[0]},), got {lens_arr.shape}")
        lengths = np.asarray(lens_arr) if _is_concrete(lens_arr) else None
    batch = prompts_arr.shape[0]
    if width < 1:
        raise ValueError("prompts: every prompt needs at least one token")

    if lengths is not None:
        empty = np.flatnonzero(lengths < 1)
        if empty.size:
            raise ValueError(f"prompts: row(s) {empty.tolist()} are empty; every prompt needs at least one token")
        if (lengths > width).any():
            raise ValueError(f"prompt_lens: values must be <= the padded width {width}")
    if _is_concrete(prompts_arr):
        ids = np.asarray(prompts_arr)
        mask = np.arange(width)[None, :] < (lengths[:, None] if lengths is not None else width)
        bad = ids[mask & ((ids < 0) | (ids >= mconf.vocab_size))]
        if bad.size:
            raise ValueError(f"prompts: token ids must be in [0, vocab_size={mconf.vocab_size}); got {bad[:5].tolist()}")

    needed = required_capacity(width, config)
    step_slots = needed - width - config.max_new_tokens
    if needed > mconf.max_position_embeddings:
        raise ValueError(f"prompt length {width} + max_new_tokens {config.max_new_tokens} + draft window "
                         f"{step_slots} = {needed} exceeds max_position_embeddings={mconf.max_position_embeddings}")
    capacity = config.max_cache_len if config.max_cache_len is not None else default_capacity(width, config)
    if capacity < needed:
        raise ValueError(f"DecodeConfig.max_cache_len={capacity} is too small: prompt length {width} + "
                         f"max_new_tokens {config.max_new_tokens} + draft window {step_slots} needs {needed} slots")
    if page_table is not None:
        rows_available = page_table.shape[0]
        if batch > rows_available:
            raise ValueError(f"batch size {batch} exceeds the cache's rows ({rows_available} in page_table)")
        page_table = page_table[:batch]
        if page_table.shape[1] * config.page_size < needed:
            raise ValueError(f"page_table holds {page_table.shape[1] * config.page_size} slots per row; "
                             f"{needed} are needed")
        capacity = page_table.shape[1] * config.page_size

    shards = row_shards(mesh, plan)
    padded = -(-batch // shards) * shards
    if padded > batch:  # padding rows: one token each, retired after prefill (`jaxspec.loop.retire_padding`)
        prompts_arr = jnp.concatenate([prompts_arr, jnp.zeros((padded - batch, width), jnp.int32)])
        lens_arr = jnp.concatenate([lens_arr, jnp.ones((padded - batch,), jnp.int32)])
    if mesh is not None:
        rows = NamedSharding(mesh, row_spec(plan))
        prompts_arr, lens_arr = put(prompts_arr, rows), put(lens_arr, rows)

    # Each cache gets its own copy of the page table: the caches are donated to the computation,
    # which must consume neither the caller's array nor one buffer twice.
    own = lambda: None if page_table is None else jnp.array(page_table, jnp.int32)

    ring_kwargs = cache_kwargs(model.config, width, config)

    def caches():
        cache = lambda mtp: model.init_cache(padded, capacity, page_size=config.page_size, mtp=mtp,
                                             page_table=own(), row_shards=shards, **ring_kwargs)
        return cache(False), cache(True) if config.draft_tree is not None else None

    if mesh is None:
        target_cache, mtp_cache = caches()
    else:  # created in place, split by rows: no device ever holds the whole cache
        target_cache, mtp_cache = jax.jit(caches, out_shardings=cache_shardings(jax.eval_shape(caches), mesh, plan))()
    return PreparedBatch(prompts_arr, lens_arr, target_cache, mtp_cache, batch)


def _generate(graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, config) -> DecodeState:
    state = prefill(graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, config)
    return decode(graphdef, params, state, config)


def _generate_mesh(graphdef, params, prompts, prompt_lens, target_cache, mtp_cache, rng_key, config, mesh, plan,
                   num_rows) -> DecodeState:
    """`_generate` inside the loop's shard_map on `mesh` (`jaxspec.loop.mesh_program`); the rows
    past `num_rows` are padding, retired after prefill."""
    def body(params, *args):
        state = retire_padding(prefill(graphdef, params, *args, config), num_rows)
        return decode(graphdef, params, state, config)

    return mesh_program(body, params, (prompts, prompt_lens, target_cache, mtp_cache, rng_key), mesh=mesh, plan=plan)


# The caches are donated: the loop updates them in place (one copy of the cache on the device).
_generate_jit = jax.jit(_generate, static_argnames=("graphdef", "config"), donate_argnames=("target_cache", "mtp_cache"))
_generate_mesh_jit = jax.jit(_generate_mesh, static_argnames=("graphdef", "config", "mesh", "plan", "num_rows"),
                             donate_argnames=("target_cache", "mtp_cache"))


def _program(graphdef, params, batch: PreparedBatch, config: DecodeConfig, mesh: Mesh | None, plan: str):
    """The jitted generate program for `batch` and its arguments: (jitted fn, args, static args)."""
    if mesh is None:
        return _generate_jit, (params,), (config,)
    return _generate_mesh_jit, (shard_params(params, mesh, plan),), (config, mesh, plan, batch.num_rows)


def _empty_cache(layout: PagedCache | None) -> PagedCache | None:
    """New empty buffers laid out as `layout` (arrays or ShapeDtypeStructs, each with its sharding
    when it has one) and a copy of its page table."""
    if layout is None:
        return None
    # device=: a sharded layout's buffers are created split (no device ever holds the whole cache).
    empty = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), layout.replace(page_table=None))
    # A V4Cache's page table is a dict of per-structure tables; a PagedCache's is one array.
    return empty.replace(page_table=jax.tree.map(jnp.array, layout.page_table))


def _layout(cache: PagedCache | None) -> PagedCache | None:
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
        """The ids row `row` emitted, without padding."""
        return np.asarray(self.tokens[row, : int(self.num_tokens[row])]).tolist()


def result_from_state(state: DecodeState, config: DecodeConfig, num_rows: int | None = None) -> GenerateResult:
    """The result of a finished loop state; num_rows: keep the first rows only (a mesh's padding dropped)."""
    rows = slice(num_rows)
    return GenerateResult(tokens=state.tokens[rows, :config.max_new_tokens], num_tokens=state.num_generated[rows],
                          target_calls=state.target_calls[rows], accepted=state.accepted[rows],
                          position_accepts=state.position_accepts[rows])


def generate(model: nnx.Module, prompts, config: DecodeConfig = DecodeConfig(), *, prompt_lens=None,
             page_table: jax.Array | None = None, key=0, mesh: Mesh | None = None,
             plan: str = DEFAULT_PLAN) -> GenerateResult:
    """Speculative decoding of `prompts` with the model's MTP module as the drafter (a chain or a
    tree, `config`).

    One jitted computation (prefill, then a `jax.lax.while_loop` of speculative steps), compiled
    once per (model structure, config, prompt width, batch size). Inside a user's `jax.jit`, pass
    `prompts` as a [B, P] array (with `prompt_lens`); the checks that need concrete values are
    then skipped. With temperature 0 the output equals plain greedy decoding (`num_draft=0`) token
    for token; with temperature > 0 it is distributed as plain sampling's. `key` (an int seed or a
    `jax.random.key`) is a runtime argument: changing it does not recompile. Row b's draws depend
    on (key, step, b) only. Relaxed acceptance (`config.relaxed`) is the one lossy mode.

    model: a `DeepseekV3` (with an MTP module unless `config.num_draft == 0`).
    prompts: a list of B token-id sequences (lengths may differ; ids in [0, vocab_size)), or a
      right-padded [B, P] int array with `prompt_lens` [B] (None: every row is P long).
    config: a `DecodeConfig` (draft length or tree, sampling, budget, cache geometry, backend).
    page_table: optional [B', M] int32 page layout shared by the target and MTP caches (B' >= B,
      M pages of `config.page_size` slots per row); by default each row gets consecutive pages.
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
    token ids outside the vocabulary, `prompt_lens` of the wrong shape or longer than P, a prompt
    plus budget plus draft window over `max_position_embeddings` or `config.max_cache_len`, a
    `page_table` with too few rows or slots, drafting (`num_draft > 0` or a tree) with a model that
    has no MTP module, a tree whose top_k exceeds the vocabulary, a mesh without the axes
    ("data", "model"), an unknown plan, a page_table with a mesh or with a DeepSeek-V4 model.
    """
    batch = prepare(model, prompts, config, prompt_lens=prompt_lens, page_table=page_table, mesh=mesh, plan=plan)
    graphdef, params = nnx.split(model)
    fn, params, static = _program(graphdef, params, batch, config, mesh, plan)
    state = fn(graphdef, *params, batch.prompts, batch.prompt_lens, batch.target_cache, batch.mtp_cache,
               base_key(key), *static)
    return result_from_state(state, config, batch.num_rows)


def compile_generate(model: nnx.Module, prompts, config: DecodeConfig = DecodeConfig(), *, prompt_lens=None,
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
    batch = prepare(model, prompts, config, prompt_lens=prompt_lens, page_table=page_table, mesh=mesh, plan=plan)
    graphdef, params = nnx.split(model)
    rng_key = base_key(key)
    if mesh is not None:  # a compiled program takes its arguments exactly where it was compiled for
        rng_key = put(rng_key, NamedSharding(mesh, PartitionSpec()))
    fn, (params,), static = _program(graphdef, params, batch, config, mesh, plan)
    compiled = fn.lower(graphdef, params, batch.prompts, batch.prompt_lens, batch.target_cache, batch.mtp_cache,
                        rng_key, *static).compile()
    # The computation consumes (donates) its caches, so every run gets new empty ones; only their
    # layout and page tables are kept here, not a second copy of the caches.
    target_layout, mtp_layout = _layout(batch.target_cache), _layout(batch.mtp_cache)
    prompts, prompt_lens, num_rows = batch.prompts, batch.prompt_lens, batch.num_rows
    del batch

    def run() -> GenerateResult:
        return result_from_state(compiled(params, prompts, prompt_lens, _empty_cache(target_layout),
                                          _empty_cache(mtp_layout), rng_key), config, num_rows)

    return run
