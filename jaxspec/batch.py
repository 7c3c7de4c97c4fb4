"""Preparing a batch for decoding: input checks, prompt padding, cache capacity and empty caches.

    batch = prepare(model, [[1, 2, 3], [4, 5]], DecodeConfig(num_draft=3))
    batch.prompts            # [B, P] int32, right-padded with 0
    batch.target_cache, batch.mtp_cache

`jaxspec.generation.generate` and `jaxspec.loop.init_state` run `prepare`; `jaxspec.memory_plan`
and `jaxspec.aot` size caches with the same functions, so all four agree on the geometry. Bad input
raises `ValueError` naming the argument, before anything is traced. The model is any
`jaxspec.models.interface.DecoderModel`; nothing here asks which family it is.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxspec.decode_config import DecodeConfig
from jaxspec.drafting import mtp_draft_slots
from jaxspec.models.interface import CacheGeometry, DecodeCache, DecoderModel
from jaxspec.sharding import (DEFAULT_PLAN, HEAD_AXES, cache_shardings, check_mesh, check_plan, put, row_shards,
                              row_spec)


class PreparedBatch(NamedTuple):
    prompts: jax.Array       # [B, P] int32, right-padded with 0 (on a mesh: B padded, see `prepare`)
    prompt_lens: jax.Array   # [B] int32
    target_cache: DecodeCache
    mtp_cache: DecodeCache | None
    num_rows: int            # the caller's rows: B without a mesh's padding rows
    max_new_tokens: int      # the budget the caches and the program are built for (`budget_bucket`)


# -- capacity and geometry ------------------------------------------------------------------------

def required_capacity(prompt_width: int, config: DecodeConfig) -> int:
    """Slots a row needs: the prompt, the budget and one step's writes past the last commit (the
    verification window, or the MTP's draft window when a dynamic tree's is wider)."""
    return prompt_width + config.max_new_tokens + max(config.window_size, mtp_draft_slots(config)) - 1


def default_capacity(prompt_width: int, config: DecodeConfig) -> int:
    """Slots per row when `DecodeConfig.max_cache_len` is None: whole pages for the prompt and the
    budget, plus whole pages (at least one) for one step's writes past the last commit.

    Why whole pages even for plain decoding: attention reduces over the cache's capacity, and on a
    GPU the order of that reduction depends on its length, so every draft setting whose step
    writes at most a page gets plain decoding's capacity and its rounding (docs/model-interface.md).
    """
    pages = lambda slots: -(-slots // config.page_size)
    step_slots = required_capacity(prompt_width, config) - prompt_width - config.max_new_tokens
    return (pages(prompt_width + config.max_new_tokens) + max(1, pages(step_slots))) * config.page_size


def widest_call(prompt_width: int, config: DecodeConfig) -> int:
    """The most tokens either cache sees in one call: a prefill call (the padded prompt, or one
    chunk of it with `DecodeConfig.prefill_chunk`), the verification window, the MTP's catch-up (at
    most the window) and its drafting calls (each within the `mtp_draft_slots` it writes)."""
    return max(config.prefill_width(prompt_width), config.window_size, mtp_draft_slots(config))


def cache_geometry(prompt_width: int, config: DecodeConfig, *, batch_size: int, capacity: int,
                   row_shards: int = 1) -> CacheGeometry:
    """The caches' geometry for prompts `prompt_width` wide decoded as `config` says: the widest
    call sizes bounded structures, and the verification window is the widest tree call (the
    prefill's calls are chains)."""
    return CacheGeometry(batch_size=batch_size, capacity=capacity, page_size=config.page_size,
                         max_window=widest_call(prompt_width, config), lookback=config.window_size,
                         row_shards=row_shards, cache_dtype=config.cache_dtype)


# -- checks and padding ---------------------------------------------------------------------------

def check_request(model: DecoderModel, config: DecodeConfig, *, page_table, mesh: Mesh | None, plan: str) -> None:
    """The checks that need no prompt: plan and mesh, the model's layout constraints, drafting."""
    check_plan(plan)
    if mesh is None:
        model.check_layout(head_split=1, page_table=page_table)
    else:
        check_mesh(mesh, plan)
        try:
            model.check_layout(head_split=int(np.prod([mesh.shape[axis] for axis in HEAD_AXES[plan]])),
                               page_table=page_table)
        except ValueError as error:
            raise ValueError(f"plan={plan!r} on a {dict(mesh.shape)} mesh: {error}") from None
    if mesh is not None and page_table is not None:
        raise ValueError("page_table: not supported with a mesh (each device numbers the pages of its own rows)")
    if config.draft_tree is not None and getattr(model, "mtp", None) is None:
        raise ValueError(f"{'tree' if config.tree else f'num_draft={config.num_draft}'} needs an MTP module, "
                         "but the model has none (num_nextn_predict_layers == 0); use num_draft=0")
    vocab = model.config.vocab_size
    if config.eos_token_id is not None and config.eos_token_id >= vocab:
        raise ValueError(f"DecodeConfig.eos_token_id={config.eos_token_id}: must be < vocab_size={vocab} (no row "
                         "could ever emit it)")
    if page_table is not None and (getattr(page_table, "ndim", None) != 2
                                   or not jnp.issubdtype(page_table.dtype, jnp.integer)):
        raise ValueError(f"page_table: must be a [B, M] integer array, got "
                         f"{getattr(page_table, 'dtype', type(page_table).__name__)} of shape {np.shape(page_table)}")
    if config.tree is not None and config.tree.top_k > vocab:
        raise ValueError(f"DecodeConfig.tree top_k={config.tree.top_k} exceeds the vocabulary ({vocab})")


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def pad_prompts(prompts, prompt_lens=None) -> tuple[jax.Array, jax.Array, np.ndarray | None]:
    """prompts: a sequence of token-id sequences, or a [B, P] int array with `prompt_lens` [B] (None:
    every row is P long) -> (prompts [B, P] int32 right-padded with 0, prompt_lens [B] int32, the
    lengths as numpy when they are concrete, else None). Checks shapes and lengths."""
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts: empty batch; pass at least one prompt")
        if prompt_lens is not None:
            raise ValueError("prompt_lens: only with a [B, P] array of prompts; a list's rows have their own lengths")
        rows = [_token_row(p, i) for i, p in enumerate(prompts)]
        lengths = np.array([len(r) for r in rows], np.int32)
        padded = np.zeros((len(rows), int(lengths.max())), np.int32)
        for i, r in enumerate(rows):
            padded[i, :len(r)] = r
        prompts_arr, lens_arr = jnp.asarray(padded), jnp.asarray(lengths)
    else:
        if np.ndim(prompts) != 2:
            raise ValueError(f"prompts: expected [B, P] token ids, got shape {np.shape(prompts)}")
        prompts_arr = jnp.asarray(_integers("prompts", prompts), jnp.int32)
        width = prompts_arr.shape[1]
        lens_arr = (jnp.full((prompts_arr.shape[0],), width, jnp.int32) if prompt_lens is None
                    else jnp.asarray(_integers("prompt_lens", prompt_lens), jnp.int32))
        if lens_arr.shape != (prompts_arr.shape[0],):
            raise ValueError(f"prompt_lens: expected shape ({prompts_arr.shape[0]},), got {lens_arr.shape}")
        lengths = np.asarray(lens_arr) if _is_concrete(lens_arr) else None
    width = prompts_arr.shape[1]
    if width < 1:
        raise ValueError("prompts: every prompt needs at least one token")
    if lengths is not None:
        empty = np.flatnonzero(lengths < 1)
        if empty.size:
            raise ValueError(f"prompts: row(s) {empty.tolist()} are empty; every prompt needs at least one token")
        if (lengths > width).any():
            raise ValueError(f"prompt_lens: values must be <= the padded width {width}")
    return prompts_arr, lens_arr, lengths


def _integers(name: str, values):
    """`values` (an array or nested lists) unchanged if its entries are integers that int32 holds
    (checked where concrete), else a ValueError naming `name`: a float id would be truncated and an
    id past int32 wrapped into the vocabulary, both silently."""
    if isinstance(values, jax.core.Tracer):
        if not jnp.issubdtype(values.dtype, jnp.integer):
            raise ValueError(f"{name}: must be integers, got dtype {values.dtype}")
        return values
    array = np.asarray(values)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name}: must be integers, got {array.dtype} values such as {array.reshape(-1)[:3].tolist()}")
    flat, info = array.reshape(-1), np.iinfo(np.int32)
    outside = flat[(flat < info.min) | (flat > info.max)]
    if outside.size:
        raise ValueError(f"{name}: values must fit int32, got {outside[:3].tolist()}")
    return values


