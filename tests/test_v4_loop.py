"""DeepSeek-V4 through the speculative loop (`tiny-v4`, float32, xla backend): greedy speculation
equals plain greedy for chains k = 1 and 4 (every acceptance count occurring) and a dynamic tree, the
cached drafts equal a naive MTP recompute, after every commit the V4 caches' readable rows equal a
recompute from the committed tokens, finished and padding rows write nothing and stay finite,
sampling through a static tree is lossless, and the caches' rings are sized from the widest call
rather than the capacity.

The model (conftest's `trained_v4`) was trained briefly on the word language, so drafts are both
accepted and rejected. Prompts of different lengths run past the sliding window (8) and across
many CSA (m = 4) and HCA (m' = 8) blocks, so verification windows close compression blocks that
are then rejected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.batch import prepare
from jaxspec.cache import pages_per_row
from jaxspec.cache_v4 import ENTRIES, INDEX_ENTRIES, INDEX_STATE, POOL_TABLE, STATE, init_v4_cache
from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import generate
from jaxspec.loop import init_state, step
from jaxspec.model_config import CSA, SLIDING
from jaxspec.models import DeepseekV4
from jaxspec.pallas_kernels import Visibility
from jaxspec.pallas_kernels.paged import read_slots
from jaxspec.presets import preset
from jaxspec.trees import DynamicTreeSpec
from test_loop import acceptance_histogram, emitted_sequences, naive_drafts
from test_tree_decoding import HORIZON, SAMPLE_PROMPT, SAMPLING, assert_distributed_as, exact_sequence_probs

jax.config.update("jax_default_matmul_precision", "highest")

# Different lengths (2 .. 31 tokens); some are not made of the training words, so early drafts
# get rejected. With 40 new tokens every row runs well past the window and many blocks.
PROMPTS = [list(b"the quick"), list(b"fox jumps over the lazy dog and"), list(b"zq"), list(b"brown cat ov"),
           list(b"xylophone "), list(b"la")]
NEW = 40
PAGE = 8
ENTRY_SLOTS = 128  # positions whose entries `readable_rows` reads (fixed shapes; longer than any row here)


def config(k=0, **changes):
    return DecodeConfig(**{"num_draft": k, "max_new_tokens": NEW, "page_size": PAGE, "backend": "xla", **changes})


@pytest.fixture(scope="module")
def plain_tokens(trained_v4) -> np.ndarray:
    """Plain greedy decoding's tokens [rows, NEW] (k = 0), which every greedy run must equal."""
    return np.asarray(generate(trained_v4, PROMPTS, config(0)).tokens)


def assert_every_acceptance_count(result, depth: int, what: str) -> None:
    histogram = acceptance_histogram(result, depth)
    assert (histogram > 0).all(), f"{what}: steps accepting 0..{depth} drafts = {histogram.tolist()}"


# -- cache sizing ----------------------------------------------------------------------------------

def test_rings_are_sized_by_the_widest_call():
    """`generate` sizes V4 rings from the widest call (the one-call prefill, the window, the MTP's
    draft slots), not from the capacity: window ring = sliding_window - 1 + W slots in whole pages,
    projection rings 2m - 1 + 2W (CSA) and m' - 1 + 2W (HCA); the entry pages cover the capacity.
    A call re-closes blocks only as far back as the verification window (`lookback`), however
    wide the rings; a lookback beyond the rings is refused."""
    model = nnx.eval_shape(lambda: DeepseekV4(preset("tiny-v4"), rngs=nnx.Rngs(0)))  # prepare reads only its config
    cfg = model.config
    # prompt width 31 > window 4; window 4 > prompt width 2; a dynamic tree's MTP drafting writes
    # (depth - 1) * top_k = 8 slots past the committed length, more than its window (1 + budget 3).
    dynamic = DynamicTreeSpec(top_k=4, depth=3, budget=3)
    # (exact prompt widths: a bucket would widen the one-call prefill)
    for prompts, dcfg, widest in [(PROMPTS, config(3), 31), ([[1, 2]], config(3), 4),
                                  ([[1, 2]], config(1, tree=dynamic), 8)]:
        dcfg = dcfg.replace(buckets=False)
        batch = prepare(model, prompts, dcfg)
        capacity = batch.target_cache.capacity
        for cache in (batch.target_cache, batch.mtp_cache):
            slots = {name: table.shape[1] * PAGE for name, table in cache.page_table.items()}
            assert slots["window"] == PAGE * pages_per_row(cfg.sliding_window - 1 + widest, PAGE)
            assert slots["window"] < capacity
        slots = {name: table.shape[1] * PAGE for name, table in batch.target_cache.page_table.items()}
        assert slots["csa_state"] == PAGE * pages_per_row(2 * 4 - 1 + 2 * widest, PAGE)
        assert slots["hca_state"] == PAGE * pages_per_row(8 - 1 + 2 * widest, PAGE)
        assert slots["csa_entries"] >= capacity // 4 and slots["hca_entries"] >= capacity // 8
        assert set(batch.mtp_cache.page_table) == {"window"}  # the MTP block is a sliding layer
        assert batch.target_cache.lookback == dcfg.window_size
    with pytest.raises(ValueError, match=r"lookback=5: must be in \[0, max_window=4\]"):
        init_v4_cache(cfg, 1, 64, max_window=4, lookback=5)


