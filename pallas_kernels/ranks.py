"""Top-k and stable sorts by counting comparisons: the MoE router's selections and its dispatch
order, and the DSA indexer's top-k of a decode step's few tokens (`contracts.select_topk`),
without XLA's sort.

Why: a decode step routes a handful of tokens (B x (k + 1) of them), and there XLA's sort costs
launches, not work. On a GPU a `lax.top_k` or `argsort` is one to three sort kernels plus a copy
of its operand, one after another; a row of 256 experts needs none of that. Its element's place
in the order is the number of elements ahead of it, one reduction over a [..., N, N] comparison
that XLA fuses with what computes the row. Compiled for an H200 without a GPU, a V3.2 MoE layer
at B = 1 launched 88 kernels and copies with the sorts and 75 with the counts (routing: the
group-limited top-k, the experts' order and their group sizes). Fewer since: a group's best two
are summed in one reduction (`sum_of_best_two`), and rows of at most `UNROLLED_LIMIT` elements are
counted by elementwise additions, which XLA can fuse into their reader (a B 1 token's 8
assignments by expert; not the 8 groups' ranking, which the experts' comparison reads twice).

Past `COUNT_LIMIT` comparisons a call (more than 128 tokens over 256 experts: a tree of 8 at
B 32, or a prefill, whose [A, A] dispatch comparison would grow quadratically) the same functions
sort, on the same integer keys. A caller with other rows passes its own `limit` (the indexer's
rows of thousands of slots). Both ways give the same integers, so the choice, which depends on
how many rows share the call, never changes a row's result: a token routes to the same experts,
in the same order, alone or among others (speculative decoding's verification window relies on it).

The order is `lax.top_k`'s on floats: descending in IEEE total order (+NaN > +inf > ... > +0.0 >
-0.0 > ... > -inf > -NaN), equal values by lower index first. `total_order_keys`
(`order_keys`) makes it an order of int32 keys, which both ways compare, so NaN
and signed zeros sort the same on every platform.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .backend import lowers_for_gpu
from .order_keys import LOWEST_KEY, ordered_values, total_order_keys

# Comparisons (elements of the [..., N, N] or [A, A] comparison) a call may count before it sorts
# instead: 2^23 counts a row of 256 experts for up to 128 tokens (B 32 at k = 3) and the dispatch
# of 8 experts a token for up to 362. The bound is XLA's: compiled for sm_90a (jax 0.10.2), its
# reduction over 256 experts takes output tiles of 16 x 8 up to 128 tokens and spills registers at
# 160 and 256 tokens (tiles of 16 x 16 and 32 x 8); past it a sort's work also grows slower.
COUNT_LIMIT = 1 << 23
# Rows at most this long are counted, on a GPU, by adding their N terms one after another,
# elementwise (`_summed`): XLA can fuse that into what reads the count, where a reduction is a
# kernel of its own (a B 1 token's 8 assignments by expert: their places, order and sizes).
UNROLLED_LIMIT = 16


def _counted(elements: int, limit: int | None) -> bool:
    return elements <= (COUNT_LIMIT if limit is None else limit)


def _summed(terms: jax.Array) -> jax.Array:
    """terms [..., N] int or bool -> [...] int32: their sum over the last axis. Lowered for a GPU
    with 0 < N <= UNROLLED_LIMIT, one elementwise addition after another (fewer launches); else a
    reduction (on the CPU there is no launch to save, and XLA's CPU compiler took half as long
    again over the tiny model's routing programs unrolled). The same integers either way."""
    count = terms.shape[-1]
    if 0 < count <= UNROLLED_LIMIT and lowers_for_gpu():
        return functools.reduce(jnp.add, (terms[..., j].astype(jnp.int32) for j in range(count)))
    return jnp.sum(terms, axis=-1, dtype=jnp.int32)


def _counted_places(keys: jax.Array) -> jax.Array:
    """keys [..., N] int32 -> [..., N] int32: how many elements of its row are ahead of each, in
    descending order with ties to the lower index (a permutation of 0..N-1 per row)."""
    index = jnp.arange(keys.shape[-1])
    other, own = keys[..., None, :], keys[..., :, None]
    return _summed((other > own) | ((other == own) & (index < index[:, None])))


def places(values: jax.Array, *, limit: int | None = None) -> jax.Array:
    """values [..., N] float -> [..., N] int32: each element's place in its row's order (0 = best),
    a permutation of 0..N-1 per row. Counted where the [..., N, N] comparison has at most `limit`
    elements (default `COUNT_LIMIT`; an element's place is how many are ahead of it), else sorted."""
    keys = total_order_keys(values)
    if not _counted(keys.size * keys.shape[-1], limit):
        # ~key reverses the order without overflow; a stable sort keeps ties by index.
        return jnp.argsort(jnp.argsort(~keys, axis=-1, stable=True), axis=-1).astype(jnp.int32)
    return _counted_places(keys)


def sum_of_best_two(values: jax.Array) -> jax.Array:
    """values [..., N] float32, N >= 2 -> [...] float32: the sum of each row's two best values in
    the order above (`jnp.sum(lax.top_k(values, 2)[0], -1)`), the larger first. One reduction
    whose state is a row's best two keys: where counting places would take two (the places, then
    the sum), on every N."""
    if values.shape[-1] < 2:
        raise ValueError(f"values: the last axis of {values.shape} must hold at least 2 values")
    lowest = jnp.int32(LOWEST_KEY)

    def best_two(a, b):  # (best, second) of two rows' bests -> of their union
        return jnp.maximum(a[0], b[0]), jnp.maximum(jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1]))

    keys = total_order_keys(values)
    first, second = jax.lax.reduce((keys, jnp.full_like(keys, lowest)), (lowest, lowest), best_two,
                                   (keys.ndim - 1,))
    return ordered_values(first) + ordered_values(second)


