"""Acceptance rules: pure functions from draft and target outputs to the accepted tokens.

Every function is jittable with fixed shapes and treats rows independently, so the decoding loop
calls them inside `lax.while_loop`. Window layout as in `jaxspec.trees`: node 0 is the root (the
last committed token), `parents [B, N]` lists parents before children, and the target's output at
node n (`target_tokens[:, n]` or `target_probs[:, n]`) is its prediction for n's children.

Greedy (lossless for greedy decoding): a draft node is correct when it equals the target's argmax
at its parent. Chain: the accepted count is the number of leading correct drafts. Tree: the
accepted path is the deepest root-to-node path of correct nodes (ties: the smaller node index).
The bonus token is the target's argmax at the last accepted node.

Rejection sampling (lossless: emitted tokens are distributed as the processed target distribution
p, see `jaxspec.sampling`). Chain (Leviathan et al. / Chen et al.): draft x_j ~ q_j is accepted with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the bonus token is drawn from
norm(max(0, p_j - q_j)), and when all pass from p_k. Tree (SpecInfer multi-round): at the current
node the children are tried in node order, child x drawn from proposal q_x is accepted with
probability min(1, r(x) / q_x(x)) where r starts as the target's p at the node; each rejection
replaces r by norm(max(0, r - q_x)); an accepted child becomes the current node (r = its p); when
no child is accepted the bonus token is drawn from r. Each round is a Leviathan step of target r
against q_x, which is lossless provided x is drawn independently of the earlier rounds' outcomes;
so the proposals are either
  * `draft_probs` given: children drawn i.i.d. from the draft distribution at their parent
    (`jaxspec.sampling.draft_candidates` for sampled rows), q_x = draft_probs[parent]; or
  * `draft_probs=None`: children chosen deterministically (top-k, a dynamic tree), q_x = one-hot
    at x, so x is accepted with probability r(x) and a rejection removes x from r.
With greedy rows (one-hot p and q) both reduce exactly to greedy acceptance.

Relaxed acceptance (opt-in, LOSSY): a draft is accepted when it is among the target's top-k at its
parent and its probability is within `delta` of the top-1 probability; the bonus is the target's
argmax. The emitted tokens are then no longer the target's greedy (or sampled) output: it trades
fidelity for acceptance length and changes the output distribution.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.sampling import ACCEPT_STREAM, sample_tokens, stream_keys
from jaxspec.trees import ancestor_mask


class TreeAcceptance(NamedTuple):
    """path [B, D + 1] int32: accepted window nodes, root (0) first, -1 padded; accepted [B] int32:
    accepted draft nodes (the path holds accepted + 1 entries); bonus [B] int32: the token after."""

    path: jax.Array
    accepted: jax.Array
    bonus: jax.Array


def _prefix_len(matches: jax.Array) -> jax.Array:
    """matches [B, k] bool -> [B] int32: number of leading True entries."""
    return jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def greedy_accept_chain(draft_tokens: jax.Array, target_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """draft_tokens [B, k], target_tokens [B, k + 1] (argmax after each window token)
    -> accepted [B] int32 in [0, k], bonus [B] int32 (`target_tokens[b, accepted[b]]`)."""
    accepted = _prefix_len(draft_tokens == target_tokens[:, :-1])
    bonus = jnp.take_along_axis(target_tokens, accepted[:, None], axis=1)[:, 0]
    return accepted, bonus


def _relaxed_match(tokens: jax.Array, probs: jax.Array, top_k: int, delta: float) -> jax.Array:
    """tokens [B, M], probs [B, M, V] (the target's distribution each token is judged by) -> [B, M]
    bool: the token is among the top_k (ties counted in its favour) and within delta of the top-1."""
    token_probs = jnp.take_along_axis(probs, tokens[..., None], axis=-1)
    better = jnp.sum(probs > token_probs, axis=-1)
    return (better < top_k) & (token_probs[..., 0] >= jnp.max(probs, axis=-1) - delta)


def relaxed_accept_chain(
    draft_tokens: jax.Array, target_probs: jax.Array, top_k: int, delta: float
) -> tuple[jax.Array, jax.Array]:
    """LOSSY. draft_tokens [B, k], target_probs [B, k + 1, V] -> accepted [B] int32, bonus [B] int32
    (the target's argmax after the last accepted token). top_k = 1 is greedy acceptance."""
    accepted = _prefix_len(_relaxed_match(draft_tokens, target_probs[:, :-1], top_k, delta))
    bonus = jnp.argmax(jnp.take_along_axis(target_probs, accepted[:, None, None], axis=1)[:, 0], axis=-1)
    return accepted, bonus.astype(jnp.int32)


def _at_parents(values: jax.Array, parents: jax.Array) -> jax.Array:
    """values [B, N, ...], parents [B, N] -> [B, N, ...]: each node's parent's entry (root: its own)."""
    rows = jnp.arange(values.shape[0])[:, None]
    return values[rows, jnp.maximum(parents, 0)]


def _longest_path(node_ok: jax.Array, parents: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """node_ok [B, N] bool (node 0 ignored) -> path [B, D + 1], accepted [B], last node [B]: the
    deepest node whose ancestors are all ok, the smallest index among equally deep ones."""
    batch, num_nodes = parents.shape
    rows = jnp.arange(batch)
    mask = ancestor_mask(parents)
    node_ok = node_ok | (jnp.arange(num_nodes) == 0)
    reachable = jnp.all(~mask | node_ok[:, None, :], axis=-1)
    depth = jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1
    last = jnp.argmax(jnp.where(reachable, depth, -1), axis=1)
    on_path = mask[rows, last]
    step = jnp.where(on_path, jnp.cumsum(on_path, axis=1) - 1, max_depth + 1)
    nodes = jnp.broadcast_to(jnp.arange(num_nodes, dtype=jnp.int32), (batch, num_nodes))
    path = jnp.full((batch, max_depth + 1), -1, jnp.int32).at[rows[:, None], step].set(nodes, mode="drop")
    return path, depth[rows, last], last


def greedy_accept_tree(
    tokens: jax.Array, parents: jax.Array, target_tokens: jax.Array, max_depth: int
) -> TreeAcceptance:
    """tokens [B, N] (node 0 = root), parents [B, N], target_tokens [B, N] (argmax after each node),
    max_depth = D (static) -> TreeAcceptance.

    Siblings with equal tokens (which top-k and dynamic drafting never produce) are the one case
    where this deepest-path rule and the rejection sampler at temperature 0 (first accepted sibling)
    may pick different paths; both emit the target's greedy tokens."""
    path, accepted, last = _longest_path(tokens == _at_parents(target_tokens, parents), parents, max_depth)
    bonus = jnp.take_along_axis(target_tokens, last[:, None], axis=1)[:, 0]
    return TreeAcceptance(path, accepted, bonus.astype(jnp.int32))


def relaxed_accept_tree(
    tokens: jax.Array, parents: jax.Array, target_probs: jax.Array, top_k: int, delta: float, max_depth: int
) -> TreeAcceptance:
    """LOSSY. tokens [B, N], parents [B, N], target_probs [B, N, V], max_depth = D (static)
    -> TreeAcceptance: the deepest path of relaxed-accepted nodes, bonus = argmax after its end."""
    node_ok = _relaxed_match(tokens, _at_parents(target_probs, parents), top_k, delta)
    path, accepted, last = _longest_path(node_ok, parents, max_depth)
    rows = jnp.arange(tokens.shape[0])
    return TreeAcceptance(path, accepted, jnp.argmax(target_probs[rows, last], axis=-1).astype(jnp.int32))


def _residual(target: jax.Array, draft: jax.Array) -> jax.Array:
    """target, draft [B, V] -> norm(max(0, target - draft)) [B, V]. If it has no mass (target equals
    draft up to rounding, when rejection has probability zero) the target is kept."""
    excess = jnp.maximum(target - draft, 0.0)
    mass = jnp.sum(excess, axis=-1, keepdims=True)
    return jnp.where(mass > 0, excess / jnp.where(mass > 0, mass, 1.0), target)


def _acceptance_draws(keys: jax.Array, num_nodes: int) -> tuple[jax.Array, jax.Array]:
    """keys [B] row keys -> uniforms [B, N] (one per window node, node 0 unused), bonus keys [B].
    Chain and tree samplers draw alike, so a chain-shaped tree reproduces the chain sampler."""
    accept_keys = stream_keys(keys, ACCEPT_STREAM)
    uniforms = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 0), (num_nodes,)))(accept_keys)
    return uniforms, stream_keys(accept_keys, 1)