def test_a_single_page_table_is_refused_for_v4():
    """A user page table ([B, M], one layout for every cache) cannot address V4's per-structure
    pages: `generate` refuses it before tracing, and `init_v4_cache` refuses a non-mapping table."""
    model = nnx.eval_shape(lambda: DeepseekV4(preset("tiny-v4"), rngs=nnx.Rngs(0)))  # refused before params are read
    with pytest.raises(ValueError, match="page_table: a DeepSeek-V4 model's caches"):
        generate(model, [[1, 2]], config(1), page_table=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="page_table: must be a mapping"):
        init_v4_cache(model.config, 1, 64, max_window=4, page_table=jnp.zeros((1, 8), jnp.int32))


# -- greedy losslessness ---------------------------------------------------------------------------

# EAGLE-2 top-2 children of the 2 best frontier nodes, depth 3, 4 nodes kept: its MTP drafts two
# candidates per level into the V4 caches. Wider trees (3,3,6) hold the next three tokens almost
# every step on this model, so shorter accepted paths would not all occur.
V4_DYNAMIC = "2,3,4"


def test_greedy_speculative_equals_plain(trained_v4, plain_tokens):
    """The chain k = 1 and a dynamic tree emit plain greedy's tokens, with every acceptance count
    0..1 occurring for the chain and every accepted path length 1..3 for the tree (its two
    candidates per level always hold the next token here: the chain covers the all-rejected step).
    The chain prefills in chunks of 5 (`DecodeConfig.prefill_chunk`: boundaries inside CSA and HCA
    blocks and the sliding window, 2-token rows riding along empty chunks, rings sized by the chunk
    as the widest call; tests/test_chunked_prefill.py). k = 4: the stepped test below, which
    checks these tokens and every acceptance count 0..4 itself; the static tree: the sampling test."""
    for k, tree, chunk in [(1, None, 5), (1, V4_DYNAMIC, None)]:
        cfg = config(k, tree=tree, prefill_chunk=chunk)
        spec = generate(trained_v4, PROMPTS, cfg)
        np.testing.assert_array_equal(np.asarray(spec.tokens), plain_tokens,
                                      err_msg=f"k={k} tree={tree} prefill_chunk={chunk}")
        if tree is None:
            assert_every_acceptance_count(spec, k, f"k={k}")
        else:
            histogram = acceptance_histogram(spec, cfg.max_depth)
            assert (histogram[1:] > 0).all(), f"tree {tree}: steps accepting 0..3 drafts = {histogram.tolist()}"


# -- drafts, caches and finished rows, step by step -----------------------------------------------

