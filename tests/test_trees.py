"""Draft trees: static trees from choices lists, the jittable tree helpers, EAGLE-2 dynamic trees,
and path compaction. References here are written independently of jaxspec.trees."""

from __future__ import annotations

import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import trees
from jaxspec.trees import StaticTree

EXAMPLE_CHOICES = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


def closure_of_parents(parents: np.ndarray) -> np.ndarray:
    """[N] parents -> [N, N] reflexive-transitive closure of the child->parent relation (Warshall)."""
    num_nodes = parents.size
    reach = np.eye(num_nodes, dtype=bool)
    for child, parent in enumerate(parents):
        if parent >= 0:
            reach[child, parent] = True
    for middle in range(num_nodes):
        reach |= reach[:, middle : middle + 1] & reach[middle : middle + 1, :]
    return reach


def random_parents(rng: np.random.Generator, num_nodes: int) -> np.ndarray:
    """A random tree in window order: each node's parent is an earlier node."""
    return np.array([-1] + [rng.integers(0, n) for n in range(1, num_nodes)], np.int32)


def random_choices(rng: np.random.Generator, num_nodes: int, top_k: int) -> list[list[int]]:
    """A random valid choices list, in random order."""
    paths = {()}
    while len(paths) < num_nodes + 1:
        parent = sorted(paths)[rng.integers(len(paths))]
        if len(parent) < 4:
            paths.add(parent + (int(rng.integers(top_k)),))
    choices = [list(path) for path in paths if path]
    rng.shuffle(choices)
    return choices


TREES = {
    "small": trees.SMALL_TREE,
    "eagle": trees.EAGLE_TREE,
    "example": StaticTree(EXAMPLE_CHOICES),
    "random": StaticTree(random_choices(np.random.default_rng(0), 30, 5)),
}


@pytest.mark.parametrize("name", sorted(TREES))
def test_static_tree_arrays_agree_with_choices(name):
    tree = TREES[name]
    paths = [()] + [tuple(path) for path in tree.choices]
    parents = tree.parents
    assert parents[0] == -1 and all(0 <= parents[n] < n for n in range(1, tree.num_nodes))
    for node in range(1, tree.num_nodes):
        assert paths[parents[node]] == paths[node][:-1]
        assert tree.ranks[node] == paths[node][-1] < tree.top_k
    closure = closure_of_parents(parents)
    np.testing.assert_array_equal(tree.ancestor_mask, closure)
    np.testing.assert_array_equal(tree.depths, closure.sum(axis=1) - 1)
    np.testing.assert_array_equal(tree.depths, [len(path) for path in paths])
    prefix_len = jnp.array([0, 5, 17])
    positions = trees.tree_positions(prefix_len, jnp.asarray(tree.depths))
    np.testing.assert_array_equal(positions, np.array([0, 5, 17])[:, None] + tree.depths[None, :])
    for depth in range(tree.max_depth + 1):
        nodes = tree.nodes_at_depth(depth)
        assert set(range(nodes.start, nodes.stop)) == {n for n in range(tree.num_nodes) if len(paths[n]) == depth}


@pytest.mark.parametrize("name", sorted(TREES))
def test_leaf_paths_are_the_root_to_leaf_chains(name):
    tree = TREES[name]
    leaves = [n for n in range(tree.num_nodes) if n not in set(tree.parents.tolist())]
    assert tree.leaf_paths.shape == (len(leaves), tree.max_depth + 1)
    for row, leaf in zip(tree.leaf_paths, leaves):
        chain = [leaf]
        while chain[-1] != 0:
            chain.append(int(tree.parents[chain[-1]]))
        assert row.tolist() == chain[::-1] + [-1] * (tree.max_depth + 1 - len(chain))


def test_example_choices_give_the_expected_tree():
    shuffled = [[0, 0, 0], [0, 1], [1], [0, 0], [0]]
    tree = StaticTree(shuffled)
    assert tree == StaticTree(EXAMPLE_CHOICES) and hash(tree) == hash(StaticTree(EXAMPLE_CHOICES))
    assert tree.choices == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert (tree.num_nodes, tree.max_depth, tree.top_k) == (6, 3, 2)
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.leaf_paths.tolist() == [[0, 2, -1, -1], [0, 1, 4, -1], [0, 1, 3, 5]]


def test_named_trees_have_the_documented_sizes():
    assert (trees.SMALL_TREE.num_nodes, trees.SMALL_TREE.max_depth, trees.SMALL_TREE.top_k) == (8, 3, 3)
    assert (trees.EAGLE_TREE.num_nodes, trees.EAGLE_TREE.max_depth, trees.EAGLE_TREE.top_k) == (26, 5, 4)
    assert len(trees.SMALL_TREE.leaf_paths) == 4 and len(trees.EAGLE_TREE.leaf_paths) == 11
    assert trees.STATIC_TREES == {"small": trees.SMALL_TREE, "eagle": trees.EAGLE_TREE}


def expected_accepted_length(tree: StaticTree, rank_accept=(0.6, 0.15, 0.07, 0.04)) -> float:
    return sum(float(np.prod([rank_accept[rank] for rank in path])) for path in tree.choices)


