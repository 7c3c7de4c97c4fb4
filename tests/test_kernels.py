"""The kernel ops: references against naive per-token loops, Pallas kernels against the references.

Three layers, each on seeded random inputs:
  * the pure-jnp references (the definitions) against independent numpy loops over tokens, written
    from the data model in DESIGN.md (a token sees its prefix and its ancestors' window slots);
  * the Pallas kernels (interpret mode on CPU, always under jax.jit) against the references, on
    chain and tree windows with padding and empty rows, random page tables and contexts that end
    mid-page, bf16 and float32, tiny and DeepSeek dims;
  * the Pallas-to-Triton lowering for CUDA at DeepSeek-V3.2's real shapes and the tiny preset's
    (runs without a GPU), and `gpu`-marked tests that repeat the comparisons compiled at larger
    shapes.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas_kernels import (EMPTY_LSE, Visibility, indexer_scores_reference, indexer_topk_reference,
                                    mla_attention_reference, sparse_mla_attention_reference, write_slots)
from jaxspec.pallas_kernels.indexer_pallas import indexer_scores_pallas, indexer_topk_pallas
from jaxspec.pallas_kernels.mla_attention_pallas import mla_attention_pallas
from jaxspec.pallas_kernels.sparse_mla_attention_pallas import sparse_mla_attention_pallas
from cuda_lowering import triton_calls

# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


class Window(NamedTuple):
    """A `[B, Q]` window over a paged cache, as numpy: what every test case is built on."""

    prefix_len: np.ndarray  # [B]
    query_len: np.ndarray  # [B]
    ancestors: np.ndarray  # [B, Q, Q] bool: ancestors[b, q, j] = window token j is an ancestor of q
    is_tree: bool
    page_table: np.ndarray  # [B, max_pages], a random permutation of pages
    num_pages: int
    page_size: int

    def vis(self) -> Visibility:
        tree = jnp.asarray(self.ancestors) if self.is_tree else None
        return Visibility(jnp.asarray(self.prefix_len, jnp.int32), jnp.asarray(self.query_len, jnp.int32), tree)

    def visible_slots(self, b: int, q: int) -> list[int]:
        """The slots token (b, q) sees, straight from the data model."""
        if q >= self.query_len[b]:
            return []
        prefix = int(self.prefix_len[b])
        return list(range(prefix)) + [prefix + j for j in range(q + 1) if self.ancestors[b, q, j]]

    def read(self, cache: np.ndarray, b: int, slot: int) -> np.ndarray:
        return cache[self.page_table[b, slot // self.page_size], slot % self.page_size]


def make_window(rng, batch: int, num_queries: int, page_size: int, max_pages: int, tree: bool) -> Window:
    """Rows cycle through: a long row whose context ends mid-page, a row with padding tokens, an
    empty row (no tokens), a short row. Pages are a random permutation with spare pages."""
    capacity = max_pages * page_size
    prefix, query_len = [], []
    for b in range(batch):
        kind = b % 4
        if kind == 0:  # spans almost every page, last token mid-page
            prefix.append(capacity - num_queries - int(rng.integers(1, page_size // 2)))
            query_len.append(num_queries)
        elif kind == 1:
            prefix.append(int(rng.integers(1, capacity - num_queries)))
            query_len.append(int(rng.integers(1, num_queries)) if num_queries > 1 else 1)
        elif kind == 2:
            prefix.append(int(rng.integers(0, capacity - num_queries)))
            query_len.append(0)
        else:
            prefix.append(int(rng.integers(0, 2 * page_size)))
            query_len.append(num_queries)
    ancestors = np.zeros((batch, num_queries, num_queries), bool)
    for b in range(batch):
        if tree:  # random tree, parents listed before children
            parent = [-1] + [int(rng.integers(0, j)) for j in range(1, num_queries)]
            for q in range(num_queries):
                node = q
                while node >= 0:
                    ancestors[b, q, node] = True
                    node = parent[node]
        else:
            ancestors[b] = np.tril(np.ones((num_queries, num_queries), bool))
    num_pages = batch * max_pages + 3
    page_table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    return Window(np.array(prefix, np.int32), np.array(query_len, np.int32), ancestors, tree, page_table,
                  num_pages, page_size)


def unused_pages_nan(cache: np.ndarray, window: Window) -> np.ndarray:
    """Fill the pages no row owns with NaN: a kernel that reads outside a row's pages shows it."""
    cache = cache.copy()
    unused = np.setdiff1d(np.arange(window.num_pages), window.page_table)
    cache[unused] = np.nan
    return cache


