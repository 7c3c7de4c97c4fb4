"""The Mosaic GPU kernels of DSA, the indexer (`indexer_mosaic.py`) and sparse MLA
(`sparse_mla_attention_mosaic.py`), interpreted on the CPU (compiled and run on a GPU host,
`conftest.MOSAIC_INTERPRET`) against their references, on
compute-dtype and FP8 caches (`fp8_cache.Fp8Pool`); their invariance to the window they share a
call with, bit for bit; their argument checks; the `backend="mosaic"` dispatch; and their compiles
for an H100 (sm_90a) without a GPU, with the shared memory their launches claim
(`aot.mosaic_launches`: Mosaic GPU's own count).

Interpret mode simulates every warpgroup, TMA copy and wgmma in Python, so the shapes are small.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import aot
from jaxspec.presets import preset
from jaxspec.pallas_kernels import (EMPTY_LSE, Visibility, gather_rows, indexer_scores, indexer_scores_reference,
                                    indexer_topk, indexer_topk_reference, select_topk, sparse_mla_attention,
                                    sparse_mla_attention_reference)
from jaxspec.pallas_kernels import fp8_cache
from jaxspec.pallas_kernels.fp8_cache import Fp8Pool
from jaxspec.pallas_kernels.indexer import score_keys
from jaxspec.pallas_kernels.indexer_mosaic import indexer_scores_mosaic, indexer_topk_mosaic
from jaxspec.pallas_kernels.mosaic_gpu import warp_map_interpretable
from jaxspec.pallas_kernels.sparse_mla_attention_mosaic import PART_SLOTS as SPARSE_PART_SLOTS
from jaxspec.pallas_kernels.sparse_mla_attention_mosaic import sparse_mla_attention_mosaic
from jaxspec.pallas_kernels.split_kv import num_parts
from conftest import MOSAIC_INTERPRET
from test_fp8_cache import fp8_pool_of
from test_kernels import (assert_attention_close, indexer_inputs, latent_inputs, make_window, random_indices,
                          scale_for)

Spec = jax.ShapeDtypeStruct
# The shared memory a block may claim on sm_90 (227 KiB).
SM90_SMEM = 232448


def assert_costed(compiled, name: str, flops: int) -> None:
    """The program's one Pallas kernel is a Mosaic kernel that names its op `name` and states
    `flops` (the Triton kernel's count for the op), and `jaxspec.aot` counts it: no Mosaic call
    left uncounted, and the attention class holds exactly its stated cost."""
    [call] = aot.pallas_calls(compiled)
    assert (call.lowering, call.name, call.flops) == ("mosaic", name, flops)
    uncounted = aot.program_cost(compiled).uncounted
    assert not [target for target in uncounted if target.startswith(("mosaic", "pallas"))], uncounted
    assert aot.op_class_costs(compiled)["attention"] == (call.flops, call.bytes_accessed)


def fp8_keys(rng, keys: jax.Array) -> Fp8Pool:
    """An FP8 key pool from integer-valued keys [P, page, Di] (exact in e4m3; NaN stays NaN) with
    random power-of-two scales, so every FP8 score is exact in float32 whatever the summation order."""
    scales = 2.0 ** rng.integers(-3, 4, (*keys.shape[:2], 1))
    return Fp8Pool(keys.astype(fp8_cache.E4M3), jnp.asarray(scales, jnp.float32), None, fp8_cache.INDEX_RULE)


@pytest.mark.parametrize("case", [
    dict(num_queries=4, heads=4, dim=64, page_size=16, max_pages=6, topk=24, tree=False, integer=True),
    dict(num_queries=4, heads=4, dim=64, page_size=16, max_pages=6, topk=24, tree=True, integer=True),
    dict(num_queries=2, heads=64, dim=128, page_size=64, max_pages=3, topk=64, tree=True, integer=True),
    dict(num_queries=3, heads=8, dim=64, page_size=32, max_pages=4, topk=40, tree=False, integer=False),
], ids=["q4-page16-chain-int", "q4-page16-tree-int", "q2-64x128-page64-tree-int", "q3-page32-float"])
def test_indexer_mosaic_matches_reference(case):
    """Rows with a context ending mid-page, padding tokens, an empty row and a short one; pages out of
    order with NaN in the pages no row owns. Integer inputs make every score exact, so scores and
    the selection (ties to the lower slot included) must equal the reference's exactly."""
    rng = np.random.default_rng(40)
    topk, integer = case.pop("topk"), case.pop("integer")
    heads, dim = case.pop("heads"), case.pop("dim")
    window = make_window(rng, batch=4, **case)
    args = (*indexer_inputs(rng, window, heads, dim, jnp.bfloat16, integer), jnp.asarray(window.page_table),
            window.vis())
    scores = np.asarray(indexer_scores_mosaic(*args, interpret=MOSAIC_INTERPRET))
    indices = np.asarray(indexer_topk_mosaic(*args, topk=topk, interpret=MOSAIC_INTERPRET))
    with jax.default_matmul_precision("highest"):
        want_scores = np.asarray(jax.jit(indexer_scores_reference)(*args))
        want_indices = np.asarray(jax.jit(functools.partial(indexer_topk_reference, topk=topk))(*args))
    assert np.array_equal(np.isfinite(scores), np.isfinite(want_scores))  # same visibility
    assert not np.isnan(scores).any()
    if integer:
        np.testing.assert_array_equal(scores, want_scores)
        np.testing.assert_array_equal(indices, want_indices)
        return
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)
    # Rounding may swap near-equal scores; what is selected must score the same.
    np.testing.assert_array_equal(indices < 0, want_indices < 0)
    picked = np.take_along_axis(want_scores, np.maximum(indices, 0), axis=2)
    best = np.take_along_axis(want_scores, np.maximum(want_indices, 0), axis=2)
    np.testing.assert_allclose(np.where(indices < 0, 0, picked), np.where(want_indices < 0, 0, best), rtol=1e-5)