def _token_row(prompt, index: int) -> np.ndarray:
    """One prompt of a list: a 1-D sequence of integer ids -> int64 [len]."""
    if np.ndim(prompt) != 1:
        raise ValueError(f"prompts[{index}]: each prompt must be a sequence of token ids (a list of lists, or a "
                         f"[B, P] array), got {'a single id' if np.ndim(prompt) == 0 else f'shape {np.shape(prompt)}'}")
    return np.asarray(_integers(f"prompts[{index}]", prompt), dtype=np.int64)


def check_token_ids(prompts: jax.Array, lengths: np.ndarray | None, vocab_size: int) -> None:
    """Every id inside a row's length is in [0, vocab_size) (skipped when prompts are traced)."""
    if not _is_concrete(prompts):
        return
    ids = np.asarray(prompts)
    width = ids.shape[1]
    mask = np.arange(width)[None, :] < (lengths[:, None] if lengths is not None else width)
    bad = ids[mask & ((ids < 0) | (ids >= vocab_size))]
    if bad.size:
        raise ValueError(f"prompts: token ids must be in [0, vocab_size={vocab_size}); got {bad[:5].tolist()}")


# The narrowest bucket: prompts of up to 16 tokens share one program, and so do budgets.
MIN_BUCKET = 16
# Past this size the buckets are its multiples: a power of two would give a long prompt up to
# twice its cache and prefill (a 70,000-token prompt 131,072 slots a row), where a multiple adds
# fewer than BUCKET_STEP slots.
BUCKET_STEP = 1024


