"""Acceptance rules and sampling: greedy chain / tree acceptance against brute force, logits
processing against a numpy reference, losslessness of rejection sampling (exact enumeration and a
Monte-Carlo check of the jitted sampler), and relaxed acceptance (shown to be lossy)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import acceptance, sampling
from jaxspec.trees import StaticTree

greedy_accept_chain = jax.jit(acceptance.greedy_accept_chain)
greedy_accept_tree = jax.jit(acceptance.greedy_accept_tree, static_argnames="max_depth")
relaxed_accept_chain = jax.jit(acceptance.relaxed_accept_chain)
relaxed_accept_tree = jax.jit(acceptance.relaxed_accept_tree, static_argnames="max_depth")
reject_tree = jax.jit(acceptance.reject_tree, static_argnames="max_depth")
emitted_tokens = jax.jit(acceptance.emitted_tokens)
processed_probs = jax.jit(sampling.processed_probs)
draft_candidates = jax.jit(sampling.draft_candidates, static_argnames="num_candidates")

CHAIN_2 = StaticTree([[0], [0, 0]])  # a chain of k = 2 drafts, as a tree
BRANCHY = StaticTree([[0], [1], [0, 0], [1, 0]])  # two siblings at the root, one child each


def random_parents(rng: np.random.Generator, batch: int, num_nodes: int) -> np.ndarray:
    """[B, N] random trees in window order (each parent an earlier node)."""
    return np.stack([[-1] + [rng.integers(0, n) for n in range(1, num_nodes)] for _ in range(batch)]).astype(np.int32)


def root_paths(parents_row: np.ndarray, node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(int(parents_row[path[-1]]))
    return path[::-1]


# --- greedy ----------------------------------------------------------------------------------


def test_greedy_chain_counts_leading_matches():
    draft = jnp.array([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 7]])
    target = jnp.array([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 0, 8]])
    accepted, bonus = greedy_accept_chain(draft, target)
    assert accepted.tolist() == [3, 1, 0, 2] and bonus.tolist() == [8, 6, 5, 0]


def test_greedy_tree_equals_brute_force_over_root_to_node_paths():
    rng = np.random.default_rng(0)
    batch, num_nodes, vocab, max_depth = 96, 12, 3, 11
    parents = random_parents(rng, batch, num_nodes)
    tokens = rng.integers(0, vocab, (batch, num_nodes)).astype(np.int32)
    target_tokens = rng.integers(0, vocab, (batch, num_nodes)).astype(np.int32)
    result = greedy_accept_tree(tokens, parents, target_tokens, max_depth=max_depth)
    emitted = np.asarray(emitted_tokens(tokens, result))
    deepest = []
    for row in range(batch):
        best = [0]
        for node in range(num_nodes):  # ascending, so the first of equally deep paths wins
            path = root_paths(parents[row], node)
            correct = all(tokens[row, child] == target_tokens[row, parent] for parent, child in zip(path, path[1:]))
            if correct and len(path) > len(best):
                best = path
        deepest.append(len(best) - 1)
        assert result.path[row].tolist() == best + [-1] * (max_depth + 1 - len(best))
        assert int(result.accepted[row]) == len(best) - 1
        assert int(result.bonus[row]) == target_tokens[row, best[-1]]
        expected = [int(tokens[row, n]) for n in best[1:]] + [int(target_tokens[row, best[-1]])]
        assert emitted[row].tolist() == expected + [-1] * (max_depth + 1 - len(expected))
    assert max(deepest) >= 3 and min(deepest) == 0  # the random trees exercise deep and empty paths


def test_greedy_tree_on_a_chain_equals_greedy_chain():
    rng = np.random.default_rng(1)
    batch, num_draft = 64, 4
    draft = rng.integers(0, 2, (batch, num_draft)).astype(np.int32)
    target = rng.integers(0, 2, (batch, num_draft + 1)).astype(np.int32)
    tokens = np.concatenate([np.full((batch, 1), 9, np.int32), draft], axis=1)
    parents = np.broadcast_to(np.arange(-1, num_draft, dtype=np.int32), (batch, num_draft + 1))
    result = greedy_accept_tree(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(target), max_depth=num_draft)
    accepted, bonus = greedy_accept_chain(jnp.asarray(draft), jnp.asarray(target))
    np.testing.assert_array_equal(result.accepted, accepted)
    np.testing.assert_array_equal(result.bonus, bonus)


# --- sampling: logits processing, keys, candidates ---------------------------------------------


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """One row's processed distribution, by its definition (no ties in the test logits)."""
    if temperature <= 0:
        return np.eye(logits.size)[np.argmax(logits)]
    scaled = logits / temperature
    order = np.argsort(-scaled)
    kept = order[:top_k] if top_k > 0 else order
    probs = np.exp(scaled[kept] - scaled[kept].max())
    probs /= probs.sum()
    # the smallest prefix of the sorted tokens whose mass reaches top_p
    num_kept = len(kept) if top_p >= 1 else int(np.searchsorted(np.cumsum(probs), top_p)) + 1
    out = np.zeros(logits.size)
    out[kept[:num_kept]] = np.exp(scaled[kept[:num_kept]] - scaled.max())
    return out / out.sum()