def latent_inputs(rng, window: Window, heads: int, latent: int, rope: int, dtype):
    """q_nope [B, Q, H, Dl], q_rope [B, Q, H, Dr], latent_cache [P, page, Dl + Dr] (jnp, dtype)."""
    batch, num_queries = window.ancestors.shape[:2]
    q_nope = rng.normal(size=(batch, num_queries, heads, latent))
    q_rope = rng.normal(size=(batch, num_queries, heads, rope))
    cache = unused_pages_nan(rng.normal(size=(window.num_pages, window.page_size, latent + rope)), window)
    return tuple(jnp.asarray(x, dtype) for x in (q_nope, q_rope, cache))


def indexer_inputs(rng, window: Window, heads: int, dim: int, dtype, integer: bool):
    """q_idx [B, Q, Hi, Di], weights [B, Q, Hi], key_cache [P, page, Di] (jnp, dtype).

    integer=True draws small integers: every score is then exact in float32 whatever the summation
    order, so kernel and reference scores are bit-identical and their top-k must match exactly,
    ties included.
    """
    batch, num_queries = window.ancestors.shape[:2]
    draw = (lambda *shape: rng.integers(-3, 4, size=shape)) if integer else (lambda *shape: rng.normal(size=shape))
    q_idx, weights = draw(batch, num_queries, heads, dim), draw(batch, num_queries, heads)
    keys = unused_pages_nan(draw(window.num_pages, window.page_size, dim).astype(np.float64), window)
    return tuple(jnp.asarray(x, dtype) for x in (q_idx, weights, keys))


def random_indices(rng, window: Window, topk: int) -> np.ndarray:
    """[B, Q, topk] int32: visible slots in random order, -1 scattered where fewer (or at random), and
    a few slots past the row's pages, which address nothing and must be skipped like -1."""
    batch, num_queries = window.ancestors.shape[:2]
    capacity = window.page_table.shape[1] * window.page_size
    indices = np.full((batch, num_queries, topk), -1, np.int32)
    for b in range(batch):
        for q in range(num_queries):
            slots = rng.permutation(window.visible_slots(b, q))[:topk]
            chosen = np.full(topk, -1)
            chosen[:len(slots)] = slots
            chosen[rng.random(topk) < 0.1] = -1
            chosen[rng.random(topk) < 0.03] = capacity + rng.integers(0, 50)
            indices[b, q] = rng.permutation(chosen)
    return indices


# ----------------------------------------------------------------------------------------------
# Naive per-token implementations (float64)
# ----------------------------------------------------------------------------------------------


def naive_attention(q_nope, q_rope, cache, window: Window, slots_of, softmax_scale):
    """slots_of(b, q) -> the slots token (b, q) attends. Returns out [B, Q, H, Dl], lse [B, Q, H]."""
    q_nope, q_rope, cache = (np.asarray(x, np.float64) for x in (q_nope, q_rope, cache))
    batch, num_queries, heads, latent = q_nope.shape
    out = np.zeros((batch, num_queries, heads, latent))
    lse = np.full((batch, num_queries, heads), EMPTY_LSE)
    for b in range(batch):
        for q in range(num_queries):
            slots = slots_of(b, q)
            if not slots:
                continue
            kv = np.stack([window.read(cache, b, s) for s in slots])  # [n, Dl + Dr]
            scores = (q_nope[b, q] @ kv[:, :latent].T + q_rope[b, q] @ kv[:, latent:].T) * softmax_scale
            top = scores.max(axis=1, keepdims=True)
            probs = np.exp(scores - top)
            out[b, q] = probs @ kv[:, :latent] / probs.sum(axis=1, keepdims=True)
            lse[b, q] = top[:, 0] + np.log(probs.sum(axis=1))
    return out, lse