def bucket(size: int) -> int:
    """The next power of two >= max(size, MIN_BUCKET) up to BUCKET_STEP, the next multiple of
    BUCKET_STEP past it."""
    if size <= BUCKET_STEP:
        return max(MIN_BUCKET, 1 << (size - 1).bit_length())
    return -(-size // BUCKET_STEP) * BUCKET_STEP


def _fits(prompt_width: int, config: DecodeConfig, max_positions: int, page_table: jax.Array | None) -> bool:
    """Whether the prompt, the budget and one step fit `max_positions`, `config.max_cache_len` and
    the slots of `page_table` [B, M] (when given)."""
    slots = None if page_table is None else page_table.shape[1] * config.page_size
    needed = required_capacity(prompt_width, config)
    return all(limit is None or needed <= limit for limit in (max_positions, config.max_cache_len, slots))


def prompt_bucket(width: int, config: DecodeConfig, *, max_positions: int, page_table: jax.Array | None = None
                  ) -> int:
    """The prompt width `generate` compiles for when the longest prompt has `width` tokens: with
    `config.buckets` its `bucket`, unless the bucket's prompt, budget and step no longer fit
    `max_positions`, `config.max_cache_len` or the slots of a given `page_table` [B, M];
    otherwise `width`."""
    padded = bucket(width)
    return padded if config.buckets and _fits(padded, config, max_positions, page_table) else width


def budget_bucket(prompt_width: int, config: DecodeConfig, *, max_positions: int,
                  page_table: jax.Array | None = None) -> int:
    """The token budget `generate` builds its caches and program for, prompts `prompt_width` wide
    (their bucket already): with `config.buckets` the `bucket` of `config.max_new_tokens`, unless
    the prompt, that budget and a step no longer fit (as `prompt_bucket`); otherwise
    `config.max_new_tokens`. Each row still stops at `config.max_new_tokens`, which the program
    reads at run time (`jaxspec.loop.row_sampling`)."""
    padded = config.replace(max_new_tokens=bucket(config.max_new_tokens))
    fits = config.buckets and _fits(prompt_width, padded, max_positions, page_table)
    return padded.max_new_tokens if fits else config.max_new_tokens


def row_capacity(prompt_width: int, config: DecodeConfig, *, batch_size: int, max_positions: int,
                 page_table: jax.Array | None) -> tuple[int, jax.Array | None]:
    """Slots per row (`DecodeConfig.max_cache_len`, else `default_capacity`; a given page table's
    own) and the page table cut to the batch's rows. Raises when the prompt, the budget and one
    step's writes do not fit the positions, the capacity or the page table."""
    needed = required_capacity(prompt_width, config)
    step_slots = needed - prompt_width - config.max_new_tokens
    if needed > max_positions:
        raise ValueError(f"prompt length {prompt_width} + max_new_tokens {config.max_new_tokens} + draft window "
                         f"{step_slots} = {needed} exceeds max_position_embeddings={max_positions}")
    capacity = config.max_cache_len if config.max_cache_len is not None else default_capacity(prompt_width, config)
    if capacity < needed:
        raise ValueError(f"DecodeConfig.max_cache_len={capacity} is too small: prompt length {prompt_width} + "
                         f"max_new_tokens {config.max_new_tokens} + draft window {step_slots} needs {needed} slots")
    if page_table is None:
        return capacity, None
    if batch_size > page_table.shape[0]:
        raise ValueError(f"batch size {batch_size} exceeds the cache's rows ({page_table.shape[0]} in page_table)")
    if page_table.shape[1] * config.page_size < needed:
        raise ValueError(f"page_table holds {page_table.shape[1] * config.page_size} slots per row; "
                         f"{needed} are needed")
    return page_table.shape[1] * config.page_size, page_table[:batch_size]


def pad_rows(prompts: jax.Array, prompt_lens: jax.Array, shards: int) -> tuple[jax.Array, jax.Array]:
    """B rounded up to a multiple of `shards` with one-token rows (retired after prefill,
    `jaxspec.loop.retire_padding`)."""
    batch, width = prompts.shape
    padded = -(-batch // shards) * shards
    if padded == batch:
        return prompts, prompt_lens
    return (jnp.concatenate([prompts, jnp.zeros((padded - batch, width), jnp.int32)]),
            jnp.concatenate([prompt_lens, jnp.ones((padded - batch,), jnp.int32)]))


# -- caches ---------------------------------------------------------------------------------------

def make_caches(model: DecoderModel, geometry: CacheGeometry, *, drafting: bool, page_table: jax.Array | None = None,
                mesh: Mesh | None = None, plan: str = DEFAULT_PLAN) -> tuple[DecodeCache, DecodeCache | None]:
    """Empty target and (when drafting) MTP caches of `geometry`; on a mesh created in place split
    by rows, so no device ever holds a whole cache (a mesh takes no page_table: `check_request`)."""
    if mesh is None:
        # Each cache gets its own copy of the page table: the caches are donated to the
        # computation, which must consume neither the caller's array nor one buffer twice.
        own = lambda: None if page_table is None else jnp.array(page_table, jnp.int32)
        return _empty_caches(model, geometry, drafting, own)
    graphdef, state = nnx.split(model)
    return _sharded_caches(graphdef, geometry, drafting, mesh, plan)(state)


def _empty_caches(model: DecoderModel, geometry: CacheGeometry, drafting: bool, page_table=lambda: None):
    """(target cache, MTP cache or None); page_table: called once per cache."""
    cache = lambda mtp: model.init_cache(geometry.batch_size, geometry.capacity, mtp=mtp, page_table=page_table(),
                                         **geometry.kwargs())
    return cache(False), cache(True) if drafting else None


@functools.lru_cache(maxsize=16)
def _sharded_caches(graphdef, geometry: CacheGeometry, drafting: bool, mesh: Mesh, plan: str):
    """The jitted program that creates the caches on `mesh`, one per model structure, geometry
    and layout, so that the next `generate` on the mesh runs it again rather than tracing and
    compiling a new one (a fresh closure a call did: 0.24 s a call on the tiny model). It takes
    the model's state only to rebuild the model; the caches read none of it, and jit drops
    unused arguments, so no parameter is copied."""

    def caches(state):
        made = _empty_caches(nnx.merge(graphdef, state), geometry, drafting)
        return jax.lax.with_sharding_constraint(made, tuple(cache_shardings(cache, mesh, plan) for cache in made))

    return jax.jit(caches)


def prepare(model: DecoderModel, prompts, config: DecodeConfig, *, prompt_lens=None,
            page_table: jax.Array | None = None, mesh: Mesh | None = None, plan: str = DEFAULT_PLAN) -> PreparedBatch:
    """Check the inputs, pad the prompts and build empty caches. Raises ValueError on bad input.

    prompts: a sequence of token-id sequences, or a [B, P] int array (then `prompt_lens` [B] gives
    each row's length; None means every row is P long); padded on the right to `prompt_bucket`'s
    width, and the caches sized for `budget_bucket`'s budget, unless traced. page_table: an optional [B, M] page layout
    for both caches (M pages per row), where the model's caches take one; by default rows get
    consecutive pages. mesh / plan: lay the batch out for a mesh (`jaxspec.sharding`): B is padded
    to a multiple of the row shards with one-token rows (retired after prefill), and the caches are
    created split by rows on the mesh, each device's page table numbering its own pages (so no
    user page_table).
    """
    check_request(model, config, page_table=page_table, mesh=mesh, plan=plan)
    prompts_arr, lens_arr, lengths = pad_prompts(prompts, prompt_lens)
    check_token_ids(prompts_arr, lengths, model.config.vocab_size)
    positions = model.config.max_position_embeddings
    budget = config.max_new_tokens
    if _is_concrete(prompts_arr):  # (a traced batch's shapes are the caller's choice)
        width = prompt_bucket(prompts_arr.shape[1], config, max_positions=positions, page_table=page_table)
        # on the host: an eager jnp.pad would compile a program for every new width
        prompts_arr = jnp.asarray(np.pad(np.asarray(prompts_arr), ((0, 0), (0, width - prompts_arr.shape[1]))))
        budget = budget_bucket(width, config, max_positions=positions, page_table=page_table)
    sized = config.replace(max_new_tokens=budget)
    batch, width = prompts_arr.shape
    capacity, page_table = row_capacity(width, sized, batch_size=batch, max_positions=positions,
                                        page_table=page_table)
    shards = row_shards(mesh, plan)
    prompts_arr, lens_arr = pad_rows(prompts_arr, lens_arr, shards)
    if mesh is not None:
        rows = NamedSharding(mesh, row_spec(plan))
        prompts_arr, lens_arr = put(prompts_arr, rows), put(lens_arr, rows)
    geometry = cache_geometry(width, sized, batch_size=prompts_arr.shape[0], capacity=capacity, row_shards=shards)
    target_cache, mtp_cache = make_caches(model, geometry, drafting=config.draft_tree is not None,
                                          page_table=page_table, mesh=mesh, plan=plan)
    return PreparedBatch(prompts_arr, lens_arr, target_cache, mtp_cache, batch, budget)