def test_processed_probs_match_the_per_row_definition():
    rng = np.random.default_rng(2)
    settings = [  # (temperature, top_k, top_p) per row
        (1.0, 0, 1.0), (0.0, 0, 1.0), (0.5, 0, 1.0), (1.3, 3, 1.0),
        (0.8, 0, 0.6), (1.0, 5, 0.3), (2.0, 1, 0.9), (0.7, 0, 0.05),
    ]
    batch, nodes, vocab = len(settings), 3, 17
    logits = (rng.normal(size=(batch, nodes, vocab)) * 2).astype(np.float32)
    params = sampling.sampling_params(batch, *map(list, zip(*settings)))
    probs = np.asarray(processed_probs(logits, params))
    for row, setting in enumerate(settings):
        for node in range(nodes):
            np.testing.assert_allclose(probs[row, node], reference_probs(logits[row, node], *setting), atol=2e-6)
    # without top-k / top-p in any row the sort is skipped; the result is the tempered softmax
    plain = sampling.sampling_params(batch, temperature=0.9)
    np.testing.assert_allclose(processed_probs(logits, plain), jax.nn.softmax(logits / 0.9), atol=1e-6)


def test_row_streams_depend_on_seed_step_and_row_only():
    key = jax.random.key(7)
    key_data = lambda keys: np.asarray(jax.random.key_data(keys))
    np.testing.assert_array_equal(key_data(sampling.row_keys(key, 0, 8))[:3], key_data(sampling.row_keys(key, 0, 3)))
    assert not np.any(np.all(key_data(sampling.row_keys(key, 1, 8)) == key_data(sampling.row_keys(key, 0, 8)), axis=-1))

    rng = np.random.default_rng(3)
    tree, batch, vocab = BRANCHY, 8, 6
    logits = np.tile(0.3 * rng.normal(size=(1, tree.num_nodes, vocab)), (batch, 1, 1)).astype(np.float32)
    tokens = np.tile(rng.integers(0, vocab, (1, tree.num_nodes)), (batch, 1)).astype(np.int32)

    @jax.jit
    def draws(logits, tokens):
        keys = sampling.row_keys(key, 0, batch)
        params = sampling.sampling_params(batch)
        candidates, probs = sampling.draft_candidates(keys, 1, logits[:, :1], params, 5)
        parents = jnp.broadcast_to(tree.parents, tokens.shape)
        probs = sampling.processed_probs(logits, params)
        return candidates, acceptance.speculative_sample_tree(keys, tokens, parents, probs, probs, tree.max_depth)

    candidates, result = draws(logits, tokens)
    # identical inputs in every row, yet each row draws its own stream
    assert len({tuple(row) for row in np.asarray(candidates[:, 0])}) == batch
    # other rows' inputs do not change a row's draws
    other_logits, other_tokens = logits.copy(), tokens.copy()
    other_logits[3:] = rng.normal(size=other_logits[3:].shape)
    other_tokens[3:] = rng.integers(0, vocab, other_tokens[3:].shape)
    other_candidates, other_result = draws(other_logits, other_tokens)
    np.testing.assert_array_equal(candidates[:3], other_candidates[:3])
    for field, other_field in zip(result, other_result):
        np.testing.assert_array_equal(field[:3], other_field[:3])