def naive_indexer(q_idx, weights, keys, window: Window, topk: int):
    """-> scores [B, Q, S] (-inf where invisible), indices [B, Q, topk] (ties: lower slot first)."""
    q_idx, weights, keys = (np.asarray(x, np.float64) for x in (q_idx, weights, keys))
    batch, num_queries = q_idx.shape[:2]
    num_slots = window.page_table.shape[1] * window.page_size
    scores = np.full((batch, num_queries, num_slots), -np.inf)
    indices = np.full((batch, num_queries, topk), -1, np.int32)
    for b in range(batch):
        for q in range(num_queries):
            slots = window.visible_slots(b, q)
            for s in slots:
                scores[b, q, s] = np.sum(weights[b, q] * np.maximum(q_idx[b, q] @ window.read(keys, b, s), 0))
            best = sorted(slots, key=lambda s: (-scores[b, q, s], s))[:topk]
            indices[b, q, :len(best)] = best
    return scores, indices


def scale_for(latent: int, rope: int) -> float:
    return (latent + rope) ** -0.5


# ----------------------------------------------------------------------------------------------
# Cache writes
# ----------------------------------------------------------------------------------------------


def naive_write(cache: np.ndarray, page_table: np.ndarray, slots: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Each valid slot's entry set, from the data model: row b's slot s at page page_table[b, s //
    page], offset s % page; -1 and slots past the row's pages skipped."""
    cache, page = cache.copy(), cache.shape[1]
    for (b, q), slot in np.ndenumerate(slots):
        if 0 <= slot < page_table.shape[1] * page:
            cache[page_table[b, slot // page], slot % page] = values[b, q]
    return cache


@pytest.mark.parametrize("slot", [0, 37, 63, -1, 64], ids=["first", "mid-page", "last", "padding", "past-the-pages"])
def test_one_slots_write_sets_its_entry_and_nothing_else(slot):
    """A decode step's one token (B = Q = 1, written as a dynamic update of its entry) and a
    window's tokens (the scatter) set the entries the data model says, bit for bit, and leave every
    other entry: a slot -1 or past the row's pages writes nothing, at an out-of-order page table
    whose last page is the pool's last."""
    rng = np.random.default_rng(slot + 2)
    cache = rng.standard_normal((5, 32, 24)).astype(jnp.bfloat16)
    page_table = np.array([[3, 4]], np.int32)
    write = jax.jit(write_slots)
    for slots, table in ((np.array([[slot]], np.int32), page_table),
                         (np.array([[slot, 5], [-1, 40]], np.int32), np.array([[3, 4], [1, 0]], np.int32))):
        values = rng.standard_normal((*slots.shape, 24)).astype(jnp.bfloat16)
        got = np.asarray(write(jnp.asarray(cache), jnp.asarray(table), jnp.asarray(slots), jnp.asarray(values)))
        want = naive_write(cache, table, slots, values)
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        written = ((0 <= slots) & (slots < 64)).sum()
        assert (got != cache).any(axis=-1).sum() == written  # those entries, no other


def test_one_slots_write_compiles_to_one_kernel_in_place(h100):
    """Compiled for an H100 without a GPU, a decode step's one-token write into each layer of a
    donated stacked pool (a scan over 4 layers, the model's layout: `cache.stacked_pages`) is one
    kernel a layer, the update of its entry in place (the scatter took three: its bounds
    predicate, a read of the old entry and the update); a window's two tokens stay the scatter, one
    kernel a layer. Either moves kilobytes, not the 19 MB layers (`aot.program_cost`: the update's
    read of the old entry is a slice of the pool it updates, not the pool)."""
    from jaxspec import aot
    from jaxspec.cache import stacked_pages, unstacked_pages

    def each_layer(cache, page_table, slots, values):
        def layer(cache, row):
            flat, rows = stacked_pages(cache, page_table, row)
            return unstacked_pages(write_slots(flat, rows, slots, values), cache), None
        return jax.lax.scan(layer, cache, jnp.arange(cache.shape[0]))[0]

    for tokens in (1, 2):
        compiled = aot.compile_gpu(each_layer, jax.ShapeDtypeStruct((4, 65, 64, 576), jnp.bfloat16),
                                   jax.ShapeDtypeStruct((1, 65), jnp.int32), jax.ShapeDtypeStruct((1, tokens), jnp.int32),
                                   jax.ShapeDtypeStruct((1, tokens, 576), jnp.bfloat16), devices=h100,
                                   donate_argnums=(0,))
        writes = {name: count for name, count in aot.launch_counts(compiled).items()
                  if "update_slice" in name or "scatter" in name}
        assert writes == {"loop_dynamic_update_slice_fusion" if tokens == 1 else "input_scatter_fusion": 4}, writes
        assert 0 < aot.program_cost(compiled).bytes_accessed < 65_536


# ----------------------------------------------------------------------------------------------
# References against the naive loops
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_mla_reference_matches_naive(tree):
    rng = np.random.default_rng(1)
    window = make_window(rng, batch=4, num_queries=4, page_size=16, max_pages=5, tree=tree)
    q_nope, q_rope, cache = latent_inputs(rng, window, heads=3, latent=32, rope=8, dtype=jnp.float32)
    scale = scale_for(32, 8)
    out, lse = jax.jit(functools.partial(mla_attention_reference, softmax_scale=scale))(
        q_nope, q_rope, cache, jnp.asarray(window.page_table), window.vis())
    want_out, want_lse = naive_attention(q_nope, q_rope, cache, window, window.visible_slots, scale)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert (lse == EMPTY_LSE).any() and np.all(np.asarray(out)[np.asarray(lse) == EMPTY_LSE] == 0)


def test_sparse_mla_reference_matches_naive():
    rng = np.random.default_rng(2)
    window = make_window(rng, batch=3, num_queries=3, page_size=16, max_pages=4, tree=True)
    q_nope, q_rope, cache = latent_inputs(rng, window, heads=2, latent=32, rope=8, dtype=jnp.float32)
    indices = random_indices(rng, window, topk=24)
    capacity = window.page_table.shape[1] * window.page_size
    assert (indices >= capacity).any()
    scale = scale_for(32, 8)
    out, lse = jax.jit(functools.partial(sparse_mla_attention_reference, softmax_scale=scale))(
        q_nope, q_rope, cache, jnp.asarray(window.page_table), jnp.asarray(indices))
    want_out, want_lse = naive_attention(q_nope, q_rope, cache, window,
                                         lambda b, q: [int(s) for s in indices[b, q] if 0 <= s < capacity], scale)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_indexer_reference_matches_naive(tree):
    rng = np.random.default_rng(3)
    window = make_window(rng, batch=4, num_queries=3, page_size=16, max_pages=4, tree=tree)
    q_idx, weights, keys = indexer_inputs(rng, window, heads=4, dim=16, dtype=jnp.float32, integer=False)
    args = (q_idx, weights, keys, jnp.asarray(window.page_table), window.vis())
    want_scores, want_indices = naive_indexer(q_idx, weights, keys, window, topk=40)
    scores = jax.jit(indexer_scores_reference)(*args)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)
    indices = jax.jit(functools.partial(indexer_topk_reference, topk=40))(*args)
    np.testing.assert_array_equal(indices, want_indices)  # this draw has no scores within float32 rounding


# ----------------------------------------------------------------------------------------------
# Pallas kernels against the references
# ----------------------------------------------------------------------------------------------


def tolerance(dtype) -> dict:
    return dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)


def assert_attention_close(got, want, window: Window, dtype):
    """Outputs and lse within dtype tolerance; empty tokens exactly (0, EMPTY_LSE); nothing non-finite."""
    (out, lse), (want_out, want_lse) = got, want
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert out.dtype == np.float32 and np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(out, np.asarray(want_out, np.float32), **tolerance(dtype))
    np.testing.assert_allclose(lse, np.asarray(want_lse), rtol=1e-5, atol=1e-4)
    empty = np.asarray(want_lse) == EMPTY_LSE
    assert np.all(lse[empty] == EMPTY_LSE) and np.all(out[empty] == 0)


def check_mla(rng, *, batch, num_queries, heads, latent, rope, page_size, max_pages, tree, dtype, interpret=None,
              **tuning):
    window = make_window(rng, batch, num_queries, page_size, max_pages, tree)
    args = (*latent_inputs(rng, window, heads, latent, rope, dtype), jnp.asarray(window.page_table), window.vis())
    scale = scale_for(latent, rope)
    got = jax.jit(functools.partial(mla_attention_pallas, softmax_scale=scale, interpret=interpret, **tuning))(*args)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(functools.partial(mla_attention_reference, softmax_scale=scale))(*args)
    assert got[0].dtype == dtype and got[0].shape == args[0].shape and got[1].shape == args[0].shape[:3]
    assert_attention_close(got, want, window, dtype)


@pytest.mark.parametrize("case", [
    dict(num_queries=1, heads=4, latent=32, rope=8, page_size=16, max_pages=6, tree=False, dtype=jnp.float32),
    dict(num_queries=2, heads=4, latent=32, rope=8, page_size=16, max_pages=5, tree=True, dtype=jnp.bfloat16,
         num_splits=3),
    dict(num_queries=4, heads=16, latent=512, rope=64, page_size=64, max_pages=4, tree=True, dtype=jnp.bfloat16,
         num_splits=2),
    dict(num_queries=8, heads=2, latent=512, rope=64, page_size=16, max_pages=9, tree=False, dtype=jnp.float32),
    # The shipped model's dims: a latent that is not a power of two is read as a zero-padded block.
    dict(num_queries=8, heads=16, latent=48, rope=16, page_size=64, max_pages=3, tree=True, dtype=jnp.float32,
         num_splits=1),
    dict(num_queries=2, heads=8, latent=512, rope=64, page_size=16, max_pages=7, tree=False, dtype=jnp.bfloat16,
         num_splits=4, block_n=16),
], ids=["q1-tiny-f32", "q2-tiny-bf16-tree-split3", "q4-h16-ds-bf16-tree-p64", "q8-h2-ds-f32-p16",
        "q8-h16-latent48-f32-tree-2blocks", "q2-h8-ds-bf16-split4-bn16"])
def test_mla_pallas_matches_reference(case):
    check_mla(np.random.default_rng(10), batch=4, **case)


def check_sparse(rng, *, batch, num_queries, heads, latent, rope, page_size, max_pages, topk, dtype, interpret=None,
                 **tuning):
    window = make_window(rng, batch, num_queries, page_size, max_pages, tree=True)
    indices = random_indices(rng, window, topk)
    indices[0, 0] = -1  # a real token that selects nothing
    args = (*latent_inputs(rng, window, heads, latent, rope, dtype), jnp.asarray(window.page_table),
            jnp.asarray(indices))
    scale = scale_for(latent, rope)
    got = jax.jit(functools.partial(sparse_mla_attention_pallas, softmax_scale=scale, interpret=interpret,
                                    **tuning))(*args)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(functools.partial(sparse_mla_attention_reference, softmax_scale=scale))(*args)
    assert got[0].dtype == dtype and got[0].shape == args[0].shape
    assert_attention_close(got, want, window, dtype)


@pytest.mark.parametrize("case", [
    dict(num_queries=1, heads=4, latent=32, rope=8, page_size=16, max_pages=5, topk=40, dtype=jnp.float32),
    dict(num_queries=4, heads=16, latent=512, rope=64, page_size=64, max_pages=3, topk=64, dtype=jnp.bfloat16,
         num_splits=2),
    dict(num_queries=8, heads=8, latent=48, rope=16, page_size=16, max_pages=4, topk=32, dtype=jnp.bfloat16,
         num_splits=3, block_n=16),
    dict(num_queries=2, heads=2, latent=512, rope=64, page_size=16, max_pages=8, topk=96, dtype=jnp.float32),
], ids=["q1-tiny-f32-k40", "q4-h16-ds-bf16-split2", "q8-latent48-bf16-split3-bn16", "q2-ds-f32-k96"])
def test_sparse_mla_pallas_matches_reference(case):
    check_sparse(np.random.default_rng(20), batch=3, **case)


def test_sparse_mla_pallas_selecting_every_visible_slot_is_dense_attention():
    """DESIGN invariant: when a token sees no more than topk slots, sparse attention equals dense."""
    rng = np.random.default_rng(21)
    window = make_window(rng, batch=3, num_queries=3, page_size=16, max_pages=3, tree=True)
    q_nope, q_rope, cache = latent_inputs(rng, window, heads=4, latent=32, rope=8, dtype=jnp.float32)
    indices = np.full((3, 3, 48), -1, np.int32)  # 48 = every slot of a row
    for b, q in np.ndindex(3, 3):
        slots = window.visible_slots(b, q)
        indices[b, q, :len(slots)] = rng.permutation(slots)
    scale = scale_for(32, 8)
    sparse = jax.jit(functools.partial(sparse_mla_attention_pallas, softmax_scale=scale))(
        q_nope, q_rope, cache, jnp.asarray(window.page_table), jnp.asarray(indices))
    dense = jax.jit(functools.partial(mla_attention_reference, softmax_scale=scale))(
        q_nope, q_rope, cache, jnp.asarray(window.page_table), window.vis())
    assert_attention_close(sparse, dense, window, jnp.float32)


def check_indexer(rng, *, batch, num_queries, heads, dim, page_size, max_pages, topk, tree, dtype, integer,
                  interpret=None, **tuning):
    window = make_window(rng, batch, num_queries, page_size, max_pages, tree)
    args = (*indexer_inputs(rng, window, heads, dim, dtype, integer), jnp.asarray(window.page_table), window.vis())
    scores = jax.jit(functools.partial(indexer_scores_pallas, interpret=interpret, **tuning))(*args)
    indices = jax.jit(functools.partial(indexer_topk_pallas, topk=topk, interpret=interpret))(*args)
    with jax.default_matmul_precision("highest"):
        want_scores = np.asarray(jax.jit(indexer_scores_reference)(*args))
        want_indices = np.asarray(jax.jit(functools.partial(indexer_topk_reference, topk=topk))(*args))
    assert indices.shape == (batch, num_queries, topk) and indices.dtype == jnp.int32
    assert np.array_equal(np.isfinite(scores), np.isfinite(want_scores))  # same visibility
    if integer:  # exact scores: identical scores and identical selection, tie order included
        np.testing.assert_array_equal(scores, want_scores)
        np.testing.assert_array_equal(indices, want_indices)
        return
    np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-4)
    # Float rounding may swap near-equal scores; what is selected must score the same.
    indices = np.asarray(indices)
    np.testing.assert_array_equal(indices < 0, want_indices < 0)
    picked = np.take_along_axis(want_scores, np.maximum(indices, 0), axis=2)
    best = np.take_along_axis(want_scores, np.maximum(want_indices, 0), axis=2)
    np.testing.assert_allclose(np.where(indices < 0, 0, picked), np.where(want_indices < 0, 0, best),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", [
    dict(num_queries=2, heads=64, dim=128, page_size=64, max_pages=3, topk=64, tree=True, dtype=jnp.bfloat16,
         integer=True),
    dict(num_queries=8, heads=2, dim=16, page_size=16, max_pages=4, topk=80, tree=False, dtype=jnp.float32,
         integer=True),
    dict(num_queries=4, heads=4, dim=32, page_size=16, max_pages=6, topk=24, tree=True, dtype=jnp.bfloat16,
         integer=True, tiles_per_program=2),
    dict(num_queries=1, heads=8, dim=24, page_size=64, max_pages=2, topk=32, tree=False, dtype=jnp.float32,
         integer=True, block_n=32),
    dict(num_queries=1, heads=64, dim=128, page_size=16, max_pages=8, topk=48, tree=False, dtype=jnp.float32,
         integer=False),
    dict(num_queries=4, heads=16, dim=64, page_size=64, max_pages=2, topk=40, tree=True, dtype=jnp.bfloat16,
         integer=False),
], ids=["q2-64x128-bf16-tree-int", "q8-tiny-f32-int-pad", "q4-bf16-tree-int-chunks", "q1-dim24-f32-int",
        "q1-64x128-f32-float", "q4-bf16-tree-float"])