@pytest.mark.parametrize("case", [
    dict(num_queries=3, heads=4, dim=64, page_size=32, max_pages=4, tree=False),
    dict(num_queries=2, heads=64, dim=128, page_size=64, max_pages=3, tree=True),
], ids=["q3-page32-chain-64", "q2-64x128-page64-tree"])
def test_indexer_mosaic_reads_fp8_keys(case):
    """FP8 keys (e4m3 values, one float32 scale each) and e4m3 queries, as the model stores and
    rotates them: the kernel dequantizes nothing in HBM, feeds the e4m3 values to the tensor cores
    as bfloat16 and scales each key's head sum. Integer values and power-of-two scales make every
    score exact, so scores and selection equal the reference's exactly (out-of-order pages, NaN in
    the pages no row owns, padded and empty rows)."""
    rng = np.random.default_rng(43)
    heads, dim = case.pop("heads"), case.pop("dim")
    window = make_window(rng, batch=4, **case)
    q_idx, weights, keys = indexer_inputs(rng, window, heads, dim, jnp.float32, integer=True)
    args = (q_idx.astype(fp8_cache.E4M3), weights, fp8_keys(rng, keys), jnp.asarray(window.page_table), window.vis())
    scores = np.asarray(indexer_scores_mosaic(*args, interpret=MOSAIC_INTERPRET))
    want = np.asarray(jax.jit(indexer_scores_reference)(*args))
    assert np.isfinite(want).any() and not np.isnan(scores).any()
    np.testing.assert_array_equal(scores, want)
    np.testing.assert_array_equal(np.asarray(select_topk(jnp.asarray(scores), 24)),
                                  np.asarray(jax.jit(functools.partial(indexer_topk_reference, topk=24))(*args)))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_indexer_mosaic_scores_do_not_depend_on_the_window(fp8):
    """A token decoded alone (Q = 1), inside a chain window (Q = 4) and as a tree node scores every
    slot it sees with the same bits (random float inputs: any change of summation order would show),
    with bfloat16 keys and with FP8 keys (`quantize_act`) and e4m3 queries."""
    rng = np.random.default_rng(41)
    heads, dim, page_size, max_pages, prefix = 8, 64, 32, 3, 37
    pages = rng.permutation(max_pages + 2)[:max_pages].astype(np.int32)[None]
    keys = rng.normal(size=(max_pages + 2, page_size, dim))
    keys = (Fp8Pool(*fp8_cache.quantize_act(jnp.asarray(keys)), None, fp8_cache.INDEX_RULE) if fp8
            else jnp.asarray(keys, jnp.bfloat16))
    q_window = jnp.asarray(rng.normal(size=(1, 4, heads, dim)), fp8_cache.E4M3 if fp8 else jnp.bfloat16)
    w_window = jnp.asarray(rng.normal(size=(1, 4, heads)), jnp.float32)
    token = 3  # window token 3; in the tree its ancestors are 0 and 1 (slot prefix + 2 is a sibling's)
    run = functools.partial(indexer_scores_mosaic, key_cache=keys, page_table=jnp.asarray(pages),
                            interpret=MOSAIC_INTERPRET)
    one = lambda value: jnp.asarray([value], jnp.int32)
    alone = run(q_window[:, token:token + 1], w_window[:, token:token + 1], vis=Visibility(one(prefix + token), one(1)))
    chain = run(q_window, w_window, vis=Visibility(one(prefix), one(4)))
    ancestors = np.tril(np.ones((4, 4), bool))
    ancestors[3, 2] = False
    tree = run(q_window, w_window, vis=Visibility(one(prefix), one(4), jnp.asarray(ancestors)[None]))
    alone, chain, tree = (np.asarray(x)[0, -1 if x is alone else token] for x in (alone, chain, tree))
    seen = prefix + token + 1
    assert np.isfinite(alone[:seen]).all() and np.isneginf(alone[seen:]).all()
    np.testing.assert_array_equal(chain, alone)
    np.testing.assert_array_equal(tree[:prefix + 2], alone[:prefix + 2])
    assert np.isneginf(tree[prefix + 2]) and tree[prefix + 3] == alone[prefix + 3]


