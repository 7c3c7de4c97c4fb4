"""DeepSeek-V4's `sliding_compressed_attention` as a Mosaic GPU kernel
(`sliding_compressed_attention_mosaic.py`): interpreted on the CPU (compiled and run on a GPU host,
`conftest.MOSAIC_INTERPRET`) against the reference, a token's
output bits whatever window it shares a call with, the argument checks, the `backend="mosaic"`
dispatch, and its compile for an H100 (sm_90a) at DeepSeek-V4-Flash's widths without a GPU, on
bfloat16 arrays and FP8 pools (the kernel's FP8 reads: `tests/test_fp8_cache_v4.py`).

Interpret mode simulates every TMA copy and wgmma in Python, so the shapes are small.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import aot
from jaxspec.cache_v4 import init_v4_cache
from jaxspec.model_config import CSA, ModelConfig
from jaxspec.models.v4_attention import V4Attention
from jaxspec.pallas_kernels import Visibility, sliding_compressed_attention
from jaxspec.pallas_kernels.backend import gpu_lowering, resolve_backend
from jaxspec.pallas_kernels.sliding_compressed_attention_mosaic import PART_SLOTS, sliding_compressed_attention_mosaic
from jaxspec.pallas_kernels.mosaic_gpu import warp_map_interpretable
from jaxspec.pallas_kernels.split_kv import num_parts
from conftest import MOSAIC_INTERPRET, ON_GPU
from test_sliding_compressed_attention import FLASH, SHARED_MEMORY_LIMIT, SPEC, abstract_call, make_case, run, v4_pool
from test_sparse_mosaic import assert_costed, refuses_copies_by_thread
from test_v4_attention import HF_FIELDS

MOSAIC_CASES = {
    # a tree window, CSA top-k (-1 and entries past the row's pages mixed in), extra keys, 8-slot
    # pages: a 64-key tile spans several pages, in random order
    "tree-csa-extra-page8": dict(tree=True, num_queries=3, heads=4, dim=128, extra=2, topk=40, page=8, ring_pages=2,
                                 window=8),
    # a chain, HCA counts, 72 heads (two head blocks, the second padded), D = 256 (128 columns a warpgroup)
    "chain-hca-h72-d256": dict(num_queries=2, heads=72, dim=256, compressed="count", page=16, ring_pages=1, window=12),
    # a sliding-only layer whose ring is exactly W - 1 + Q long; D = 512 (two column blocks)
    "sliding-only-d512": dict(compressed=None, num_queries=2, heads=4, dim=512, window=15, page=8, ring_pages=2),
}


@pytest.mark.parametrize("options", MOSAIC_CASES.values(), ids=MOSAIC_CASES.keys())
def test_mosaic_matches_reference(options):
    """Through the op's `backend="mosaic"` (jitted, interpreted). make_case's rows: a long context
    (ring wrapped), padding tokens, an empty row, a short context; NaN in all memory no token may
    see. Within bf16 tolerance of the reference, finite, padding tokens exactly 0."""
    case = make_case(np.random.default_rng(60), **options)
    got = np.asarray(run(case, jnp.bfloat16, backend="mosaic"), np.float32)
    want = np.asarray(run(case, jnp.bfloat16), np.float32)
    assert got.shape == case.q.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    padding = np.arange(case.q.shape[1])[None, :] >= case.query_len[:, None]
    assert padding.any() and (got[padding] == 0).all()


def test_mosaic_split_kv_parts_match_reference():
    """part_slots=64: each token's seen tiles (ring, CSA entries, extra keys: three) run as parts of
    one tile, merged by log-sum-exp with the sink in part 0 only. Within bf16 tolerance of the
    reference; padding tokens, which see nothing, exactly 0."""
    case = make_case(np.random.default_rng(63), **MOSAIC_CASES["tree-csa-extra-page8"])
    args, kwargs = case.args(jnp.bfloat16)
    got = np.asarray(sliding_compressed_attention_mosaic(*args, **kwargs, part_slots=64, interpret=MOSAIC_INTERPRET),
                     np.float32)
    want = np.asarray(run(case, jnp.bfloat16), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    padding = np.arange(case.q.shape[1])[None, :] >= case.query_len[:, None]
    assert padding.any() and (got[padding] == 0).all()


def test_mosaic_copies_by_warp_give_the_same_bits():
    """copies_by_warp=True (each of the scorer's warps issues a quarter of a tile's key copies)
    moves the same bytes to the same places: interpreted, the output equals the default's bit for
    bit over a tree window's ring, CSA entries (-1 and past-the-pages numbers) and extra keys, in
    two split-KV parts. jax 0.10.2's interpreter cannot run it (no `core_map`): a ValueError
    before tracing there; both versions compile it (below)."""
    case = make_case(np.random.default_rng(64), **MOSAIC_CASES["tree-csa-extra-page8"])
    args, kwargs = case.args(jnp.bfloat16)
    run = functools.partial(sliding_compressed_attention_mosaic, *args, **kwargs, part_slots=128,
                            interpret=MOSAIC_INTERPRET)
    if not warp_map_interpretable():
        with pytest.raises(ValueError, match="copies_by_warp=True interpreted needs jax >= 0.11"):
            run(copies_by_warp=True)
        return
    np.testing.assert_array_equal(np.asarray(run(copies_by_warp=True), np.float32), np.asarray(run(), np.float32))


def test_mosaic_copies_by_thread_give_the_same_bits():
    """copies_by_thread=True (each of the scorer's first 64 threads issues one key's copies, in
    inline Mosaic GPU code, inside the `pl.when` that picks a tile's run) moves the same bytes to
    the same places: on a GPU the output equals the default's bit for bit over a tree window's
    ring, CSA entries (-1 and past-the-pages numbers) and extra keys, in two split-KV parts. The
    simulator does not run inline Mosaic GPU code: interpreted it is a ValueError before tracing,
    as is asking for it with copies_by_warp."""
    case = make_case(np.random.default_rng(65), **MOSAIC_CASES["tree-csa-extra-page8"])
    args, kwargs = case.args(jnp.bfloat16)
    run = functools.partial(sliding_compressed_attention_mosaic, *args, **kwargs, part_slots=128,
                            interpret=MOSAIC_INTERPRET)
    if refuses_copies_by_thread(run):
        return
    np.testing.assert_array_equal(np.asarray(run(copies_by_thread=True), np.float32), np.asarray(run(), np.float32))


def test_mosaic_token_seeing_nothing_returns_zero():
    """A tree token that is not its own ancestor, with no compressed entry and no extra key, sees
    nothing: 0 whatever its sink, beside a token that sees its ring slot."""
    case = make_case(np.random.default_rng(61), batch=1, num_queries=2, heads=4, dim=128, tree=True, extra=1)
    ancestors = case.ancestors.copy()
    ancestors[0, 1] = False
    case = case._replace(ancestors=ancestors, prefix_len=np.zeros(1, np.int32), query_len=np.array([2], np.int32),
                         positions=np.array([[0, 1]], np.int32), compressed_indices=np.full_like(
                             case.compressed_indices, -1), extra_valid=np.zeros_like(case.extra_valid))
    got = np.asarray(run(case, jnp.bfloat16, backend="mosaic"), np.float32)
    np.testing.assert_array_equal(got[0, 1], 0)
    np.testing.assert_allclose(got, np.asarray(run(case, jnp.bfloat16), np.float32), rtol=2e-2, atol=2e-2)
    assert np.abs(got[0, 0]).max() > 0


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_mosaic_output_does_not_depend_on_the_window(fp8):
    """Token 1 of a row gives the same bits decoded alone (Q = 1, the token before it committed),
    inside a chain window (Q = 4), and as a node of a tree (root 0 with children 1 and 2, node 3
    under 2): same ring, entry list and extra keys; random float inputs, so any change of the
    order of summation would show. Its seen tiles run as split-KV parts of one tile (part_slots=64:
    three parts, the sink in the first). fp8: the ring and entries V4 FP8 pools (D 256: 192 e4m3 values,
    at least a copy's 128 bytes)."""
    case = make_case(np.random.default_rng(62), batch=1, num_queries=4, heads=4, dim=256 if fp8 else 128, extra=2,
                     topk=40, page=8, ring_pages=2, window=9)
    args, kwargs = case.args(jnp.bfloat16)
    if fp8:
        args = (args[0], v4_pool(args[1], 64), *args[2:])
        kwargs["compressed_kv"] = v4_pool(kwargs["compressed_kv"], 64)
    q, window_kv, window_pages, positions, vis, sinks = args
    prefix = int(case.prefix_len[0])
    call = functools.partial(sliding_compressed_attention_mosaic, part_slots=64, interpret=MOSAIC_INTERPRET)
    chain = call(*args, **kwargs)
    token = slice(1, 2)
    per_token = {k: v[:, token] if k in ("compressed_indices", "extra_kv", "extra_valid") else v
                 for k, v in kwargs.items()}
    one = lambda value: jnp.asarray([value], jnp.int32)  # noqa: E731
    alone = call(q[:, token], window_kv, window_pages, positions[:, token], Visibility(one(prefix + 1), one(1)), sinks,
                 **per_token)
    tree_mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)[None]
    tree_positions = jnp.asarray([[prefix, prefix + 1, prefix + 1, prefix + 2]], jnp.int32)
    tree = call(q, window_kv, window_pages, tree_positions, Visibility(one(prefix), one(4), jnp.asarray(tree_mask)),
                sinks, **kwargs)
    alone = np.asarray(alone[0, 0], np.float32)
    assert np.isfinite(alone).all() and np.abs(alone).max() > 0
    np.testing.assert_array_equal(np.asarray(chain[0, 1], np.float32), alone)
    np.testing.assert_array_equal(np.asarray(tree[0, 1], np.float32), alone)


@pytest.mark.parametrize("change, match", [
    (dict(q=jnp.float32), r"dtype float32 not supported by the Mosaic GPU kernel: must be bfloat16 or float16"),
    (dict(compressed_kv=jnp.float16), r"compressed_kv.dtype=float16 must equal window_kv.dtype=bfloat16"),
    (dict(dim=192), r"q last dim D=192 must be a multiple of 128 \(of 512 when wider\)"),
    (dict(dim=640), r"q last dim D=640 must be a multiple of 128 \(of 512 when wider\)"),
], ids=["float32", "mixed-key-dtypes", "d192", "d640"])
def test_mosaic_refuses_what_it_cannot_tile(change, match):
    case = make_case(np.random.default_rng(63), batch=1, num_queries=1, dim=change.get("dim", 128))
    args, kwargs = case.args(jnp.bfloat16)
    if "q" in change:
        args = (args[0].astype(change["q"]), *args[1:])
    if "compressed_kv" in change:
        kwargs["compressed_kv"] = kwargs["compressed_kv"].astype(change["compressed_kv"])
    with pytest.raises(ValueError, match=match):
        sliding_compressed_attention_mosaic(*args, **kwargs, interpret=MOSAIC_INTERPRET)


def test_mosaic_refuses_key_arrays_past_exact_float32_rows():
    """Key rows reach the kernel as float32: an entry pool of more than 2**24 keys is refused before
    tracing (abstract arrays: nothing is allocated)."""
    args, kwargs, _ = abstract_call(**FLASH, num_queries=1, compressed="indices", tree=False, extra=0)
    kwargs["compressed_kv"] = SPEC((2 ** 18 + 1, FLASH["page"], FLASH["dim"]), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"compressed_kv holds 16777280 keys: at most 16777216"):
        sliding_compressed_attention_mosaic(*args, **kwargs)


def test_backend_choice():
    """"mosaic" runs this kernel (a float32 call reaches its dtype check); "auto" stays on Triton
    on a GPU (no measurement has picked Mosaic) and on the reference off one."""
    case = make_case(np.random.default_rng(64), batch=1, num_queries=1, dim=128)
    args, kwargs = case.args(jnp.float32)
    with pytest.raises(ValueError, match="sliding_compressed_attention_mosaic: dtype float32 not supported"):
        sliding_compressed_attention(*args, **kwargs, backend="mosaic")
    assert resolve_backend("auto", "sliding_compressed_attention") == ("pallas" if ON_GPU else "xla")
    with gpu_lowering("NVIDIA H100 80GB HBM3"):
        assert resolve_backend("auto", "sliding_compressed_attention") == "pallas"
        assert resolve_backend("mosaic", "sliding_compressed_attention") == "mosaic"


def test_window_invariant_chain_on_the_mosaic_kernel_equals_single_steps(monkeypatch):
    """A bfloat16 CSA layer (D 128 and index_head_dim 64, the kernels' smallest widths) with
    window_invariant on the "mosaic" backend: a chain window of 5 tokens runs the CSA selection
    (`indexer_topk`) and the attention as one kernel call of 5 tokens each (not once per token),
    and its outputs equal the same tokens decoded one per call, bit for bit. 13..17 closes entry 3
    inside the window, so the window's last tokens rank 4 entries for index_topk 3."""
    from jaxspec.pallas_kernels import indexer_mosaic
    from jaxspec.pallas_kernels import sliding_compressed_attention_mosaic as attention_mosaic
    widths = {"attention": [], "indexer": []}  # the Q of every kernel call traced

    def record(module, name, kind):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda q, *args, **kwargs: widths[kind].append(q.shape[1])
                            or kernel(q, *args, **kwargs))

    record(attention_mosaic, "sliding_compressed_attention_mosaic", "attention")
    record(indexer_mosaic, "indexer_scores_mosaic", "indexer")
    config = ModelConfig.from_hf(dict(HF_FIELDS, head_dim=128, partial_rotary_factor=0.0625, index_head_dim=64,
                                      layer_types=[CSA], model_type="deepseek_v4"))
    graphdef, params = nnx.split(V4Attention(config, 0, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))

    @functools.partial(jax.jit, static_argnames="backend")
    def step(x, start, cache, backend):
        start = jnp.full((x.shape[0],), start, jnp.int32)
        positions = start[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)
        vis = Visibility(start, jnp.full(start.shape, x.shape[1], jnp.int32))
        return nnx.merge(graphdef, params)(x, positions, cache, 0, vis, backend=backend, window_invariant=True)

    x = jax.random.normal(jax.random.key(3), (2, 18, config.hidden_size), jnp.bfloat16)
    cache = init_v4_cache(config, 2, 32, max_window=13, page_size=8, layer_types=(CSA,), dtype=jnp.bfloat16)
    _, cache = step(x[:, :13], 0, cache, "xla")
    window, _ = step(x[:, 13:18], 13, cache, "mosaic")
    assert widths == {"attention": [5], "indexer": [5]}
    for t in range(13, 18):
        alone, cache = step(x[:, t:t + 1], t, cache, "mosaic")
        got = np.asarray(window[:, t - 13], np.float32)
        assert np.isfinite(got).all() and np.abs(got).max() > 0
        np.testing.assert_array_equal(np.asarray(alone[:, 0], np.float32), got)