def test_indexer_pallas_matches_reference(case):
    check_indexer(np.random.default_rng(30), batch=4, **case)


# ----------------------------------------------------------------------------------------------
# CUDA lowering (the real Pallas-to-Triton lowering; no GPU needed)
# ----------------------------------------------------------------------------------------------

SHAPE = jax.ShapeDtypeStruct
DEEPSEEK_V32 = dict(batch=4, heads=128, latent=512, rope=64, page_size=64, max_pages=2048, num_pages=8192,
                    index_heads=64, index_dim=128, topk=2048)
# The `tiny` preset's dims: the RoPE part (8) and the indexer heads (2) are narrower than a block.
TINY = dict(batch=3, heads=4, latent=32, rope=8, page_size=8, max_pages=6, num_pages=20, index_heads=2,
            index_dim=16, topk=16)


def lowering_case(kernel: str, num_queries: int, tree: bool, dims: dict):
    """-> (function, abstract args, Triton kernel name) at the given dims, bf16 as served."""
    batch, heads = dims["batch"], dims["heads"]
    page_table = SHAPE((batch, dims["max_pages"]), jnp.int32)
    vis = Visibility(SHAPE((batch,), jnp.int32), SHAPE((batch,), jnp.int32),
                     SHAPE((batch, num_queries, num_queries), jnp.bool_) if tree else None)
    if kernel == "indexer":
        fn = functools.partial(indexer_topk_pallas, topk=dims["topk"], interpret=False)
        args = (SHAPE((batch, num_queries, dims["index_heads"], dims["index_dim"]), jnp.bfloat16),
                SHAPE((batch, num_queries, dims["index_heads"]), jnp.float32),
                SHAPE((dims["num_pages"], dims["page_size"], dims["index_dim"]), jnp.bfloat16), page_table, vis)
        return fn, args, "indexer_scores"
    latent_args = (SHAPE((batch, num_queries, heads, dims["latent"]), jnp.bfloat16),
                   SHAPE((batch, num_queries, heads, dims["rope"]), jnp.bfloat16),
                   SHAPE((dims["num_pages"], dims["page_size"], dims["latent"] + dims["rope"]), jnp.bfloat16),
                   page_table)
    scale = scale_for(dims["latent"], dims["rope"])
    if kernel == "mla":
        fn = functools.partial(mla_attention_pallas, softmax_scale=scale, interpret=False)
        return fn, (*latent_args, vis), "mla_attention"
    fn = functools.partial(sparse_mla_attention_pallas, softmax_scale=scale, interpret=False)
    return fn, (*latent_args, SHAPE((batch, num_queries, dims["topk"]), jnp.int32)), "sparse_mla_attention"