@pytest.mark.parametrize("backend", ["pallas", "mosaic"])
def test_indexer_scores_over_slot_counts(backend):
    """Visibility as per-token slot counts (DeepSeek-V4's compressed entries: token (b, q) sees
    slots [0, counts[b, q])), on each kernel through the op: counts of 0 and below (nothing seen),
    mid-page, not monotone along the window, and past the row's capacity (every slot). Integer
    inputs: scores and selection equal the reference's exactly, which equals the score over the
    mask the counts describe; out-of-order pages with NaN in the pages no row owns."""
    rng = np.random.default_rng(44)
    window = make_window(rng, batch=3, num_queries=4, page_size=16, max_pages=5, tree=False)
    q_idx, weights, keys = indexer_inputs(rng, window, 8, 64, jnp.bfloat16, True)
    capacity = 5 * 16
    counts = jnp.asarray([[0, 37, 16, 80], [-3, 1, capacity + 9, 50], [79, 5, 64, 0]], jnp.int32)
    args = (q_idx, weights, keys, jnp.asarray(window.page_table), counts)
    want = np.asarray(jax.jit(indexer_scores_reference)(*args))
    slot = np.arange(capacity)
    np.testing.assert_array_equal(np.isfinite(want), slot < np.asarray(counts)[..., None])
    mask = jnp.asarray(slot < np.asarray(counts)[..., None])
    np.testing.assert_array_equal(want, score_keys(q_idx, weights, gather_rows(keys, args[3]), mask))
    np.testing.assert_array_equal(np.asarray(indexer_scores(*args, backend=backend)), want)
    np.testing.assert_array_equal(np.asarray(indexer_topk(*args, topk=24, backend=backend)),
                                  np.asarray(indexer_topk_reference(*args, topk=24)))


def test_indexer_topk_dispatches_to_mosaic():
    rng = np.random.default_rng(42)
    window = make_window(rng, batch=2, num_queries=2, page_size=16, max_pages=4, tree=False)
    args = (*indexer_inputs(rng, window, 4, 64, jnp.bfloat16, True), jnp.asarray(window.page_table), window.vis())
    got = indexer_topk(*args, topk=16, backend="mosaic")
    np.testing.assert_array_equal(got, indexer_topk_reference(*args, topk=16))


