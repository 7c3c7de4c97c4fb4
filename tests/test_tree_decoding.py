"""Trees and sampling in the decoding loop: greedy tree decoding is lossless (static and dynamic
trees, V3 and V3.2, every accepted path length), sampled decoding is distributed as the target's
own sampling (chain and dynamic tree; the static tree in test_v4_loop), a committed tree path leaves the caches as a
from-scratch recompute of the emitted tokens would, and bad decoding options are refused before
tracing."""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.batch import required_capacity
from jaxspec.cache import PagedCache, init_cache
from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import generate
from jaxspec.loop import _step as step_program, init_state, step
from jaxspec.models import DeepseekV3
from jaxspec.pallas_kernels import Visibility, read_slots
from jaxspec.presets import preset
from jaxspec.sampling import processed_probs, sampling_params
from jaxspec.trees import DynamicTreeSpec, StaticTree, compact_slots
from test_acceptance import chi_square_p_value
from test_loop import PROMPTS, acceptance_histogram, config, emitted_sequences

jax.config.update("jax_default_matmul_precision", "highest")

DYNAMIC = "3,3,6"  # EAGLE-2: top-3 children of the 3 best frontier nodes, depth 3, 6 nodes kept


@pytest.mark.parametrize("model_name", ["trained_v3", "trained_v32"])
def test_greedy_tree_decoding_equals_plain(model_name, request):
    """The static tree and a dynamic tree (V3.2), and the static tree under relaxed acceptance at
    top-1 (V3; greedy) emit plain greedy decoding's tokens, over permuted page tables, with every
    accepted path length 1..D occurring (and 0 for the dynamic tree)."""
    model = request.getfixturevalue(model_name)
    plain = np.asarray(generate(model, PROMPTS, config(0)).tokens)
    rng = np.random.default_rng(1)
    # Each case is a compile: V3.2 (DSA) gets both tree kinds with greedy acceptance; V3's dense
    # attention runs the static tree's window under relaxed top-1 acceptance (its dynamic tree runs
    # on a mesh in test_sharding, against one device).
    if model_name == "trained_v3":
        cases = {"relaxed top-1": config(3, tree="small", relaxed=(1, 0.0))}
    else:
        cases = {"small": config(3, tree="small"), "dynamic": config(3, tree=DYNAMIC)}
    for name, cfg in cases.items():
        pages = -(-required_capacity(max(map(len, PROMPTS)), cfg) // cfg.page_size)
        page_table = jnp.asarray(rng.permutation(len(PROMPTS) * pages).reshape(len(PROMPTS), pages), jnp.int32)
        result = generate(model, PROMPTS, cfg, page_table=page_table)
        np.testing.assert_array_equal(np.asarray(result.tokens), plain, err_msg=name)
        histogram = acceptance_histogram(result, cfg.max_depth)
        assert (histogram[1:] > 0).all(), f"{name}: steps accepting 0..D drafts = {histogram.tolist()}"
        # a wide static tree nearly always holds the target's next token; a pruned dynamic one misses it
        assert name != "dynamic" or histogram[0] > 0


# --- sampling is lossless ---------------------------------------------------------------------

SAMPLE_PROMPT = list(b"the lazy dog ")  # the next word is a guess: the first tokens vary
SAMPLING = dict(temperature=3.0, top_k=3, top_p=0.95)  # flat enough that all three tokens vary
HORIZON = 3
NUM_ROWS = 2048


def exact_sequence_probs(model, prompt: list[int], horizon: int) -> dict[tuple[int, ...], float]:
    """The target's own sampling distribution over its next `horizon` tokens (with SAMPLING's
    processing), enumerated prefix by prefix with from-scratch forward passes."""
    graphdef, params = nnx.split(model)
    rows, width = SAMPLING["top_k"] ** (horizon - 1), len(prompt) + horizon - 1  # the most prefixes, the longest

    @jax.jit
    def next_probs(tokens, lens):
        model = nnx.merge(graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
        vis = Visibility(jnp.zeros((rows,), jnp.int32), lens)
        logits = model(tokens, positions, model.init_cache(rows, width, page_size=width), vis, form="expanded",
                       backend="xla")[0]
        last = jnp.take_along_axis(logits, (lens - 1)[:, None, None], axis=1)[:, 0]
        return processed_probs(last, sampling_params(rows, **SAMPLING))

    dist = {(): 1.0}
    for _ in range(horizon):
        prefixes = list(dist)
        tokens, lens = np.zeros((rows, width), np.int32), np.ones(rows, np.int32)
        for i, prefix in enumerate(prefixes):
            tokens[i, :len(prompt) + len(prefix)] = prompt + list(prefix)
            lens[i] = len(prompt) + len(prefix)
        probs = np.asarray(next_probs(tokens, lens))
        dist = {prefix + (int(token),): dist[prefix] * float(probs[i, token])
                for i, prefix in enumerate(prefixes) for token in np.flatnonzero(probs[i] > 0)}
    return dist


def assert_distributed_as(result, target_distribution, *, max_total_variation: float):
    """The rows' emitted sequences are a sample of `target_distribution`: none outside its support,
    a chi-square test p > 1e-3 (bins with fewer than 5 expected rows merged), total variation below
    `max_total_variation`."""
    sequences = [tuple(row) for row in np.asarray(result.tokens).tolist()]
    num_rows = len(sequences)
    support = sorted(target_distribution, key=target_distribution.get, reverse=True)
    assert set(sequences) <= set(support), "a sequence the target never samples was emitted"
    counts = np.array([sequences.count(s) for s in support], float)
    probs = np.array([target_distribution[s] for s in support])
    small = probs * num_rows < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        probs = np.append(probs[~small], probs[small].sum())
    assert chi_square_p_value(counts, probs) > 1e-3
    assert 0.5 * np.abs(counts / num_rows - probs).sum() < max_total_variation


@pytest.fixture(scope="module")
def target_distribution(trained_v3):
    return exact_sequence_probs(trained_v3, SAMPLE_PROMPT, HORIZON)


# The static tree samples through the V4 caches in test_v4_loop (its draft-side code is the same).
@pytest.mark.parametrize("tree", [None, "2,2,3"], ids=["chain_k2", "dynamic_tree"])
def test_sampling_is_lossless(trained_v3, target_distribution, tree):
    """2048 rows of one prompt, one RNG stream each (fixed key): the emitted 3-token sequences (up
    to 27) match the target's exact sampling distribution by a chi-square test (p > 1e-3, bins with
    fewer than 5 expected rows merged) and in total variation (< 0.07; about 0.02 is typical at this
    many rows), while drafts are sometimes accepted and sometimes not. (That the key is a runtime
    argument: test_loop's test_sampling_values_are_runtime_arguments.)"""
    cfg = DecodeConfig(num_draft=2, tree=tree, max_new_tokens=HORIZON, page_size=8, backend="xla", **SAMPLING)
    result = generate(trained_v3, [SAMPLE_PROMPT] * NUM_ROWS, cfg, key=1)
    assert_distributed_as(result, target_distribution, max_total_variation=0.07)
    assert 1.0 < result.mean_accepted_length < cfg.max_depth + 1


# --- a chain's MTP calls are one scan -------------------------------------------------------

def equations(jaxpr):
    """The equations of a jaxpr and of its sub-jaxprs (scans, conds, calls, kernel bodies), depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from equations(sub)


def equation_count(jaxpr) -> int:
    """Equations of a jaxpr, those of its sub-jaxprs included."""
    return sum(1 for _ in equations(jaxpr))


def test_chain_drafting_program_does_not_grow_with_k(trained_v32):
    """A chain of k drafts makes k - 1 one-token MTP calls of one shape; they run as one scan, so
    the traced step (and the compiled program) holds one drafting MTP call whatever k: the step's
    equations are the same for k = 2 and k = 5, while one more MTP call would add hundreds. A
    static tree with a leading chain scans that chain and unrolls the rest."""
    graphdef, params = nnx.split(trained_v32)
    sizes = {}
    for k in (2, 5):
        cfg = config(k)
        state = jax.eval_shape(lambda: init_state(trained_v32, PROMPTS, cfg))
        sizes[k] = equation_count(jax.make_jaxpr(lambda p, s: step_program(graphdef, p, s, cfg))(params, state).jaxpr)
    batch = state.last_token.shape[0]
    hidden = jnp.zeros((batch, 1, trained_v32.config.hidden_size))
    one_token = jnp.zeros((batch, 1), jnp.int32)
    vis = Visibility(jnp.zeros(batch, jnp.int32), jnp.ones(batch, jnp.int32))
    mtp_call = equation_count(jax.make_jaxpr(
        lambda p, cache: nnx.merge(graphdef, p).draft(one_token, hidden, one_token, cache, vis, form="absorbed",
                                                      backend="xla"))(params, state.mtp_cache).jaxpr)
    assert mtp_call > 100
    assert sizes[2] == sizes[5], sizes


# --- commit compacts the accepted path ------------------------------------------------------


def test_cache_move_reads_every_source_before_writing():
    """Row 0 (prefix 1) compacts the path [0, 2, 5]: slot 3 -> 2 and 6 -> 3, so slot 3 is read
    before it is overwritten; across a page boundary, in every layer's latents and indexer keys.
    Row 1's path [0, 1] is already contiguous; -1 entries move nothing."""
    cache = init_cache(num_layers=2, batch_size=2, capacity=8, latent_dim=3, index_dim=2, page_size=4,
                       page_table=jnp.array([[3, 0], [1, 2]], jnp.int32))
    slots = jnp.broadcast_to(jnp.arange(8), (2, 8))
    value = (slots + 100 * jnp.arange(2)[:, None]).astype(jnp.float32)[..., None]  # slot + 100 * row
    for layer in range(2):
        cache = cache.write(layer, slots, jnp.broadcast_to(value + 1000 * layer, (2, 8, 3)),
                            jnp.broadcast_to(value - 1000 * layer, (2, 8, 2)))
    src, dst = compact_slots(jnp.array([1, 0]), jnp.array([[0, 2, 5], [0, 1, -1]]), jnp.array([3, 2]))
    moved = cache.move(src, dst)
    expected = np.array([[0, 1, 3, 6, 4, 5, 6, 7], [100, 101, 102, 103, 104, 105, 106, 107]], np.float32)
    for layer in range(2):
        for pages, offset, width in ((moved.latent, 1000, 3), (moved.index_keys, -1000, 2)):
            got = np.asarray(read_slots(pages[layer], moved.page_table, slots))
            np.testing.assert_array_equal(got, np.repeat(expected[..., None] + offset * layer, width, axis=-1))


def visible_entries(cache: PagedCache, lengths: np.ndarray) -> list[np.ndarray]:
    """Every layer's latents, then indexer keys, at each row's slots [0, lengths[b]) (zeros past)."""
    slots = jnp.arange(cache.capacity)[None, :]
    slots = jnp.where(slots < jnp.asarray(lengths)[:, None], slots, -1)
    return [np.asarray(read_slots(layer, cache.page_table, slots)) for pool in jax.tree.leaves((cache.latent, cache.index_keys))
            for layer in pool]


def recomputed_caches(model, sequences: list[list[int]], capacity: int) -> tuple[PagedCache, PagedCache]:
    """The target and MTP caches of `sequences` computed from scratch: one prefill of each whole
    sequence, then the MTP module over the pairs (h_i, t_{i+1})."""
    tokens = np.zeros((len(sequences), max(map(len, sequences))), np.int32)
    for b, s in enumerate(sequences):
        tokens[b, :len(s)] = s
    return _recompute(model, jnp.asarray(tokens), jnp.asarray([len(s) for s in sequences], jnp.int32), capacity)


# Jitted: run eagerly, the model's every op compiles a program of its own (hundreds).
@functools.partial(nnx.jit, static_argnames=("capacity",))
def _recompute(model, tokens, lens, capacity):
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    vis = Visibility(jnp.zeros((batch,), jnp.int32), lens)
    _, hidden, target_cache = model(tokens, positions, model.init_cache(batch, capacity, page_size=8), vis,
                                    form="expanded", backend="xla")
    next_tokens = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    mtp_vis = Visibility(jnp.zeros((batch,), jnp.int32), lens - 1)
    empty_mtp_cache = model.init_cache(batch, capacity, page_size=8, mtp=True)
    _, _, mtp_cache = model.draft(next_tokens, hidden, positions, empty_mtp_cache, mtp_vis, form="expanded",
                                  backend="xla")
    return target_cache, mtp_cache


def test_commit_leaves_the_caches_of_the_emitted_tokens(trained_v32):
    """After every step of the small tree (whose accepted paths of 2+ drafts always move: node
    (0, 0) is window node 4, committed at slot n + 2), the visible target entries (latents and
    DSA indexer keys, every layer) and MTP entries equal a from-scratch recompute of the prompt
    and the emitted tokens; rejected nodes leave nothing visible."""
    cfg = config(3, tree="small", max_new_tokens=20)
    state = init_state(trained_v32, PROMPTS, cfg)
    snapshots = []
    while not bool(np.all(state.done)):
        state = step(trained_v32, state, cfg)
        # Host copies: the next step consumes (donates) this state's arrays.
        snapshots.append((*jax.device_get((state.target_cache, state.mtp_cache)), np.asarray(state.num_generated),
                          np.asarray(state.done)))
    assert int(np.sum(state.position_accepts[:, 1])) > 0, "no step accepted a path that needs moving"
    sequences = emitted_sequences(PROMPTS, state)
    target_ref, mtp_ref = recomputed_caches(trained_v32, sequences, state.target_cache.capacity)
    known = np.array([len(seq) - 1 for seq in sequences])  # the budget may cut a last commit's tokens
    prompt_lens = np.array([len(p) for p in PROMPTS])
    for target_cache, mtp_cache, num_generated, done in snapshots:
        lengths = np.minimum(np.asarray(target_cache.lengths), known)
        np.testing.assert_array_equal(mtp_cache.lengths, target_cache.lengths)
        np.testing.assert_array_equal(lengths[~done], (prompt_lens + num_generated - 1)[~done])
        for got, want in zip(visible_entries(target_cache, lengths) + visible_entries(mtp_cache, lengths),
                             visible_entries(target_ref, lengths) + visible_entries(mtp_ref, lengths)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# --- bad options are refused before tracing -------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(tree="bushy"), r"tree 'bushy': expected one of \['eagle', 'small'\] or 'top_k,depth,budget'"),
    (dict(tree="4,5"), "top_k,depth,budget"),
    (dict(tree="0,2,4"), r"DynamicTreeSpec.top_k=0: must be >= 1"),
    (dict(tree="2,5,4"), r"DynamicTreeSpec.depth=5: must be in \[1, budget=4\]"),
    (dict(tree="2,2,9"), r"DynamicTreeSpec.budget=9: must be <= the candidate pool"),
    (dict(tree=[[0], [1]]), "DecodeConfig.tree"),
    (dict(tree="small", num_draft=0), "num_draft=0 means plain decoding"),
    (dict(temperature=-1.0), r"temperature=-1.0: must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(temperature=1.0, top_k=-1), r"top_k=-1: must be >= 0"),
    (dict(temperature=1.0, top_p=0.0), r"top_p=0.0: must be in \(0, 1\]"),
    (dict(temperature=1.0, top_p=1.5), r"top_p=1.5"),
    (dict(top_k=5), "temperature=0 is greedy"),
    (dict(top_p=0.9), "temperature=0 is greedy"),
    (dict(relaxed=(2,)), r"relaxed=\(2,\): must be None or \(top_k, delta\)"),
    (dict(relaxed=(0, 0.1)), "relaxed top_k=0: must be an integer >= 1"),
    (dict(relaxed=(2, 1.5)), r"relaxed delta=1.5: must be in \[0, 1\]"),
    (dict(relaxed=(2, 0.1), temperature=0.7), "needs temperature=0"),
    (dict(relaxed=(2, 0.1), num_draft=0), "relaxed needs drafts"),
])
def test_bad_decode_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecodeConfig(**kwargs)


def test_tree_options_are_checked_against_the_model():
    model = DeepseekV3(preset("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"tree top_k=300 exceeds the vocabulary \(258\)"):
        generate(model, [[1, 2]], DecodeConfig(tree=DynamicTreeSpec(300, 1, 300), max_new_tokens=4))
    with pytest.raises(ValueError, match="max_cache_len=12 is too small.*draft window 7"):
        generate(model, [[1, 2]], DecodeConfig(tree="small", max_new_tokens=4, max_cache_len=12))
    no_mtp = DeepseekV3(preset("tiny", num_nextn_predict_layers=0), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs an MTP module"):
        generate(no_mtp, [[1, 2]], DecodeConfig(tree=StaticTree([[0], [1]]), max_new_tokens=4))
