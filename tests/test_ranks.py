"""pallas_kernels.ranks: top-k and stable sorts by counting comparisons equal XLA's sorts, integer
for integer, on both sides of COUNT_LIMIT; the router built on them routes a token as the sorts
did, alone or among other tokens; the indexer's selection (`select_topk`) counts few rows and sorts
many, with the same indices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import moe
from jaxspec.pallas_kernels import contracts, ranks, select_topk
from jaxspec.presets import preset


@pytest.fixture(params=["counted", "sorted"])
def way(request, monkeypatch):
    """Each test runs once counting and once sorting (a limit no call reaches)."""
    if request.param == "sorted":
        monkeypatch.setattr(ranks, "COUNT_LIMIT", 0)
    return request.param


def _tied(key, shape, levels=7):
    """Random float32 values drawn from `levels` values, so that most rows hold ties."""
    return jax.random.randint(key, shape, 0, levels).astype(jnp.float32) / levels - 0.5


def test_top_k_indices_are_lax_top_k_with_its_tie_rule(way):
    for seed, (shape, k) in enumerate([((5, 9), 4), ((3, 4, 32), 2), ((2, 256), 8), ((7,), 7)]):
        values = _tied(jax.random.key(seed), shape)
        values = values.at[..., 0].set(jnp.inf).at[..., -1].set(-jnp.inf)
        got = ranks.top_k_indices(values, k)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, jax.lax.top_k(values, k)[1])


def test_top_k_indices_give_the_chosen_elements_labels_within_a_callers_limit(way):
    """With labels, the chosen elements' labels (in the count, summed in the same reduction); a
    call's own limit decides whether it counts (a reduction, no sort) or sorts, beside
    COUNT_LIMIT's default."""
    values = _tied(jax.random.key(7), (3, 2, 24))
    labels = jax.random.randint(jax.random.key(8), values.shape, -5, 100)
    want = jnp.take_along_axis(labels, jax.lax.top_k(values, 9)[1], axis=-1)
    np.testing.assert_array_equal(ranks.top_k_indices(values, 9, labels=labels), want)
    comparisons = values.size * values.shape[-1]
    for limit, counts in ((comparisons, True), (comparisons - 1, False)):
        jaxpr = str(jax.make_jaxpr(lambda v: ranks.top_k_indices(v, 9, limit=limit, labels=labels))(values))  # noqa: B023
        assert ("sort" in jaxpr or "top_k" in jaxpr) != counts and ("reduce_sum" in jaxpr) == counts
        np.testing.assert_array_equal(ranks.top_k_indices(values, 9, limit=limit, labels=labels), want)


def _stable_top(scores: np.ndarray, topk: int) -> np.ndarray:
    """numpy's stable sort of the total-order keys, descending: the selection `select_topk` defines
    (-1 for invisible slots and past the row), independent of XLA's sort and of the count."""
    keys = np.asarray(ranks.total_order_keys(jnp.asarray(scores)), np.int64)
    order = np.argsort(-keys, axis=-1, kind="stable")[..., :topk]
    order = np.where(np.take_along_axis(scores, order, axis=-1) > -np.inf, order, -1)
    return np.pad(order, [(0, 0)] * (scores.ndim - 1) + [(0, topk - order.shape[-1])], constant_values=-1)


@pytest.mark.parametrize("shape, topk", [((1, 1, 64), 16), ((2, 3, 40), 48), ((4, 4, 96), 32)],
                         ids=["one-token", "fewer-slots-than-topk", "window"])
def test_select_topk_counts_few_long_rows_and_sorts_others_with_the_same_indices(shape, topk, monkeypatch):
    """The indexer's selection over scores with ties, signed zeros and invisible slots (-inf, and
    in a call of several rows one with none visible): counted where rows are longer than
    SELECT_SORT_ONE_PASS and the call's comparisons within SELECT_COUNT_LIMIT (here with the rows'
    bound lowered: the suite's rows are short), sorted otherwise, both numpy's stable descending
    order of the total-order keys with -1 for invisible slots and past the row's slots."""
    rng = np.random.default_rng(sum(shape))
    scores = rng.integers(-3, 4, shape).astype(np.float32) / 2
    scores[rng.random(shape) < 0.2] = -0.0
    scores[rng.random(shape) < 0.3] = -np.inf
    several = scores[..., 0].size > 1
    if several:
        scores[-1, -1] = -np.inf
    want = _stable_top(scores, topk)
    comparisons = scores.size * shape[-1]
    assert comparisons <= contracts.SELECT_COUNT_LIMIT and shape[-1] <= contracts.SELECT_SORT_ONE_PASS
    for one_pass, limit, sorts in ((0, contracts.SELECT_COUNT_LIMIT, False), (0, comparisons - 1, True),
                                   (contracts.SELECT_SORT_ONE_PASS, contracts.SELECT_COUNT_LIMIT, True)):
        monkeypatch.setattr(contracts, "SELECT_SORT_ONE_PASS", one_pass)
        monkeypatch.setattr(contracts, "SELECT_COUNT_LIMIT", limit)
        select = lambda s: select_topk(s, topk)  # noqa: E731  (a new function: no trace cached under the old bounds)
        assert ("top_k" in str(jax.make_jaxpr(select)(scores))) == sorts
        np.testing.assert_array_equal(jax.jit(select)(scores), want)
    assert (want >= 0).any() and (want[-1, -1] == -1).all() == several