def test_named_trees_are_the_most_likely_paths_of_their_size():
    """The documented construction: the N most likely paths under the per-rank acceptance model."""
    rank_accept = (0.6, 0.15, 0.07, 0.04)
    for tree, expected in ((trees.SMALL_TREE, 1.58), (trees.EAGLE_TREE, 2.35)):
        assert expected_accepted_length(tree) == pytest.approx(expected, abs=0.005)
        frontier = [(-rank_accept[rank], (rank,)) for rank in range(tree.top_k)]
        best = []
        while len(best) < len(tree.choices):
            neg_prob, path = heapq.heappop(frontier)
            best.append(path)
            if len(path) < tree.max_depth:
                for rank in range(tree.top_k):
                    heapq.heappush(frontier, (neg_prob * rank_accept[rank], path + (rank,)))
        assert set(best) == set(tree.choices)


@pytest.mark.parametrize(
    "choices, top_k",
    [
        ([[0], [1, 0]], None),  # parent (1,) missing
        ([[0, 0]], None),  # parent (0,) missing
        ([[0], [1], [0]], None),  # duplicate
        ([[0], [3]], 3),  # rank beyond top-k
        ([[0], [0, 2]], 2),  # rank beyond top-k deeper down
        ([[0], [-1]], None),  # negative rank
        ([], None),  # no draft node
        ([[0], []], None),  # explicit root
    ],
)
def test_invalid_choices_raise(choices, top_k):
    with pytest.raises(ValueError):
        StaticTree(choices, top_k=top_k)


ancestor_mask = jax.jit(trees.ancestor_mask)
node_depths = jax.jit(trees.node_depths)


def test_ancestor_mask_and_depths_of_random_trees():
    rng = np.random.default_rng(1)
    for num_nodes in (1, 2, 9, 33):
        parents = np.stack([random_parents(rng, num_nodes) for _ in range(4)])
        mask = np.asarray(ancestor_mask(jnp.asarray(parents)))
        depths = np.asarray(node_depths(jnp.asarray(parents)))
        for row in range(4):
            closure = closure_of_parents(parents[row])
            np.testing.assert_array_equal(mask[row], closure)
            np.testing.assert_array_equal(depths[row], closure.sum(axis=1) - 1)


def test_child_tokens_take_the_parents_candidates_by_rank():
    tree = TREES["random"]
    rng = np.random.default_rng(2)
    tokens = np.zeros((3, tree.num_nodes), np.int32)
    for depth in range(1, tree.max_depth + 1):
        parent_nodes = tree.nodes_at_depth(depth - 1)
        candidates = rng.integers(0, 1000, (3, parent_nodes.stop - parent_nodes.start, tree.top_k + 1))
        tokens[:, tree.nodes_at_depth(depth)] = tree.child_tokens(depth, jnp.asarray(candidates))
        for node in range(tree.nodes_at_depth(depth).start, tree.nodes_at_depth(depth).stop):
            parent, rank = tree.parents[node], tree.ranks[node]
            np.testing.assert_array_equal(tokens[:, node], candidates[:, parent - parent_nodes.start, rank])


def test_compact_slots_moves_the_path_to_contiguous_slots():
    prefix_len = jnp.array([3, 0, 6])
    path = jnp.array([[0, 2, 5, -1], [0, 1, 2, 3], [0, -1, -1, -1]])
    path_len = jnp.array([3, 4, 1])
    src, dst = trees.compact_slots(prefix_len, path, path_len)
    assert src.tolist() == [[3, 5, 8, -1], [0, 1, 2, 3], [6, -1, -1, -1]]
    assert dst.tolist() == [[3, 4, 5, -1], [0, 1, 2, 3], [6, -1, -1, -1]]
    # gather every source, then scatter: the committed row reads the accepted window tokens in order
    cache = np.arange(3 * 12).reshape(3, 12)
    moved = cache.copy()
    for row in range(3):
        valid = src[row] >= 0
        moved[row, np.asarray(dst[row])[valid]] = cache[row, np.asarray(src[row])[valid]]
        window = cache[row, int(prefix_len[row]) :]
        expected = window[np.asarray(path[row])[: int(path_len[row])]]
        np.testing.assert_array_equal(moved[row, int(prefix_len[row]) : int(prefix_len[row] + path_len[row])], expected)


# --- dynamic (EAGLE-2) trees -------------------------------------------------------------------


def draft_logprobs(row: int, path: tuple[int, ...], vocab: int) -> np.ndarray:
    """A deterministic pseudo draft model: log-probabilities after `path` in `row`."""
    seed = hash((row,) + path) % (2**32)
    logits = np.random.default_rng(seed).normal(size=vocab) * 2.0
    return logits - np.log(np.sum(np.exp(logits)))