def readable_rows(cache, lengths: np.ndarray) -> dict[str, np.ndarray]:
    """Every row b of `cache` as a later query can still read it after lengths[b] committed tokens
    (0: nothing read), every layer: window ring rows of the last sliding_window - 1 slots,
    projection rows of the blocks still to close, the compressed (and indexer) entries closed so
    far. All rows in one read per structure: read row by row, these eager reads took about a
    quarter of the stepped test's time."""
    config = preset("tiny-v4")
    rates = dict(config.compress_rates)
    lengths = np.asarray(lengths)[:, None]
    before = lambda count: jnp.asarray(np.maximum(lengths - count + np.arange(count), -1), jnp.int32)
    rows = {}
    for layer, kind in enumerate(cache.layer_types):
        rows[f"window{layer}"] = cache.read_ring("window", layer, before(config.sliding_window - 1))
        if kind == SLIDING:
            continue
        m = rates[kind]
        tail = before(2 * m - 1 if kind == CSA else m - 1)
        entries = np.arange(ENTRY_SLOTS // m)[None]
        entries = jnp.asarray(np.where(entries < lengths // m, entries, -1), jnp.int32)  # fixed shape
        names = [(STATE[kind], ENTRIES[kind])] + ([(INDEX_STATE, INDEX_ENTRIES)] if kind == CSA else [])
        for state, entry in names:
            rows[f"{state}{layer}"] = cache.read_ring(state, layer, tail)
            rows[f"{entry}{layer}"] = read_slots(*cache.layer_pages(entry, layer), entries)
    return {name: np.asarray(value) for name, value in rows.items()}


def row_pages(cache, b: int) -> list[np.ndarray]:
    """Every page row b owns, in every layer's structures."""
    return [np.asarray(getattr(cache, name)[:, cache.page_table[table][b]]) for name, table in POOL_TABLE.items()
            if getattr(cache, name) is not None]


def test_steps_draft_naively_commit_exactly_and_finished_rows_write_nothing(trained_v4, plain_tokens):
    """k = 4 stepped by hand: every step's drafts equal a from-scratch MTP recompute; after every
    commit the target cache's readable rows (every layer: window ring, projection rings, CSA / HCA
    / indexer entries) equal a fresh prefill of the committed tokens, also after windows of 5
    tokens that close two CSA blocks in one call; rows that finished (at different steps: their
    budgets run out after different acceptances) change none of their pages in either cache while
    the others go on; nothing in the state is NaN; the tokens equal plain greedy's, with every
    acceptance count 0..4. (`generate`'s loop body is this `step`, so this is the k = 4 chain's
    losslessness check.)"""
    k = 4
    cfg = config(k)
    width = max(map(len, PROMPTS)) + NEW + k + 1
    graphdef, params = nnx.split(trained_v4)

    @jax.jit
    def recompute(params, tokens, lens):
        model = nnx.merge(graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
        cache = model.init_cache(tokens.shape[0], width, page_size=PAGE)
        vis = Visibility(jnp.zeros(lens.shape, jnp.int32), lens)
        return model(tokens, positions, cache, vis, form="expanded", backend="xla")[2]

    state = init_state(trained_v4, PROMPTS, cfg)
    checked, finished_at = 0, {}
    while not bool(np.all(state.done)):
        sequences = emitted_sequences(PROMPTS, state)
        active = ~np.asarray(state.done)
        expected = naive_drafts(trained_v4, sequences, k, width)
        before = {b: row_pages(state.target_cache, b) + row_pages(state.mtp_cache, b)
                  for b in np.flatnonzero(~active)}
        state = step(trained_v4, state, cfg)
        np.testing.assert_array_equal(np.asarray(state.drafts)[active], expected[active])
        checked += int(active.sum())
        for b, pages in before.items():
            for old, new in zip(pages, row_pages(state.target_cache, b) + row_pages(state.mtp_cache, b)):
                np.testing.assert_array_equal(new, old, err_msg=f"finished row {b} wrote")
        for leaf in jax.tree.leaves(state):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                assert np.isfinite(np.asarray(leaf)).all()

        # Rows still going: their cache holds every emitted token but the last (a row that just
        # finished may hold accepted drafts past its budget, which it never emits).
        going = ~np.asarray(state.done)
        committed = np.asarray(state.target_cache.lengths)
        tokens = np.zeros((len(PROMPTS), width), np.int32)
        emitted = emitted_sequences(PROMPTS, state)
        for b in np.flatnonzero(going):
            seq = emitted[b]
            assert len(seq) == committed[b] + 1
            tokens[b, :committed[b]] = seq[:committed[b]]
        fresh = recompute(params, jnp.asarray(tokens), jnp.asarray(np.where(going, committed, 1), jnp.int32))
        read = np.where(going, committed, 0)
        ours, theirs = readable_rows(state.target_cache, read), readable_rows(fresh, read)
        for b in np.flatnonzero(going):
            for name in theirs:
                np.testing.assert_allclose(ours[name][b], theirs[name][b], rtol=1e-5, atol=1e-5,
                                           err_msg=f"{name} of row {b} after {committed[b]} committed")
        for b in np.flatnonzero(active & np.asarray(state.done)):
            finished_at[int(b)] = int(state.steps)
    assert checked >= 20
    assert len(set(finished_at.values())) > 1, f"rows should finish at different steps: {finished_at}"
    np.testing.assert_array_equal(np.asarray(state.tokens[:, :NEW]), plain_tokens, err_msg=f"k={k}")
    assert_every_acceptance_count(state, k, f"k={k}")


# -- sampling ----------------------------------------------------------------------------------------

# Running the rows costs more than compiling here (2048 rows: about 40 s on the suite's CPU code).
NUM_ROWS = 1024


def test_sampling_is_lossless(trained_v4):
    """1024 rows of one prompt through the static `small` tree (top-3 candidates at depths 1 and 2):
    the emitted 3-token sequences match the target's exact sampling distribution by a chi-square
    test (p > 1e-3, bins under 5 expected rows merged) and in total variation (< 0.08: for exact
    samples of this many rows from this target, 0.03 on average, 0.066 the 99.9th percentile and
    0.077 the largest of 20,000 simulated), with drafts sometimes accepted. (Chains sample
    losslessly on V3 in test_tree_decoding: chain and tree share the V4 caches' code paths, the
    tree writes more of them.)"""
    # exact sizes: buckets would pad the 1024 rows' 13-token prompt to 16 and their 3-token budget to 16
    cfg = DecodeConfig(num_draft=1, tree="small", max_new_tokens=HORIZON, page_size=PAGE, backend="xla", buckets=False,
                       **SAMPLING)
    target = exact_sequence_probs(trained_v4, SAMPLE_PROMPT, HORIZON)
    result = generate(trained_v4, [SAMPLE_PROMPT] * NUM_ROWS, cfg, key=1)
    assert_distributed_as(result, target, max_total_variation=0.08)
    assert 1.0 < result.mean_accepted_length < cfg.max_depth + 1