def _at_places(place: jax.Array, k: int, labels: jax.Array | None = None) -> jax.Array:
    """place [..., N] (a permutation of 0..N-1 per row) -> [..., k] int32: the label (default: the
    index; else labels [..., N] int32) of the element at places 0..k-1."""
    if labels is None:
        labels = jnp.arange(place.shape[-1], dtype=jnp.int32)
    else:
        labels = labels[..., None, :]
    return _summed(jnp.where(place[..., None, :] == jnp.arange(k)[:, None], labels, 0))


def top_k_indices(values: jax.Array, k: int, *, limit: int | None = None,
                  labels: jax.Array | None = None) -> jax.Array:
    """values [..., N] float, 1 <= k <= N -> [..., k] int32: `lax.top_k(values, k)[1]`, best first
    (with labels [..., N] int32: the chosen elements' labels instead of their indices, which the
    count sums in the same reduction). Counted as `places` is (within `limit`), else `lax.top_k`
    of `total_order_keys`: the same integers either way."""
    if not 1 <= k <= values.shape[-1]:
        raise ValueError(f"k={k}: must be in [1, {values.shape[-1]}] (the last axis of values {values.shape})")
    if not _counted(values.size * values.shape[-1], limit):
        indices = jax.lax.top_k(total_order_keys(values), k)[1].astype(jnp.int32)
        return indices if labels is None else jnp.take_along_axis(labels, indices, axis=-1)
    return _at_places(places(values, limit=limit), k, labels)


def sort_by_group(groups: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """groups [A] int in [0, num_groups) -> (order [A], position [A], sizes [num_groups]), int32:
    order = `argsort(groups, stable=True)` (sorted place -> element), position its inverse
    (element -> sorted place), sizes = `bincount(groups, length=num_groups)`.

    Counted where the [A, A] and [num_groups, A] comparisons have at most `COUNT_LIMIT` elements
    each, else sorted: the same integers either way."""
    if groups.ndim != 1:
        raise ValueError(f"groups: must be [A], got shape {groups.shape}")
    count = groups.shape[0]
    if not (_counted(count * count, None) and _counted(num_groups * count, None)):
        order = jnp.argsort(groups, stable=True).astype(jnp.int32)
        position = jnp.zeros(count, jnp.int32).at[order].set(jnp.arange(count, dtype=jnp.int32))
        return order, position, jnp.bincount(groups, length=num_groups).astype(jnp.int32)
    position = _counted_places(~groups.astype(jnp.int32))  # ascending: descending in ~group
    sizes = _summed(groups[None, :] == jnp.arange(num_groups)[:, None])
    return _at_places(position, count), position, sizes
