"""Draft token trees: static trees from a choices list, dynamic (EAGLE-2) trees, and path compaction.

A tree lives in the verification window as N nodes per row. Node 0 is the root: the last committed
(bonus) token, whose target output scores the first draft level. Nodes are listed parents before
children, so `parents[b, n] < n` for n > 0 and `parents[b, 0] = -1`. Node n sits at RoPE position
`prefix_len + depth[n]` (siblings share a position) and in cache slot `prefix_len + n` (see
`jaxspec.pallas_kernels.visibility`); it sees the prefix and its ancestors, itself included, which is
`ancestor_mask [B, N, N]`. After acceptance the accepted path (window node indices, root first) is
moved to contiguous slots with `compact_slots`.

Static trees (`StaticTree`) follow the EAGLE/Medusa form: each draft node is a path of top-k ranks
from the root, e.g. `(0, 1)` = the rank-1 candidate after the rank-0 candidate. The drafter fills
them one depth at a time (`StaticTree.child_tokens`); the tree is the same for every row and step.

Dynamic trees (`DynamicTree`, EAGLE-2) are grown per row from the draft's log-probabilities. They are
step functions rather than one function taking a draft callback: the decoding loop owns the draft
model, its cache and its hidden states, and calls `dynamic_tree_init` once, `dynamic_tree_expand`
once per further depth (from a Python loop or a `lax.fori_loop`; every shape is fixed), and
`dynamic_tree_select` to obtain the verification window; `DynamicTreeSpec` fixes its shape.
`parse_tree` reads either kind from its command-line form, and `chain_tree` is the chain of k drafts
as a one-wide static tree.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)  # shared by every caller of a cached property
    return array


@dataclasses.dataclass(frozen=True)
class StaticTree:
    """A draft tree fixed before decoding, built from a choices list.

    choices: the draft nodes as paths of top-k ranks; stored sorted by (depth, ranks), which is the
      window order of nodes 1..N-1 (node 0 is the root). Every node's parent path must be present,
      paths are distinct, and ranks lie in [0, top_k); otherwise ValueError.
    top_k: candidates the drafter proposes per node; None = the largest rank used + 1.

    Hashable (by its fields), so it can be a static argument of `jax.jit`. The array properties are
    numpy constants shared by all rows; N = len(choices) + 1, D = max_depth.
    """

    choices: tuple[tuple[int, ...], ...]
    top_k: int | None = None

    def __post_init__(self):
        paths = [tuple(int(rank) for rank in path) for path in self.choices]
        if not paths:
            raise ValueError("StaticTree: choices is empty; a tree needs at least one draft node")
        if len(set(paths)) != len(paths):
            raise ValueError(f"StaticTree: duplicate paths in choices {paths}")
        known = set(paths)
        largest_rank = -1
        for path in paths:
            if not path:
                raise ValueError("StaticTree: the empty path is the root, which is implicit; remove it")
            if min(path) < 0:
                raise ValueError(f"StaticTree: path {path} has a negative rank")
            if len(path) > 1 and path[:-1] not in known:
                raise ValueError(f"StaticTree: path {path} has no parent {path[:-1]} in choices")
            largest_rank = max(largest_rank, max(path))
        top_k = largest_rank + 1 if self.top_k is None else self.top_k
        if largest_rank >= top_k:
            raise ValueError(f"StaticTree: rank {largest_rank} is beyond top_k={top_k}")
        object.__setattr__(self, "choices", tuple(sorted(paths, key=lambda path: (len(path), path))))
        object.__setattr__(self, "top_k", top_k)

    @property
    def num_nodes(self) -> int:
        """N: draft nodes plus the root."""
        return len(self.choices) + 1

    @property
    def max_depth(self) -> int:
        """D: depth of the deepest node (the root has depth 0)."""
        return len(self.choices[-1])

    @functools.cached_property
    def _paths(self) -> tuple[tuple[int, ...], ...]:
        return ((),) + self.choices

    @functools.cached_property
    def parents(self) -> np.ndarray:
        """[N] int32: window index of each node's parent; -1 for the root."""
        index = {path: n for n, path in enumerate(self._paths)}
        return _frozen(np.array([-1] + [index[path[:-1]] for path in self.choices], np.int32))

    @functools.cached_property
    def depths(self) -> np.ndarray:
        """[N] int32: path length; position offsets from the prefix."""
        return _frozen(np.array([len(path) for path in self._paths], np.int32))

    @functools.cached_property
    def ranks(self) -> np.ndarray:
        """[N] int32: each node's rank among its parent's candidates; -1 for the root."""
        return _frozen(np.array([-1] + [path[-1] for path in self.choices], np.int32))

    @functools.cached_property
    def ancestor_mask(self) -> np.ndarray:
        """[N, N] bool: node j is an ancestor of node n (itself included) iff j's path prefixes n's."""
        paths = self._paths
        return _frozen(np.array([[path[: len(other)] == other for other in paths] for path in paths]))

    @functools.cached_property
    def leaf_paths(self) -> np.ndarray:
        """[L, D + 1] int32: root-to-leaf window indices (root first), -1 padded; leaves in node order.

        Every root-to-node path is a prefix of one of these rows, which is what retrieving the
        accepted candidate from per-leaf results needs."""
        has_child = np.zeros(self.num_nodes, bool)
        has_child[self.parents[1:]] = True
        rows = np.full((int(np.sum(~has_child)), self.max_depth + 1), -1, np.int32)
        for row, leaf in enumerate(np.flatnonzero(~has_child)):
            ancestors = np.flatnonzero(self.ancestor_mask[leaf])  # ascending = root to leaf
            rows[row, : ancestors.size] = ancestors
        return _frozen(rows)

    def nodes_at_depth(self, depth: int) -> slice:
        """The window indices of the nodes at `depth`: a contiguous range, because nodes sort by depth."""
        start, stop = np.searchsorted(self.depths, [depth, depth + 1])
        return slice(int(start), int(stop))

    def child_tokens(self, depth: int, candidates: jax.Array) -> jax.Array:
        """candidates [B, M, C] (the drafter's candidates at the M nodes of depth - 1, in window order;
        C >= top_k) -> [B, nodes at depth] int32: each node's token, `candidates[parent, rank]`."""
        nodes = self.nodes_at_depth(depth)
        parent_offset = self.parents[nodes] - self.nodes_at_depth(depth - 1).start
        return candidates[:, parent_offset, self.ranks[nodes]]


