"""FP8 caches for DeepSeek-V4 (`init_v4_cache(cache_dtype="fp8")`): FlashMLA's MODEL1 token
(`fp8_cache.V4_RULE`, `pack_model1`), the attention op reading FP8 pools on the reference, Triton
and Mosaic GPU backends, and greedy speculation equal to plain greedy with them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from flax import nnx

from jaxspec.aot.model import reduced_depth
from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import generate
from jaxspec.model_config import CSA, HCA
from jaxspec.models import DeepseekV4
from jaxspec.models.interface import CacheGeometry, cache_bytes
from jaxspec.pallas_kernels import fp8_cache, sliding_compressed_attention
from jaxspec.pallas_kernels.fp8_cache import V4_RULE, Fp8Pool
from jaxspec.pallas_kernels.sliding_compressed_attention_mosaic import sliding_compressed_attention_mosaic
from jaxspec.pallas_kernels.sliding_compressed_attention_pallas import sliding_compressed_attention_pallas
from jaxspec.presets import preset
from conftest import MOSAIC_INTERPRET, on_cpu
from test_sliding_compressed_attention import make_case, v4_pool
from test_v4_attention import check_nodes_equal_branches, run, tree_case


def model1_reference(x: np.ndarray, rope_dim: int) -> np.ndarray:
    """An independent numpy writer of FlashMLA's MODEL1 page as vLLM's V4 cache kernel fills it
    (`fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`): x [page, D] -> the page's bytes. Per
    token and 64-value tile of the leading D - rope_dim values (rounded to bfloat16 first): e =
    ceil(log2(max(amax, 1e-4) / 448)), the tile's e4m3 values x * 2**-e clamped to +-448, its scale
    byte e + 127; the RoPE values in bfloat16. Page: every token's values and RoPE bytes, then 8
    bytes a token (its scale bytes, zero padded), zeros to a multiple of 576."""
    page, dim = x.shape
    quant = dim - rope_dim
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    tokens, scale_bytes = [], []
    for row in x:
        tiles = row[:quant].reshape(-1, min(64, quant))
        amax = np.maximum(np.abs(tiles).max(axis=1), np.float32(1e-4))
        exponent = np.ceil(np.log2(amax.astype(np.float64) / 448)).astype(np.int32)
        values = np.clip(tiles * np.exp2(-exponent.astype(np.float32))[:, None], -448, 448)
        tokens.append(np.concatenate([values.astype(ml_dtypes.float8_e4m3fn).reshape(-1).view(np.uint8),
                                      row[quant:].astype(ml_dtypes.bfloat16).view(np.uint8)]))
        scale_bytes.append(np.pad((exponent + 127).astype(np.uint8), (0, 8 - len(exponent))))
    packed = np.concatenate([np.concatenate(tokens), np.concatenate(scale_bytes)])
    return np.pad(packed, (0, -len(packed) % 576))


@pytest.mark.parametrize("dim,rope", [(512, 64), (32, 8)], ids=["deepseek", "tiny"])
def test_v4_pool_is_flashmlas_model1_page_byte_for_byte(dim, rope):
    """`write_entries` into a V4 pool, packed (`pack_model1`), equals the independent writer above
    byte for byte, over magnitudes from 1e-6 (the 1e-4 amax clamp) to 1e3; `unpack_model1` gives
    the pool back; DeepSeek's widths make 584 bytes a token (2,880 for a page of 4)."""
    rng = np.random.default_rng(0)
    page = 4
    x = (rng.normal(size=(1, page, dim)) * 10.0 ** rng.uniform(-6, 3, size=(1, page, dim // 16)).repeat(16, -1))
    pool = fp8_cache.init_pool(1, page, dim - rope, rope, rule=V4_RULE)
    pool = fp8_cache.write_entries(pool, jnp.zeros((1, 1), jnp.int32), jnp.arange(page, dtype=jnp.int32)[None],
                                   jnp.asarray(x, jnp.float32))
    packed = np.asarray(fp8_cache.pack_model1(pool))
    np.testing.assert_array_equal(packed[0], model1_reference(x[0], rope))
    if dim == 512:
        assert packed.shape == (1, 2880) and pool.token_bytes == 604
    back = fp8_cache.unpack_model1(jnp.asarray(packed), page, dim - rope, rope)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(pool)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    with pytest.raises(ValueError, match="expected"):
        fp8_cache.unpack_model1(jnp.asarray(packed[:, :-1]), page, dim - rope, rope)


def fp8_case(dim: int, rope: int, dtype=jnp.float32, **options):
    """`make_case`'s arguments in `dtype` with the ring and entries as V4 FP8 pools (NaN memory
    stays NaN); and the same with the pools' entries as plain bfloat16 arrays
    (`fp8_cache.entries`) and the extra keys as the entries' pool would store them
    (`fp8_cache.as_stored`), which is how the op reads extra keys beside FP8 pools."""
    case = make_case(np.random.default_rng(11), dim=dim, **options)
    args, kwargs = case.args(dtype)
    pool = functools.partial(v4_pool, rope=rope)
    args_fp8 = (args[0], pool(args[1]), *args[2:])
    kwargs_fp8 = dict(kwargs)
    if kwargs["compressed_kv"] is not None:
        kwargs_fp8["compressed_kv"] = pool(kwargs["compressed_kv"])
    plain = lambda x: fp8_cache.entries(x) if isinstance(x, Fp8Pool) else x  # noqa: E731
    args_plain = tuple(plain(a) for a in args_fp8)
    kwargs_plain = {k: plain(v) for k, v in kwargs_fp8.items()}
    if kwargs["extra_kv"] is not None:
        kwargs_plain["extra_kv"] = fp8_cache.as_stored(kwargs_fp8["compressed_kv"], kwargs["extra_kv"])
    return case, (args_fp8, kwargs_fp8), (args_plain, kwargs_plain)


FP8_CASES = {
    "tree-csa-extra": dict(tree=True, num_queries=5, extra=3, heads=4),
    "chain-hca": dict(compressed="count", heads=4),
}


@pytest.mark.parametrize("options", FP8_CASES.values(), ids=FP8_CASES.keys())
@pytest.mark.parametrize("dim,rope", [(32, 8), (192, 64)], ids=["one-block", "two-blocks"])
def test_fp8_pools_read_as_their_entries(options, dim, rope):
    """The op on FP8 pools: the reference equals itself on the pools' bfloat16 entries bit for bit
    (the definition; on the CPU device, `conftest.on_cpu`), and the Triton kernel (interpreted)
    equals the reference within float32's tolerance, finite, padding tokens 0. 192 = 128 + 64: two
    scale blocks, so a column reads its own block's scale."""
    case, (args, kwargs), (plain_args, plain_kwargs) = fp8_case(dim, rope, **options)
    static = {name: kwargs.pop(name) for name in ("sliding_window", "scale")}
    plain_kwargs = {k: v for k, v in plain_kwargs.items() if k not in static}

    def op(backend, *args, **kwargs):
        return jax.jit(functools.partial(sliding_compressed_attention, backend=backend, **static))(*args, **kwargs)

    with jax.default_matmul_precision("highest"):
        want = np.asarray(op("xla", *on_cpu(args), **on_cpu(kwargs)))
        np.testing.assert_array_equal(want, np.asarray(op("xla", *on_cpu(plain_args), **on_cpu(plain_kwargs))))
        got = np.asarray(op("pallas", *args, **kwargs))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    padding = np.arange(case.q.shape[1])[None, :] >= case.query_len[:, None]
    assert (got[padding] == 0).all()


MOSAIC_FP8_CASES = {
    "tree-csa-extra-page8": dict(tree=True, num_queries=3, heads=4, extra=2, topk=40, page=8, ring_pages=2, window=8),
    "chain-hca": dict(num_queries=2, heads=4, compressed="count", page=16, ring_pages=1, window=12),
}


@pytest.mark.parametrize("options", MOSAIC_FP8_CASES.values(), ids=MOSAIC_FP8_CASES.keys())
def test_mosaic_kernel_reads_fp8_pools(options):
    """The Mosaic kernel (interpreted; compiled on a GPU host) on V4 FP8 pools of three scale
    blocks (D 256 = 192 + 64, so each 64-column move takes its own block's scale), raw extra keys
    beside them: bit for bit the kernel on the pools' entries and the extra keys as stored (its
    dequantization is `fp8_cache.entries`', its extra keys the op's), and the reference within
    bfloat16's tolerance; finite, padding tokens 0."""
    case, (args, kwargs), (plain_args, plain_kwargs) = fp8_case(256, 64, jnp.bfloat16, **options)
    static = {name: kwargs.pop(name) for name in ("sliding_window", "scale")}
    plain_kwargs = {k: v for k, v in plain_kwargs.items() if k not in static}
    call = functools.partial(sliding_compressed_attention_mosaic, interpret=MOSAIC_INTERPRET, **static)
    got = np.asarray(call(*args, **kwargs), np.float32)
    np.testing.assert_array_equal(got, np.asarray(call(*plain_args, **plain_kwargs), np.float32))
    with jax.default_matmul_precision("highest"):
        want = np.asarray(jax.jit(functools.partial(sliding_compressed_attention, backend="xla", **static))(
            *args, **kwargs), np.float32)
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    padding = np.arange(case.q.shape[1])[None, :] >= case.query_len[:, None]
    assert padding.any() and (got[padding] == 0).all()


@pytest.mark.parametrize("change, match", [
    ("plain-entries", r"window_kv and compressed_kv must both be FP8 pools or both plain arrays"),
    ("narrow", r"FP8 window_kv width 32 must be a multiple of 64 with one scale per 64 values"),
    ("short", r"window_kv.values rows of 64 float8_e4m3fn \(64 bytes\) must be at least 128 bytes"),
], ids=["mixed-pools", "narrow-blocks", "short-rows"])
def test_mosaic_kernel_refuses_fp8_pools_it_cannot_tile(change, match):
    rope = {"narrow": 96, "short": 64}.get(change, 64)
    _, (args, kwargs), (_, plain_kwargs) = fp8_case(128 if change != "plain-entries" else 256, rope, jnp.bfloat16,
                                                    heads=4)
    if change == "plain-entries":
        kwargs["compressed_kv"] = plain_kwargs["compressed_kv"]
    with pytest.raises(ValueError, match=match):
        sliding_compressed_attention_mosaic(*args, **kwargs, interpret=MOSAIC_INTERPRET)


def test_triton_kernel_on_fp8_pools_compiles_for_h100_without_spills(h100):
    """V4-Flash widths (64 heads, D 512 = 448 + 64, window 128, top-512), B 32, a verification
    tree of 8 with extra keys, the ring and entries FP8 pools: the Triton kernel compiles for
    sm_90a with its FP8 tiles (16 x 16, `FP8_ACCUMULATOR`) without spilling (the compile fails on a
    spill) and within sm_90's shared memory."""
    from jaxspec import aot
    from test_sliding_compressed_attention import FLASH, SHARED_MEMORY_LIMIT, abstract_call
    args, kwargs, _ = abstract_call(**FLASH, num_queries=8, compressed="indices", tree=True, extra=2, fp8=True)
    compiled = aot.compile_gpu(sliding_compressed_attention_pallas, *args, devices=h100,
                               interpret=False, static_argnames=("sliding_window", "scale", "interpret"), **kwargs)
    (launch,) = aot.kernel_launches(compiled)
    assert launch.spill_stores == launch.spill_loads == 0 and launch.registers <= 255
    assert 0 < launch.shared_memory <= SHARED_MEMORY_LIMIT


# ----------------------------------------------------------------------------------------------
# The model with FP8 caches
# ----------------------------------------------------------------------------------------------

def test_v4_fp8_cache_layout_and_bytes():
    """`init_cache(cache_dtype="fp8")`: the window ring and the CSA / HCA entries are V4 pools
    (stacked over their layers), the projection rings float32, the indexer keys in the compute
    dtype; `cache_bytes` counts 604 bytes an entry slot at DeepSeek-V4-Flash's widths, against
    1,024 in bfloat16."""
    model = nnx.eval_shape(lambda: DeepseekV4(preset("tiny-v4"), rngs=nnx.Rngs(0)))
    cache = model.init_cache(2, 64, page_size=8, max_window=4, cache_dtype="fp8")
    for name in ("window", "csa_entries", "hca_entries"):
        pool = getattr(cache, name)
        assert isinstance(pool, Fp8Pool) and pool.rule == V4_RULE, name
        assert pool.values.dtype == fp8_cache.E4M3 and pool.rope.shape[-1] == model.config.qk_rope_head_dim
    assert cache.csa_index_entries.dtype == jnp.float32 and cache.csa_state.dtype == jnp.float32
    flash = reduced_depth(preset("deepseek-v4-flash"), 4)  # sliding, sliding, CSA, HCA
    full = nnx.eval_shape(lambda: DeepseekV4(flash, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    plain, fp8 = (cache_bytes(full, CacheGeometry(batch_size=2, capacity=1024, max_window=4, cache_dtype=dtype))
                  for dtype in (None, "fp8"))
    pools = jax.eval_shape(lambda: full.init_cache(2, 1024, max_window=4))
    slots = sum(np.prod(getattr(pools, name).shape[:-1]) for name in ("window", "csa_entries", "hca_entries"))
    assert plain - fp8 == slots * (1024 - 604)


def test_v4_widths_that_do_not_fit_model1_are_refused():
    model = nnx.eval_shape(lambda: DeepseekV4(preset("tiny-v4", head_dim=96, qk_rope_head_dim=16),
                                              rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"head_dim - qk_rope_head_dim = 96 - 16 = 80 must be positive and <= 64 "
                                         r"or a multiple of 64"):
        model.init_cache(2, 16, cache_dtype="fp8")


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_fp8_tree_nodes_equal_their_branches(kind):
    """One V4 layer with FP8 caches (`test_v4_attention`'s tree: row 0's depth-2 nodes close CSA
    block 3 and HCA block 1 from their own branch): every node of a tree call equals the chain
    call of its branch, which reads the closed entry back from the FP8 pool; the tree's branch
    entries are quantized and read back the same way, else they differ by the FP8 rounding."""
    model, _, nodes, prefix, cache, mask, depths = tree_case(kind, cache_dtype="fp8")
    assert isinstance(cache.window, Fp8Pool)
    out, _ = run(model, kind, nodes, prefix, [5, 5], cache, depths=depths, tree_mask=mask)
    check_nodes_equal_branches(model, kind, nodes, prefix, cache, mask, out)


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_fp8_window_invariant_tree_nodes_equal_their_branches_decoded_alone(kind):
    """window_invariant=True with FP8 caches: every node of a tree call is bit for bit its branch
    decoded one token per call. Each node runs on a view whose ring rows were moved to its
    branch's slots (`V4Cache.move_layer`: the FP8 parts' bytes) and closes its blocks from them, as
    the one-token calls do, so quantization happens on the same rows either way."""
    model, _, nodes, prefix, cache, mask, depths = tree_case(kind, cache_dtype="fp8")
    out, _ = run(model, kind, nodes, prefix, [5, 5], cache, window_invariant=True, depths=depths, tree_mask=mask)
    for node in range(len(mask)):
        step_cache = cache
        for depth, ancestor in enumerate(np.nonzero(mask[node])[0]):
            step, step_cache = run(model, kind, nodes[:, ancestor:ancestor + 1], prefix + depth, [1, 1], step_cache,
                                   window_invariant=True)
        np.testing.assert_array_equal(np.asarray(out[:, node]), np.asarray(step[:, 0]), err_msg=f"node {node}")


PROMPTS = [list(b"the quick"), list(b"fox jumps over the lazy dog and"), list(b"zq"), list(b"brown cat ov")]


def test_v4_fp8_greedy_speculation_equals_plain_greedy(trained_v4):
    """The trained tiny V4 (sliding, CSA and HCA layers) with FP8 caches: a chain of k = 3 and the
    dynamic tree 2,2,3 emit plain greedy's tokens, with drafts really accepted. Rejected drafts
    leave FP8 ring and entry bytes behind, a tree's accepted path moves ring bytes, and a tree's
    branch entries are read back as the pool would hold them (`fp8_cache.as_stored`)."""
    base = DecodeConfig(num_draft=0, max_new_tokens=24, page_size=8, backend="xla", cache_dtype="fp8")
    plain = np.asarray(generate(trained_v4, PROMPTS, base).tokens)
    for draft in (dict(num_draft=3), dict(num_draft=1, tree="2,2,3")):
        spec = generate(trained_v4, PROMPTS, base.replace(**draft))
        np.testing.assert_array_equal(np.asarray(spec.tokens), plain, err_msg=str(draft))
        assert spec.mean_accepted_length > 1.5, draft