def speculative_sample_chain(
    keys: jax.Array, draft_tokens: jax.Array, target_probs: jax.Array, draft_probs: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Lossless rejection sampling of a drafted chain.

    keys [B] row keys, draft_tokens [B, k] (draft j drawn from draft_probs[:, j]), target_probs
    [B, k + 1, V] and draft_probs [B, k, V] processed distributions -> accepted [B] int32 in [0, k],
    bonus [B] int32. Emitted tokens: `draft_tokens[:, :accepted]` then the bonus."""
    batch, num_draft = draft_tokens.shape
    rows = jnp.arange(batch)
    uniforms, bonus_keys = _acceptance_draws(keys, num_draft + 1)
    target_at_draft = jnp.take_along_axis(target_probs[:, :-1], draft_tokens[..., None], axis=-1)[..., 0]
    draft_at_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    accepted = _prefix_len(uniforms[:, 1:] * draft_at_draft < target_at_draft)
    target_next = target_probs[rows, accepted]
    draft_next = draft_probs[rows, jnp.minimum(accepted, num_draft - 1)]
    bonus_probs = jnp.where((accepted == num_draft)[:, None], target_next, _residual(target_next, draft_next))
    return accepted, sample_tokens(bonus_keys, bonus_probs)


def reject_tree(
    uniforms: jax.Array,
    tokens: jax.Array,
    parents: jax.Array,
    target_probs: jax.Array,
    draft_probs: jax.Array | None,
    max_depth: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The deterministic core of `speculative_sample_tree`, with its uniforms given.

    uniforms [B, N] in [0, 1) (node n's acceptance draw; node 0 unused), tokens [B, N], parents
    [B, N], target_probs [B, N, V], draft_probs [B, N, V] or None (see the module docstring),
    max_depth = D (static) -> path [B, D + 1], accepted [B], bonus_probs [B, V] (the residual r at
    the last accepted node, which the bonus token is drawn from).

    One pass over the nodes in order suffices: an accepted node's children all come after it, and
    nodes whose parent is not the current node are skipped."""
    batch, num_nodes, vocab = target_probs.shape
    rows = jnp.arange(batch)

    def visit(node, carry):
        current, residual, path, accepted = carry
        parent, token = parents[:, node], tokens[:, node]
        if draft_probs is None:
            proposal = jax.nn.one_hot(token, vocab, dtype=residual.dtype)
        else:
            proposal = draft_probs[rows, jnp.maximum(parent, 0)]
        is_child = parent == current
        take = is_child & (uniforms[:, node] * proposal[rows, token] < residual[rows, token])
        rejected = (is_child & ~take)[:, None]
        residual = jnp.where(rejected, _residual(residual, proposal), residual)
        residual = jnp.where(take[:, None], target_probs[:, node], residual)
        accepted = accepted + take
        path = path.at[rows, jnp.where(take, accepted, max_depth + 1)].set(node, mode="drop")
        return jnp.where(take, node, current), residual, path, accepted

    start = (
        jnp.zeros(batch, jnp.int32),
        target_probs[:, 0].astype(jnp.float32),
        jnp.full((batch, max_depth + 1), -1, jnp.int32).at[:, 0].set(0),
        jnp.zeros(batch, jnp.int32),
    )
    _, bonus_probs, path, accepted = jax.lax.fori_loop(1, num_nodes, visit, start)
    return path, accepted, bonus_probs


def speculative_sample_tree(
    keys: jax.Array,
    tokens: jax.Array,
    parents: jax.Array,
    target_probs: jax.Array,
    draft_probs: jax.Array | None,
    max_depth: int,
) -> TreeAcceptance:
    """Lossless multi-round (SpecInfer) rejection sampling of a drafted tree.

    keys [B] row keys, tokens [B, N] (node 0 = root), parents [B, N], target_probs [B, N, V]
    processed, draft_probs [B, N, V] (children of node n were drawn i.i.d. from draft_probs[:, n];
    entries at leaves are unused) or None (children chosen deterministically), max_depth = D
    (static) -> TreeAcceptance."""
    uniforms, bonus_keys = _acceptance_draws(keys, tokens.shape[1])
    path, accepted, bonus_probs = reject_tree(uniforms, tokens, parents, target_probs, draft_probs, max_depth)
    return TreeAcceptance(path, accepted, sample_tokens(bonus_keys, bonus_probs))


def emitted_tokens(tokens: jax.Array, acceptance: TreeAcceptance) -> jax.Array:
    """tokens [B, N] -> [B, D + 1] int32: the accepted draft tokens along the path, then the bonus,
    then -1. These are the tokens a step appends to each row."""
    path_tokens = jnp.take_along_axis(tokens, jnp.maximum(acceptance.path, 0), axis=1)
    after_root = jnp.pad(path_tokens[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
    step = jnp.arange(acceptance.path.shape[1])[None, :]
    accepted = acceptance.accepted[:, None]
    bonus = jnp.where(step == accepted, acceptance.bonus[:, None], -1)
    return jnp.where(step < accepted, after_root, bonus).astype(jnp.int32)
