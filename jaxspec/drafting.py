"""Drafting with the MTP module: each step's verification window, as a chain, a static tree or a
dynamic (EAGLE-2) tree (`DecodeConfig.draft_tree`).

Window node 0 is the root t_n (the last emitted token, not yet cached); node i >= 1 is a draft at
depth `depths[i]`, verified at RoPE position n + depths[i]. The root's children come from the seed
logits (the previous catch-up's MTP output). A draft node's children come from the MTP pair
(hidden of its parent, its token) at position n + depth - 1, where the parent's hidden is the MTP
output hidden state at the parent (the seed hidden for the root): the MTP module stands in for the
target it has not yet heard from. So a tree of depth D takes D - 1 MTP calls, one per depth.

Each call's window covers every drafted node of depth <= d, not only the frontier: a node must see
its ancestors at earlier depths but not their siblings, and a `Visibility` can only mask ancestors
inside its own window (its prefix is seen whole). The call reads the depth-d outputs; the earlier
nodes are recomputed from the same inputs and rewrite the same entries. A static tree's leading
nodes that are alone at their depth are ancestors of every later node, so they stay in the prefix
instead: a chain makes one one-token call per depth, and only branching parts are recomputed.
Those one-token calls all have one shape, so they run as one `jax.lax.scan` over the depths: the
compiled step holds one drafting MTP call whatever the chain's length.

MTP cache slots (past the committed length n, hidden by `lengths` and overwritten by the next
catch-up): static node i at n + i - 1; a dynamic tree's frontier node j of depth d at
n + (d - 1) K + j (`jaxspec.trees.DynamicTree`).
"""

from __future__ import annotations

import functools

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode_config import DecodeConfig
from jaxspec.models.interface import DecodeCache
from jaxspec.pallas_kernels import Visibility
from jaxspec.sampling import SamplingParams, draft_candidates
from jaxspec.trees import (DynamicTreeSpec, StaticTree, ancestor_mask, dynamic_tree_expand, dynamic_tree_init,
                           dynamic_tree_select, is_chain, node_depths)


class Draft(NamedTuple):
    """One step's verification window: N nodes (`DecodeConfig.window_size`), vocabulary V.

    tokens [B, N] int32: node 0 the root, then the drafts, parents before children.
    parents [B, N] int32: each node's parent's window index, -1 for the root.
    depths [B, N] int32: position offsets from the committed length n.
    tree_mask [B, N, N] bool ancestor mask (itself included), or None for a chain.
    draft_probs [B, N, V] float32: the processed draft distribution each node's children were
      drawn from (zeros at leaves), or None when drafts are chosen deterministically (greedy
      decoding, dynamic trees).
    mtp_cache: the MTP cache with the drafted nodes written past its committed length.
    """

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    tree_mask: jax.Array | None
    draft_probs: jax.Array | None
    mtp_cache: DecodeCache | None


def mtp_draft_slots(config: DecodeConfig) -> int:
    """MTP cache slots drafting writes past a row's committed length (for sizing the cache)."""
    tree = config.draft_tree
    if isinstance(tree, DynamicTreeSpec):
        return (tree.depth - 1) * tree.top_k
    return 0 if tree is None else tree.nodes_at_depth(tree.max_depth).start - 1


def draft(model, state, config: DecodeConfig, keys: jax.Array, params: SamplingParams) -> Draft:
    """The window of `state` (a `jaxspec.loop.DecodeState`) for this step. keys [B]: the step's row
    keys (sampled static drafting draws from them); params: the rows' sampling parameters."""
    tree = config.draft_tree
    if tree is None:  # plain decoding: the window is the root alone
        batch = state.last_token.shape[0]
        zeros = jnp.zeros((batch, 1), jnp.int32)
        return Draft(state.last_token[:, None], zeros - 1, zeros, None, None, state.mtp_cache)
    if isinstance(tree, DynamicTreeSpec):
        return _draft_dynamic(model, state, tree, config)
    return _draft_static(model, state, tree, config, keys, params)