def test_a_tokens_long_row_counts_in_as_many_kernels_as_its_sort(h100, monkeypatch):
    """Compiled for an H100 without a GPU, one token's row of 4,160 scores (a 4,096-token context)
    selects its top-2048 by counting in no more launches than the sort it replaces (the sort with
    the bound lowered), none of them spilling registers (the compile refuses spills); 8 tokens a
    call are past the bound and sort."""
    from jaxspec import aot

    def compiled(rows):
        return aot.compile_gpu(lambda s: select_topk(s, 2048), jax.ShapeDtypeStruct((1, rows, 4160), jnp.float32),
                               devices=h100)

    assert 4160 * 4160 * 8 > contracts.SELECT_COUNT_LIMIT >= 4160 * 4160 * 4  # the k = 3 window counts
    counted, window = compiled(1), compiled(8)
    monkeypatch.setattr(contracts, "SELECT_COUNT_LIMIT", 0)
    sorted_ = compiled(1)
    # the [S, S] comparison's work where it counts, none where it sorts
    assert aot.program_cost(counted).flops > 4160 * 4160 > max(aot.program_cost(p).flops for p in (sorted_, window))
    assert 0 < sum(aot.launch_counts(counted).values()) <= sum(aot.launch_counts(sorted_).values())


@pytest.mark.gpu
def test_select_topk_counts_a_windows_long_rows_as_the_gpus_sort_selects():
    """On a GPU, at the decode step's shapes (a k = 3 window's 4 tokens over 4,160 slots, top-2048),
    the count gives the indices of XLA's GPU sort (its total order and ties, on scores with many
    ties, signed zeros and invisible slots), and both numpy's."""
    rng = np.random.default_rng(11)
    scores = rng.integers(-40, 40, (1, 4, 4160)).astype(np.float32) / 4
    scores[rng.random(scores.shape) < 0.05] = -0.0
    scores[:, :, 3000:] = -np.inf
    assert scores.size * scores.shape[-1] <= contracts.SELECT_COUNT_LIMIT < scores.shape[-1] * scores.size * 2
    counted = np.asarray(jax.jit(lambda s: select_topk(s, 2048))(scores))
    assert "top_k" not in str(jax.make_jaxpr(lambda s: select_topk(s, 2048))(scores))
    doubled = np.concatenate([scores, scores], axis=1)  # 8 tokens a call: past the bound, sorted
    assert "top_k" in str(jax.make_jaxpr(lambda s: select_topk(s, 2048))(doubled))
    sorted_ = np.asarray(jax.jit(lambda s: select_topk(s, 2048))(doubled))
    np.testing.assert_array_equal(counted, sorted_[:, :4])
    np.testing.assert_array_equal(counted, sorted_[:, 4:])
    np.testing.assert_array_equal(counted, _stable_top(scores, 2048))


def test_places_are_the_order_of_a_stable_descending_sort(way):
    values = _tied(jax.random.key(3), (6, 40), levels=5)
    order = np.argsort(-np.asarray(values), axis=-1, kind="stable")
    expected = np.argsort(order, axis=-1)
    np.testing.assert_array_equal(ranks.places(values), expected)


def test_both_ways_order_nan_and_signed_zeros_alike(monkeypatch):
    """The IEEE total order: +NaN > +inf > 1 > +0.0 > -0.0 > -inf > -NaN, equal keys by index."""
    nan = jnp.float32(jnp.nan)
    row = jnp.array([0.0, -0.0, nan, 1.0, -nan, jnp.inf, -jnp.inf, 1.0, -0.0, 0.0, nan], jnp.float32)
    expected = [2, 10, 5, 3, 7, 0, 9, 1, 8, 6, 4]
    counted = ranks.top_k_indices(row, row.shape[0])
    monkeypatch.setattr(ranks, "COUNT_LIMIT", 0)
    np.testing.assert_array_equal(counted, expected)
    np.testing.assert_array_equal(ranks.top_k_indices(row, row.shape[0]), expected)
    assert int(ranks.total_order_keys(jnp.float32(-0.0))) < int(ranks.total_order_keys(jnp.float32(0.0)))


