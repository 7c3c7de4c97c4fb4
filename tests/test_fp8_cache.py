"""FP8 caches (`DecodeConfig(cache_dtype="fp8")`, `jaxspec.pallas_kernels.fp8_cache`).

* the FP8 indexer against an independent numpy implementation of DeepSeek's arithmetic (Hadamard
  rotation, `act_quant`, `fp8_index`, top-k): identical indices, on the reference, the Triton
  kernel and the Mosaic GPU kernel (interpret mode);
* the latent's quantization against a numpy transcription of vLLM's FlashMLA cache writer, and
  FlashMLA's packed 656-byte token byte for byte;
* the FP8 latent readers (reference and Triton kernels) against the reference on the dequantized
  entries, and the CUDA lowering of the Triton kernels on FP8 pools;
* greedy speculation equal to plain greedy with FP8 caches, default mode and `window_invariant`
  (the shipped model's front in bfloat16), and on the Mosaic GPU kernels (interpreted);
  (the Mosaic kernels' own FP8 tests: `test_sparse_mosaic.py`, `test_mla_mosaic.py`);
* clear errors, and the memory plan's FP8 cache bytes against a compiled program's.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxspec.aot.model import reduced_depth
from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import generate
from jaxspec.models import DeepseekV3
from jaxspec.models.interface import CacheGeometry, cache_bytes
from jaxspec.pallas_kernels import (Visibility, indexer_scores_reference, indexer_topk, mla_attention,
                                    mla_attention_reference, sparse_mla_attention, sparse_mla_attention_reference)
from jaxspec.pallas_kernels import fp8_cache
from jaxspec.pallas_kernels.fp8_cache import Fp8Pool
from jaxspec.presets import preset
from cuda_lowering import triton_calls
from test_exactness import prompts, rows, shipped_front
from test_kernels import (DEEPSEEK_V32, SHAPE, TINY, assert_attention_close, latent_inputs, lowering_case, make_window,
                          random_indices, scale_for)

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16

# ----------------------------------------------------------------------------------------------
# An independent numpy implementation of DeepSeek's FP8 indexer
# ----------------------------------------------------------------------------------------------


def numpy_hadamard(dim: int) -> np.ndarray:
    """H_dim by the Sylvester recursion H_2n = [[H, H], [H, -H]], as a Kronecker product."""
    h = np.ones((1, 1))
    while h.shape[0] < dim:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h.astype(np.float32)


def numpy_rotate(x: np.ndarray) -> np.ndarray:
    """`rotate_activation`: hadamard_transform(x, scale=d**-0.5) of a bfloat16 tensor, in float32,
    returned in bfloat16."""
    dim = x.shape[-1]
    return ((x.astype(np.float32) @ numpy_hadamard(dim)) * np.float32(dim ** -0.5)).astype(BF16)


def numpy_act_quant(x: np.ndarray, pow2: bool) -> tuple[np.ndarray, np.ndarray]:
    """`act_quant(x, 128, scale_fmt)` for a last axis of at most 128 values (one block): amax
    clamped to 1e-4, s = amax * f32(1/448), with scale_fmt s = 2**ceil(log2 s) (the log taken in
    float64, so a scale just above a power of two still rounds up), y = e4m3(clamp(x / s))."""
    x = x.astype(np.float32)
    amax = np.maximum(np.max(np.abs(x), axis=-1, keepdims=True), np.float32(1e-4))
    scale = amax * np.float32(1 / 448)
    if pow2:
        scale = np.exp2(np.ceil(np.log2(scale.astype(np.float64)))).astype(np.float32)
    return np.clip(x / scale, -448, 448).astype(E4M3), scale[..., 0]


def numpy_fp8_topk(q, k, raw_weights, visible, topk: int, pow2: bool):
    """DeepSeek-V3.2-Exp's indexer selection, written from its published semantics
    (github.com/deepseek-ai/DeepSeek-V3.2-Exp, `inference/model.py` `Indexer.forward` and
    `inference/kernel.py` `act_quant` / `fp8_index`), not from its code:

    q [B, Q, Hi, Di] bf16 after RoPE, k [B, S, Di] bf16 after k_norm and RoPE, raw_weights
    [B, Q, Hi] float32 (weights_proj(x)), visible [B, Q, S] bool. Both sides rotated, quantized per
    block; weights' = raw * Hi^-0.5 * q_scale * Di^-0.5; score(s) = sum_h relu(q8[h] . k8[s]) *
    weights'[h], times k_scale[s], products of e4m3 values accumulated in float32; the topk visible
    slots, best first, ties to the lower slot, -1 past the visible ones. Returns (indices, scores)."""
    heads, dim = q.shape[-2:]
    q8, q_scale = numpy_act_quant(numpy_rotate(q), pow2)
    k8, k_scale = numpy_act_quant(numpy_rotate(k), pow2)
    weights = raw_weights * np.float32(heads ** -0.5) * q_scale * np.float32(dim ** -0.5)
    logits = np.einsum("bqhd,bsd->bqhs", q8.astype(np.float32), k8.astype(np.float32))
    scores = np.einsum("bqhs,bqh->bqs", np.maximum(logits, 0), weights) * k_scale[:, None, :]
    scores = np.where(visible, scores, -np.inf).astype(np.float32)
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :topk]
    picked = np.take_along_axis(scores, order, axis=-1)
    return np.where(np.isfinite(picked), order, -1).astype(np.int32), scores


def contiguous_window(batch: int, num_queries: int, page_size: int, max_pages: int, rng):
    """A chain window: rows with different prefixes, pages a random permutation. -> (vis,
    page_table [B, M], slots [B, S] of every visible slot in order, visible [B, Q, S] bool)."""
    capacity = page_size * max_pages
    prefix = rng.integers(capacity // 2, capacity - num_queries, batch)
    page_table = rng.permutation(batch * max_pages).reshape(batch, max_pages).astype(np.int32)
    slot = np.arange(capacity)
    visible = slot[None, None, :] < (prefix[:, None] + np.arange(num_queries)[None, :] + 1)[..., None]
    vis = Visibility(jnp.asarray(prefix, jnp.int32), jnp.full((batch,), num_queries, jnp.int32))
    return vis, jnp.asarray(page_table), visible


@pytest.mark.parametrize("heads,dim,backend,rule,page_size", [
    (4, 128, "xla", fp8_cache.INDEX_RULE, 16), (4, 128, "xla", fp8_cache.PLAIN_INDEX_RULE, 16),
    (64, 128, "pallas", fp8_cache.INDEX_RULE, 16), (2, 32, "pallas", fp8_cache.PLAIN_INDEX_RULE, 16),
    (8, 128, "mosaic", fp8_cache.INDEX_RULE, 32)],
    ids=["h4-d128-xla-ue8m0", "h4-d128-xla", "h64-d128-pallas-ue8m0", "h2-d32-pallas", "h8-d128-mosaic-ue8m0-page32"])
def test_fp8_indexer_selects_what_deepseeks_arithmetic_selects(heads, dim, backend, rule, page_size):
    """Random bf16 queries and keys (a few outlier columns, so the rotation and the block scales
    matter), written to an FP8 key pool by the cache's own write path, with power-of-two scales
    (`scale_fmt` "ue8m0") or without: the top-k indices equal the numpy implementation's exactly.
    The scores agree to float32 rounding (summation order); the inputs are checked to have no near-tie at the top-k boundary, so equal indices are required,
    not luck; exact ties (scores of 0) are broken towards the lower slot on both sides. (The Mosaic
    kernel's FP8 keys need pages of 32 slots or more: their scales arrive by TMA.)"""
    rng = np.random.default_rng(dim + heads)
    batch, num_queries, max_pages, topk = 2, 2, 64 // page_size, 24
    vis, page_table, visible = contiguous_window(batch, num_queries, page_size, max_pages, rng)
    capacity = page_size * max_pages
    spread = np.where(rng.random(dim) < 0.05, 20.0, 1.0)  # outlier columns
    q = (rng.normal(size=(batch, num_queries, heads, dim)) * spread).astype(BF16)
    k = (rng.normal(size=(batch, capacity, dim)) * spread).astype(BF16)
    raw_weights = rng.normal(size=(batch, num_queries, heads)).astype(np.float32)
    pow2 = rule == fp8_cache.INDEX_RULE
    want, want_scores = numpy_fp8_topk(q, k, raw_weights, visible, topk, pow2)
    # Exact ties can only be scores of exactly 0 (every head's ReLU at 0), which both sides compute
    # exactly and order by slot; any other tie at the boundary must be far from float32 rounding.
    upper, lower = np.moveaxis(np.sort(want_scores, axis=-1)[..., ::-1][..., topk - 1:topk + 1], -1, 0)
    assert np.all(((upper == 0) & (lower == 0)) | (upper - lower > 1e-4 * np.abs(upper))), "near-tie: pick a seed"

    pool = fp8_cache.init_pool(batch * max_pages, page_size, dim, rule=rule)
    slots = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (batch, capacity))
    pool = fp8_cache.write_entries(pool, page_table, slots, fp8_cache.rotate(jnp.asarray(k)))
    q8, weights = fp8_cache.fp8_index_queries(jnp.asarray(q), jnp.asarray(raw_weights), pow2_scales=pow2)
    got = jax.jit(functools.partial(indexer_topk, topk=topk, backend=backend))(q8, weights, pool, page_table, vis)
    np.testing.assert_array_equal(np.asarray(got), want)
    scores = indexer_scores_reference(q8, weights, pool, page_table, vis)
    np.testing.assert_allclose(np.asarray(scores), want_scores, rtol=1e-5)


