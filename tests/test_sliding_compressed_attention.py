"""DeepSeek-V4's sliding-window + compressed attention: the reference against a naive numpy loop
that builds every token's key list by hand (ring slots by the sliding-window rule, compressed
entries by number or count, extra keys; softmax with the sink in the denominator, as transformers'
`eager_attention_forward`), then the Pallas kernel against the reference."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas_kernels import (Visibility, fp8_cache, sliding_compressed_attention,
                                    sliding_compressed_attention_reference)
from jaxspec.pallas_kernels.fp8_cache import Fp8Pool
from jaxspec.pallas_kernels.sliding_compressed_attention_pallas import sliding_compressed_attention_pallas
from cuda_lowering import triton_calls


class Case(NamedTuple):
    """Numpy inputs of one call, and how to run it."""

    q: np.ndarray  # [B, Q, H, D]
    window_kv: np.ndarray  # [P, page, D]
    window_pages: np.ndarray  # [B, R // page]
    positions: np.ndarray  # [B, Q]
    prefix_len: np.ndarray  # [B]
    query_len: np.ndarray  # [B]
    ancestors: np.ndarray  # [B, Q, Q] bool
    is_tree: bool
    sinks: np.ndarray  # [H]
    sliding_window: int
    scale: float
    compressed_kv: np.ndarray | None  # [Pc, page, D]
    compressed_pages: np.ndarray | None  # [B, E // page]
    compressed_indices: np.ndarray | None  # [B, Q, K]
    compressed_count: np.ndarray | None  # [B, Q]
    extra_kv: np.ndarray | None  # [B, Q, X, D]
    extra_valid: np.ndarray | None  # [B, Q, X]

    def args(self, dtype):
        """(positional args, keyword args) for the op, as jnp arrays in `dtype`."""
        tree = jnp.asarray(self.ancestors) if self.is_tree else None
        vis = Visibility(jnp.asarray(self.prefix_len), jnp.asarray(self.query_len), tree)
        cast = lambda x: None if x is None else jnp.asarray(x, dtype)  # noqa: E731
        keep = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
        args = (cast(self.q), cast(self.window_kv), jnp.asarray(self.window_pages), jnp.asarray(self.positions), vis,
                jnp.asarray(self.sinks, jnp.float32))
        kwargs = dict(sliding_window=self.sliding_window, scale=self.scale, compressed_kv=cast(self.compressed_kv),
                      compressed_pages=keep(self.compressed_pages), compressed_indices=keep(self.compressed_indices),
                      compressed_count=keep(self.compressed_count), extra_kv=cast(self.extra_kv),
                      extra_valid=keep(self.extra_valid))
        return args, kwargs


def make_case(rng, *, batch=4, num_queries=4, heads=4, dim=32, page=4, ring_pages=4, window=8, tree=False,
              compressed="indices", entry_pages=3, topk=6, extra=0) -> Case:
    """Rows cycle through: a long context (ring wrapped many times), a row with padding tokens, an
    empty row (query_len 0), a short context (ring not yet full). Page tables are random
    permutations. Memory no token may see is NaN (pages no row owns, ring indices never written,
    entries past every count of the row, invalid extra keys), so reading it unmasked shows."""
    ring = ring_pages * page
    prefix, query_len = [], []
    for b in range(batch):
        kind = b % 4
        prefix.append([int(rng.integers(3 * ring, 5 * ring)), int(rng.integers(1, 2 * ring)),
                       int(rng.integers(0, 2 * ring)), int(rng.integers(0, 3))][kind])
        query_len.append([num_queries, int(rng.integers(1, num_queries + 1)), 0, num_queries][kind])
    ancestors = np.zeros((batch, num_queries, num_queries), bool)
    positions = np.zeros((batch, num_queries), np.int32)
    for b in range(batch):
        parent = [-1] + [int(rng.integers(0, j)) if tree else j - 1 for j in range(1, num_queries)]
        for q in range(num_queries):
            node, depth = q, -1
            while node >= 0:
                ancestors[b, q, node] = True
                node, depth = parent[node], depth + 1
            positions[b, q] = prefix[b] + depth

    def pages(count):
        total = batch * count + 2
        table = rng.permutation(total)[:batch * count].reshape(batch, count).astype(np.int32)
        kv = rng.normal(size=(total, page, dim)).astype(np.float32)
        kv[np.setdiff1d(np.arange(total), table)] = np.nan
        return kv, table

    window_kv, window_pages = pages(ring_pages)
    for b in range(batch):  # ring indices no slot below prefix_len + query_len has reached
        for r in range(prefix[b] + query_len[b], ring):
            window_kv[window_pages[b, r // page], r % page] = np.nan
    compressed_kv = compressed_pages = indices = count = None
    if compressed is not None:
        compressed_kv, compressed_pages = pages(entry_pages)
        entries = entry_pages * page
        if compressed == "indices":  # some -1, some past the row's pages (both skipped)
            indices = rng.integers(-1, entries + 2, size=(batch, num_queries, topk)).astype(np.int32)
        else:
            count = rng.integers(0, entries + 1, size=(batch, num_queries)).astype(np.int32)
            for b in range(batch):
                for e in range(count[b, :query_len[b]].max(initial=0), entries):
                    compressed_kv[compressed_pages[b, e // page], e % page] = np.nan
    extra_kv = extra_valid = None
    if extra:
        extra_kv = rng.normal(size=(batch, num_queries, extra, dim)).astype(np.float32)
        extra_valid = rng.random((batch, num_queries, extra)) < 0.6
        extra_kv[~extra_valid] = np.nan
    return Case(rng.normal(size=(batch, num_queries, heads, dim)).astype(np.float32), window_kv, window_pages,
                positions, np.array(prefix, np.int32), np.array(query_len, np.int32), ancestors, tree,
                rng.normal(size=heads).astype(np.float32), window, dim ** -0.5, compressed_kv, compressed_pages,
                indices, count, extra_kv, extra_valid)


def v4_pool(kv: jax.Array, rope: int) -> Fp8Pool:
    """kv [..., D] written to a V4 FP8 pool (FlashMLA's MODEL1 token, `rope` bfloat16 RoPE values)."""
    return fp8_cache.quantize_entries(kv, fp8_cache.V4_RULE, kv.shape[-1] - rope)


def naive(case: Case) -> np.ndarray:
    """Per token: its key list from the data model (the contract's words), then a float64 softmax
    whose denominator also holds exp(sink)."""
    batch, num_queries, heads, dim = case.q.shape
    page = case.window_kv.shape[1]
    ring = case.window_pages.shape[1] * page
    out = np.zeros(case.q.shape)

    def read(kv, table, b, slot):
        return kv[table[b, slot // page], slot % page]

    for b, q in np.ndindex(batch, num_queries):
        if q >= case.query_len[b]:
            continue
        p, prefix = int(case.positions[b, q]), int(case.prefix_len[b])
        keys = [read(case.window_kv, case.window_pages, b, s % ring)
                for s in range(max(0, p - case.sliding_window + 1), prefix)]
        keys += [read(case.window_kv, case.window_pages, b, (prefix + j) % ring) for j in range(case.query_len[b])
                 if case.ancestors[b, q, j] and case.positions[b, j] > p - case.sliding_window]
        if case.compressed_kv is not None:
            entries = case.compressed_pages.shape[1] * page
            numbers = (case.compressed_indices[b, q] if case.compressed_indices is not None
                       else range(case.compressed_count[b, q]))
            keys += [read(case.compressed_kv, case.compressed_pages, b, int(e)) for e in numbers if 0 <= e < entries]
        if case.extra_kv is not None:
            keys += [k for k, v in zip(case.extra_kv[b, q], case.extra_valid[b, q]) if v]
        keys = np.array(keys, np.float64).reshape(-1, dim)
        logits = case.q[b, q].astype(np.float64) @ keys.T * case.scale  # [H, S]
        top = np.maximum(logits.max(axis=1, initial=-np.inf), case.sinks)[:, None]
        weights = np.exp(logits - top)
        out[b, q] = weights @ keys / (weights.sum(axis=1, keepdims=True) + np.exp(case.sinks[:, None] - top))
    return out


def run(case: Case, dtype=jnp.float32, backend="xla", **options):
    args, kwargs = case.args(dtype)
    op = functools.partial(sliding_compressed_attention, backend=backend, **kwargs, **options)
    with jax.default_matmul_precision("highest"):
        return jax.jit(op)(*args)


# ----------------------------------------------------------------------------------------------
# The reference is the definition: against the naive loop
# ----------------------------------------------------------------------------------------------

REFERENCE_CASES = {
    "chain-csa": dict(),
    "tree-csa-extra": dict(tree=True, num_queries=5, extra=3, ring_pages=4),
    "chain-hca": dict(compressed="count"),
    "tree-hca-extra": dict(tree=True, compressed="count", extra=2),
    "sliding-only": dict(compressed=None, num_queries=1, window=13),
    "window-past-ring-start": dict(num_queries=6, window=11, page=8, ring_pages=2),  # R = W - 1 + Q exactly
}


@pytest.mark.parametrize("options", REFERENCE_CASES.values(), ids=REFERENCE_CASES.keys())
def test_reference_matches_naive(options):
    case = make_case(np.random.default_rng(1), **options)
    got = np.asarray(run(case))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, naive(case), rtol=1e-5, atol=1e-5)
    padding = np.arange(case.q.shape[1])[None, :] >= case.query_len[:, None]
    assert padding.any() and (got[padding] == 0).all()


def test_reference_token_seeing_nothing_returns_zero():
    """A tree token that is not its own ancestor sees no ring slot; with no entries and no extra
    keys it sees nothing: 0, not NaN, whatever the sink."""
    case = make_case(np.random.default_rng(2), batch=1, num_queries=2, tree=True, compressed=None)
    ancestors = case.ancestors.copy()
    ancestors[0, 1] = False
    case = case._replace(ancestors=ancestors, prefix_len=np.zeros(1, np.int32), query_len=np.array([2], np.int32),
                         positions=np.array([[0, 1]], np.int32))
    got = np.asarray(run(case))
    np.testing.assert_array_equal(got[0, 1], 0)
    np.testing.assert_allclose(got, naive(case), rtol=1e-5, atol=1e-5)


def test_reference_sink_only_scales_the_output():
    """One visible key of value v: softmax with the sink gives v * 1 / (1 + exp(sink - score))."""
    case = make_case(np.random.default_rng(3), batch=1, num_queries=1, heads=2, compressed=None, window=1)
    case = case._replace(prefix_len=np.array([5], np.int32), positions=np.array([[5]], np.int32))
    got = np.asarray(run(case))[0, 0]
    page = case.window_kv.shape[1]
    ring = case.window_pages.shape[1] * page
    key = case.window_kv[case.window_pages[0, (5 % ring) // page], 5 % page]
    score = case.q[0, 0] @ key * case.scale
    np.testing.assert_allclose(got, key[None, :] / (1 + np.exp(case.sinks - score))[:, None], rtol=1e-5)


def test_bad_arguments_raise_value_errors():
    case = make_case(np.random.default_rng(4), compressed="indices")
    args, kwargs = case.args(jnp.float32)
    call = functools.partial(sliding_compressed_attention_reference, *args)
    with pytest.raises(ValueError, match=r"ring capacity R = .* = 16: must be >= sliding_window - 1 \+ Q = 17"):
        call(**{**kwargs, "sliding_window": 14})
    with pytest.raises(ValueError, match="exactly one of compressed_indices"):
        call(**{**kwargs, "compressed_count": jnp.zeros((4, 4), jnp.int32)})
    with pytest.raises(ValueError, match="compressed_kv needs compressed_pages"):
        call(**{**kwargs, "compressed_pages": None})
    with pytest.raises(ValueError, match="without compressed_kv"):
        call(**{**kwargs, "compressed_kv": None})
    with pytest.raises(ValueError, match="extra_kv and extra_valid together"):
        call(**{**kwargs, "extra_kv": jnp.zeros((4, 4, 2, 32))})
    with pytest.raises(ValueError, match=r"sinks has shape \(3,\): must be \[4\]"):
        sliding_compressed_attention_reference(*args[:5], jnp.zeros(3), **kwargs)
    with pytest.raises(ValueError, match=r"window_kv has shape .*: must be \[\*, \*, 32\]"):
        sliding_compressed_attention_reference(args[0], args[1][..., :16], *args[2:], **kwargs)
    with pytest.raises(ValueError, match="sliding_window=0: must be an int >= 1"):
        call(**{**kwargs, "sliding_window": 0})
    with pytest.raises(ValueError, match="backend='gpu'"):
        sliding_compressed_attention(*args, **kwargs, backend="gpu")


# ----------------------------------------------------------------------------------------------
# The Pallas kernel (interpret mode on CPU) against the reference
# ----------------------------------------------------------------------------------------------

PALLAS_CASES = {
    # one token per row block (block_m 16 = H), bf16, CSA top-k over several tiles
    "chain-csa-bf16": dict(case=dict(heads=16, dim=64, topk=40), dtype=jnp.bfloat16, backend_op=True),
    # several tokens per row block, a tree with extra keys, HCA count, split into parts
    "tree-hca-extra-f32-split": dict(case=dict(tree=True, num_queries=5, heads=4, compressed="count", extra=3,
                                               entry_pages=6), dtype=jnp.float32, num_splits=3),
    # a row block straddling tokens (H = 12), D not a power of two, CSA with extra keys
    "tree-csa-extra-h12-d40-f32": dict(case=dict(tree=True, heads=12, dim=40, extra=2), dtype=jnp.float32),
    # a long chain (Q > W, as in a prefill chunk): each row block walks its own tokens' ring slots
    "long-chain-hca-f32-blocks": dict(case=dict(num_queries=12, window=4, heads=4, dim=32, compressed="count"),
                                      dtype=jnp.float32, block_m=16),
    # a sliding-only layer with a ring exactly W - 1 + Q long, bf16
    "sliding-only-bf16": dict(case=dict(compressed=None, num_queries=6, window=11, page=8, ring_pages=2),
                              dtype=jnp.bfloat16, block_n=16),
}


def check_pallas(case: Case, dtype, *, backend_op: bool = False, **tuning):
    """The kernel (jitted; through the op's `backend="pallas"` when backend_op) against the
    reference: within dtype tolerance, finite, padding tokens exactly 0."""
    if backend_op:
        got = run(case, dtype, backend="pallas")
    else:
        args, kwargs = case.args(dtype)
        kernel = functools.partial(sliding_compressed_attention_pallas, **kwargs, **tuning)
        with jax.default_matmul_precision("highest"):
            got = jax.jit(kernel)(*args)
    want = run(case, dtype)
    assert got.dtype == dtype and got.shape == case.q.shape
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    padding = np.arange(case.q.shape[1])[None, :] >= case.query_len[:, None]
    assert (got[padding] == 0).all()


@pytest.mark.parametrize("options", PALLAS_CASES.values(), ids=PALLAS_CASES.keys())
def test_pallas_matches_reference(options):
    options = dict(options)
    check_pallas(make_case(np.random.default_rng(5), **options.pop("case")), options.pop("dtype"), **options)


def test_pallas_token_alone_equals_token_in_window():
    """Window invariance (what keeps speculative greedy decoding exact in bfloat16): each token of a
    chain window gives bit for bit what it gives alone in a one-token call after the tokens before
    it were committed (same ring, same entries): tiles are anchored to absolute slots and entry
    numbers, and a tile a row sees nothing of leaves its carry unchanged."""
    case = make_case(np.random.default_rng(8), batch=2, num_queries=4, heads=4, dim=32, window=40, ring_pages=12,
                     compressed="count", extra=2)
    args, kwargs = case.args(jnp.float32)
    kernel = jax.jit(functools.partial(sliding_compressed_attention_pallas, sliding_window=case.sliding_window,
                                       scale=case.scale))
    drop = ("sliding_window", "scale")
    window = np.asarray(kernel(*args, **{k: v for k, v in kwargs.items() if k not in drop}))
    for q in range(case.q.shape[1]):
        one = slice(q, q + 1)
        vis = Visibility(jnp.asarray(case.prefix_len + q), jnp.asarray((case.query_len > q).astype(np.int32)))
        alone = kernel(args[0][:, one], *args[1:3], args[3][:, one], vis, args[5],
                       **{k: v[:, one] if k in ("compressed_count", "extra_kv", "extra_valid") else v
                          for k, v in kwargs.items() if k not in drop})
        np.testing.assert_array_equal(np.asarray(alone)[:, 0], window[:, q])


# ----------------------------------------------------------------------------------------------
# Compiled for an H100 (sm_90a) without a GPU, and run on one where there is one
# ----------------------------------------------------------------------------------------------

SPEC = jax.ShapeDtypeStruct
SHARED_MEMORY_LIMIT = 232448  # bytes a block may opt into on sm_90 (227 KB), as tests/test_aot.py
# DeepSeek-V4-Flash (deepseek-ai/DeepSeek-V4-Flash config.json): 64 heads, head_dim 512, sliding
# window 128, index_topk 512; CSA compresses 4 tokens an entry, HCA 128. Served at B = 32.
FLASH = dict(heads=64, dim=512, window=128, topk=512, batch=32, page=64, context=4096)


def abstract_call(*, heads, dim, window, topk, batch, page, context, num_queries, compressed, tree, extra,
                  fp8=False):
    """(abstract args, keyword args) of a bf16 call: a ring of W - 1 + Q slots in whole pages,
    the compressed entries of `context` tokens (every 4th for CSA's indices, every 128th for HCA);
    fp8: the ring and the entries V4 FP8 pools (e4m3 values, a float32 scale per 64, 64 bfloat16
    RoPE values)."""
    ring_pages = -(-(window - 1 + num_queries) // page)
    entry_pages = -(-context // (4 if compressed == "indices" else 128) // page)
    vis = Visibility(SPEC((batch,), jnp.int32), SPEC((batch,), jnp.int32),
                     SPEC((batch, num_queries, num_queries), jnp.bool_) if tree else None)

    def pool(pages):
        if not fp8:
            return SPEC((pages, page, dim), jnp.bfloat16)
        quant = dim - 64
        return Fp8Pool(SPEC((pages, page, quant), fp8_cache.E4M3), SPEC((pages, page, quant // 64), jnp.float32),
                       SPEC((pages, page, 64), jnp.bfloat16), fp8_cache.V4_RULE)

    args = (SPEC((batch, num_queries, heads, dim), jnp.bfloat16), pool(batch * ring_pages),
            SPEC((batch, ring_pages), jnp.int32), SPEC((batch, num_queries), jnp.int32), vis,
            SPEC((heads,), jnp.float32))
    kwargs = dict(sliding_window=window, scale=dim ** -0.5, compressed_kv=pool(batch * entry_pages),
                  compressed_pages=SPEC((batch, entry_pages), jnp.int32))
    if compressed == "indices":
        kwargs["compressed_indices"] = SPEC((batch, num_queries, topk), jnp.int32)
    else:
        kwargs["compressed_count"] = SPEC((batch, num_queries), jnp.int32)
    if extra:
        kwargs.update(extra_kv=SPEC((batch, num_queries, extra, dim), jnp.bfloat16),
                      extra_valid=SPEC((batch, num_queries, extra), jnp.bool_))
    entries = topk if compressed == "indices" else entry_pages * page
    # Every query row scores and averages D features per key it may meet: the ring span, its
    # entries, its extra keys.
    flops = 4 * batch * num_queries * heads * dim * (window - 1 + num_queries + entries + extra)
    return args, kwargs, flops


def test_cuda_lowering_at_tiny_dims():
    """The Pallas-to-Triton lowering of every feature at once (tree, top-k, extra keys) at dims no
    block has (H = 12, D = 40): one Triton kernel. Needs no GPU and no CUDA plugin."""
    args, kwargs, _ = abstract_call(heads=12, dim=40, window=8, topk=12, batch=3, page=8, context=96, num_queries=3,
                                    compressed="indices", tree=True, extra=2)
    static = {name: kwargs.pop(name) for name in ("sliding_window", "scale")}
    kernel = functools.partial(sliding_compressed_attention_pallas, interpret=False, **static)
    calls = triton_calls(kernel, *args, **kwargs)
    assert len(calls) == 1 and 'name = "sliding_compressed_attention"' in calls[0]


@pytest.mark.parametrize("compressed", ["indices", "count"], ids=["csa", "hca"])
def test_compiles_for_h100_at_v4_flash_shapes(h100, compressed):
    """V4-Flash widths, B = 32, a verification tree of 8 with extra keys (every feature on, the
    most registers): no spills (the compile fails on one), shared memory within sm_90's, and the
    stated cost is the kernel's arithmetic."""
    from jaxspec import aot
    args, kwargs, flops = abstract_call(**FLASH, num_queries=8, compressed=compressed, tree=True, extra=2)
    compiled = aot.compile_gpu(sliding_compressed_attention_pallas, *args, devices=h100, interpret=False,
                               static_argnames=("sliding_window", "scale", "interpret"), **kwargs)
    (launch,) = aot.kernel_launches(compiled)
    assert 0 < launch.shared_memory <= SHARED_MEMORY_LIMIT
    assert launch.spill_stores == launch.spill_loads == 0 and launch.registers <= 255
    (call,) = aot.pallas_calls(compiled)
    assert call.flops == flops
    cost = aot.program_cost(compiled)
    assert cost.kernel_flops == flops and not cost.uncounted


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_pallas_compiled_on_gpu(dtype):
    """The comparisons, compiled, at V4-Flash widths: a CSA tree with extra keys, an HCA chain."""
    flash = dict(heads=64, dim=512, window=128, page=64, ring_pages=3)
    check_pallas(make_case(np.random.default_rng(6), batch=6, num_queries=4, tree=True, topk=512, entry_pages=16,
                           extra=2, **flash), dtype, interpret=False)
    check_pallas(make_case(np.random.default_rng(7), batch=5, num_queries=8, compressed="count", entry_pages=4,
                           **flash), dtype, interpret=False)