def test_sum_of_best_two_is_the_sum_of_lax_top_k_in_one_reduction():
    """Bit for bit `jnp.sum(lax.top_k(values, 2)[0], -1)` on rows with ties, infinities and NaN
    (whose place in the total order decides what is summed), at 2 values a row and at 32."""
    nan = jnp.float32(jnp.nan)
    special = jnp.array([[nan, 1.0, 0.5, -jnp.inf], [-nan, -jnp.inf, -jnp.inf, -nan], [jnp.inf, 2.0, jnp.inf, 0.0],
                         [-0.0, 0.0, -0.0, -1.0]], jnp.float32)
    for values in (special, _tied(jax.random.key(5), (3, 8, 32)), _tied(jax.random.key(6), (4, 2))):
        got = ranks.sum_of_best_two(values)
        want = jnp.sum(jax.lax.top_k(values, 2)[0], axis=-1)
        assert got.shape == values.shape[:-1] and got.dtype == jnp.float32
        bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)  # noqa: E731  (signed zeros, NaN's sign)
        np.testing.assert_array_equal(bits(got), bits(want))
    with pytest.raises(ValueError, match=r"at least 2 values"):
        ranks.sum_of_best_two(jnp.zeros((3, 1)))


def test_short_rows_count_without_a_reduction_for_a_gpu():
    """Traced for a GPU, rows of at most UNROLLED_LIMIT values are counted by elementwise additions
    (no reduce in the program), longer ones by a reduction; on the CPU always by a reduction. Each
    way gives a stable descending sort's places; likewise the dispatch of as many assignments (a
    B 1 token's 8): its order, places and group sizes."""
    from jaxspec.pallas_kernels.backend import gpu_lowering

    for length in (ranks.UNROLLED_LIMIT, ranks.UNROLLED_LIMIT + 1):
        values = _tied(jax.random.key(length), (5, length), levels=4)
        expected = np.argsort(np.argsort(-np.asarray(values), axis=-1, kind="stable"), axis=-1)
        ids = jax.random.randint(jax.random.key(length), (length,), 0, 256)
        programs = lambda: (jax.make_jaxpr(ranks.places)(values),  # noqa: E731
                            jax.make_jaxpr(lambda g: ranks.sort_by_group(g, 256))(ids))
        for jaxpr in programs():
            assert "reduce_sum" in str(jaxpr)
        with gpu_lowering():
            for jaxpr in programs():
                assert ("reduce_sum" in str(jaxpr)) == (length > ranks.UNROLLED_LIMIT)
            places = jax.core.eval_jaxpr(programs()[0].jaxpr, programs()[0].consts, values)[0]
        np.testing.assert_array_equal(ranks.places(values), expected)
        np.testing.assert_array_equal(places, expected)


def test_sort_by_group_is_a_stable_argsort_its_inverse_and_bincount(way):
    for seed, (count, groups) in enumerate([(1, 4), (8, 256), (24, 5), (96, 256)]):
        ids = jax.random.randint(jax.random.key(seed), (count,), 0, groups)
        order, position, sizes = ranks.sort_by_group(ids, groups)
        np.testing.assert_array_equal(order, np.argsort(np.asarray(ids), kind="stable"))
        np.testing.assert_array_equal(np.asarray(order)[np.asarray(position)], np.arange(count))
        np.testing.assert_array_equal(sizes, np.bincount(np.asarray(ids), minlength=groups))
        assert order.dtype == position.dtype == sizes.dtype == jnp.int32


def test_bad_k_and_shapes_are_refused():
    with pytest.raises(ValueError, match=r"k=0: must be in \[1, 5\]"):
        ranks.top_k_indices(jnp.zeros((2, 5)), 0)
    with pytest.raises(ValueError, match=r"k=6: must be in \[1, 5\]"):
        ranks.top_k_indices(jnp.zeros((2, 5)), 6)
    with pytest.raises(ValueError, match=r"groups: must be \[A\]"):
        ranks.sort_by_group(jnp.zeros((2, 3), jnp.int32), 4)