def _mtp(model, state, config: DecodeConfig, mtp_cache: DecodeCache, tokens: jax.Array, hidden: jax.Array,
         depths, first_slot: jax.Array, tree_mask: jax.Array | None):
    """One MTP call over drafted nodes: tokens [B, Q], hidden [B, Q, H] (their parents' MTP hidden),
    depths [Q] or [B, Q], first_slot [B] (MTP slot of window token 0) -> logits, hidden, cache."""
    num_queries = tokens.shape[1]
    vis = Visibility(prefix_len=first_slot, query_len=jnp.where(state.done, 0, num_queries).astype(jnp.int32),
                     tree_mask=tree_mask)
    positions = state.target_cache.lengths[:, None] + depths - 1
    return model.draft(tokens, hidden, positions, mtp_cache, vis, form="absorbed", backend=config.backend)


def _leading_chain(tree: StaticTree) -> int:
    """Leading draft nodes alone at their depth (node i at depth i): ancestors of every later node."""
    length = 0
    while length < tree.max_depth and tree.nodes_at_depth(length + 1) == slice(length + 1, length + 2):
        length += 1
    return length


def _draft_static(model, state, tree: StaticTree, config: DecodeConfig, keys, params) -> Draft:
    """Fill `tree` depth by depth: each node's children are its parent's top-`tree.top_k` candidates
    (greedy) or that many independent draws from the processed draft distribution (sampling)."""
    batch, hidden_dim = state.seed_hidden.shape
    num_nodes, vocab = tree.num_nodes, state.seed_logits.shape[-1]
    sampled = config.temperature > 0
    n = state.target_cache.lengths
    leading = _leading_chain(tree)
    tokens = jnp.zeros((batch, num_nodes), jnp.int32).at[:, 0].set(state.last_token)
    parent_hidden = jnp.zeros((batch, num_nodes, hidden_dim), state.seed_hidden.dtype)
    draft_probs = jnp.zeros((batch, num_nodes, vocab), jnp.float32) if sampled else None
    # the draft's outputs at the nodes of the previous depth: [B, M, V], [B, M, H]
    level_logits, level_hidden = state.seed_logits[:, None], state.seed_hidden[:, None]
    mtp_cache = state.mtp_cache
    ranks = jnp.asarray(tree.ranks, jnp.int32)

    def chain_depth(carry, depth):
        """Depth `depth` (traced) of the leading chain: its node's token from the node above's
        draft outputs, then the one-token MTP call at it -> the outputs at this depth."""
        tokens, draft_probs, level_logits, level_hidden, mtp_cache = carry
        if sampled:
            candidates, probs = draft_candidates(keys, depth, level_logits, params, tree.top_k)
            draft_probs = jax.lax.dynamic_update_slice_in_dim(draft_probs, probs, depth - 1, axis=1)
        else:
            candidates = jax.lax.top_k(level_logits, tree.top_k)[1]
        token = jnp.take(candidates[:, 0], ranks[depth], axis=1)
        tokens = tokens.at[:, depth].set(token)
        logits, out_hidden, mtp_cache = _mtp(model, state, config, mtp_cache, token[:, None], level_hidden,
                                             depth[None], n + depth - 1, None)
        return (tokens, draft_probs, logits, out_hidden, mtp_cache), None

    # The leading chain's one-token MTP calls have one shape, so they run as one scan: the program
    # holds one MTP call for all of them instead of one per depth (each costs as much compile time
    # as a decoder layer). The depth after them, and any branching depths, follow unrolled.
    scanned = min(leading, tree.max_depth - 1)
    if scanned:
        (tokens, draft_probs, level_logits, level_hidden, mtp_cache), _ = jax.lax.scan(
            chain_depth, (tokens, draft_probs, level_logits, level_hidden, mtp_cache),
            jnp.arange(1, scanned + 1, dtype=jnp.int32))
    for depth in range(scanned + 1, tree.max_depth + 1):
        level, nodes = tree.nodes_at_depth(depth - 1), tree.nodes_at_depth(depth)
        if sampled:
            candidates, probs = draft_candidates(keys, depth, level_logits, params, tree.top_k)
            draft_probs = draft_probs.at[:, level].set(probs)
        else:
            candidates = jax.lax.top_k(level_logits, tree.top_k)[1]
        tokens = tokens.at[:, nodes].set(tree.child_tokens(depth, candidates))
        parent_hidden = parent_hidden.at[:, nodes].set(level_hidden[:, tree.parents[nodes] - level.start])
        if depth == tree.max_depth:
            break
        start = min(leading, depth - 1) + 1
        window = slice(start, nodes.stop)
        mask = tree.ancestor_mask[window, window]
        tree_mask = (None if np.array_equal(mask, np.tri(len(mask), dtype=bool))
                     else jnp.broadcast_to(mask, (batch,) + mask.shape))
        logits, out_hidden, mtp_cache = _mtp(model, state, config, mtp_cache, tokens[:, window],
                                             parent_hidden[:, window], tree.depths[window], n + start - 1, tree_mask)
        level_logits, level_hidden = logits[:, nodes.start - start:], out_hidden[:, nodes.start - start:]
    mask = tree.ancestor_mask
    tree_mask = None if is_chain(tree) else jnp.broadcast_to(mask, (batch,) + mask.shape)
    parents = jnp.broadcast_to(jnp.asarray(tree.parents), (batch, num_nodes))
    depths = jnp.broadcast_to(jnp.asarray(tree.depths), (batch, num_nodes))
    return Draft(tokens, parents, depths, tree_mask, draft_probs, mtp_cache)


