"""The Mosaic GPU `mla_attention` kernel: interpreted on the CPU (compiled and run on a GPU host,
`conftest.MOSAIC_INTERPRET`) against the reference on bfloat16 and FP8 latent caches, invariant bit
for bit, and compiled for an H100 without a GPU.

Interpret mode (`pallas_kernels/mosaic_gpu.py`) runs the kernel's TMA copies, barriers, two
warpgroups and split-KV parts on the CPU; it is slow (seconds a call), so the shapes are small:
Dl 128, Dr 64 (the kernel's smallest widths), a few heads, pages of 64 slots, and one case at
DeepSeek's 512 + 64.
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
from jaxspec.models import DeepseekV3
from jaxspec.pallas_kernels import Visibility, fp8_cache, mla_attention, mla_attention_reference
from jaxspec.pallas_kernels.backend import AUTO_KERNELS, gpu_lowering
from jaxspec.pallas_kernels.fp8_cache import Fp8Pool
from jaxspec.pallas_kernels.mla_attention_mosaic import PART_SLOTS, mla_attention_mosaic
from jaxspec.pallas_kernels.split_kv import num_parts
from jaxspec.presets import preset
from conftest import MOSAIC_INTERPRET
from test_fp8_cache import fp8_pool_of
from test_kernels import assert_attention_close, latent_inputs, make_window, scale_for
from test_sparse_mosaic import SM90_SMEM, assert_costed

LATENT, ROPE, PAGE = 128, 64, 64


def run_mosaic(args, scale, **kwargs):
    return mla_attention_mosaic(*args, softmax_scale=scale, interpret=MOSAIC_INTERPRET, **kwargs)


def reference(args, scale):
    with jax.default_matmul_precision("highest"):
        return jax.jit(functools.partial(mla_attention_reference, softmax_scale=scale))(*args)


@pytest.mark.parametrize("case", [
    dict(num_queries=4, heads=4, latent=LATENT, max_pages=2, tree=False, part_slots=64),
    dict(num_queries=4, heads=2, latent=512, max_pages=1, tree=True, part_slots=1024),
    dict(num_queries=3, heads=2, latent=LATENT, max_pages=3, tree=False, part_slots=192, page_size=128),
], ids=["chain-q4-2parts", "tree-q4-deepseek-widths", "page128-parts-start-mid-page"])
def test_mosaic_matches_reference(case):
    """Rows cycle through a context ending mid-page, padding tokens, an empty row and a short row,
    on an out-of-order page table whose unused pages are NaN; bf16 within tolerance, empty tokens
    exactly (0, EMPTY_LSE), nothing non-finite. The third case's parts of 192 slots start mid-page
    in pages of 128, so each block's own page table (`part_tables`) spans a page more than a part."""
    rng = np.random.default_rng(3)
    window = make_window(rng, 4, case["num_queries"], case.get("page_size", PAGE), case["max_pages"], case["tree"])
    args = (*latent_inputs(rng, window, case["heads"], case["latent"], ROPE, jnp.bfloat16),
            jnp.asarray(window.page_table), window.vis())
    scale = scale_for(case["latent"], ROPE)
    got = run_mosaic(args, scale, part_slots=case["part_slots"])
    assert got[0].dtype == jnp.bfloat16 and got[0].shape == args[0].shape and got[1].shape == args[0].shape[:3]
    assert_attention_close(got, reference(args, scale), window, jnp.bfloat16)


def test_mosaic_reads_fp8_latents():
    """An FP8 latent pool at DeepSeek's widths (512 e4m3 values with 4 float32 scales, 64 bfloat16
    RoPE values; NaN in the pages no row owns), a tree window with padding and an empty row, two
    split-KV parts: each tile's e4m3 values are dequantized in shared memory as `fp8_cache.entries`
    does, so out and lse equal, bit for bit, the kernel's own on the pool's bfloat16 entries, and
    the reference on the pool within bfloat16 tolerance."""
    rng = np.random.default_rng(4)
    latent = 512
    window = make_window(rng, 4, 3, PAGE, 2, tree=True)
    q_nope, q_rope, cache = latent_inputs(rng, window, 2, latent, ROPE, jnp.bfloat16)
    pool, page_table, scale = fp8_pool_of(cache, latent), jnp.asarray(window.page_table), scale_for(latent, ROPE)
    got = run_mosaic((q_nope, q_rope, pool, page_table, window.vis()), scale, part_slots=64)
    on_entries = run_mosaic((q_nope, q_rope, fp8_cache.entries(pool), page_table, window.vis()), scale, part_slots=64)
    for name, got_part, exact in zip(("out", "lse"), got, on_entries):
        np.testing.assert_array_equal(np.asarray(got_part, np.float32), np.asarray(exact, np.float32), err_msg=name)
    assert_attention_close(got, reference((q_nope, q_rope, pool, page_table, window.vis()), scale), window,
                           jnp.bfloat16)