def _sorted_router(config, choice):
    """The group-limited top-k as the router computed it with XLA's sorts (an independent
    implementation of DeepSeek-V3's `noaux_tc` selection)."""
    tokens, experts = choice.shape
    per_group = experts // config.n_group
    grouped = choice.reshape(tokens, config.n_group, per_group)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    best = jax.lax.top_k(group_score, config.topk_group)[1]
    keep = jnp.zeros((tokens, config.n_group), bool).at[jnp.arange(tokens)[:, None], best].set(True)
    return jax.lax.top_k(jnp.where(jnp.repeat(keep, per_group, axis=1), choice, -jnp.inf),
                         config.num_experts_per_tok)[1]


def test_router_selects_as_the_sorts_did_and_a_token_alone_as_among_others(monkeypatch):
    """DeepSeek-V3.2's router (256 experts in 8 groups, top-4 groups, top-8): the counted selection
    equals the sorts', ties included (scores on a coarse grid), and a token's experts chosen alone
    (counted) equal its row's among 300 tokens chosen with COUNT_LIMIT forcing the sorts."""
    config = preset("deepseek-v3.2")
    dim, experts = 64, config.n_routed_experts
    key_x, key_w, key_b = jax.random.split(jax.random.key(11), 3)
    x = jax.random.normal(key_x, (300, dim))
    gate = jnp.round(jax.random.normal(key_w, (dim, experts)) * 4) / 64  # coarse: tied scores
    bias = jnp.round(jax.random.normal(key_b, (experts,)) * 8) / 64
    choice = jax.nn.sigmoid(x @ gate) + bias
    assert len(np.unique(np.asarray(choice[:40]))) < 40 * experts  # ties exist
    counted = moe._top_k_experts(config, choice[:40])
    np.testing.assert_array_equal(counted, _sorted_router(config, choice[:40]))

    alone = [moe._top_k_experts(config, choice[t:t + 1])[0] for t in (0, 7, 299)]
    monkeypatch.setattr(ranks, "COUNT_LIMIT", 0)
    among = moe._top_k_experts(config, choice)
    for row, t in zip(alone, (0, 7, 299)):
        np.testing.assert_array_equal(row, among[t])


def _places_by_reduction(values):
    """values [..., N] -> each one's place in its row, as one reduction over the [..., N, N] comparison."""
    keys, index = ranks.total_order_keys(values), jnp.arange(values.shape[-1])
    other, own = keys[..., None, :], keys[..., :, None]
    return jnp.sum((other > own) | ((other == own) & (index < index[:, None])), axis=-1)


def _router_by_places(config, scores, bias):
    """The router as it ran before its chain was shortened: a group's best two summed through their
    places, every place a reduction, a reduction over the weights for their sum. Weights and
    experts [T, k]."""
    choice = scores + bias
    tokens, experts = choice.shape
    per_group = experts // config.n_group
    grouped = choice.reshape(tokens, config.n_group, per_group)
    group_score = jnp.sum(jnp.where(_places_by_reduction(grouped) < 2, grouped, 0.0), -1)
    keep = _places_by_reduction(group_score) < config.topk_group
    chosen = ranks.top_k_indices(jnp.where(jnp.repeat(keep, per_group, axis=1), choice, -jnp.inf),
                                 config.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, chosen, axis=1)
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * config.routed_scaling_factor, chosen


@pytest.mark.parametrize("num_tokens", [1, 32])
def test_router_chain_compiled_for_h100_launches_fewer_kernels(h100, num_tokens):
    """DeepSeek-V3.2's routing after its gate, compiled for sm_90a without a GPU: fewer kernels than
    the places-and-reductions formulation, which picks the same experts (bit for bit, on the
    CPU) and weights within float32 rounding of a sum's order."""
    from jaxspec import aot
    from jaxspec.aot.analysis import is_thunk_kind

    config = preset("deepseek-v3.2")
    key_s, key_b = jax.random.split(jax.random.key(num_tokens))
    scores = jax.nn.sigmoid(jax.random.normal(key_s, (num_tokens, config.n_routed_experts)))
    bias = jax.random.normal(key_b, (config.n_routed_experts,)) / 8

    shortened = lambda s, b: moe.choose(config, s, b)  # noqa: E731
    (got_w, got_e), (want_w, want_e) = shortened(scores, bias), _router_by_places(config, scores, bias)
    np.testing.assert_array_equal(got_e, want_e)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-6)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (scores, bias)]
    kernels = lambda fn: sum(n for name, n in aot.launch_counts(aot.compile_gpu(  # noqa: E731
        fn, *specs, devices=h100)).items() if not is_thunk_kind(name))
    assert kernels(shortened) < kernels(lambda s, b: _router_by_places(config, s, b))