# Named static trees. Each holds the N paths most likely to be accepted when the rank-r candidate is
# accepted with probability (0.6, 0.15, 0.07, 0.04)[r], independently at every depth: the
# construction behind the EAGLE / Medusa default trees, with acceptance rates typical of a one-layer
# draft head. Under that model the expected number of accepted draft tokens is the sum of the path
# probabilities: 1.58 for SMALL_TREE, 2.35 for EAGLE_TREE.
SMALL_TREE = StaticTree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
"""7 draft nodes, depth 3, top-3: a cheap tree for small batches on small GPUs."""

EAGLE_TREE = StaticTree(
    (
        (0,), (1,), (2,), (3,),
        (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0), (3, 0),
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 2, 0), (1, 0, 0), (2, 0, 0),
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0),
        (0, 0, 0, 0, 0),
    )
)
"""25 draft nodes, depth 5, top-4: the default tree (window of 26 tokens)."""

STATIC_TREES = {"small": SMALL_TREE, "eagle": EAGLE_TREE}


def chain_tree(num_draft: int) -> StaticTree:
    """The chain of `num_draft` >= 1 drafts as a one-wide static tree (each node the rank-0 candidate)."""
    return StaticTree(tuple((0,) * depth for depth in range(1, num_draft + 1)), top_k=1)


def is_chain(tree: StaticTree) -> bool:
    """True when every depth holds one node: the ancestor mask is then the causal one."""
    return tree.num_nodes == tree.max_depth + 1


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """parents [B, N] int32 (-1 for the root) -> [B, N, N] bool: node j is an ancestor of node n,
    itself included. Jittable; walks up the tree N - 1 times, enough for any depth."""
    num_nodes = parents.shape[1]
    node_ids = jnp.arange(num_nodes, dtype=jnp.int32)

    def climb(_, carry):
        mask, ancestor = carry
        ancestor = jnp.where(ancestor >= 0, jnp.take_along_axis(parents, jnp.maximum(ancestor, 0), axis=1), -1)
        return mask | (ancestor[:, :, None] == node_ids), ancestor

    start = jnp.broadcast_to(node_ids, parents.shape)
    mask, _ = jax.lax.fori_loop(0, num_nodes - 1, climb, (start[:, :, None] == node_ids, start))
    return mask


def node_depths(parents: jax.Array) -> jax.Array:
    """parents [B, N] -> [B, N] int32: number of proper ancestors (the root has depth 0)."""
    return jnp.sum(ancestor_mask(parents), axis=-1, dtype=jnp.int32) - 1


def tree_positions(prefix_len: jax.Array, depths: jax.Array) -> jax.Array:
    """prefix_len [B], depths [B, N] or [N] -> [B, N] int32 RoPE positions `prefix_len + depth`."""
    return (prefix_len[:, None] + depths).astype(jnp.int32)