def test_draft_candidates_greedy_rows_take_top_k_and_sampled_rows_draw_from_q():
    rng = np.random.default_rng(4)
    batch, vocab = 4096, 5
    logits = jnp.asarray(np.tile(rng.normal(size=(1, 2, vocab)), (batch, 1, 1)), jnp.float32)
    params = sampling.sampling_params(batch, temperature=np.arange(batch) % 2)  # even rows greedy
    keys = jax.jit(sampling.row_keys, static_argnames="num_rows")(jax.random.key(0), 0, num_rows=batch)
    candidates, probs = draft_candidates(keys, 1, logits, params, num_candidates=3)
    top_3 = np.argsort(-np.asarray(logits[0]), axis=-1)[:, :3]
    np.testing.assert_array_equal(candidates[0::2], np.broadcast_to(top_3, (batch // 2, 2, 3)))
    np.testing.assert_allclose(probs[1], jax.nn.softmax(logits[1]), atol=1e-6)
    # sampled rows: the 3 candidates of each node are independent draws from q
    for node in range(2):
        drawn = np.asarray(candidates[1::2, node])
        frequencies = np.bincount(drawn.ravel(), minlength=vocab) / drawn.size
        np.testing.assert_allclose(frequencies, probs[1, node], atol=0.02)
        pair_frequencies = np.bincount(drawn[:, 0] * vocab + drawn[:, 1], minlength=vocab**2) / len(drawn)
        np.testing.assert_allclose(pair_frequencies, np.outer(probs[1, node], probs[1, node]).ravel(), atol=0.02)


# --- rejection sampling: the exact model ----------------------------------------------------


def residual(target: np.ndarray, draft: np.ndarray) -> np.ndarray:
    excess = np.maximum(target - draft, 0.0)
    return excess / excess.sum() if excess.sum() > 0 else target


def walk_outcomes(children, tokens, target_at, proposal_at, decide, node=0, weight=1.0, path=(0,)):
    """Every outcome of the SpecInfer walk below `node`: yields (weight, path, bonus distribution).

    target_at(node) -> p after node; proposal_at(parent, token) -> the distribution the child was
    drawn from; decide(child, a) -> [(accepted, weight)] for acceptance probability a."""

    def try_children(index, remaining, weight):
        if index == len(children[node]):
            yield weight, path, remaining
            return
        child = children[node][index]
        token = tokens[child]
        proposal = proposal_at(node, token)
        if proposal[token] > 0:
            accept_prob = min(1.0, remaining[token] / proposal[token])
        else:
            accept_prob = float(remaining[token] > 0)
        for accepted, branch_weight in decide(child, accept_prob):
            if branch_weight == 0:
                continue
            if accepted:
                yield from walk_outcomes(
                    children, tokens, target_at, proposal_at, decide, child, weight * branch_weight, path + (child,)
                )
            else:
                yield from try_children(index + 1, residual(remaining, proposal), weight * branch_weight)

    yield from try_children(0, target_at(node), weight)


def enumerate_all(child, accept_prob):
    return [(True, accept_prob), (False, 1.0 - accept_prob)]


def children_of(tree: StaticTree) -> list[list[int]]:
    children = [[] for _ in range(tree.num_nodes)]
    for node in range(1, tree.num_nodes):
        children[tree.parents[node]].append(node)
    return children


def random_tables(rng: np.random.Generator, vocab: int, horizon: int) -> list[np.ndarray]:
    """A toy language model: tables[t][x_1..x_t] = distribution of x_{t+1}; every probability is
    at least 0.15 / vocab so Monte-Carlo cells are well filled."""
    return [0.85 * rng.dirichlet(np.ones(vocab), size=(vocab,) * length) + 0.15 / vocab for length in range(horizon)]


def sequence_probs(tables: list[np.ndarray], prefix: tuple[int, ...], horizon: int) -> np.ndarray:
    """[V] * horizon: probability of each full sequence given that it starts with `prefix`."""
    vocab = tables[0].size
    out = np.zeros((vocab,) * horizon)
    for rest in itertools.product(range(vocab), repeat=horizon - len(prefix)):
        sequence = prefix + rest
        out[sequence] = np.prod([tables[t][sequence[:t]][sequence[t]] for t in range(len(prefix), horizon)])
    return out


def node_context(tree: StaticTree, tokens, node: int) -> tuple[int, ...]:
    return tuple(int(tokens[a]) for a in np.flatnonzero(tree.ancestor_mask[node])[1:])


def exact_output(tree: StaticTree, target: list[np.ndarray], draft: list[np.ndarray], sampled: bool) -> np.ndarray:
    """Exact distribution of the sequence of length D + 1 that one speculative step emits (then
    completed from the target), over every draft outcome: drafts i.i.d. from q when `sampled`, else
    the parent's top-rank tokens, verified by the SpecInfer rule."""
    vocab, horizon = target[0].size, tree.max_depth + 1
    children = children_of(tree)
    outcomes = []  # (probability, tokens by node)
    if sampled:
        for drafted in itertools.product(range(vocab), repeat=tree.num_nodes - 1):
            tokens = (0,) + drafted
            weight = np.prod([
                draft[tree.depths[n] - 1][node_context(tree, tokens, tree.parents[n])][tokens[n]]
                for n in range(1, tree.num_nodes)
            ])
            outcomes.append((weight, tokens))
    else:
        tokens = [0] * tree.num_nodes
        for n in range(1, tree.num_nodes):
            q = draft[tree.depths[n] - 1][node_context(tree, tokens, tree.parents[n])]
            tokens[n] = int(np.argsort(-q, kind="stable")[tree.ranks[n]])
        outcomes.append((1.0, tuple(tokens)))
    total = np.zeros((vocab,) * horizon)
    for weight, tokens in outcomes:
        target_at = lambda node: target[tree.depths[node]][node_context(tree, tokens, node)]
        if sampled:
            proposal_at = lambda node, token: draft[tree.depths[node]][node_context(tree, tokens, node)]
        else:
            proposal_at = lambda node, token: np.eye(vocab)[token]
        for branch_weight, path, bonus_probs in walk_outcomes(children, tokens, target_at, proposal_at, enumerate_all):
            emitted = tuple(tokens[n] for n in path[1:])
            for bonus, bonus_prob in enumerate(bonus_probs):
                total += weight * branch_weight * bonus_prob * sequence_probs(target, emitted + (bonus,), horizon)
    return total


@pytest.mark.parametrize("tree", [CHAIN_2, BRANCHY], ids=["chain_k2", "tree"])
@pytest.mark.parametrize("sampled", [True, False], ids=["drafts_from_q", "top_rank_drafts"])
def test_rejection_sampling_is_exactly_lossless(tree, sampled):
    rng = np.random.default_rng(5)
    vocab, horizon = 4, tree.max_depth + 1
    target, draft = random_tables(rng, vocab, horizon), random_tables(rng, vocab, horizon)
    output = exact_output(tree, target, draft, sampled)
    np.testing.assert_allclose(output, sequence_probs(target, (), horizon), atol=1e-6)
    assert abs(output.sum() - 1.0) < 1e-9


@pytest.mark.parametrize("sampled", [True, False], ids=["draft_probs", "deterministic"])
def test_reject_tree_follows_the_exact_model(sampled):
    """The jitted walk takes, for given uniforms, the same path and residual as the model above."""
    rng = np.random.default_rng(6)
    batch, num_nodes, vocab, max_depth = 200, 9, 5, 8
    parents = random_parents(rng, batch, num_nodes)
    tokens = rng.integers(0, vocab, (batch, num_nodes)).astype(np.int32)
    target_probs = rng.dirichlet(np.ones(vocab) * 0.7, size=(batch, num_nodes)).astype(np.float32)
    draft_probs = rng.dirichlet(np.ones(vocab) * 0.7, size=(batch, num_nodes)).astype(np.float32)
    uniforms = rng.uniform(size=(batch, num_nodes)).astype(np.float32)
    path, accepted, bonus_probs = reject_tree(
        jnp.asarray(uniforms), jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(target_probs),
        jnp.asarray(draft_probs) if sampled else None, max_depth=max_depth,
    )
    depths = []
    for row in range(batch):
        children = [[n for n in range(num_nodes) if parents[row, n] == node] for node in range(num_nodes)]
        if sampled:
            proposal_at = lambda node, token: draft_probs[row, node]
        else:
            proposal_at = lambda node, token: np.eye(vocab)[token]
        decide = lambda child, accept_prob: [(uniforms[row, child] < accept_prob, 1.0)]
        (_, expected_path, expected_residual), = walk_outcomes(
            children, tokens[row], lambda node: target_probs[row, node].astype(np.float64), proposal_at, decide
        )
        depths.append(len(expected_path) - 1)
        assert path[row].tolist() == list(expected_path) + [-1] * (max_depth + 1 - len(expected_path))
        assert int(accepted[row]) == len(expected_path) - 1
        np.testing.assert_allclose(bonus_probs[row], expected_residual, atol=1e-5)
    assert max(depths) >= 2 and min(depths) == 0


# --- rejection sampling: the jitted sampler -------------------------------------------------


def test_chain_sampler_equals_tree_sampler_on_a_chain():
    rng = np.random.default_rng(7)
    batch, num_draft, vocab = 512, 3, 6

    @jax.jit
    def chain_and_tree(target_probs, draft_probs, draft):
        keys = sampling.row_keys(jax.random.key(1), 3, batch)
        tokens = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), draft], axis=1)
        parents = jnp.broadcast_to(jnp.arange(-1, num_draft, dtype=jnp.int32), tokens.shape)
        tree_draft_probs = jnp.concatenate([draft_probs, jnp.zeros((batch, 1, vocab))], axis=1)
        return (
            acceptance.speculative_sample_chain(keys, draft, target_probs, draft_probs),
            acceptance.speculative_sample_tree(keys, tokens, parents, target_probs, tree_draft_probs, num_draft),
        )

    target_probs = rng.dirichlet(np.ones(vocab), size=(batch, num_draft + 1)).astype(np.float32)
    draft_probs = rng.dirichlet(np.ones(vocab), size=(batch, num_draft)).astype(np.float32)
    draft = rng.integers(0, vocab, (batch, num_draft)).astype(np.int32)
    (accepted, bonus), result = chain_and_tree(target_probs, draft_probs, draft)
    np.testing.assert_array_equal(result.accepted, accepted)
    np.testing.assert_array_equal(result.bonus, bonus)
    assert len(set(np.asarray(accepted).tolist())) == num_draft + 1  # every count occurs