@pytest.mark.parametrize("kernel,num_queries,tree,dims", [
    ("mla", 1, False, DEEPSEEK_V32), ("mla", 8, True, DEEPSEEK_V32), ("sparse", 1, False, DEEPSEEK_V32),
    ("sparse", 8, False, DEEPSEEK_V32), ("indexer", 1, False, DEEPSEEK_V32), ("indexer", 8, True, DEEPSEEK_V32),
    ("mla", 3, True, TINY), ("sparse", 3, False, TINY), ("indexer", 3, True, TINY),
], ids=["mla-q1", "mla-q8-tree", "sparse-q1", "sparse-q8", "indexer-q1", "indexer-q8-tree", "tiny-mla-q3-tree",
        "tiny-sparse-q3", "tiny-indexer-q3-tree"])
def test_cuda_lowering(kernel, num_queries, tree, dims):
    """The real Pallas-to-Triton lowering (DeepSeek-V3.2 and tiny dims) emits one Triton kernel.

    It checks what Pallas turns into Triton IR (block shapes, indexing, every primitive); Triton's
    own compilation to PTX (register and shared-memory budgets) happens only on a GPU.
    """
    fn, args, name = lowering_case(kernel, num_queries, tree, dims)
    calls = triton_calls(fn, *args)
    assert len(calls) == 1 and re.search(rf'\bname = "{name}"', calls[0]) and "num_warps" in calls[0]
    out = jax.eval_shape(fn, *args)
    if kernel == "indexer":
        assert out.shape == (dims["batch"], num_queries, dims["topk"]) and out.dtype == jnp.int32
    else:
        assert out[0].shape == args[0].shape and out[0].dtype == jnp.bfloat16
        assert out[1].shape == args[0].shape[:3] and out[1].dtype == jnp.float32


# ----------------------------------------------------------------------------------------------
# On a GPU: the same comparisons, compiled, at larger shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_mla_pallas_compiled_on_gpu(dtype):
    check_mla(np.random.default_rng(40), batch=6, num_queries=4, heads=128, latent=512, rope=64, page_size=64,
              max_pages=50, tree=True, dtype=dtype, interpret=False)
    check_mla(np.random.default_rng(41), batch=2, num_queries=1, heads=128, latent=512, rope=64, page_size=64,
              max_pages=300, tree=False, dtype=dtype, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_sparse_mla_pallas_compiled_on_gpu(dtype):
    check_sparse(np.random.default_rng(42), batch=3, num_queries=2, heads=128, latent=512, rope=64, page_size=64,
                 max_pages=64, topk=2048, dtype=dtype, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("integer", [True, False], ids=["int", "float"])
def test_indexer_pallas_compiled_on_gpu(integer):
    check_indexer(np.random.default_rng(43), batch=4, num_queries=4, heads=64, dim=128, page_size=64, max_pages=80,
                  topk=2048, tree=True, dtype=jnp.bfloat16, integer=integer, interpret=False)