def test_act_quant_scales_are_the_next_power_of_two():
    """quantize_act's scales against numpy's act_quant with and without scale_fmt, including
    amaxes at exact multiples of 448 (where s is a power of two and must not round up) and tiny
    blocks (the 1e-4 clamp)."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 64)).astype(np.float32)
    x[0, 3] = 448.0 * 4  # s = 4 exactly
    x[1] = 0.0  # amax clamped to 1e-4
    x[2, 7] = -7 * 2.0 ** -3  # a bf16-representable 7 * 2^m
    for pow2 in (True, False):
        values, scales = fp8_cache.quantize_act(jnp.asarray(x), pow2_scales=pow2)
        want_values, want_scales = numpy_act_quant(x, pow2)
        np.testing.assert_array_equal(np.asarray(scales)[:, 0], want_scales)
        np.testing.assert_array_equal(np.asarray(values).view(np.uint8), want_values.view(np.uint8))
    assert float(fp8_cache.quantize_act(jnp.asarray(x))[1][0, 0]) == 4.0


# ----------------------------------------------------------------------------------------------
# The latent: FlashMLA's token
# ----------------------------------------------------------------------------------------------


def numpy_flashmla_token(latent: np.ndarray, rope: np.ndarray) -> np.ndarray:
    """vLLM's `concat_and_cache_ds_mla_kernel` (csrc/cache_kernels.cu), per token: for each tile of
    128 latent values s = max(amax / 448, FLT_MIN), the e4m3 of clamp(x / s); then the 4 float32
    scales, then the RoPE values in bfloat16, little-endian -> [..., 656] uint8. The division is
    taken as amax * f32(1/448), as XLA computes it (`fp8_cache.quantize_latent`)."""
    tiles = latent.astype(np.float32).reshape(*latent.shape[:-1], -1, 128)
    scales = np.maximum(np.max(np.abs(tiles), axis=-1) * np.float32(1 / 448), np.finfo(np.float32).tiny)
    values = np.clip(tiles / scales[..., None], -448, 448).astype(E4M3).reshape(latent.shape)
    as_bytes = lambda a: np.ascontiguousarray(a).view(np.uint8).reshape(*a.shape[:-1], -1)
    return np.concatenate([as_bytes(values), as_bytes(scales.astype("<f4")), as_bytes(rope.astype(BF16))], axis=-1)


def test_latent_pool_is_flashmlas_token_byte_for_byte():
    """Entries written through `write_entries` (random slots, padding skipped) pack to the numpy
    writer's 656-byte tokens (slots nobody wrote stay zero), unpack back to the same pool, and
    dequantize within e4m3's rounding."""
    rng = np.random.default_rng(7)
    batch, window, page_size, pages = 2, 5, 8, 3
    entries = (rng.normal(size=(batch, window, 576)) * np.where(rng.random(576) < 0.02, 30, 1)).astype(BF16)
    page_table = jnp.asarray(rng.permutation(batch * pages).reshape(batch, pages), jnp.int32)
    slots = np.stack([rng.permutation(page_size * pages)[:window] for _ in range(batch)]).astype(np.int32)
    slots[1, -1] = -1
    pool = fp8_cache.init_pool(batch * pages, page_size, 512, 64)
    pool = fp8_cache.write_entries(pool, page_table, jnp.asarray(slots), jnp.asarray(entries))
    packed = np.asarray(fp8_cache.pack_flashmla(pool))
    assert packed.shape == (batch * pages, page_size, 656) and pool.token_bytes == 656
    want = numpy_flashmla_token(entries[..., :512], entries[..., 512:])
    for b, w in np.ndindex(batch, window):
        if slots[b, w] < 0:
            continue
        page = int(page_table[b, slots[b, w] // page_size])
        np.testing.assert_array_equal(packed[page, slots[b, w] % page_size], want[b, w], err_msg=f"{b}, {w}")
    written = np.zeros((batch * pages, page_size), bool)
    for b, w in np.ndindex(batch, window):
        if slots[b, w] >= 0:
            written[int(page_table[b, slots[b, w] // page_size]), slots[b, w] % page_size] = True
    assert not packed[~written].any()
    back = fp8_cache.unpack_flashmla(jnp.asarray(packed), 512, 64)
    for got, stored in zip(jax.tree.leaves(back), jax.tree.leaves(pool)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(stored).view(np.uint8))
    dequantized = np.asarray(fp8_cache.as_entries(fp8_cache.read_parts(pool, page_table, jnp.asarray(slots))),
                             np.float32)
    # e4m3 keeps 3 mantissa bits (half an ulp: 1/16 relative) down to its subnormals, 2**-9 of a
    # block's scale; bfloat16 adds 1/256.
    kept, exact = slots >= 0, entries.astype(np.float32)
    np.testing.assert_allclose(dequantized[kept], exact[kept], rtol=1 / 16 + 1 / 256,
                               atol=np.abs(exact).max() / 448 * 2 ** -9)


def fp8_pool_of(cache: jax.Array, latent: int) -> Fp8Pool:
    """A compute-dtype latent cache [P, page, Dl + Dr] quantized as the cache stores it."""
    return fp8_cache.quantize_entries(cache, fp8_cache.LATENT_RULE, latent)


@pytest.mark.parametrize("latent,rope,dtype", [(48, 16, jnp.bfloat16), (512, 64, jnp.float32)],
                         ids=["shipped-widths-bf16", "deepseek-widths-f32"])
def test_fp8_latent_readers_equal_the_reference_on_dequantized_entries(latent, rope, dtype):
    """mla_attention and sparse_mla_attention over an FP8 pool: the reference reads exactly the
    entries `fp8_cache.entries` defines (bit for bit against the reference on them), the Triton
    kernels (interpret mode) within the dtype's tolerance, a tree window with padding and empty rows."""
    rng = np.random.default_rng(latent)
    window = make_window(rng, 3, 3, 16, 4, tree=True)
    q_nope, q_rope, cache = latent_inputs(rng, window, 4, latent, rope, dtype)
    pool = fp8_pool_of(jnp.nan_to_num(cache), latent)  # NaN pages would poison a whole scale block
    dense = fp8_cache.entries(pool)
    page_table, scale = jnp.asarray(window.page_table), scale_for(latent, rope)
    indices = jnp.asarray(random_indices(rng, window, 24))
    for op, reference, where in ((mla_attention, mla_attention_reference, window.vis()),
                                 (sparse_mla_attention, sparse_mla_attention_reference, indices)):
        want = reference(q_nope, q_rope, dense, page_table, where, softmax_scale=scale)
        on_pool = reference(q_nope, q_rope, pool, page_table, where, softmax_scale=scale)
        np.testing.assert_array_equal(np.asarray(on_pool[0]), np.asarray(want[0]))
        kernel = jax.jit(functools.partial(op, softmax_scale=scale, backend="pallas"))
        assert_attention_close(kernel(q_nope, q_rope, pool, page_table, where), want, window, dtype)


@pytest.mark.parametrize("kernel,num_queries,tree,dims", [
    ("mla", 4, True, DEEPSEEK_V32), ("sparse", 4, False, DEEPSEEK_V32), ("indexer", 4, True, DEEPSEEK_V32),
    ("mla", 3, False, TINY)], ids=["mla-q4-tree", "sparse-q4", "indexer-q4-tree", "tiny-mla-q3"])
def test_cuda_lowering_of_fp8_pools(kernel, num_queries, tree, dims):
    """The Triton kernels lower for CUDA on FP8 pools at DeepSeek-V3.2's widths: one Triton kernel,
    whose operands are the pool's e4m3, float32 and bfloat16 parts (no dequantized copy)."""
    fn, args, name = lowering_case(kernel, num_queries, tree, dims)
    pages, page = dims["num_pages"], dims["page_size"]
    if kernel == "indexer":
        q, weights, _, *rest = args
        keys = Fp8Pool(SHAPE((pages, page, dims["index_dim"]), fp8_cache.E4M3), SHAPE((pages, page, 1), jnp.float32),
                       None, fp8_cache.INDEX_RULE)
        args = (SHAPE(q.shape, fp8_cache.E4M3), weights, keys, *rest)
    else:
        q_nope, q_rope, _, *rest = args
        latent, rope = dims["latent"], dims["rope"]
        pool = Fp8Pool(SHAPE((pages, page, latent), fp8_cache.E4M3),
                       SHAPE((pages, page, latent // fp8_cache.scale_block(latent)), jnp.float32),
                       SHAPE((pages, page, rope), jnp.bfloat16))
        args = (q_nope, q_rope, pool, *rest)
    calls = triton_calls(fn, *args)
    assert len(calls) == 1 and re.search(rf'\bname = "{name}"', calls[0])
    assert "f8E4M3FN" in calls[0]


# ----------------------------------------------------------------------------------------------
# Exactness with FP8 caches
# ----------------------------------------------------------------------------------------------

PROMPTS = [list(b"the quick"), list(b"fox jumps over the lazy dog and"), list(b"zq"), list(b"brown cat ov")]


def test_fp8_greedy_speculation_equals_plain_greedy(trained_v32):
    """Default mode (float32 trained V3.2: DSA, MoE): with FP8 caches a chain of k = 3 and the
    dynamic tree 2,2,3 emit plain greedy's tokens, and drafts are really accepted (a tree's commit
    moves its accepted path's FP8 entries and scales to their slots)."""
    base = DecodeConfig(num_draft=0, max_new_tokens=32, page_size=8, backend="xla", cache_dtype="fp8")
    plain = generate(trained_v32, PROMPTS, base)
    for draft in (dict(num_draft=3), dict(num_draft=1, tree="2,2,3")):
        spec = generate(trained_v32, PROMPTS, base.replace(**draft))
        np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens), err_msg=str(draft))
        assert spec.mean_accepted_length > 1.5, draft


def test_fp8_greedy_speculation_on_the_mosaic_kernels_equals_plain_greedy():
    """backend="mosaic" with FP8 caches, end to end (the Mosaic GPU indexer and sparse MLA kernels
    interpreted on the CPU, in the jitted decoding loop): a one-layer V3.2 in bfloat16 at widths
    the kernels take (latent 128 + 64, indexer keys 64 wide, pages of 64) emits with k = 2 the
    tokens of plain greedy. Its weights are random, so drafts are rarely accepted: what this shows
    is that the FP8 kernels' verify windows and catch-up give each token the bits plain decoding
    gives it; `test_fp8_greedy_speculation_equals_plain_greedy` shows acceptance on trained weights."""
    config = preset("tiny", num_hidden_layers=1, first_k_dense_replace=1, kv_lora_rank=128, qk_rope_head_dim=64,
                    index_head_dim=64)
    model = DeepseekV3(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    base = DecodeConfig(num_draft=0, max_new_tokens=3, page_size=64, backend="mosaic", cache_dtype="fp8")
    prompts = [list(b"the quick"), list(b"zq")]
    plain = generate(model, prompts, base)
    spec = generate(model, prompts, base.replace(num_draft=2))
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))


def test_fp8_window_invariant_rows_of_the_shipped_model_equal_plain_greedy():
    """The shipped model's front (`test_exactness.shipped_front`) in bfloat16 with FP8 caches and
    window_invariant: a chain of k = 3 emits plain greedy's rows on the held-out prompts
    (`benchmarks/heldout.py --cache-dtype fp8` runs the whole model). Tree windows on FP8 caches
    are pinned bit for bit by `test_exactness.test_window_hidden_states_equal_single_steps`, and
    a tree's commit of FP8 entries end to end by `test_fp8_greedy_speculation_equals_plain_greedy`:
    a tree here compiled for as long as the rest of the test."""
    model = shipped_front(jnp.bfloat16)
    base = DecodeConfig(max_new_tokens=24, backend="xla", num_draft=0, window_invariant=True, cache_dtype="fp8")
    assert rows(model, prompts(), base.replace(num_draft=3)) == rows(model, prompts(), base)


# ----------------------------------------------------------------------------------------------
# Errors and accounting
# ----------------------------------------------------------------------------------------------


def test_bad_cache_dtype_settings_are_named():
    with pytest.raises(ValueError, match=r"cache_dtype='bf16': must be one of \(None, 'fp8'\)"):
        DecodeConfig(cache_dtype="bf16")


@pytest.mark.parametrize("overrides,message", [
    (dict(kv_lora_rank=200), "kv_lora_rank=200 must be <= 128 or a multiple of 128"),
    (dict(index_head_dim=24), "index_head_dim=24 must be a power of two"),
    (dict(index_head_dim=256), "index_head_dim=256 must be a power of two .* and <= 128"),
])
def test_widths_that_do_not_fit_the_layout_are_refused(overrides, message):
    model = nnx.eval_shape(lambda: DeepseekV3(preset("tiny", **overrides), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=message):
        model.init_cache(2, 16, cache_dtype="fp8")


@pytest.mark.parametrize("scale_fmt,rule", [(None, fp8_cache.PLAIN_INDEX_RULE), ("ue8m0", fp8_cache.INDEX_RULE)])
def test_indexer_keys_take_the_configs_scale_fmt(scale_fmt, rule):
    """The target's and the MTP's FP8 key caches quantize by the config's `scale_fmt` (the indexer
    quantizes its queries by the key cache's rule, so the two cannot disagree)."""
    model = nnx.eval_shape(lambda: DeepseekV3(preset("tiny", scale_fmt=scale_fmt), rngs=nnx.Rngs(0)))
    for mtp in (False, True):
        assert model.init_cache(2, 16, page_size=8, mtp=mtp, cache_dtype="fp8").index_keys.rule == rule


def test_cache_bytes_count_the_fp8_layout():
    """The accounting every caller uses (`cache_bytes`, through `init_cache` under eval_shape):
    656 + 132 bytes a slot and layer at DeepSeek-V3.2's widths, against 1,152 + 256 in bfloat16,
    for the target and the MTP module alike."""
    config = reduced_depth(preset("deepseek-v3.2"), 2)  # full width; the depth only multiplies
    model = nnx.eval_shape(lambda: DeepseekV3(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    geometry = CacheGeometry(batch_size=2, capacity=256, page_size=64)
    fp8 = CacheGeometry(batch_size=2, capacity=256, page_size=64, cache_dtype="fp8")
    slots, layers = 2 * 256, model.config.num_hidden_layers
    tables = 2 * 4 * 4 + 2 * 4  # page table and lengths
    assert cache_bytes(model, geometry) == slots * layers * (1152 + 256) + tables
    assert cache_bytes(model, fp8) == slots * layers * (656 + 132) + tables
    assert cache_bytes(model, fp8, mtp=True) == slots * (656 + 132) + tables


def test_memory_plan_counts_the_compiled_programs_fp8_caches(h100):
    """One full-width V3.2 layer in bfloat16, B = 8, context 16k, k = 1, FP8 caches, compiled for
    an H100 (`jaxspec.aot`): the step's donated (aliased) arguments, its caches and loop state, are
    the plan's within 1%; the caches it takes are FP8 pools; and its temporaries are far below the
    caches (a dequantized bfloat16 copy of the latent pools alone would be 1.6 times them)."""
    from jaxspec import aot
    from jaxspec.aot.model import compile_model
    from jaxspec.memory_plan import plan_memory

    config = reduced_depth(preset("deepseek-v3.2"), 1)
    decode = DecodeConfig(num_draft=1, backend="pallas", cache_dtype="fp8")
    compiled = compile_model(config, decode, phase="decode", batch=8, context=16384, devices=h100)
    memory = aot.memory(compiled)
    plan = plan_memory(config, decode.replace(max_new_tokens=16384), batch=8, prompt_len=1)
    assert abs(memory.alias - plan.caches - plan.state) <= 0.01 * memory.alias, (plan.describe(), memory)
    donated = [arg for arg in jax.tree.leaves(compiled.args_info) if arg.donated]
    assert sum(arg.dtype == fp8_cache.E4M3 for arg in donated) == 2 * 2  # latent and keys, target and MTP
    assert memory.temp < 0.5 * plan.caches, (plan.describe(), memory)