def compact_slots(prefix_len: jax.Array, path: jax.Array, path_len: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Where the accepted path's cache entries move so the committed sequence is contiguous.

    prefix_len [B] int32 (slot of window node 0), path [B, D + 1] int32 window node indices root first,
    path_len [B] int32 valid entries (accepted + 1) -> src_slots, dst_slots [B, D + 1] int32, -1 past
    `path_len`. Entry i moves slot `prefix_len + path[i]` to `prefix_len + i`; as `path[i] >= i`, a
    move never reads a slot an earlier move wrote if all sources are gathered before any write.
    Entries whose source equals their destination (a chain-like prefix of the path) are no-ops."""
    step = jnp.arange(path.shape[1], dtype=jnp.int32)
    valid = step[None, :] < path_len[:, None]
    src_slots = jnp.where(valid, prefix_len[:, None] + path, -1)
    dst_slots = jnp.where(valid, prefix_len[:, None] + step[None, :], -1)
    return src_slots, dst_slots


class DynamicTree(NamedTuple):
    """An EAGLE-2 tree being grown. K = branching, D = depth, P = K + (D - 1) K^2 candidates.

    The candidate pool holds the root's top-K children (depth 1) and, for each later depth, the top-K
    children of each of the K frontier nodes, in that block order, so a candidate's parent always has
    a smaller pool index.

    tokens [B, P] int32, parents [B, P] int32 (pool index; -1 = child of the root),
    scores [B, P] float32: cumulative draft log-probability of the path (-inf before it is filled);
    frontier [B, K] int32: pool indices of the best K nodes of the deepest depth, expanded next;
    frontier_parent [B, K] int32: each frontier node's parent as an index into the previous frontier
      (0 at depth 1, whose parent is the root), to gather the draft's hidden states;
    frontier_mask [B, K, D * K] bool: ancestor mask of the frontier over the draft-side window, where
      the frontier of depth d occupies draft slots `(d - 1) * K + i` (the draft model writes only
      frontier nodes, so these slots hold every ancestor a frontier node has);
    frontier_depth [] int32: the frontier's depth, 1..D.
    """

    tokens: jax.Array
    parents: jax.Array
    scores: jax.Array
    frontier: jax.Array
    frontier_parent: jax.Array
    frontier_mask: jax.Array
    frontier_depth: jax.Array


@dataclasses.dataclass(frozen=True)
class DynamicTreeSpec:
    """The shape of an EAGLE-2 tree: grow `depth` levels, expanding the `top_k` best children of
    the `top_k` best frontier nodes at each, then keep the `budget` best draft nodes.

    Raises ValueError unless top_k >= 1, 1 <= depth <= budget (a node deeper than the budget could
    never be kept with all its ancestors) and budget <= the candidate pool
    (top_k + (depth - 1) * top_k^2). Hashable, so it can sit in a static config.
    """

    top_k: int
    depth: int
    budget: int

    def __post_init__(self):
        if self.top_k < 1:
            raise ValueError(f"DynamicTreeSpec.top_k={self.top_k}: must be >= 1")
        if not 1 <= self.depth <= self.budget:
            raise ValueError(f"DynamicTreeSpec.depth={self.depth}: must be in [1, budget={self.budget}]")
        if self.budget > self.pool_size:
            raise ValueError(f"DynamicTreeSpec.budget={self.budget}: must be <= the candidate pool "
                             f"top_k + (depth - 1) * top_k^2 = {self.pool_size}")

    @property
    def pool_size(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    @property
    def num_nodes(self) -> int:
        """N: kept draft nodes plus the root."""
        return self.budget + 1

    @property
    def max_depth(self) -> int:
        return self.depth


def parse_tree(spec: str) -> StaticTree | DynamicTreeSpec:
    """A tree from its command-line form: a name in STATIC_TREES, or `top_k,depth,budget` for a
    dynamic (EAGLE-2) tree. Raises ValueError on anything else."""
    if spec in STATIC_TREES:
        return STATIC_TREES[spec]
    fields = spec.split(",")
    if len(fields) != 3 or not all(field.strip().isdigit() for field in fields):
        raise ValueError(f"tree {spec!r}: expected one of {sorted(STATIC_TREES)} or 'top_k,depth,budget' "
                         "(three non-negative integers, e.g. '4,5,16')")
    top_k, depth, budget = (int(field) for field in fields)
    return DynamicTreeSpec(top_k=top_k, depth=depth, budget=budget)


def dynamic_tree_init(root_logprobs: jax.Array, branching: int, depth: int) -> DynamicTree:
    """root_logprobs [B, V] (the draft's log-probabilities after the root) -> a tree whose candidates
    and frontier are the root's top-`branching` tokens. The loop then drafts the frontier."""
    batch = root_logprobs.shape[0]
    pool_size = branching + (depth - 1) * branching * branching
    scores, tokens = jax.lax.top_k(root_logprobs.astype(jnp.float32), branching)
    frontier = jnp.broadcast_to(jnp.arange(branching, dtype=jnp.int32), (batch, branching))
    pad = ((0, 0), (0, pool_size - branching))
    window = depth * branching
    return DynamicTree(
        tokens=jnp.pad(tokens.astype(jnp.int32), pad),
        parents=jnp.full((batch, pool_size), -1, jnp.int32),
        scores=jnp.pad(scores, pad, constant_values=-jnp.inf),
        frontier=frontier,
        frontier_parent=jnp.zeros((batch, branching), jnp.int32),
        frontier_mask=jnp.broadcast_to(jnp.eye(branching, window, dtype=bool), (batch, branching, window)),
        frontier_depth=jnp.ones((), jnp.int32),
    )


def dynamic_tree_expand(tree: DynamicTree, frontier_logprobs: jax.Array) -> DynamicTree:
    """frontier_logprobs [B, K, V] (the draft's log-probabilities after each frontier node) -> the
    tree with the frontier's top-K children added as candidates and the best K of them (by
    cumulative log-probability) as the new frontier. Call D - 1 times."""
    batch, branching = tree.frontier.shape
    child_logprobs, child_tokens = jax.lax.top_k(frontier_logprobs.astype(jnp.float32), branching)
    frontier_scores = jnp.take_along_axis(tree.scores, tree.frontier, axis=1)
    child_scores = (frontier_scores[:, :, None] + child_logprobs).reshape(batch, branching * branching)
    child_parents = jnp.repeat(tree.frontier, branching, axis=1)
    block_start = branching + (tree.frontier_depth - 1) * branching * branching

    def write(pool, block):
        return jax.lax.dynamic_update_slice_in_dim(pool, block, block_start, axis=1)

    _, best_children = jax.lax.top_k(child_scores, branching)
    frontier_parent = best_children // branching
    new_slots = tree.frontier_depth * branching + jnp.arange(branching)
    frontier_mask = jnp.take_along_axis(tree.frontier_mask, frontier_parent[:, :, None], axis=1)
    frontier_mask = frontier_mask | (jnp.arange(frontier_mask.shape[-1]) == new_slots[:, None])[None]
    return DynamicTree(
        tokens=write(tree.tokens, child_tokens.reshape(batch, -1).astype(jnp.int32)),
        parents=write(tree.parents, child_parents),
        scores=write(tree.scores, child_scores),
        frontier=(block_start + best_children).astype(jnp.int32),
        frontier_parent=frontier_parent.astype(jnp.int32),
        frontier_mask=frontier_mask,
        frontier_depth=tree.frontier_depth + 1,
    )


def dynamic_tree_select(tree: DynamicTree, root_tokens: jax.Array, num_draft: int) -> tuple[jax.Array, jax.Array]:
    """Keep the `num_draft` best candidates by cumulative log-probability, as a verification window.

    root_tokens [B] -> tokens [B, num_draft + 1] int32 (node 0 = root), parents [B, num_draft + 1]
    int32 (window indices, -1 for the root). A child's score never exceeds its parent's and ties go
    to the smaller pool index (the parent), so the kept set contains every kept node's ancestors;
    ordering kept nodes by pool index puts parents before children.
    """
    pool_size = tree.tokens.shape[1]
    if not 1 <= num_draft <= pool_size:
        raise ValueError(f"dynamic_tree_select: num_draft={num_draft} must be in [1, {pool_size}] (the candidate pool)")
    _, kept = jax.lax.top_k(tree.scores, num_draft)
    kept = jnp.sort(kept, axis=1)
    pool_parents = jnp.take_along_axis(tree.parents, kept, axis=1)
    # a kept parent's window index is 1 + the number of kept pool indices below it
    parent_window = 1 + jnp.sum(kept[:, None, :] < pool_parents[:, :, None], axis=-1, dtype=jnp.int32)
    parents = jnp.where(pool_parents >= 0, parent_window, 0)
    tokens = jnp.take_along_axis(tree.tokens, kept, axis=1)
    root_parent = jnp.full_like(root_tokens[:, None], -1, dtype=jnp.int32)
    return (
        jnp.concatenate([root_tokens[:, None].astype(jnp.int32), tokens], axis=1),
        jnp.concatenate([root_parent, parents], axis=1),
    )