def draft_tree(keys, tree: StaticTree, params, draft_logits_after):
    """[B, N] tokens of `tree` drafted depth by depth with `draft_candidates`, as the loop does.
    draft_logits_after(tokens [B, N]) -> [B, N, V]: the draft's logits after each node (reading only
    the tokens on the node's path, which are filled by then)."""
    tokens = jnp.zeros((keys.shape[0], tree.num_nodes), jnp.int32)
    for depth in range(1, tree.max_depth + 1):
        logits = draft_logits_after(tokens)[:, tree.nodes_at_depth(depth - 1)]
        candidates, _ = sampling.draft_candidates(keys, depth, logits, params, tree.top_k)
        tokens = tokens.at[:, tree.nodes_at_depth(depth)].set(tree.child_tokens(depth, candidates))
    return tokens


def test_greedy_rows_reduce_to_greedy_acceptance():
    """With temperature 0 (one-hot target and draft) both tree modes and the chain are greedy."""
    rng = np.random.default_rng(8)
    tree, batch, vocab = BRANCHY, 256, 3
    chain = [1, 3]  # nodes 0 -> 1 -> 3 form a chain

    @jax.jit
    def greedy_and_sampled(target_logits, draft_logits):
        keys = sampling.row_keys(jax.random.key(2), 0, batch)
        greedy = sampling.sampling_params(batch, temperature=0.0)
        tokens = draft_tree(keys, tree, greedy, lambda tokens: draft_logits)  # distinct siblings
        target_probs = sampling.processed_probs(target_logits, greedy)
        draft_probs = sampling.processed_probs(draft_logits, greedy)
        parents = jnp.broadcast_to(tree.parents, tokens.shape)
        target_tokens = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
        return (
            acceptance.greedy_accept_tree(tokens, parents, target_tokens, tree.max_depth),
            [
                acceptance.speculative_sample_tree(keys, tokens, parents, target_probs, mode, tree.max_depth)
                for mode in (draft_probs, None)
            ],
            acceptance.greedy_accept_chain(tokens[:, chain], target_tokens[:, [0, *chain]]),
            acceptance.speculative_sample_chain(
                keys, tokens[:, chain], target_probs[:, [0, *chain]], draft_probs[:, [0, 1]]
            ),
        )

    target_logits, draft_logits = rng.normal(size=(2, batch, tree.num_nodes, vocab)).astype(np.float32)
    expected, sampled, expected_chain, sampled_chain = greedy_and_sampled(target_logits, draft_logits)
    assert np.any(expected.accepted == 0) and np.any(expected.accepted == tree.max_depth)
    for result in sampled:
        for field, expected_field in zip(result, expected):
            np.testing.assert_array_equal(field, expected_field)
    for field, expected_field in zip(sampled_chain, expected_chain):
        np.testing.assert_array_equal(field, expected_field)