def _draft_dynamic(model, state, spec: DynamicTreeSpec, config: DecodeConfig) -> Draft:
    """Grow an EAGLE-2 tree from the draft's log-probabilities (`jaxspec.trees`), then keep the
    `spec.budget` best nodes. The tree is a deterministic function of the draft model, so the
    rejection sampler takes its nodes as deterministic proposals (draft_probs None)."""
    top_k, depth = spec.top_k, spec.depth
    batch, hidden_dim = state.seed_hidden.shape
    n = state.target_cache.lengths
    width = (depth - 1) * top_k  # the MTP window: frontiers of depths 1 .. D - 1, K slots each
    window_tokens = jnp.zeros((batch, width), jnp.int32)
    window_hidden = jnp.zeros((batch, width, hidden_dim), state.seed_hidden.dtype)
    window_mask = jnp.zeros((batch, width, width), bool)
    tree = dynamic_tree_init(jax.nn.log_softmax(state.seed_logits, axis=-1), top_k, depth)
    frontier_parent_hidden = jnp.broadcast_to(state.seed_hidden[:, None], (batch, top_k, hidden_dim))
    mtp_cache = state.mtp_cache
    for level in range(1, depth):
        block = slice((level - 1) * top_k, level * top_k)
        # A static update slice, not `.at[:, block].set`: where the block is the whole window
        # (depth 2) that is a scatter with a zero-sized index constant, which jax 0.11 hoists into
        # the mesh program's shard_map, and Shardy's canonicalizer (jax 0.11.2) crashes removing it.
        put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=block.start, axis=1)
        window_tokens = put(window_tokens, jnp.take_along_axis(tree.tokens, tree.frontier, axis=1))
        window_hidden = put(window_hidden, frontier_parent_hidden)
        window_mask = put(window_mask, tree.frontier_mask[:, :, :width])
        used = level * top_k
        logits, out_hidden, mtp_cache = _mtp(model, state, config, mtp_cache, window_tokens[:, :used],
                                             window_hidden[:, :used], np.arange(used) // top_k + 1, n,
                                             window_mask[:, :used, :used])
        tree = dynamic_tree_expand(tree, jax.nn.log_softmax(logits[:, block], axis=-1))
        frontier_parent_hidden = jnp.take_along_axis(out_hidden[:, block], tree.frontier_parent[..., None], axis=1)
    tokens, parents = dynamic_tree_select(tree, state.last_token, spec.budget)
    return Draft(tokens, parents, node_depths(parents), ancestor_mask(parents), None, mtp_cache)