@pytest.mark.parametrize("backend, kernel", [("mosaic", "name=_mla_attention_mosaic"),
                                             ("pallas", "name=mla_attention_pallas")])
def test_op_dispatches_by_backend(backend, kernel):
    """`mla_attention(backend=...)` lowered for a GPU calls the Mosaic GPU or the Triton kernel."""
    spec = jax.ShapeDtypeStruct
    args = (spec((1, 1, 2, LATENT), jnp.bfloat16), spec((1, 1, 2, ROPE), jnp.bfloat16),
            spec((2, PAGE, LATENT + ROPE), jnp.bfloat16), spec((1, 2), jnp.int32),
            Visibility(spec((1,), jnp.int32), spec((1,), jnp.int32)))
    with gpu_lowering():
        jaxpr = str(jax.make_jaxpr(functools.partial(mla_attention, softmax_scale=1.0, backend=backend))(*args))
    assert kernel in jaxpr


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_token_gets_the_same_bits_alone_in_a_chain_in_a_tree_and_in_a_batch(fp8):
    """Token t of a window whose prefix is P sees slots [0, P + t]. Decoded alone (Q = 1, prefix
    P + t, B = 1), beside another row (B = 2), as token t of a chain window (Q = 4) and as a tree
    node whose ancestors are window tokens 0..t, its output and lse are the same bits: the kernel's
    tiles and split-KV parts are fixed by the capacity, never by B, Q or the rows that share a block.
    On a bfloat16 cache (Dl 128) and an FP8 one (Dl 512, the width FP8 takes)."""
    rng = np.random.default_rng(7)
    heads, window_len, prefix = (2 if fp8 else 4), 4, 100
    latent = 512 if fp8 else LATENT
    cache = jnp.asarray(rng.normal(size=(4, PAGE, latent + ROPE)), jnp.bfloat16)
    if fp8:
        cache = fp8_pool_of(cache, latent)
    table = jnp.asarray([[2, 0]], jnp.int32)
    queries = rng.normal(size=(1, window_len, heads, latent + ROPE))
    q_nope, q_rope = (jnp.asarray(x, jnp.bfloat16) for x in (queries[..., :latent], queries[..., latent:]))
    scale = scale_for(latent, ROPE)
    lengths = lambda *n: jnp.asarray(n, jnp.int32)
    run = lambda qn, qr, tbl, vis: run_mosaic((qn, qr, cache, tbl, vis), scale, part_slots=64)  # 2 parts

    chain = run(q_nope, q_rope, table, Visibility(lengths(prefix), lengths(window_len)))
    parents = [-1, 0, 1, 0]  # node 2's ancestors are window tokens 0, 1, 2: the chain's slots
    ancestors = np.zeros((1, window_len, window_len), bool)
    for q in range(window_len):
        node = q
        while node >= 0:
            ancestors[0, q, node], node = True, parents[node]
    tree = run(q_nope, q_rope, table, Visibility(lengths(prefix), lengths(window_len), jnp.asarray(ancestors)))
    token = 2
    alone = run(q_nope[:, token:token + 1], q_rope[:, token:token + 1], table,
                Visibility(lengths(prefix + token), lengths(1)))
    # Beside it, a row with other pages, another length and the last token's query.
    pair = run(q_nope[[0, 0], [token, 3]][:, None], q_rope[[0, 0], [token, 3]][:, None],
               jnp.asarray([[2, 0], [3, 1]], jnp.int32), Visibility(lengths(prefix + token, 30), lengths(1, 1)))
    want_out, want_lse = np.asarray(alone[0][0, 0], np.float32), np.asarray(alone[1][0, 0])
    for name, (out, lse) in {"chain": chain, "tree": tree, "pair": pair}.items():
        row, position = (0, 0) if name == "pair" else (0, token)
        np.testing.assert_array_equal(np.asarray(out[row, position], np.float32), want_out, err_msg=name)
        np.testing.assert_array_equal(np.asarray(lse[row, position]), want_lse, err_msg=name)


