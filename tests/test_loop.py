"""Loop invariants: greedy speculative decoding is lossless, the cached drafts equal a naive
recompute, rows are independent (finished and padding rows change nothing), bad input is refused
before tracing, and generate works inside a user's jit."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from jaxspec.batch import budget_bucket, prompt_bucket, required_capacity
from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import generate
from jaxspec.loop import PAD_TOKEN, check_step_config, init_state, step
from jaxspec.models import DeepseekV3, DeepseekV4
from jaxspec.pallas_kernels import Visibility
from jaxspec.presets import preset
from jaxspec.sharding import MESH_AXES

jax.config.update("jax_default_matmul_precision", "highest")

# Different lengths; some are not made of the training words, so early drafts get rejected. This
# mix makes every acceptance count 0..k occur for k = 1..4 with both trained fixtures.
PROMPTS = [list(b"the quick"), list(b"fox jumps over the lazy dog and"), list(b"zq"), list(b"brown cat ov"),
           list(b"xylophone "), list(b"la")]


def config(k, **changes):
    return DecodeConfig(**{"num_draft": k, "max_new_tokens": 48, "page_size": 8, "backend": "xla", **changes})


def acceptance_histogram(result, k):
    """[k + 1]: verification steps that accepted exactly 0 .. k drafts, over all rows."""
    at_least = [int(np.sum(result.target_calls))] + [int(np.sum(result.position_accepts[:, j])) for j in range(k)]
    at_least.append(0)
    return np.array([at_least[j] - at_least[j + 1] for j in range(k + 1)])


def emitted_sequences(prompts, state) -> list[list[int]]:
    """Each row's prompt followed by the tokens `state` (a DecodeState) has emitted for it. Read on the
    host: an eager slice of a device array compiles a program for each row and length."""
    tokens, num_generated = np.asarray(state.tokens), np.asarray(state.num_generated)
    return [list(prompt) + tokens[b, :num_generated[b]].tolist() for b, prompt in enumerate(prompts)]


@pytest.fixture(scope="module")
def plain_v32(trained_v32):
    """Plain greedy decoding of PROMPTS by trained_v32 (`config(0)`): the tokens the V3.2 tests here
    compare with, one program run once."""
    return generate(trained_v32, PROMPTS, config(0))


@pytest.mark.parametrize("model_name, draft_lengths, prefill_chunk",
                         [("trained_v3", (1,), None), ("trained_v32", (2, 4), 5)])
def test_greedy_speculative_equals_plain(model_name, draft_lengths, prefill_chunk, request):
    """Tokens equal plain greedy for k = 1, 2, 4, with every acceptance count 0..k occurring (each k
    is a compile: k = 3 on both models runs in test_pallas_backend and test_rows_are_independent,
    on meshes in test_sharding, trees in test_tree_decoding). V3.2's speculative runs prefill in
    chunks of 5 (`DecodeConfig.prefill_chunk`; V4's: tests/test_chunked_prefill.py)."""
    model = request.getfixturevalue(model_name)
    plain = request.getfixturevalue("plain_v32") if model_name == "trained_v32" else generate(model, PROMPTS, config(0))
    plain_tokens = np.asarray(plain.tokens)
    assert plain.mean_accepted_length == 1.0
    rng = np.random.default_rng(0)
    for k in draft_lengths:
        pages = -(-(len(PROMPTS[1]) + 48 + k) // 8)  # the longest prompt, the budget and a window
        page_table = jnp.asarray(rng.permutation(len(PROMPTS) * pages).reshape(len(PROMPTS), pages), jnp.int32)
        spec = generate(model, PROMPTS, config(k, prefill_chunk=prefill_chunk), page_table=page_table)
        np.testing.assert_array_equal(np.asarray(spec.tokens), plain_tokens, err_msg=f"k={k}")
        histogram = acceptance_histogram(spec, k)
        assert (histogram > 0).all(), f"k={k}: steps accepting 0..k drafts = {histogram.tolist()}"
        assert spec.mean_accepted_length > 1.0


@functools.cache
def _naive_fns(graphdef):
    @jax.jit
    def target_hidden(params, tokens, lens):
        model = nnx.merge(graphdef, params)
        batch, width = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        vis = Visibility(jnp.zeros((batch,), jnp.int32), lens)
        return model(tokens, positions, model.init_cache(batch, width, page_size=width), vis, form="expanded",
                     backend="xla")[1]

    @jax.jit
    def mtp(params, next_tokens, hidden, lens):
        model = nnx.merge(graphdef, params)
        batch, width = next_tokens.shape
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        vis = Visibility(jnp.zeros((batch,), jnp.int32), lens)
        logits, out_hidden, _ = model.draft(next_tokens, hidden, positions,
                                            model.init_cache(batch, width, page_size=width, mtp=True), vis,
                                            form="expanded", backend="xla")
        return logits, out_hidden

    return target_hidden, mtp


def naive_drafts(model, sequences, k, width):
    """Drafts from scratch: sequences[b] = t_0 .. t_n (t_n the last emitted token) -> [B, k].

    The target runs over t_0 .. t_{n-1} without any cache reuse; each draft recomputes the MTP
    module over the whole pair sequence (h_i, t_{i+1}), its own earlier drafts appended as
    (MTP hidden, draft) pairs.
    """
    graphdef, params = nnx.split(model)
    target_hidden, mtp = _naive_fns(graphdef)
    batch = len(sequences)
    n = np.array([len(s) - 1 for s in sequences])
    tokens = np.zeros((batch, width), np.int32)
    for b, s in enumerate(sequences):
        tokens[b, :len(s)] = s
    hidden = np.array(target_hidden(params, jnp.asarray(tokens), jnp.asarray(n, jnp.int32)))
    next_tokens = np.zeros_like(tokens)
    next_tokens[:, :-1] = tokens[:, 1:]
    drafts = np.zeros((batch, k), np.int32)
    lens = n.copy()
    for j in range(k):
        logits, mtp_hidden = mtp(params, jnp.asarray(next_tokens), jnp.asarray(hidden), jnp.asarray(lens, jnp.int32))
        rows = np.arange(batch)
        drafts[:, j] = np.argmax(np.asarray(logits)[rows, lens - 1], axis=-1)
        hidden[rows, lens] = np.asarray(mtp_hidden)[rows, lens - 1]
        next_tokens[rows, lens] = drafts[:, j]
        lens = lens + 1
    return drafts


def test_cached_drafts_equal_naive_recompute(trained_v32, plain_v32):
    """Every step's drafts (k = 3) equal a from-scratch recompute; nothing in the state is NaN, also
    once rows have finished (their budgets run out at different steps); stepping by hand emits plain
    greedy's tokens, as generate does (test_greedy_speculative_equals_plain)."""
    k = 3
    cfg = config(k, max_new_tokens=30)
    state = init_state(trained_v32, PROMPTS, cfg)
    width = max(map(len, PROMPTS)) + cfg.max_new_tokens + k + 1
    checked, finish_steps = 0, set()
    while not bool(np.all(state.done)):
        sequences = emitted_sequences(PROMPTS, state)
        active = ~np.asarray(state.done)
        expected = naive_drafts(trained_v32, sequences, k, width)
        state = step(trained_v32, state, cfg)
        np.testing.assert_array_equal(np.asarray(state.drafts)[active], expected[active])
        checked += int(active.sum())
        for leaf in jax.tree.leaves(state):  # rows that finished ride along: nothing turns NaN
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                assert np.isfinite(np.asarray(leaf)).all()
        finish_steps.update(int(state.steps) for _ in np.flatnonzero(active & np.asarray(state.done)))
    assert checked >= 20
    assert len(finish_steps) > 1, "rows should finish at different steps"
    np.testing.assert_array_equal(np.asarray(state.tokens)[:, :cfg.max_new_tokens],
                                  np.asarray(plain_v32.tokens)[:, :cfg.max_new_tokens])


def test_rows_are_independent_and_finish_cleanly(trained_v32, plain_v32):
    """Rows stopped by EOS at different steps ride along without changing the others: each row equals
    its own single-row run and plain greedy cut at the first EOS. (Finished rows' state stays finite:
    test_cached_drafts_equal_naive_recompute checks every step's.)"""
    eos = ord(" ")
    cfg = config(3, eos_token_id=eos)
    batched = generate(trained_v32, PROMPTS, cfg)
    finished_at = []
    width = max(map(len, PROMPTS))
    for b, prompt in enumerate(PROMPTS):  # each row alone, padded to one width: one compile for all
        alone = generate(trained_v32, jnp.asarray([prompt + [0] * (width - len(prompt))], jnp.int32), cfg,
                         prompt_lens=jnp.asarray([len(prompt)], jnp.int32))
        assert batched.row_tokens(b) == alone.row_tokens(0)
        row = plain_v32.row_tokens(b)
        cut = row.index(eos) + 1 if eos in row else len(row)
        assert batched.row_tokens(b) == row[:cut]
        finished_at.append(cut)
    assert len(set(finished_at)) > 1, "rows should finish at different lengths"


def test_generate_inside_user_jit(trained_v32, plain_v32):
    """generate traces inside a user's jitted function, with array prompts and lengths, and emits
    plain greedy's tokens there."""
    cfg = config(2, max_new_tokens=12)
    width = max(map(len, PROMPTS))
    padded = np.zeros((len(PROMPTS), width), np.int32)
    for b, p in enumerate(PROMPTS):
        padded[b, :len(p)] = p
    lens = np.array([len(p) for p in PROMPTS], np.int32)

    @jax.jit
    def user_fn(prompts, prompt_lens):
        return generate(trained_v32, prompts, cfg, prompt_lens=prompt_lens).tokens

    np.testing.assert_array_equal(np.asarray(user_fn(padded, lens)),
                                  np.asarray(plain_v32.tokens)[:, :cfg.max_new_tokens])


def test_sampling_values_are_runtime_arguments(trained_v32, plain_v32):
    """Sampled configs that differ only in temperature, top_k or top_p run one compiled generate
    program and one compiled step, and each value reaches it: top-k 1, a top-p that keeps only
    the top token, and a temperature of 1e-4 sample greedy's tokens, a temperature of 5 does not.
    The key is a runtime argument too: another key runs the same program and gives other tokens.
    (Greedy is its own program.)"""
    # The counts are this test's alone: no test before it in this module compiles a sampled program,
    # and conftest clears JAX's in-memory caches between modules.
    programs = []

    def count(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            programs.append(kwargs.get("fun_name"))

    base = config(2, max_new_tokens=13)
    greedy = np.asarray(plain_v32.tokens)[:, :base.max_new_tokens]
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        runs = [np.asarray(generate(trained_v32, PROMPTS, base.replace(**values), key=key).tokens)
                for values, key in ((dict(temperature=1.0, top_k=1), 3), (dict(temperature=1.0, top_p=1e-6), 3),
                                    (dict(temperature=1e-4), 3), (dict(temperature=5.0), 3),
                                    (dict(temperature=5.0), 4))]
        stepped = []
        for values in (dict(temperature=1.0, top_k=1), dict(temperature=5.0)):
            cfg = base.replace(**values)
            state = init_state(trained_v32, PROMPTS, cfg, key=3)
            while not state.done.all():
                state = step(trained_v32, state, cfg)
            stepped.append(np.asarray(state.tokens[:, :base.max_new_tokens]))
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    *filtered, hot, other_key = runs
    for tokens in filtered:
        np.testing.assert_array_equal(tokens, greedy)
    assert (hot != greedy).any() and (other_key != hot).any()
    np.testing.assert_array_equal(stepped[0], greedy)
    assert (stepped[1] != greedy).any()
    assert [name for name in programs if "_generate" in name] == ["jit(_generate)"], programs
    assert sum("_step" in name for name in programs) == 1, programs


def test_similar_prompts_and_budgets_share_one_program(trained_v32):
    """Batches whose longest prompts and budgets are (2, 5), (9, 9) and (16, 16) tokens run one
    compiled generate program (both padded to 16), (17, 11) a second (width 32) and (5, 17) a
    third (budget 32); each program's tokens equal those of the exact run (`buckets=False`,
    float32) of a batch it padded: (2, 5), (17, 11) and (5, 17).
    Stepping budgets 5 and 9 compiles one prefill and one step, and each row stops at its budget.
    The rule at its edges, and where a bucket would not fit."""
    jax.clear_caches()  # counts this test's programs alone, whatever ran before it
    programs = []

    def count(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            programs.append(kwargs.get("fun_name", ""))

    base = config(2)
    rows = (list(b"the quick brown fox"), list(b"def __init__(self):"))
    runs = [([row[:width] for row in rows], base.replace(max_new_tokens=budget))
            for width, budget in ((2, 5), (9, 9), (16, 16), (17, 11), (5, 17))]
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        padded = [np.asarray(generate(trained_v32, prompts, cfg).tokens) for prompts, cfg in runs]
        stepped = []
        for budget in (5, 9):
            cfg = base.replace(max_new_tokens=budget)
            state = init_state(trained_v32, runs[0][0], cfg)
            while not state.done.all():
                state = step(trained_v32, state, cfg)
            stepped.append(state)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert sum("_generate" in name for name in programs) == 3, programs
    assert [programs.count(name) for name in ("jit(prefill)", "jit(_step)")] == [1, 1], programs
    for i, ((prompts, cfg), tokens) in enumerate(zip(runs, padded)):
        assert tokens.shape == (2, cfg.max_new_tokens)
        if i in (0, 3, 4):  # each program once, against the exact run of a batch it padded
            np.testing.assert_array_equal(tokens, np.asarray(generate(trained_v32, prompts, cfg.replace(
                buckets=False)).tokens))
    for budget, state in zip((5, 9), stepped):  # greedy: budget 9's first 5 tokens are budget 5's
        tokens = np.asarray(state.tokens)
        assert tokens.shape[1] == 16 + base.max_depth + 1 and (np.asarray(state.num_generated) == budget).all()
        np.testing.assert_array_equal(tokens[:, :5], padded[0])
        assert (tokens[:, :budget] >= 0).all() and (tokens[:, budget:] == PAD_TOKEN).all()

    positions = trained_v32.config.max_position_embeddings
    sizes = (1, 16, 17, 100, 1024, 1025, 70_000)
    assert [prompt_bucket(w, base, max_positions=10 ** 6) for w in sizes] == [16, 16, 32, 128, 1024, 2048, 70_656]
    assert [budget_bucket(16, base.replace(max_new_tokens=n), max_positions=10 ** 6)
            for n in sizes] == [16, 16, 32, 128, 1024, 2048, 70_656]
    exact = base.replace(buckets=False, max_new_tokens=5)
    assert prompt_bucket(5, exact, max_positions=positions) == 5 == budget_bucket(5, exact, max_positions=positions)
    # a bucket must fit what the exact size fits: the positions, max_cache_len, a page table's slots
    assert prompt_bucket(100, base, max_positions=required_capacity(127, base)) == 100
    assert prompt_bucket(100, base.replace(max_cache_len=required_capacity(100, base)), max_positions=positions) == 100
    table = jnp.zeros((2, -(-required_capacity(100, base) // base.page_size)), jnp.int32)
    assert prompt_bucket(100, base, max_positions=positions, page_table=table) == 100
    small = base.replace(max_new_tokens=40)  # bucket 64
    assert budget_bucket(16, small, max_positions=required_capacity(16, small)) == 40
    assert budget_bucket(16, small.replace(max_cache_len=required_capacity(16, small)), max_positions=positions) == 40
    table = jnp.zeros((2, -(-required_capacity(16, small) // base.page_size)), jnp.int32)
    assert budget_bucket(16, small, max_positions=positions, page_table=table) == 40
    assert budget_bucket(16, small, max_positions=positions) == 64
    with pytest.raises(ValueError, match="buckets=1"):
        DecodeConfig(buckets=1)


@pytest.fixture(scope="module")
def random_model():
    return DeepseekV3(preset("tiny"), rngs=nnx.Rngs(0))


def test_step_refuses_a_config_that_is_not_the_states(random_model):
    """A state made for k = 3 stepped with k = 2, a tree of the same depth, no drafts, prompts in the
    loop, another EOS, window_invariant or cache dtype: a ValueError naming each field that differs,
    before tracing (the first ones failed deep inside the trace, the others decoded otherwise than
    `init_state` was asked, silently). What a program reads at run time may differ: the budget and,
    when sampling, the sampling values (the state's rows keep theirs)."""
    made = DecodeConfig(num_draft=3, max_new_tokens=4)
    state = init_state(random_model, [[1, 2]], made)
    for changes, match in [(dict(num_draft=2), r"decodes with num_draft=2 \(the state's: 3\);"),
                           (dict(num_draft=1, tree="3,3,3"),
                            r"num_draft=1 \(the state's: 3\), tree=.*\(the state's: None\)"),
                           (dict(num_draft=0), r"num_draft=0 \(the state's: 3\)"),
                           (dict(prefill_in_loop=True), r"prefill_in_loop=True \(the state's: False\)"),
                           (dict(eos_token_id=7), r"eos_token_id=7 \(the state's: None\)"),
                           (dict(window_invariant=True, cache_dtype="fp8"),
                            r"window_invariant=True \(the state's: False\), cache_dtype='fp8' \(the state's: None\)")]:
        with pytest.raises(ValueError, match=match):
            step(random_model, state, made.replace(**changes))
    check_step_config(state, made.replace(max_new_tokens=9))
    sampled = made.replace(temperature=0.7, top_k=5)
    check_step_config(init_state(random_model, [[1, 2]], sampled), sampled.replace(temperature=1.3, top_p=0.9))


def test_step_refuses_a_model_that_is_not_the_states(random_model):
    """A state stepped with another model: another width (DeepSeek-V4's hyper-connections carry
    4 x 64), or caches of another depth or family, is a ValueError naming the difference before
    tracing (the first two failed deep inside the trace with a broadcasting error); the state's own
    model steps. The other models are shapes only: the check reads no parameter."""
    state = init_state(random_model, [[1, 2]], DecodeConfig(num_draft=1, max_new_tokens=4))
    abstract = lambda family, name, **changes: nnx.eval_shape(lambda: family(preset(name, **changes), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="model: hidden width 96 and vocabulary 258, the state's 64 and 258"):
        step(abstract(DeepseekV3, "tiny", hidden_size=96), state)
    with pytest.raises(ValueError, match="model: hidden width 256 and vocabulary 258, the state's 64"):
        step(abstract(DeepseekV4, "tiny-v4"), state)
    with pytest.raises(ValueError, match=r"model: its caches are a PagedCache of leading axes \[3, 3, .*the state's a "
                                         r"PagedCache of \[2, 2, "):
        step(abstract(DeepseekV3, "tiny", num_hidden_layers=3), state)
    assert int(step(random_model, state).steps) == 1


def test_a_one_device_state_refuses_a_mesh(random_model):
    """A state `init_state` made on one device steps there: a mesh or plan passed to `step` is
    refused before tracing (on a mesh, tests/sharding_checks.py: its state steps on its mesh)."""
    state = init_state(random_model, [[1, 2]], DecodeConfig(num_draft=1, max_new_tokens=4))
    assert state.mesh is None and state.plan is None
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), MESH_AXES)
    with pytest.raises(ValueError, match="mesh=Mesh.*the state was made on one device"):
        step(random_model, state, mesh=mesh)
    with pytest.raises(ValueError, match="plan='tp': the state was made on one device"):
        step(random_model, state, plan="tp")


def test_a_state_steps_with_the_config_it_holds(random_model):
    """`step` without a config decodes with the state's (`DecodeState.config`, the program's:
    the budget the buffer's), to the tokens `generate` emits; the config rides along unchanged."""
    config = DecodeConfig(num_draft=2, max_new_tokens=6, eos_token_id=3)
    state = init_state(random_model, [[1, 2], [5]], config)
    assert state.config == config.program_config(state.tokens.shape[1] - config.max_depth - 1)
    while not state.done.all():
        state = step(random_model, state)
    assert state.config.eos_token_id == 3
    result = generate(random_model, [[1, 2], [5]], config)
    assert emitted_sequences([[], []], state) == [result.row_tokens(b) for b in range(2)]


@pytest.mark.parametrize("kwargs, prompts, match", [
    (dict(max_cache_len=20), [[1, 2, 3]], "max_cache_len=20 is too small"),
    (dict(), [[1, 2], []], r"row\(s\) \[1\] are empty"),
    (dict(), [], "empty batch"),
    (dict(), [[1, 300]], "token ids must be in"),
    (dict(max_new_tokens=2000), [[1, 2]], "max_position_embeddings"),
    (dict(), [72, 105], r"prompts\[0\]: each prompt must be a sequence of token ids .* got a single id"),
    (dict(), [[[1, 2], [3, 4]]], r"prompts\[0\]: each prompt must be a sequence .* got shape \(2, 2\)"),
    (dict(), [[72.7, 105.2]], r"prompts\[0\]: must be integers, got float64"),
    (dict(), np.array([[72.7, 105.2]]), "prompts: must be integers, got float64"),
    (dict(), [[2**32 + 5, 1]], r"prompts\[0\]: values must fit int32, got \[4294967301\]"),
    (dict(), np.array([[2**32 + 5, 1]]), r"prompts: values must fit int32"),
    (dict(eos_token_id=258), [[1, 2]], "eos_token_id=258: must be < vocab_size=258"),
])
def test_bad_input_is_refused_before_tracing(random_model, kwargs, prompts, match):
    """Each refused with a ValueError naming the argument; the prompts' forms were read silently
    before (a flat list as one-token rows, float ids truncated, ids past int32 wrapped into the
    vocabulary)."""
    with pytest.raises(ValueError, match=match):
        generate(random_model, prompts, DecodeConfig(**{"max_new_tokens": 16, **kwargs}))


# Two rows of one page each: the page tables below lay out, or misname, that pool of 2 pages.
PAGED_REQUEST = ([[72, 105], [84, 104, 101]], DecodeConfig(num_draft=1, max_new_tokens=4))


@pytest.mark.parametrize("page_table, match", [
    ([[0], [0]], r"page_table: page\(s\) \[0\] appear more than once"),
    ([[5], [9]], r"page_table: entries must be pages in \[0, 2\), got \[5, 9\]"),
    ([[-1], [0]], r"entries must be pages in \[0, 2\), got \[-1\]"),
    ([0, 1], r"page_table: must be a \[B, M\] integer array, got int32 of shape \(2,\)"),
    ([[0.0], [1.0]], r"must be a \[B, M\] integer array, got float32"),
], ids=["shared page", "past the pool", "negative", "1-D", "float"])
def test_a_page_table_that_would_overwrite_entries_is_refused(random_model, page_table, match):
    """A caller's page table may lay pages out in any order, but two slots on one page, or a page
    outside the pool, would silently overwrite entries (another row's, or clamped reads): each is a
    ValueError before tracing."""
    with pytest.raises(ValueError, match=match):
        generate(random_model, *PAGED_REQUEST, page_table=jnp.asarray(page_table))


def test_a_permuted_page_table_decodes_as_the_default_layout(random_model):
    swapped = generate(random_model, *PAGED_REQUEST, page_table=jnp.asarray([[1], [0]], jnp.int32))
    np.testing.assert_array_equal(swapped.tokens, generate(random_model, *PAGED_REQUEST).tokens)


@pytest.mark.parametrize("key, match", [(None, "key=None: must be an int seed"), ("abc", "key='abc'"),
                                        (1.5, "key=1.5"), (2**70, r"must be in \[-2\*\*63, 2\*\*63\)")])
def test_a_bad_key_is_refused_naming_it(random_model, key, match):
    with pytest.raises(ValueError, match=match):
        generate(random_model, [[1, 2]], DecodeConfig(num_draft=0, max_new_tokens=2, temperature=1.0), key=key)


def test_prompt_lens_go_with_an_array_of_prompts(random_model):
    """A list's rows carry their own lengths: `prompt_lens` beside one was ignored, now refused."""
    with pytest.raises(ValueError, match="prompt_lens: only with a \\[B, P\\] array of prompts"):
        generate(random_model, [[72, 105, 3]], DecodeConfig(max_new_tokens=2), prompt_lens=[1])
    with pytest.raises(ValueError, match="prompt_lens: must be integers, got float64"):
        generate(random_model, np.array([[1, 2, 3], [1, 2, 3]]), DecodeConfig(max_new_tokens=2), prompt_lens=[2.5, 3])


def test_bad_decode_config_and_batch(random_model):
    with pytest.raises(ValueError, match=r"num_draft=8: must be in \[0, 7\]"):
        DecodeConfig(num_draft=8)
    with pytest.raises(ValueError, match=r"num_draft=-1"):
        DecodeConfig(num_draft=-1)
    with pytest.raises(ValueError, match="backend"):
        DecodeConfig(backend="cuda")
    page_table = jnp.arange(4, dtype=jnp.int32).reshape(2, 2)
    with pytest.raises(ValueError, match="batch size 3 exceeds the cache's rows"):
        generate(random_model, [[1], [2], [3]], DecodeConfig(max_new_tokens=4, page_size=8), page_table=page_table)
    no_mtp = DeepseekV3(preset("tiny", num_nextn_predict_layers=0), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs an MTP module"):
        generate(no_mtp, [[1, 2]], DecodeConfig(num_draft=2))