def table_probs(tables: list[jax.Array], tree: StaticTree, tokens: jax.Array) -> jax.Array:
    """tokens [B, N] -> [B, N, V]: the table's distribution after each node's path."""
    batch, vocab = tokens.shape[0], tables[0].size
    out = []
    for node in range(tree.num_nodes):
        ancestors = np.flatnonzero(tree.ancestor_mask[node])[1:]
        out.append(jnp.broadcast_to(tables[len(ancestors)][tuple(tokens[:, a] for a in ancestors)], (batch, vocab)))
    return jnp.stack(out, axis=1)


@functools.partial(jax.jit, static_argnames=("batch", "tree", "draft_temperature", "with_draft_probs"))
def speculative_step_on_tables(target_tables, draft_tables, batch, tree, draft_temperature, with_draft_probs):
    """One speculative step of the toy language models for `batch` rows: draft (sampled, or top-rank
    when the draft temperature is 0), verify by rejection sampling -> (emitted [B, D + 1], accepted [B])."""
    keys = sampling.row_keys(jax.random.key(11), 0, batch)
    params = sampling.sampling_params(batch, temperature=draft_temperature)
    tokens = draft_tree(keys, tree, params, lambda tokens: jnp.log(table_probs(draft_tables, tree, tokens)))
    target_probs, draft_probs = table_probs(target_tables, tree, tokens), table_probs(draft_tables, tree, tokens)
    if tree == CHAIN_2:
        accepted, bonus = acceptance.speculative_sample_chain(keys, tokens[:, 1:], target_probs, draft_probs[:, :-1])
        path = jnp.where(jnp.arange(tree.num_nodes) <= accepted[:, None], jnp.arange(tree.num_nodes), -1)
        result = acceptance.TreeAcceptance(path, accepted, bonus)
    else:
        parents = jnp.broadcast_to(tree.parents, tokens.shape)
        result = acceptance.speculative_sample_tree(
            keys, tokens, parents, target_probs, draft_probs if with_draft_probs else None, tree.max_depth
        )
    return acceptance.emitted_tokens(tokens, result), result.accepted


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    statistic = np.sum((counts - expected) ** 2 / expected)
    return float(jax.scipy.special.gammaincc((probs.size - 1) / 2, statistic / 2))