@pytest.mark.parametrize("change, message", [
    (dict(dtype=jnp.float32), r"q_nope.dtype=float32: the Mosaic GPU mla_attention takes bfloat16 only"),
    (dict(latent=96), r"q_nope last dim \(Dl\) = 96: must be a multiple of 128"),
    (dict(rope=32), r"q_rope last dim \(Dr\) = 32: must be a multiple of 64"),
    (dict(page=16), r"latent_cache page size 16: must be a multiple of 64"),
    (dict(fp8=True), r"q_nope last dim \(Dl\) = 128: with an FP8 cache it must be a multiple of 512"),
    (dict(fp8=True, latent=512, dtype=jnp.float32), r"an FP8 latent cache needs a bfloat16 rope part, got float32"),
])
def test_unsupported_operands_are_refused_before_tracing(change, message):
    shape = dict(dtype=jnp.bfloat16, latent=LATENT, rope=ROPE, page=PAGE, fp8=False) | change
    q_nope = jnp.zeros((1, 1, 2, shape["latent"]), shape["dtype"])
    q_rope = jnp.zeros((1, 1, 2, shape["rope"]), shape["dtype"])
    cache = jnp.zeros((2, shape["page"], shape["latent"] + shape["rope"]), shape["dtype"])
    if shape["fp8"]:
        pool = fp8_pool_of(cache, shape["latent"])
        cache = Fp8Pool(pool.values, pool.scales, pool.rope.astype(shape["dtype"]))
    vis = Visibility(jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match=message):
        mla_attention_mosaic(q_nope, q_rope, cache, jnp.zeros((1, 2), jnp.int32), vis, softmax_scale=1.0)