@pytest.mark.parametrize("dtype, dim, page_size, match", [
    (jnp.float32, 64, 16, r"dtype float32 not supported by the Mosaic GPU kernel: must be bfloat16 or float16"),
    (jnp.bfloat16, 48, 16, r"index_head_dim 48 \(keys 48\) must match and be a multiple of 64"),
    (jnp.bfloat16, 64, 24, r"page_size=24 must be a multiple of 8 that divides 64 or is a multiple of it"),
    ("fp8", 64, 16, r"page_size=16: FP8 keys need a multiple of 32"),
    ("fp8-float32-queries", 64, 32, r"q_idx.dtype=float32: with FP8 keys it must be float8_e4m3fn or bfloat16"),
], ids=["float32", "dim48", "page24", "fp8-page16", "fp8-float32-queries"])
def test_indexer_mosaic_refuses_what_it_cannot_tile(dtype, dim, page_size, match):
    vis = Visibility(jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32))
    keys = jnp.zeros((4, page_size, dim), jnp.bfloat16 if isinstance(dtype, str) else dtype)
    queries = jnp.zeros((1, 1, 4, dim), jnp.float32 if isinstance(dtype, str) else dtype)
    if dtype == "fp8":
        queries = queries.astype(fp8_cache.E4M3)
    if isinstance(dtype, str):
        keys = Fp8Pool(*fp8_cache.quantize_act(keys), None, fp8_cache.INDEX_RULE)
    with pytest.raises(ValueError, match=match):
        indexer_scores_mosaic(queries, jnp.zeros((1, 1, 4)), keys, jnp.zeros((1, 4), jnp.int32), vis,
                              interpret=MOSAIC_INTERPRET)


V32 = preset("deepseek-v3.2")
BATCH, CONTEXT = 32, 4096