@pytest.mark.parametrize(
    "tree, draft_temperature, with_draft_probs",
    [(CHAIN_2, 1.0, True), (BRANCHY, 1.0, True), (BRANCHY, 0.0, False)],
    ids=["chain_k2", "tree_drafts_from_q", "tree_top_rank_drafts"],
)
def test_monte_carlo_output_distribution_matches_target(tree, draft_temperature, with_draft_probs):
    """2^17 rows in one batched call each: draft the tree with `draft_candidates` (sampled, or
    top-rank when the draft temperature is 0), verify, complete the sequence from the target, and
    compare the 64 sequence frequencies to the target by a chi-square test (p > 1e-3, fixed seeds)."""
    rng = np.random.default_rng(9)
    batch, vocab, horizon = 2**17, 4, tree.max_depth + 1
    target, draft = random_tables(rng, vocab, horizon), random_tables(rng, vocab, horizon)
    to_device = lambda tables: [jnp.asarray(table, jnp.float32) for table in tables]
    emitted, accepted = speculative_step_on_tables(
        to_device(target), to_device(draft), batch, tree, draft_temperature, with_draft_probs
    )
    sequences = np.array(emitted)
    for t in range(horizon):  # complete each row's sequence from the target
        missing = sequences[:, t] < 0
        probs = target[t][tuple(sequences[missing, :t].T)].reshape(-1, vocab)
        drawn = (rng.uniform(size=(missing.sum(), 1)) > np.cumsum(probs, axis=1)).sum(axis=1)
        sequences[missing, t] = np.minimum(drawn, vocab - 1)  # a uniform above a rounded-down total
    counts = np.bincount(np.ravel_multi_index(sequences.T, (vocab,) * horizon), minlength=vocab**horizon)
    expected = sequence_probs(target, (), horizon).ravel()
    assert chi_square_p_value(counts, expected) > 1e-3
    assert 0.5 * np.abs(counts / batch - expected).sum() < 0.015  # E[TV] <= 0.5 sqrt(64 / 2^17) = 0.011
    assert 0 < float(np.mean(accepted)) < tree.max_depth  # drafts are sometimes accepted, sometimes not