@functools.cache
def v4_flash_compile(compressed: str, fp8: bool, **tuning):
    """V4-Flash widths (64 heads, D = 512, window 128, top-512), B = 32, a verification tree of 8
    with extra keys, the ring and entries bfloat16 or V4 FP8 pools, compiled for one H100 (with the
    kernel's `tuning` arguments: copies_by_warp, copies_by_thread). Cached: the FP8 case compares
    itself with the bfloat16 one."""
    args, kwargs, _ = abstract_call(**FLASH, num_queries=8, compressed=compressed, tree=True, extra=2, fp8=fp8)
    kernel = functools.partial(sliding_compressed_attention_mosaic, **tuning)
    return aot.compile_gpu(kernel, *args, devices=aot.gpu_devices("h100"),
                           static_argnames=("sliding_window", "scale"), **kwargs)


@pytest.mark.parametrize("tuning, fp8", [(dict(copies_by_warp=True), False), (dict(copies_by_thread=True), False),
                                         (dict(copies_by_thread=True), True)],
                         ids=["copies-by-warp", "copies-by-thread", "copies-by-thread-fp8"])
def test_mosaic_compiles_with_each_tuning(h100, tuning, fp8):
    """The tunings the GPU report times beside the default (`copies_by_warp=True`: the scorer's
    warps issue the key copies, `plgpu.warp_map` inside the `pl.when` that picks a tile's run;
    `copies_by_thread=True`: one thread a key, in inline Mosaic GPU code there) lower for an H100
    at V4-Flash's CSA shapes into the same grid and threads, and the same shared memory but for
    copies_by_thread's mbarrier: the vectors buffer's fifth row, 1 KiB more (buffers start on
    1 KiB boundaries), still within the 227 KiB a block may use."""
    [launch] = aot.mosaic_launches(v4_flash_compile("indices", fp8, **tuning))
    [default] = aot.mosaic_launches(v4_flash_compile("indices", fp8))
    extra = 1024 if tuning.get("copies_by_thread") else 0
    assert (launch.grid, launch.threads, launch.shared_memory) == (default.grid, default.threads,
                                                                   default.shared_memory + extra)
    assert launch.shared_memory <= SHARED_MEMORY_LIMIT


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("compressed", ["indices", "count"], ids=["csa", "hca"])
def test_mosaic_compiles_for_h100_at_v4_flash_shapes(h100, compressed, fp8):
    """`v4_flash_compile`: the real Mosaic GPU lowering (copies, wgmma shapes, and Mosaic's check
    that the declared shared memory fits the 227 KiB a block may claim on sm_90, which raises
    otherwise) and XLA's compile around it: one Mosaic launch of three warpgroups (the scorer and
    two followers owning 256 columns each), a block per (head block, token, split-KV part of 4
    tiles: 3 for the CSA list's 12 tiles, 2 for HCA's 5), whose float32 partials are temporaries, output
    [B, Q, H, D] bf16. With FP8 the staging holds e4m3
    rows, so the block claims less shared memory, and the temporaries exceed the bfloat16
    program's by at most the listed keys' gathered scales (28 bytes a key), the pools' scale tables
    (read block-major) and the extra keys' quantized parts: no dequantized copy of a pool exists.
    Registers and spills are not in the program (Mosaic GPU's ptxas report: docs/kernels.md)."""
    compiled = v4_flash_compile(compressed, fp8)
    [launch] = aot.mosaic_launches(compiled)
    assert launch.kernel == "sliding_compressed_attention_mosaic_mosaic_gpu_kernel"  # the profiler's name for it
    tokens = FLASH["batch"] * 8
    args, kwargs, _ = abstract_call(**FLASH, num_queries=8, compressed=compressed, tree=True, extra=2, fp8=fp8)
    entries = kwargs["compressed_indices"].shape[-1] if compressed == "indices" else (
        kwargs["compressed_pages"].shape[1] * kwargs["compressed_kv"].shape[1])  # a row's whole capacity
    listed = sum(-(-n // 64) * 64 for n in (FLASH["window"] - 1 + 8, entries, 2))  # keys, in whole tiles
    parts = num_parts(listed, PART_SLOTS)
    assert parts == {"indices": 3, "count": 2}[compressed]
    assert launch.threads == (384, 1, 1) and launch.grid == (tokens * parts, 1, 1)
    assert launch.shared_memory <= SHARED_MEMORY_LIMIT
    assert aot.memory(compiled).output == tokens * FLASH["heads"] * FLASH["dim"] * 2
    assert aot.memory(compiled).temp >= parts * tokens * FLASH["heads"] * FLASH["dim"] * 4
    assert_costed(compiled, "sliding_compressed_attention", 4 * FLASH["heads"] * tokens * listed * FLASH["dim"])
    # `jaxspec aot`'s kernel table keeps its columns under the header, whatever a kernel's name
    header, *rows = [line for line in aot.report(compiled, "v4").splitlines()
                     if line.startswith(("Pallas kernel", "sliding_compressed_attention"))]
    sites = header.index("sites") + len("sites")
    assert rows and all(row[sites - 1].isdigit() and row[sites:sites + 2] == "  " for row in rows)
    if fp8:
        bf16_compiled = v4_flash_compile(compressed, False)
        blocks = (FLASH["dim"] - 64) // 64
        scales = tokens * listed * blocks * 4
        tables = sum(math.prod(pool.scales.shape) * 4 for pool in (args[1], kwargs["compressed_kv"]))
        extra_parts = tokens * 2 * (FLASH["dim"] - 64 + blocks * 4 + 64 * 2)
        assert launch.shared_memory < aot.mosaic_launches(bf16_compiled)[0].shared_memory
        assert aot.memory(compiled).temp <= aot.memory(bf16_compiled).temp + scales + tables + extra_parts