@functools.cache
def deepseek_compile(num_queries: int, fp8: bool, context: int = 4096, tree: bool = False):
    """B 32, 128 heads, 512 + 64 (bfloat16, or FlashMLA's FP8 token), a context of `context` slots
    (4096 by default), a chain or a tree window, compiled for one H100 (failing on any spill).
    Cached: the FP8 case compares itself with the bfloat16 one."""
    v32 = preset("deepseek-v3.2")
    batch, pages, spec = 32, context // 64, jax.ShapeDtypeStruct
    heads, latent, rope = v32.num_attention_heads, v32.kv_lora_rank, v32.qk_rope_head_dim
    cache = (Fp8Pool(spec((batch * pages, 64, latent), fp8_cache.E4M3),
                     spec((batch * pages, 64, latent // 128), jnp.float32),
                     spec((batch * pages, 64, rope), jnp.bfloat16)) if fp8
             else spec((batch * pages, 64, latent + rope), jnp.bfloat16))
    args = (spec((batch, num_queries, heads, latent), jnp.bfloat16),
            spec((batch, num_queries, heads, rope), jnp.bfloat16), cache, spec((batch, pages), jnp.int32),
            Visibility(spec((batch,), jnp.int32), spec((batch,), jnp.int32),
                       spec((batch, num_queries, num_queries), jnp.bool_) if tree else None))
    return aot.compile_gpu(mla_attention_mosaic, *args, devices=aot.gpu_devices("h100"),
                           static_argnames=("softmax_scale",), softmax_scale=v32.softmax_scale)


@pytest.mark.parametrize("num_queries", [1, 4])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compiles_for_h100_at_deepseek_widths(h100, num_queries, fp8):
    """`deepseek_compile`: the real Mosaic GPU lowering (TMA boxes, wgmma shapes) and XLA's compile
    of the program around it. The kernel is one Mosaic launch of three warpgroups (the scorer and
    two followers), a block per (row block, part, row), whose shared memory (Mosaic GPU's count) is within the 227 KiB a block may
    claim on sm_90 (registers: Mosaic GPU's ptxas report, docs/kernels.md). With FP8 the temporaries equal the
    bfloat16 program's: the tiles are dequantized in shared memory, no copy of the cache exists."""
    compiled = deepseek_compile(num_queries, fp8)
    batch, heads, latent = 32, 128, 512
    [launch] = aot.mosaic_launches(compiled)
    assert launch.threads == (384, 1, 1) and launch.shared_memory <= SM90_SMEM
    assert launch.kernel == "mla_attention_mosaic_mosaic_gpu_kernel"  # the profiler's name for it
    assert math.prod(launch.grid) == num_queries * heads // 64 * num_parts(4096, PART_SLOTS) * batch
    assert_costed(compiled, "mla_attention", 2 * batch * num_queries * heads * 4096 * (2 * latent + 64))
    memory, rows = aot.memory(compiled), batch * num_queries * heads
    assert memory.output >= rows * (latent * 2 + 4)  # out bf16, lse float32
    # The float32 partials of the split-KV parts, as many as the capacity sets (4 at 4096 slots).
    assert num_parts(4096, PART_SLOTS) == 4 and memory.temp >= 4 * rows * latent * 4
    if fp8:
        assert memory.temp == aot.memory(deepseek_compile(num_queries, False)).temp


def test_shared_memory_does_not_grow_with_the_context(h100):
    """DeepSeek-V3.2's longest context, 128k slots (128 split-KV parts), compiles for an H100 with
    FP8 caches and a tree of 8 as it does at 32k: a block holds only its part's pages, so its shared
    memory is the same; the combine of 128 parts compiles without spills (the compile fails on one)."""
    longest, shorter = deepseek_compile(8, True, 131072, True), deepseek_compile(8, True, 32768, True)
    [launch], [short_launch] = aot.mosaic_launches(longest), aot.mosaic_launches(shorter)
    # Mosaic GPU launches the grid reversed: the row blocks (16 at 128 heads, Q 8) are CUDA's x.
    assert launch.grid == (16, num_parts(131072, PART_SLOTS), 32) and num_parts(131072, PART_SLOTS) == 128
    assert launch.shared_memory == short_launch.shared_memory <= SM90_SMEM


def _window_call(model, tokens, positions, cache, prefix_len, tree_mask, backend):
    vis = Visibility(prefix_len, jnp.full(prefix_len.shape, tokens.shape[1], jnp.int32), tree_mask)
    return model(tokens, positions, cache, vis, form="absorbed", backend=backend, window_invariant=True)


_window = nnx.jit(_window_call, static_argnames=("backend",))


# A one-layer model at widths the Mosaic kernels take (Dl 128, Dr 64; DSA's keys 64 wide, its
# top-16 well under the 73 slots a row fills), and the names its window-invariant call's Mosaic
# kernels carry in the jaxpr.
DSA_KERNELS = ("name=_indexer_scores", "name=_sparse_mla")
INVARIANT_MODELS = {
    "v3": (dict(name="tiny-v3"), None, ("name=_mla_attention_mosaic",)),
    "v32": (dict(name="tiny", index_head_dim=64), None, DSA_KERNELS),
    "v32-fp8": (dict(name="tiny", index_head_dim=64), "fp8", DSA_KERNELS),
}


@pytest.mark.parametrize("kind", list(INVARIANT_MODELS))
def test_window_invariant_model_on_the_mosaic_kernels_equals_single_steps(kind):
    """A one-layer V3 (dense MLA) or V3.2 (DSA: the indexer and sparse MLA kernels; bfloat16 or FP8
    caches) model in bfloat16 with window_invariant on the "mosaic" backend: a chain window runs
    as one call of each kernel, a tree node as one call over its ancestors in plain decoding's order
    (`MLA._attend_invariant_kernel`); their logits and hidden states equal the same tokens decoded
    one per call, bit for bit, and the window's program runs the Mosaic kernels (not
    `_attend_alone`'s jnp). (Interpreted, tree nodes also match without the reordering: the CPU's
    sums happen not to depend on where the masked slots sit in a tile; wgmma's and the warp
    reductions' do, which is why the kernel path reorders.)"""
    overrides, cache_dtype, kernels = INVARIANT_MODELS[kind]
    config = preset(**overrides, num_hidden_layers=1, first_k_dense_replace=1, kv_lora_rank=LATENT,
                    qk_rope_head_dim=ROPE)
    model = DeepseekV3(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    rng = np.random.default_rng(1)
    batch, width = 2, 70  # the window starts mid-page, in the second page
    tokens = jnp.asarray(rng.integers(3, 250, (batch, width + 3)), jnp.int32)
    prefix = jnp.full((batch,), width, jnp.int32)
    cache = model.init_cache(batch, 2 * PAGE, cache_dtype=cache_dtype)
    _, _, cache = _window(model, tokens[:, :width], jnp.arange(width)[None].repeat(batch, 0), cache,
                          jnp.zeros((batch,), jnp.int32), None, "xla")
    window = tokens[:, width:]
    depth = jnp.asarray([0, 1, 1])
    tree = jnp.broadcast_to(jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), (batch, 3, 3))  # parents -1, 0, 0
    chain_args = (model, window, width + jnp.arange(3)[None].repeat(batch, 0), cache, prefix, None, "mosaic")
    jaxpr = str(jax.make_jaxpr(functools.partial(_window_call, model, backend="mosaic"))(*chain_args[1:-1]))
    assert all(kernel in jaxpr for kernel in kernels), kernels
    tree_logits, tree_hidden, _ = _window(model, window, width + depth[None].repeat(batch, 0), cache, prefix, tree,
                                          "mosaic")
    chain_logits, chain_hidden, _ = _window(*chain_args)
    # One call a token along each path; the paths' shared prefix (node 0) is decoded once.
    decoded = {(): (None, None, cache)}
    for path, (logits_of, hidden_of) in (([0, 1, 2], (chain_logits, chain_hidden)),
                                         ([0, 2], (tree_logits, tree_hidden))):
        for position, node in enumerate(path):
            key = tuple(path[:position + 1])
            if key not in decoded:
                decoded[key] = _window(model, window[:, node:node + 1], jnp.full((batch, 1), width + position),
                                       decoded[key[:-1]][2], prefix + position, None, "mosaic")
            logits, hidden, _ = decoded[key]
            index = node if logits_of is tree_logits else position
            as_f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
            np.testing.assert_array_equal(as_f32(hidden_of[:, index]), as_f32(hidden[:, 0]))
            np.testing.assert_array_equal(as_f32(logits_of[:, index]), as_f32(logits[:, 0]))


@pytest.mark.parametrize("dtype, page, kind, kernel", [
    (jnp.bfloat16, PAGE, "NVIDIA H200", "name=_mla_attention_mosaic"),
    (jnp.float32, PAGE, "NVIDIA H200", "name=mla_attention_pallas"),
    (jnp.bfloat16, 16, "NVIDIA H200", "name=mla_attention_pallas"),
    (jnp.bfloat16, PAGE, "NVIDIA H100 80GB HBM3", "name=mla_attention_pallas"),
], ids=["h200-bf16", "h200-float32", "h200-page16", "h100-bf16"])
def test_auto_runs_the_mosaic_kernel_where_measured_and_where_it_takes_the_operands(dtype, page, kind, kernel,
                                                                                  monkeypatch):
    """"auto" lowered for a GPU runs the Mosaic kernel on the device kinds whose `AUTO_KERNELS`
    entry names it for mla_attention (here the H200's, as a measurement would set it), for
    operands it takes; for float32 or 16-slot pages it runs the Triton kernel rather than the Mosaic
    kernel's ValueError, and on a device without the entry (the H100) Triton. A window-invariant
    model layer asks the same question (`models.mla.attention_on_mosaic`): its chain window runs
    the Mosaic kernel in one call exactly where "auto" would, and each position alone elsewhere
    (no kernel call)."""
    monkeypatch.setitem(AUTO_KERNELS, "NVIDIA H200", {"mla_attention": "mosaic"})
    spec = jax.ShapeDtypeStruct
    args = (spec((1, 1, 2, LATENT), dtype), spec((1, 1, 2, ROPE), dtype), spec((2, page, LATENT + ROPE), dtype),
            spec((1, 2), jnp.int32), Visibility(spec((1,), jnp.int32), spec((1,), jnp.int32)))
    with gpu_lowering(kind):
        jaxpr = str(jax.make_jaxpr(functools.partial(mla_attention, softmax_scale=1.0, backend="auto"))(*args))
    assert kernel in jaxpr

    config = preset(name="tiny-v3", num_hidden_layers=1, first_k_dense_replace=1, kv_lora_rank=LATENT,
                    qk_rope_head_dim=ROPE)
    model = DeepseekV3(config, rngs=nnx.Rngs(0), dtype=dtype)
    cache = model.init_cache(1, 2 * page, page_size=page)
    window = (jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None], cache, jnp.zeros((1,), jnp.int32), None)
    with gpu_lowering(kind):
        jaxpr = str(jax.make_jaxpr(functools.partial(_window_call, model, backend="auto"))(*window))
    assert ("name=_mla_attention_mosaic" in jaxpr) == ("mosaic" in kernel)
    assert "name=mla_attention_pallas" not in jaxpr  # Triton tiles a window's rows together: not invariant