# --- relaxed acceptance (lossy) -------------------------------------------------------------


def test_relaxed_acceptance_accepts_close_runners_up_only():
    probs = jnp.asarray([[[0.5, 0.4, 0.1, 0.0], [0.1, 0.2, 0.6, 0.1]]])  # [B=1, k+1=2, V=4]
    cases = [  # (draft token, top_k, delta) -> accepted
        ((0, 1, 0.0), 1),  # the argmax: what greedy accepts
        ((1, 1, 0.5), 0),  # not in the top-1
        ((1, 2, 0.15), 1),  # second, within 0.1 <= 0.15 of the top
        ((1, 2, 0.05), 0),  # second, but 0.1 > 0.05 behind
        ((2, 2, 0.5), 0),  # third: outside the top-2
        ((2, 3, 0.45), 1),
    ]
    for (token, top_k, delta), expected in cases:
        accepted, bonus = relaxed_accept_chain(jnp.array([[token]]), probs, top_k=top_k, delta=delta)
        assert int(accepted[0]) == expected
        assert int(bonus[0]) == (2 if expected else 0)  # the target's argmax after the last accepted token


def test_relaxed_top_1_is_greedy_for_chain_and_tree():
    rng = np.random.default_rng(10)
    tree, batch, vocab = BRANCHY, 128, 3
    probs = jnp.asarray(rng.dirichlet(np.ones(vocab), size=(batch, tree.num_nodes)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, tree.num_nodes)), jnp.int32)
    parents = jnp.broadcast_to(tree.parents, (batch, tree.num_nodes))
    target_tokens = jnp.argmax(probs, axis=-1).astype(jnp.int32)
    relaxed = relaxed_accept_tree(tokens, parents, probs, top_k=1, delta=0.3, max_depth=tree.max_depth)
    greedy = greedy_accept_tree(tokens, parents, target_tokens, max_depth=tree.max_depth)
    for field, greedy_field in zip(relaxed, greedy):
        np.testing.assert_array_equal(field, greedy_field)
    chain = relaxed_accept_chain(tokens[:, 1:3], probs[:, :3], top_k=1, delta=0.3)
    for field, greedy_field in zip(chain, greedy_accept_chain(tokens[:, 1:3], target_tokens[:, :3])):
        np.testing.assert_array_equal(field, greedy_field)
    wider = relaxed_accept_tree(tokens, parents, probs, top_k=2, delta=0.3, max_depth=tree.max_depth)
    assert np.all(wider.accepted >= greedy.accepted) and np.any(wider.accepted > greedy.accepted)


def test_relaxed_acceptance_is_not_lossless():
    """Exactly: with the draft's first token x ~ q, the first emitted token under relaxed acceptance
    is x whenever x is a close runner-up, so its distribution moves away from the target's greedy
    output (a point mass on the argmax), which greedy acceptance reproduces exactly."""
    vocab = 5
    target_probs = np.array([0.34, 0.30, 0.20, 0.10, 0.06])
    q = np.array([0.1, 0.6, 0.2, 0.05, 0.05])
    drafts = jnp.arange(vocab, dtype=jnp.int32)[:, None]  # every draft outcome, one per row
    probs = jnp.asarray(np.tile(target_probs, (vocab, 2, 1)), jnp.float32)
    emitted = {}
    for rule in ("relaxed", "greedy"):
        if rule == "relaxed":
            accepted, bonus = relaxed_accept_chain(drafts, probs, top_k=2, delta=0.05)
        else:
            accepted, bonus = greedy_accept_chain(drafts, jnp.argmax(probs, axis=-1).astype(jnp.int32))
        first = np.where(np.asarray(accepted) > 0, np.asarray(drafts[:, 0]), np.asarray(bonus))
        emitted[rule] = np.bincount(first, weights=q, minlength=vocab)
    greedy_output = np.eye(vocab)[0]
    np.testing.assert_allclose(emitted["greedy"], greedy_output, atol=1e-12)
    np.testing.assert_allclose(emitted["relaxed"], [0.4, 0.6, 0, 0, 0], atol=1e-12)
    assert 0.5 * np.abs(emitted["relaxed"] - greedy_output).sum() == pytest.approx(0.6)