@pytest.mark.parametrize("num_queries, tree", [(1, False), (4, True)], ids=["q1", "q4-tree"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_indexer_mosaic_compiles_for_h100_at_v32_shapes(h100, num_queries, tree, fp8):
    """DeepSeek-V3.2's indexer (64 heads x 128, top-2048), B = 32, 4096 slots in 64-slot pages, with
    bfloat16 keys and with FP8 keys (e4m3 queries).

    The Mosaic kernel is one launch of one warpgroup whose shared memory (Mosaic GPU's count) is
    within the 227 KiB a block may claim; its registers are not in the program (Mosaic GPU's
    ptxas report: docs/kernels.md). With FP8 keys the temporaries are
    smaller than the keys' own e4m3 bytes: no dequantized copy of them exists."""
    heads, dim = V32.index_n_heads, V32.index_head_dim
    pages = BATCH * CONTEXT // 64
    vis = Visibility(Spec((BATCH,), jnp.int32), Spec((BATCH,), jnp.int32),
                     Spec((BATCH, num_queries, num_queries), jnp.bool_) if tree else None)
    keys = (Fp8Pool(Spec((pages, 64, dim), fp8_cache.E4M3), Spec((pages, 64, 1), jnp.float32), None,
                    fp8_cache.INDEX_RULE) if fp8 else Spec((pages, 64, dim), jnp.bfloat16))
    args = (Spec((BATCH, num_queries, heads, dim), fp8_cache.E4M3 if fp8 else jnp.bfloat16),
            Spec((BATCH, num_queries, heads), jnp.float32), keys, Spec((BATCH, CONTEXT // 64), jnp.int32), vis)
    compiled = aot.compile_gpu(indexer_topk_mosaic, *args, devices=h100, static_argnames=("topk",),
                               topk=V32.index_topk)
    [launch] = aot.mosaic_launches(compiled)
    assert aot.memory(compiled).output == BATCH * num_queries * V32.index_topk * 4
    assert launch.kernel == "indexer_scores_mosaic_mosaic_gpu_kernel"  # the profiler's name for it
    assert launch.threads == (128, 1, 1) and launch.shared_memory <= SM90_SMEM
    # The Q programs of one key chunk side by side: Mosaic GPU launches the grid reversed, Q as CUDA's x.
    assert launch.grid == (num_queries, CONTEXT // 1024, BATCH)
    assert_costed(compiled, "indexer_scores", BATCH * num_queries * heads * CONTEXT * (2 * dim + 3))
    table_row = r"^indexer_scores \(Mosaic\)\s+1\s+\S+\s+128\s+(\d+)\s+-\s+-$"  # `jaxspec aot`'s kernel table
    row = re.search(table_row, aot.report(compiled, "indexer"), re.M)
    assert row and int(row.group(1)) == launch.shared_memory
    if fp8:
        assert aot.memory(compiled).temp < BATCH * CONTEXT * dim


# ----------------------------------------------------------------------------------------------
# Sparse MLA
# ----------------------------------------------------------------------------------------------


def sparse_case(rng, *, batch, num_queries, heads, latent, rope, page_size, max_pages, topk):
    """Random latent inputs over a tree window's paged cache (pages out of order, NaN in the pages no
    row owns) and index lists of visible slots with -1 and past-the-pages slots mixed in; token
    (0, 0) selects nothing."""
    window = make_window(rng, batch, num_queries, page_size, max_pages, tree=True)
    indices = random_indices(rng, window, topk)
    indices[0, 0] = -1
    args = (*latent_inputs(rng, window, heads, latent, rope, jnp.bfloat16), jnp.asarray(window.page_table),
            jnp.asarray(indices))
    return window, args


@pytest.mark.parametrize("case", [
    dict(num_queries=2, heads=4, latent=128, rope=64, page_size=16, max_pages=6, topk=40),
    dict(num_queries=1, heads=64, latent=128, rope=128, page_size=64, max_pages=3, topk=128),
], ids=["q2-192wide-page16-pad-heads", "q1-64heads-256wide-page64-two-tiles"])
def test_sparse_mla_mosaic_matches_reference(case):
    window, args = sparse_case(np.random.default_rng(50), batch=2, **case)
    scale = scale_for(case["latent"], case["rope"])
    got = sparse_mla_attention_mosaic(*args, softmax_scale=scale, interpret=MOSAIC_INTERPRET)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(functools.partial(sparse_mla_attention_reference, softmax_scale=scale))(*args)
    assert got[0].dtype == jnp.bfloat16 and got[0].shape == args[0].shape
    assert np.all(np.asarray(got[1][0, 0]) == np.float32(EMPTY_LSE))  # the token that selects nothing
    assert_attention_close(got, want, window, jnp.bfloat16)


def test_sparse_mla_mosaic_split_kv_parts():
    """part_slots=64 cuts a list of 150 into three parts of one tile (the last padded with -1):
    the merged result equals the reference; a token whose selection lies in its first part gives
    the bits of that part's list alone (an empty part weighs exactly 0 in the merge); a token that
    selects nothing keeps output 0 and EMPTY_LSE."""
    window, (q_nope, q_rope, cache, page_table, indices) = sparse_case(
        np.random.default_rng(54), batch=2, num_queries=3, heads=4, latent=128, rope=64, page_size=16, max_pages=10,
        topk=150)
    indices = np.array(indices)
    assert all((indices[0, 1, part] >= 0).any() for part in (slice(0, 64), slice(64, 128), slice(128, 150)))
    indices[0, 2, 64:] = -1  # this token's selection in part 0 only
    assert (indices[0, 2] >= 0).any()
    run = functools.partial(sparse_mla_attention_mosaic, softmax_scale=scale_for(128, 64), part_slots=64,
                            interpret=MOSAIC_INTERPRET)
    got = run(q_nope, q_rope, cache, page_table, jnp.asarray(indices))
    with jax.default_matmul_precision("highest"):
        want = jax.jit(functools.partial(sparse_mla_attention_reference, softmax_scale=scale_for(128, 64)))(
            q_nope, q_rope, cache, page_table, jnp.asarray(indices))
    assert_attention_close(got, want, window, jnp.bfloat16)
    assert np.all(np.asarray(got[1][0, 0]) == np.float32(EMPTY_LSE)) and not np.asarray(got[0][0, 0]).any()
    alone = run(q_nope[:1, 2:], q_rope[:1, 2:], cache, page_table[:1], jnp.asarray(indices[:1, 2:, :64]))
    for got_part, alone_part in zip(got, alone):
        np.testing.assert_array_equal(np.asarray(got_part[0, 2], np.float32), np.asarray(alone_part[0, 0], np.float32))


def test_sparse_mla_mosaic_copies_by_warp_give_the_same_bits():
    """copies_by_warp=True (each of the scorer's warps issues a quarter of a tile's slot copies)
    moves the same bytes to the same places: interpreted, out and lse equal the default's bit for
    bit, on a tile with -1 and past-the-pages slots (their arrivals without bytes come from the
    warps then) and a token that selects nothing. jax 0.10.2's interpreter cannot run it (no
    `core_map`), which is a ValueError before tracing; both versions compile it (below)."""
    _, args = sparse_case(np.random.default_rng(51), batch=2, num_queries=2, heads=4, latent=128, rope=64,
                          page_size=16, max_pages=6, topk=40)
    run = functools.partial(sparse_mla_attention_mosaic, *args, softmax_scale=scale_for(128, 64),
                            interpret=MOSAIC_INTERPRET)
    if not warp_map_interpretable():
        with pytest.raises(ValueError, match="copies_by_warp=True interpreted needs jax >= 0.11"):
            run(copies_by_warp=True)
        return
    for got, want in zip(run(copies_by_warp=True), run()):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def refuses_copies_by_thread(run) -> bool:
    """`run(**tuning)` of a Mosaic kernel refuses copies_by_thread beside copies_by_warp, and alone
    where it is interpreted (the simulator does not run inline Mosaic GPU code), before tracing ->
    whether this run interprets, so that there is nothing to compare."""
    with pytest.raises(ValueError, match="choose one"):
        run(copies_by_thread=True, copies_by_warp=True)
    if MOSAIC_INTERPRET:
        with pytest.raises(ValueError, match="copies_by_thread=True runs compiled only"):
            run(copies_by_thread=True)
    return MOSAIC_INTERPRET


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sparse_mla_mosaic_copies_by_thread_give_the_same_bits(fp8):
    """copies_by_thread=True (each of the scorer's first 64 threads issues one slot's copies on an
    mbarrier of its own, in inline Mosaic GPU code) moves the same bytes to the same places: on a
    GPU out and lse equal the default's bit for bit, on a tile with -1 and past-the-pages slots
    and a token that selects nothing, bfloat16 and FP8 (two parts a slot). The simulator does not
    run inline Mosaic GPU code: interpreted it is a ValueError before tracing, as is asking for it
    with copies_by_warp."""
    _, (q_nope, q_rope, cache, page_table, indices) = sparse_case(
        np.random.default_rng(52), batch=2, num_queries=2, heads=4, latent=128, rope=64, page_size=16, max_pages=6,
        topk=40)
    run = functools.partial(sparse_mla_attention_mosaic, q_nope, q_rope, fp8_pool_of(cache, 128) if fp8 else cache,
                            page_table, indices, softmax_scale=scale_for(128, 64), interpret=MOSAIC_INTERPRET)
    if refuses_copies_by_thread(run):
        return
    for got, want in zip(run(copies_by_thread=True), run()):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_sparse_mla_mosaic_reads_fp8_latents():
    """An FP8 latent pool (FlashMLA's token: e4m3 values, a float32 scale per 128, bfloat16 RoPE
    part; NaN in the pages no row owns): the kernel dequantizes each gathered row in registers as
    `fp8_cache.entries` does, so its output and lse equal, bit for bit, its own on the bfloat16
    entries of the same pool, and the reference on the pool within bfloat16 tolerance."""
    window, (q_nope, q_rope, cache, page_table, indices) = sparse_case(
        np.random.default_rng(53), batch=2, num_queries=2, heads=4, latent=128, rope=64, page_size=16, max_pages=6,
        topk=40)
    pool = fp8_pool_of(cache, 128)
    scale = scale_for(128, 64)
    got = sparse_mla_attention_mosaic(q_nope, q_rope, pool, page_table, indices, softmax_scale=scale,
                                      interpret=MOSAIC_INTERPRET)
    on_entries = sparse_mla_attention_mosaic(q_nope, q_rope, fp8_cache.entries(pool), page_table, indices,
                                             softmax_scale=scale, interpret=MOSAIC_INTERPRET)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(functools.partial(sparse_mla_attention_reference, softmax_scale=scale))(
            q_nope, q_rope, pool, page_table, indices)
    for name, got_part, exact in zip(("out", "lse"), got, on_entries):
        np.testing.assert_array_equal(np.asarray(got_part, np.float32), np.asarray(exact, np.float32), err_msg=name)
    assert_attention_close(got, want, window, jnp.bfloat16)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sparse_mla_mosaic_output_does_not_depend_on_the_window(fp8):
    """A token's output bits are the same decoded alone (B = 1, Q = 1) and as the second token of a
    B = 2, Q = 2 tree window (a tree node's index list is just another list), on a bfloat16 cache and
    on an FP8 one, with its list in two split-KV parts."""
    rng = np.random.default_rng(51)
    window, args = sparse_case(rng, batch=2, num_queries=2, heads=4, latent=128, rope=64, page_size=16,
                               max_pages=8, topk=128)
    q_nope, q_rope, cache, page_table, indices = args
    if fp8:
        cache = fp8_pool_of(cache, 128)
        args = (q_nope, q_rope, cache, page_table, indices)
    run = functools.partial(sparse_mla_attention_mosaic, softmax_scale=0.125, part_slots=64, interpret=MOSAIC_INTERPRET)
    together = run(*args)
    alone = run(q_nope[:1, 1:], q_rope[:1, 1:], cache, page_table[:1], indices[:1, 1:])
    assert np.isfinite(np.asarray(alone[1])).all() and (np.asarray(alone[1]) > EMPTY_LSE).all()
    np.testing.assert_array_equal(np.asarray(together[0][0, 1]), np.asarray(alone[0][0, 0]))
    np.testing.assert_array_equal(np.asarray(together[1][0, 1]), np.asarray(alone[1][0, 0]))


def test_sparse_mla_dispatches_to_mosaic():
    window, args = sparse_case(np.random.default_rng(52), batch=1, num_queries=1, heads=4, latent=128, rope=64,
                               page_size=16, max_pages=2, topk=16)
    got = sparse_mla_attention(*args, softmax_scale=0.125, backend="mosaic")
    with jax.default_matmul_precision("highest"):
        want = sparse_mla_attention_reference(*args, softmax_scale=0.125)
    assert_attention_close(got, want, window, jnp.bfloat16)


@pytest.mark.parametrize("dtype, latent, rope, match", [
    (jnp.float32, 128, 64, r"dtype float32 not supported by the Mosaic GPU kernel: must be bfloat16 or float16"),
    (jnp.bfloat16, 64, 64, r"Dl=64 must be a multiple of 128 \(of 512 when wider\) and Dr=64 of 64"),
    (jnp.bfloat16, 640, 64, r"Dl=640 must be a multiple of 128 \(of 512 when wider\) and Dr=64 of 64"),
    (jnp.bfloat16, 128, 32, r"Dl=128 must be a multiple of 128 \(of 512 when wider\) and Dr=32 of 64"),
    ("fp8", 64, 64, r"FP8 latent width 64 must be a multiple of 128 with one scale per 128 values"),
    ("fp8", 640, 64, r"Dl=640 must be a multiple of 128 \(of 512 when wider\)"),
    ("fp8-float32-rope", 128, 64, r"an FP8 latent cache needs a bfloat16 rope part, got float32"),
], ids=["float32", "dl64", "dl640", "dr32", "fp8-dl64", "fp8-dl640", "fp8-float32-rope"])
def test_sparse_mla_mosaic_refuses_what_it_cannot_tile(dtype, latent, rope, match):
    cache = jnp.zeros((4, 16, latent + rope), jnp.bfloat16 if isinstance(dtype, str) else dtype)
    if isinstance(dtype, str):
        cache = fp8_pool_of(cache, latent)
        if dtype == "fp8-float32-rope":
            cache = Fp8Pool(cache.values, cache.scales, cache.rope.astype(jnp.float32))
    query_dtype = jnp.bfloat16 if isinstance(dtype, str) else dtype
    with pytest.raises(ValueError, match=match):
        sparse_mla_attention_mosaic(jnp.zeros((1, 1, 4, latent), query_dtype), jnp.zeros((1, 1, 4, rope), query_dtype),
                                    cache, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 1, 8), jnp.int32),
                                    softmax_scale=0.1, interpret=MOSAIC_INTERPRET)


def test_sparse_mla_mosaic_refuses_a_cache_past_exact_float32_rows():
    """Slot rows reach the kernel as float32: a cache of more than 2**24 slots is refused before
    tracing (abstract arrays: nothing is allocated)."""
    with pytest.raises(ValueError, match=r"latent_cache holds 16777280 slots: at most 16777216"):
        sparse_mla_attention_mosaic(Spec((1, 1, 64, 512), jnp.bfloat16), Spec((1, 1, 64, 64), jnp.bfloat16),
                                    Spec((2 ** 18 + 1, 64, 576), jnp.bfloat16), Spec((1, 4), jnp.int32),
                                    Spec((1, 1, 64), jnp.int32), softmax_scale=0.1)


@functools.cache
def sparse_mla_compile(num_queries: int, fp8: bool, **tuning):
    """DeepSeek-V3.2's sparse MLA (128 heads, 512 + 64 in 64-slot pages, bfloat16 or FlashMLA's FP8
    token, top-2048), B = 32, 4096 slots a row, compiled for one H100 (with the kernel's `tuning`
    arguments: auto_barriers, copies_by_warp). Cached: the FP8 case compares itself with the
    bfloat16 one."""
    heads, latent, rope = V32.num_attention_heads, V32.kv_lora_rank, V32.qk_rope_head_dim
    pages = BATCH * CONTEXT // 64
    cache = (Fp8Pool(Spec((pages, 64, latent), fp8_cache.E4M3), Spec((pages, 64, latent // 128), jnp.float32),
                     Spec((pages, 64, rope), jnp.bfloat16)) if fp8 else Spec((pages, 64, latent + rope), jnp.bfloat16))
    args = (Spec((BATCH, num_queries, heads, latent), jnp.bfloat16),
            Spec((BATCH, num_queries, heads, rope), jnp.bfloat16), cache, Spec((BATCH, CONTEXT // 64), jnp.int32),
            Spec((BATCH, num_queries, V32.index_topk), jnp.int32))
    kernel = functools.partial(sparse_mla_attention_mosaic, softmax_scale=V32.softmax_scale, **tuning)
    return aot.compile_gpu(kernel, *args, devices=aot.gpu_devices("h100"))


@pytest.mark.parametrize("tuning, fp8", [(dict(auto_barriers=False), False), (dict(copies_by_warp=True), False),
                                         (dict(copies_by_thread=True), False), (dict(copies_by_thread=True), True)],
                         ids=["no-auto-barriers", "copies-by-warp", "copies-by-thread", "copies-by-thread-fp8"])
def test_sparse_mla_mosaic_compiles_with_each_tuning(h100, tuning, fp8):
    """The tunings the GPU report times beside the default (`auto_barriers=False`, Pallas'
    `unsafe_no_auto_barriers`; `copies_by_warp=True`, the scorer's warps issuing the slot copies;
    `copies_by_thread=True`, one thread a slot in inline Mosaic GPU code, on FP8 pools' two parts
    too) lower for an H100 at V3.2's shapes into the same launch: grid, threads and shared memory
    (none costs any: copies_by_thread's mbarrier sits in the 1 KiB the vectors buffer takes)."""
    [launch] = aot.mosaic_launches(sparse_mla_compile(1, fp8, **tuning))
    [default] = aot.mosaic_launches(sparse_mla_compile(1, fp8))
    assert (launch.grid, launch.threads, launch.shared_memory) == (default.grid, default.threads,
                                                                   default.shared_memory)


@pytest.mark.parametrize("num_queries", [1, 4], ids=["q1", "q4"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sparse_mla_mosaic_compiles_for_h100_at_v32_shapes(h100, num_queries, fp8):
    """`sparse_mla_compile`: one Mosaic kernel of three warpgroups (the scorer and two followers
    owning 256 columns each), a block per (head block, token, split-KV part: 4 of 512 slots at
    top-2048), whose shared memory (Mosaic GPU's count) is within the 227 KiB a block may use
    (about 226 KiB in bfloat16, 196 KiB with FP8: its staging holds e4m3 rows); registers are not in
    the program (Mosaic GPU's ptxas report: docs/kernels.md). The parts' float32 partials are
    temporaries. With FP8 the temporaries exceed the bfloat16 program's by at most the selected
    slots' gathered scales (16 bytes a slot): no dequantized copy of the cache exists."""
    compiled = sparse_mla_compile(num_queries, fp8)
    [launch] = aot.mosaic_launches(compiled)
    assert launch.kernel == "sparse_mla_attention_mosaic_mosaic_gpu_kernel"  # the profiler's name for it
    parts = num_parts(V32.index_topk, SPARSE_PART_SLOTS)
    assert parts == 4
    # One column block; a token part's two head blocks side by side on CUDA's x (`work_grid`).
    assert launch.threads == (384, 1, 1) and launch.grid == (2 * BATCH * num_queries * parts, 1, 1)
    assert launch.shared_memory <= SM90_SMEM
    heads, latent, rope = V32.num_attention_heads, V32.kv_lora_rank, V32.qk_rope_head_dim
    assert aot.memory(compiled).temp >= parts * BATCH * num_queries * heads * latent * 4
    assert_costed(compiled, "sparse_mla_attention",
                  2 * BATCH * num_queries * heads * V32.index_topk * (2 * latent + rope))
    if fp8:
        bf16_compiled = sparse_mla_compile(num_queries, False)
        gathered_scales = BATCH * num_queries * V32.index_topk * (V32.kv_lora_rank // 128) * 4
        assert launch.shared_memory < aot.mosaic_launches(bf16_compiled)[0].shared_memory
        assert aot.memory(compiled).temp <= aot.memory(bf16_compiled).temp + gathered_scales