def eagle2_reference(row: int, vocab: int, branching: int, depth: int, num_draft: int) -> dict[tuple, float]:
    """EAGLE-2 by its definition on token paths: the kept {path: cumulative log-probability}."""
    def top_children(path, score):
        logprobs = draft_logprobs(row, path, vocab)
        return [(path + (int(t),), score + logprobs[t]) for t in np.argsort(-logprobs, kind="stable")[:branching]]

    candidates = dict(top_children((), 0.0))
    frontier = list(candidates.items())
    for _ in range(depth - 1):
        children = [child for path, score in frontier for child in top_children(path, score)]
        candidates.update(children)
        frontier = sorted(children, key=lambda item: -item[1])[:branching]
    return dict(sorted(candidates.items(), key=lambda item: -item[1])[:num_draft])


@functools.partial(jax.jit, static_argnames=("branching", "depth"))
def jit_init(root_logprobs, branching, depth):
    return trees.dynamic_tree_init(root_logprobs, branching, depth)


jit_expand = jax.jit(trees.dynamic_tree_expand)
jit_select = jax.jit(trees.dynamic_tree_select, static_argnames="num_draft")


def pool_path(tree: trees.DynamicTree, row: int, index: int) -> tuple[int, ...]:
    tokens, parents = np.asarray(tree.tokens[row]), np.asarray(tree.parents[row])
    path = []
    while index >= 0:
        path.append(int(tokens[index]))
        index = int(parents[index])
    return tuple(path[::-1])


def test_dynamic_tree_matches_eagle2_definition():
    vocab, branching, depth, num_draft, batch = 7, 3, 4, 12, 3
    root = jnp.asarray(np.stack([draft_logprobs(row, (), vocab) for row in range(batch)]))
    tree = jit_init(root, branching, depth)
    prev_frontier = None
    frontier_slots = {}  # (row, pool index) -> draft-window slot, to check frontier_mask
    for level in range(1, depth + 1):
        frontier = np.asarray(tree.frontier)
        for row in range(batch):
            for i in range(branching):
                frontier_slots[row, int(frontier[row, i])] = (level - 1) * branching + i
                # the frontier's draft-side mask holds exactly its ancestors' slots
                ancestors, index = set(), int(frontier[row, i])
                while index >= 0:
                    ancestors.add(frontier_slots[row, index])
                    index = int(tree.parents[row, index])
                assert set(np.flatnonzero(np.asarray(tree.frontier_mask[row, i]))) == ancestors
                parent = int(tree.parents[row, frontier[row, i]])
                expected_parent = 0 if parent < 0 else int(np.flatnonzero(np.asarray(prev_frontier[row]) == parent)[0])
                assert int(tree.frontier_parent[row, i]) == expected_parent
        if level == depth:
            break
        logprobs = np.array(
            [[draft_logprobs(row, pool_path(tree, row, int(n)), vocab) for n in frontier[row]] for row in range(batch)]
        )
        prev_frontier = frontier
        tree = jit_expand(tree, jnp.asarray(logprobs))
    assert int(tree.frontier_depth) == depth

    root_tokens = jnp.array([100, 101, 102])
    tokens, parents = jit_select(tree, root_tokens, num_draft=num_draft)
    tokens, parents = np.asarray(tokens), np.asarray(parents)
    depths = np.asarray(node_depths(jnp.asarray(parents)))
    assert tokens.shape == parents.shape == (batch, num_draft + 1)
    for row in range(batch):
        assert tokens[row, 0] == root_tokens[row] and parents[row, 0] == -1
        assert all(0 <= parents[row, n] < n for n in range(1, num_draft + 1))
        window_paths = [()]
        for node in range(1, num_draft + 1):
            window_paths.append(window_paths[parents[row, node]] + (int(tokens[row, node]),))
        assert set(window_paths[1:]) == set(eagle2_reference(row, vocab, branching, depth, num_draft))
        np.testing.assert_array_equal(depths[row], [len(path) for path in window_paths])


def test_dynamic_tree_scores_are_cumulative_logprobs_and_run_in_fori_loop():
    vocab, branching, depth, batch = 11, 2, 5, 4
    rng = np.random.default_rng(3)
    root = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(batch, vocab))))
    level_logprobs = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(depth - 1, batch, branching, vocab))))

    @jax.jit
    def grow(root, level_logprobs):
        tree = trees.dynamic_tree_init(root, branching, depth)
        expand = lambda level, tree: trees.dynamic_tree_expand(tree, level_logprobs[level])
        return jax.lax.fori_loop(0, depth - 1, expand, tree)

    tree = grow(root, level_logprobs)
    unrolled = jit_init(root, branching, depth)
    for level in range(depth - 1):
        unrolled = jit_expand(unrolled, level_logprobs[level])
    for field, other in zip(tree, unrolled):
        np.testing.assert_array_equal(field, other)
    scores = np.asarray(tree.scores)
    assert np.all(np.isfinite(scores))
    for row in range(batch):
        for index in range(scores.shape[1]):
            parent = int(tree.parents[row, index])
            parent_score = 0.0 if parent < 0 else scores[row, parent]
            assert parent < index and scores[row, index] <= parent_score + 1e-6


def test_dynamic_tree_select_rejects_a_size_beyond_the_pool():
    tree = jit_init(jnp.zeros((1, 5)), 2, 2)  # pool of 2 + 4 candidates
    with pytest.raises(ValueError):
        trees.dynamic_tree_select(tree, jnp.zeros(1, jnp.int32), 7)
