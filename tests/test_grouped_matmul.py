"""The grouped matmul (MoE experts): reference against a numpy loop, the Pallas kernel against the
reference (interpret mode), its rows' independence of the other rows, its CUDA lowering, and one
DeepSeek-V3.2 MoE layer compiled for an H100 without a GPU: flops and bytes at the routed cost.

Inputs are seeded random; group sizes include empty groups, groups that are not a multiple of the
kernel's row tile, rows past the groups' total, and the decode shape (one row per group).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.models.moe import MoE
from jaxspec.pallas_kernels import block_fp8, grouped_matmul, grouped_matmul_reference
from jaxspec.pallas_kernels.grouped_matmul_pallas import (BLOCK_M, BLOCK_N, DECODE_GROUPS, DEFAULT_VARIANT, MAX_SPLITS,
                                                           MIN_SPLIT_STEPS, VARIANTS, Tiles, grouped_matmul_pallas,
                                                           k_splits, num_work_items, tile_variant, work_items)
from jaxspec.pallas_kernels.tiling import TARGET_PROGRAMS
from jaxspec.presets import preset
from conftest import ON_GPU
from cuda_lowering import triton_calls


def random_sizes(rng, num_groups: int, total: int, empty_fraction: float) -> np.ndarray:
    """[G] int32 group sizes summing to `total`, about `empty_fraction` of the groups empty."""
    used = rng.random(num_groups) >= empty_fraction
    used[rng.integers(num_groups)] = True
    chosen = rng.choice(np.flatnonzero(used), size=total)
    return np.bincount(chosen, minlength=num_groups).astype(np.int32)


def grouped_loop(lhs: np.ndarray, rhs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The definition, in float64 numpy, one group at a time."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs[g].astype(np.float64)
        start += size
    return out


def loop_bodies(ptx: str) -> list[str]:
    """The PTX of each loop: from a label to the branch back to it."""
    return [body for _, body in re.findall(r"^(\$L__BB\d+_\d+):\n(.*?)\bbra(?:\.uni)?\s+\1;", ptx, re.S | re.M)]


def device_fp8_experts(seed: int, groups: int, depth: int, width: int, power_of_two: bool = False):
    """FP8 experts [groups, depth, width] drawn and quantized on the default device (a GPU's tests:
    256 experts drawn with numpy took longer than a suite's patience on the lent H200), each
    column's scale spread over three decades (so e4m3 subnormals occur, about ten a 128 x 128
    block) -> (float8_e4m3fn weights, float32 scale_inv)."""
    draw, spread = jax.random.split(jax.random.key(seed))
    weights = (jax.random.normal(draw, (groups, depth, width)) * depth ** -0.5
               * jax.random.uniform(spread, (groups, 1, width), minval=0.01, maxval=10))
    return block_fp8.quantize(weights, power_of_two=power_of_two)


def make_case(seed: int, rows: int, depth: int, width: int, sizes: np.ndarray, dtype):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=(rows, depth)), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), depth, width)) * depth ** -0.5, dtype)
    return lhs, rhs, jnp.asarray(sizes)


def test_reference_matches_loop():
    rng = np.random.default_rng(0)
    sizes = random_sizes(rng, 9, 50, 0.4)
    lhs, rhs, group_sizes = make_case(1, 57, 24, 40, sizes, jnp.float32)  # 7 rows past the total
    got = jax.jit(grouped_matmul_reference)(lhs, rhs, group_sizes)
    np.testing.assert_allclose(got, grouped_loop(np.asarray(lhs), np.asarray(rhs), sizes), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[50:] == 0)


@pytest.mark.parametrize("seed", range(6))
def test_work_items_cover_each_row_once(seed):
    """The work table tiles each group's rows in BLOCK_M pieces and never exceeds its static size."""
    rng = np.random.default_rng(seed)
    num_groups, rows = int(rng.integers(1, 40)), int(rng.integers(1, 300))
    sizes = random_sizes(rng, num_groups, int(rng.integers(1, rows + 1)), 0.5)
    group, start, end = map(np.asarray, jax.jit(work_items, static_argnums=1)(jnp.asarray(sizes), rows))
    assert group.shape == (num_work_items(rows, num_groups),)
    owner = np.repeat(np.arange(num_groups), sizes)
    covered = np.zeros(rows, int)
    for g, s, e in zip(group, start, end):
        assert 0 <= s <= e <= rows and e - s <= BLOCK_M
        covered[s:e] += 1
        assert np.all(owner[s:e] == g)
    np.testing.assert_array_equal(covered, np.arange(rows) < sizes.sum())


CASES = {
    # name: (rows, depth, width, groups, rows in groups, empty fraction, dtype)
    "f32-edges": (70, 48, 40, 8, 64, 0.4, jnp.float32),  # K, N not whole blocks: masked gathers
    "bf16-edges": (70, 48, 40, 8, 64, 0.4, jnp.bfloat16),
    "f32-blocks": (90, 128, 256, 12, 90, 0.3, jnp.float32),  # whole blocks: the sliced weight loads
    "bf16-blocks": (90, 128, 256, 12, 90, 0.3, jnp.bfloat16),
    "bf16-decode": (32, 128, 128, 32, 32, 0.0, jnp.bfloat16),  # one row in most groups
    "bf16-one-group": (40, 64, 128, 5, 40, 0.9, jnp.bfloat16),
    "bf16-last-block-shifted": (70, 128, 200, 8, 64, 0.4, jnp.bfloat16),  # N past a block, not whole: sliced
    # Fewer rows than a tile (decode at a small batch): the window's rows past M load as zeros,
    # by a masked slice where K is whole and by a masked gather where it is not.
    "bf16-few-rows": (5, 128, 256, 3, 4, 0.0, jnp.bfloat16),
    "f32-few-rows-edges": (3, 48, 40, 2, 3, 0.0, jnp.float32),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_pallas_matches_reference(case):
    rows, depth, width, groups, total, empty, dtype = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    sizes = random_sizes(rng, groups, total, empty)
    lhs, rhs, group_sizes = make_case(int(rng.integers(1 << 30)), rows, depth, width, sizes, dtype)
    got = grouped_matmul_pallas(lhs, rhs, group_sizes, interpret=True)
    want = grouped_matmul_reference(lhs, rhs, group_sizes)
    assert got.dtype == want.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert np.all(np.asarray(got)[total:] == 0)
    np.testing.assert_allclose(np.asarray(got, np.float32), grouped_loop(np.asarray(lhs, np.float32),
                               np.asarray(rhs, np.float32), sizes), rtol=tol, atol=tol)


FP8_CASES = {
    # name: (rows, depth, width, groups, rows in groups, empty fraction)
    "edges": (40, 200, 300, 4, 36, 0.3),  # partial 128-blocks and partial kernel tiles both ways
    "blocks": (24, 256, 256, 16, 24, 0.0),  # whole blocks (the sliced weight loads), mostly one row per group
    "last-block-shifted": (24, 256, 320, 3, 24, 0.0),  # N not whole: its last block a slice ending at N
    "one-token": (1, 256, 256, 1, 1, 0.0),  # a dense linear at B 1: one row of the 16-row window
}


@pytest.mark.parametrize("case", FP8_CASES, ids=list(FP8_CASES))
def test_fp8_weights_equal_their_dequantized_bfloat16(case):
    """FP8 rhs + 128 x 128 block scales: the kernel (interpret mode) gives exactly what it gives for
    the dequantized bfloat16 rhs, the reference exactly what ragged_dot gives for it, and the two
    agree within bfloat16 tolerance."""
    rows, depth, width, groups, total, empty = FP8_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    sizes = jnp.asarray(random_sizes(rng, groups, total, empty))
    lhs = jnp.asarray(rng.normal(size=(rows, depth)), jnp.bfloat16)
    weights = rng.normal(size=(groups, depth, width)) * rng.uniform(0.01, 10, (groups, 1, width)) * depth ** -0.5
    rhs, scale_inv = block_fp8.quantize(jnp.asarray(weights, jnp.float32))
    dense = block_fp8.dequantize(rhs, scale_inv)
    got = grouped_matmul_pallas(lhs, rhs, sizes, scale_inv, interpret=True)
    want = grouped_matmul_reference(lhs, rhs, sizes, scale_inv)
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(grouped_matmul_pallas(lhs, dense, sizes, interpret=True)))
    np.testing.assert_array_equal(np.asarray(want), np.asarray(grouped_matmul_reference(lhs, dense, sizes)))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    assert np.all(np.asarray(got)[total:] == 0)


def test_op_dispatch_and_argument_errors():
    lhs, rhs, sizes = make_case(3, 20, 32, 16, np.array([5, 0, 15], np.int32), jnp.float32)
    # No rows at all (an expert-parallel shard's share can be empty): an empty result, no launch.
    assert grouped_matmul_pallas(lhs[:0], rhs, jnp.zeros_like(sizes), interpret=True).shape == (0, 16)
    np.testing.assert_array_equal(grouped_matmul(lhs, rhs, sizes, backend="xla"),
                                  grouped_matmul_reference(lhs, rhs, sizes))
    np.testing.assert_allclose(grouped_matmul(lhs, rhs, sizes, backend="pallas"),
                               grouped_matmul_reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lhs"):
        grouped_matmul(lhs[None], rhs, sizes)
    with pytest.raises(ValueError, match="rhs"):
        grouped_matmul(lhs, rhs[:, :8], sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(lhs, rhs, sizes[:2])
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(lhs, rhs, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match="backend"):
        grouped_matmul(lhs, rhs, sizes, backend="cuda")
    quantized, scale_inv = block_fp8.quantize(rhs)
    with pytest.raises(ValueError, match="rhs_scale_inv: must be given exactly when rhs is float8_e4m3fn"):
        grouped_matmul(lhs, quantized, sizes)
    with pytest.raises(ValueError, match="rhs_scale_inv: must be given exactly when rhs is float8_e4m3fn"):
        grouped_matmul(lhs, rhs, sizes, scale_inv)
    with pytest.raises(ValueError, match=r"rhs_scale_inv: must be float32 \[3, 1, 1\] for rhs \[3, 32, 16\]"):
        grouped_matmul(lhs, quantized, sizes, scale_inv[:, :, :0])


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """The same rows give the same bits alone, among more rows in their groups, and with more
    groups before them (speculative decoding's bit-exactness rests on this)."""
    rng = np.random.default_rng(11)
    lhs, rhs, _ = make_case(12, 64, 128, 128, np.zeros(8, np.int32), jnp.bfloat16)
    mine = lhs[:3]  # one row in group 2, two in group 5
    alone = grouped_matmul_pallas(mine, rhs, jnp.asarray([0, 0, 1, 0, 0, 2, 0, 0]), interpret=True)
    crowd = jnp.asarray(rng.normal(size=(40, 128)), jnp.bfloat16)
    # 9 rows of group 0, then 1 + 13 rows of group 2 (mine first), then 2 + 15 of group 5.
    batch = jnp.concatenate([crowd[:9], mine[:1], crowd[9:22], mine[1:], crowd[22:37]])
    together = grouped_matmul_pallas(batch, rhs, jnp.asarray([9, 0, 14, 0, 0, 17, 0, 0]), interpret=True)
    np.testing.assert_array_equal(np.asarray(together[jnp.asarray([9, 23, 24])]), np.asarray(alone))


@pytest.mark.parametrize("variant", sorted(name for name, tiles in VARIANTS.items()
                                            if name != DEFAULT_VARIANT and not tiles.integer_upcast))
def test_tile_variants_match_reference_and_keep_rows_independent(variant):
    """Each other tile variant (K step 128, K splits, stages) at shapes where it changes the launch:
    within float32 tolerance of the reference where K and N are not whole blocks, FP8 bits equal to
    its own bits for the dequantized bfloat16 weights, and a row's bits the same alone as among
    others. (Interpreted, `k64-int` is k64: its inline PTX runs compiled only, see
    `test_integer_upcast_on_gpu_gives_the_conversions_bits`.)"""
    tiles = VARIANTS[variant]
    rng = np.random.default_rng(sum(map(ord, variant)))
    sizes = random_sizes(rng, 3, 36, 0.0)
    lhs, rhs, group_sizes = make_case(5, 40, 2000, 200, sizes, jnp.float32)
    assert (k_splits(2000, 200, 3, tiles) > 1) == (k_splits(2048, 256, 2, tiles) > 1) == tiles.split_k
    got = grouped_matmul_pallas(lhs, rhs, group_sizes, interpret=True, tiles=tiles)
    np.testing.assert_allclose(got, grouped_matmul_reference(lhs, rhs, group_sizes), rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(got)[36:] == 0)

    weights = rng.normal(size=(2, 2048, 256)) * rng.uniform(0.01, 10, (2, 1, 256)) * 2048 ** -0.5
    quantized, scale_inv = block_fp8.quantize(jnp.asarray(weights, jnp.float32))
    dense = block_fp8.dequantize(quantized, scale_inv)
    lhs = jnp.asarray(rng.normal(size=(20, 2048)), jnp.bfloat16)
    crowd = jnp.asarray([7, 13])
    together = grouped_matmul_pallas(lhs, quantized, crowd, scale_inv, interpret=True, tiles=tiles)
    np.testing.assert_array_equal(np.asarray(together),
                                  np.asarray(grouped_matmul_pallas(lhs, dense, crowd, interpret=True, tiles=tiles)))
    alone = grouped_matmul_pallas(lhs[8:9], quantized, jnp.asarray([0, 1]), scale_inv, interpret=True, tiles=tiles)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(together[8:9]))


# The dense linears of DeepSeek-V3.2 (K, N of one group) and its experts (256 groups).
V32_WEIGHTS = {"q_a_proj": (7168, 1536, 1), "kv_a_proj": (7168, 576, 1), "q_b_proj": (1536, 24576, 1),
               "o_proj": (16384, 7168, 1), "mlp_down": (18432, 7168, 1), "expert_up": (7168, 2048, 256),
               "expert_down": (2048, 7168, 256)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_k_splits_fill_the_gpu_for_one_decoded_token(variant):
    """The split count at DeepSeek-V3.2's weights is the largest that keeps every rule (whole ranges
    of >= MIN_SPLIT_STEPS steps, <= TARGET_PROGRAMS programs when one token's rows hit
    DECODE_GROUPS groups, <= MAX_SPLITS): o_proj's 56 column blocks split, the experts' down
    projection (8 x 56 blocks) does not, and a variant without split_k never splits."""
    tiles = VARIANTS[variant]
    for name, (depth, width, groups) in V32_WEIGHTS.items():
        splits, steps = k_splits(depth, width, groups, tiles), -(-depth // tiles.block_k)
        programs = -(-width // BLOCK_N) * min(groups, DECODE_GROUPS)
        assert splits & (splits - 1) == 0 and steps % splits == 0, name
        if not tiles.split_k:
            assert splits == 1, name
            continue
        assert splits == 1 or (steps // splits >= MIN_SPLIT_STEPS and splits * programs <= TARGET_PROGRAMS
                               and splits <= MAX_SPLITS), name
        doubled = 2 * splits
        assert (doubled > MAX_SPLITS or steps % doubled or steps // doubled < MIN_SPLIT_STEPS
                or doubled * programs > TARGET_PROGRAMS), name
    o_proj, expert_down = k_splits(*V32_WEIGHTS["o_proj"], tiles), k_splits(*V32_WEIGHTS["expert_down"], tiles)
    assert (o_proj > 1) == tiles.split_k and expert_down == 1


def test_tile_variant_context_and_tiles_errors():
    """`tile_variant` sets what the op launches with while tracing, and restores it, even for a
    function JAX traced before (its trace cache does not know the setting); bad names and bad
    tiles are refused before tracing."""
    lhs, rhs, sizes = make_case(3, 20, 1024, 128, np.array([5, 0, 15], np.int32), jnp.float32)

    def op(lhs, rhs, sizes):
        return grouped_matmul(lhs, rhs, sizes, backend="pallas")

    default = jax.jit(op)(lhs, rhs, sizes)
    with tile_variant("k64-split"):
        split = jax.jit(op)(lhs, rhs, sizes)
        np.testing.assert_array_equal(split, grouped_matmul_pallas(lhs, rhs, sizes, interpret=not ON_GPU,
                                                                   tiles=VARIANTS["k64-split"]))
    assert not np.array_equal(split, default)
    np.testing.assert_array_equal(jax.jit(op)(lhs, rhs, sizes), default)
    with pytest.raises(ValueError, match="tile variant 'k96'"):
        with tile_variant("k96"):
            pass
    for tiles in (Tiles(block_k=96), Tiles(stages=1)):
        with pytest.raises(ValueError, match=re.escape(f"tiles={tiles!r}: must be a Tiles with block_k in")):
            grouped_matmul_pallas(lhs, rhs, sizes, interpret=True, tiles=tiles)


def test_cuda_lowering_at_deepseek_shapes():
    """The real Pallas-to-Triton lowering at DeepSeek-V3.2's expert shapes emits one Triton kernel."""
    args = (jax.ShapeDtypeStruct((256, 7168), jnp.bfloat16), jax.ShapeDtypeStruct((256, 7168, 2048), jnp.bfloat16),
            jax.ShapeDtypeStruct((256,), jnp.int32))
    fn = functools.partial(grouped_matmul_pallas, interpret=False)
    calls = triton_calls(fn, *args)
    assert len(calls) == 1 and re.search(r'\bname = "grouped_matmul"', calls[0])
    assert jax.eval_shape(fn, *args).shape == (256, 2048)


@pytest.mark.parametrize("weight,rows,variant", [("expert_up", 256, "k64"), ("expert_down", 256, "k64"),
                                                 ("expert_up", 256, "k128-split"), ("o_proj", 8, "k64-split"),
                                                 ("o_proj", 8, "k128-split"), ("kv_a_proj", 8, "k64"),
                                                 ("expert_up", 256, "k64-s7"), ("expert_up", 256, "k64-int")])
def test_fp8_kernel_compiled_for_h100_at_v32_shapes(h100, weight, rows, variant):
    """FP8 weights at DeepSeek-V3.2's widths: 256 experts with 256 rows (decode at batch 32, top-8),
    or o_proj and kv_a_proj (576 columns: not whole blocks) with 8 tokens, per tile variant. The
    kernel fits the H100's shared memory without spills, launches the variant's K splits, its
    stated bytes are 1 per weight of the groups that can be hit plus their scales (and the split's
    partial sums), not 2, and its K loop reads global memory only by asynchronous copies (a
    synchronous load there stalls every step of the weight stream), the 8 tokens' window of 16
    rows too, which it loads masked rather than from a padded copy; it unpacks e4m3 by conversions,
    or under `integer_upcast` by byte permutes with no e4m3 conversion left, and multiplies
    power-of-two scales in bfloat16 (ptxas pairs those multiplies: 32 HMUL2.BF16_V2 a K step of 64
    in the SASS)."""
    from jaxspec import aot

    (depth, width, groups), tiles = V32_WEIGHTS[weight], VARIANTS[variant]
    args = (jax.ShapeDtypeStruct((rows, depth), jnp.bfloat16),
            jax.ShapeDtypeStruct((groups, depth, width), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((groups,), jnp.int32),
            jax.ShapeDtypeStruct((groups, depth // 128, -(-width // 128)), jnp.float32))
    compiled = aot.compile_gpu(functools.partial(grouped_matmul_pallas, interpret=False, tiles=tiles), *args,
                               devices=h100)
    (launch,) = aot.kernel_launches(compiled)
    splits = k_splits(depth, width, groups, tiles)
    assert launch.grid == (num_work_items(rows, groups), -(-width // BLOCK_N), splits)
    # fewer rows than a window are read where they lie: no padded copy (a kernel of XLA's) before the launch
    assert rows >= BLOCK_M or " pad(" not in compiled.compiled.as_text()
    assert 0 < launch.shared_memory <= 227 * 1024 and launch.spill_stores == launch.spill_loads == 0
    ptx = aot.kernel_ptx(compiled, launch.name)
    loops = loop_bodies(ptx)
    assert loops and all("cp.async" in body and "ld.global" not in body for body in loops)
    assert any(("prmt.b32" if tiles.integer_upcast else "cvt.rn.f16x2.e4m3x2") in body for body in loops)
    # The two routes are branches off the loop's block: the bfloat16 one multiplies in bfloat16.
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) != tiles.integer_upcast and ("mul.rn.bf16" in ptx) == tiles.integer_upcast
    (call,) = aot.pallas_calls(compiled)
    weights = min(groups, rows) * (depth * width + 4 * (depth // 128) * -(-width // 128))
    activations = rows * (depth + width) * 2 + 3 * 4 * num_work_items(rows, groups)
    partials = 0 if splits == 1 else 2 * splits * rows * width * 4
    assert call.flops == 2 * rows * depth * width
    assert call.bytes_accessed == weights + activations + partials


# ----------------------------------------------------------------------------------------------
# One DeepSeek-V3.2 MoE layer compiled for an H100 (no GPU needed; the CUDA plugin is)
# ----------------------------------------------------------------------------------------------


# Tokens per MoE call at batch 32: decode and an MTP draft step (Q = 1), chain verification and
# the MTP catch-up at k = 3 (Q = 4), a tree of 8 (Q = 8); prefill of a 1024-token chunk.
@pytest.mark.parametrize("num_tokens,slack", [(32, 1.25), (128, 1.25), (256, 1.25), (1024, 1.5)],
                         ids=["decode-mtp", "verify-k3", "tree-8", "prefill-1024"])
def test_moe_layer_compiled_at_routed_cost(h100, num_tokens, slack):
    """Flops within `slack` of the routed work (3 matmuls per token-expert pair, the shared expert,
    the router), bytes within `slack` of reading each expert that can be hit once (min(E, T * k):
    the static worst case) plus the shared expert, router and activations, temporaries of
    activation size only, kernels within the H100's shared memory with no spills, and no while
    loop: a loop on a GPU splits the decode step's CUDA graph around it at every MoE layer (a
    binary search for the work table's groups would be one, 9 trips of one-thread kernels), and
    no sort where the router counts (`pallas_kernels.ranks`)."""
    from jaxspec import aot
    from jaxspec.aot.hlo_loops import parse_module

    config = preset("deepseek-v3.2")
    dim, hidden, experts, topk = (config.hidden_size, config.moe_intermediate_size, config.n_routed_experts,
                                  config.num_experts_per_tok)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: MoE(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)))
    x = jax.ShapeDtypeStruct((1, num_tokens, dim), jnp.bfloat16)
    compiled = aot.compile_gpu(lambda p, x: nnx.merge(graphdef, p)(x, backend="auto"), params, x, devices=h100)

    assignments, expert_bytes = num_tokens * topk, 3 * dim * hidden * 2
    routed_flops = 2 * 3 * dim * hidden * (assignments + num_tokens * config.n_shared_experts)
    router_flops = 2 * dim * experts * num_tokens
    ideal_bytes = ((min(experts, assignments) + config.n_shared_experts) * expert_bytes + dim * experts * 4
                   + 2 * num_tokens * dim * 2)
    cost = aot.program_cost(compiled)
    assert [call.name for call in aot.pallas_calls(compiled)] == ["grouped_matmul"] * 3
    assert not cost.uncounted
    assert routed_flops + router_flops <= cost.flops <= slack * (routed_flops + router_flops)
    assert ideal_bytes * 0.99 <= cost.bytes_accessed <= slack * ideal_bytes
    # Activations only: the gathered path's [T, k, D, H] weights would be 21 GB here.
    assert aot.memory(compiled).temp <= 8 * assignments * dim * 2
    launches = aot.kernel_launches(compiled)
    assert launches and all(l.shared_memory <= 227 * 1024 and l.spill_stores == l.spill_loads == 0 for l in launches)
    assert parse_module(compiled.as_text()).loops == []
    # Up to 128 tokens the router's selections and the experts' order are counted (pallas_kernels.ranks),
    # with no sort: on a GPU a sort is one to three launches and a copy. The tree of 8 and the
    # prefill sort the experts (and the prefill its assignments).
    assert bool(re.search(r"[)}\]] sort\(", compiled.as_text())) == (num_tokens > 128)


# ----------------------------------------------------------------------------------------------
# On a GPU: the kernel compiled, at DeepSeek-V3.2's expert shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("rows,empty", [(256, 0.0), (1024, 0.5)], ids=["decode", "prefill-half-empty"])
def test_pallas_compiled_on_gpu(rows, empty):
    """Natively on a GPU, bfloat16 experts of DeepSeek-V3.2's up-projection shape, within bfloat16
    rounding of the reference. 16 experts drawn on the device: 256 of them drawn in float64 numpy
    would be about 30 GB on the host."""
    rng = np.random.default_rng(rows)
    groups, depth, width = 16, 7168, 2048
    group_sizes = jnp.asarray(random_sizes(rng, groups, rows, empty))
    lhs = jnp.asarray(rng.normal(size=(rows, depth)), jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.key(rows + 1), (groups, depth, width)) * depth ** -0.5).astype(jnp.bfloat16)
    got = grouped_matmul_pallas(lhs, rhs, group_sizes, interpret=False)
    want = grouped_matmul_reference(lhs, rhs, group_sizes)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8], ids=["one-token", "eight-tokens"])
def test_fewer_rows_than_a_window_give_their_bits_among_more_on_gpu(rows):
    """Natively on a GPU, an FP8 dense linear of DeepSeek-V3.2's shape (one group): rows fewer
    than a 16-row window, which the kernel loads masked, give the bits they give among 40 rows,
    which it loads as plain slices (a decoded token's linear must not depend on the batch)."""
    rng = np.random.default_rng(rows)
    lhs = jnp.asarray(rng.normal(size=(40, 7168)), jnp.bfloat16)
    quantized, scale_inv = device_fp8_experts(rows, 1, 7168, 2048)
    run = lambda x: np.asarray(grouped_matmul_pallas(x, quantized, jnp.asarray([x.shape[0]], jnp.int32), scale_inv,
                                                     interpret=False))
    np.testing.assert_array_equal(run(lhs[:rows]), run(lhs)[:rows])


@pytest.mark.gpu
@pytest.mark.parametrize("power_of_two", [True, False], ids=["ue8m0", "amax"])
def test_integer_upcast_on_gpu_gives_the_conversions_bits(power_of_two):
    """Natively on a GPU (the only place the inline PTX runs), FP8 experts of DeepSeek-V3.2's
    up-projection shape: `k64-int` gives k64's bits, the loop being the same but for how e4m3
    leaves its bytes, on both routes (power-of-two scales or amax / 448 ones; the weights hold
    e4m3 subnormals, about ten a block). 16 experts drawn on the device."""
    rng = np.random.default_rng(7)
    groups, depth, width = 16, 7168, 2048
    sizes = jnp.asarray(random_sizes(rng, groups, 256, 0.0))
    lhs = jnp.asarray(rng.normal(size=(256, depth)), jnp.bfloat16)
    quantized, scale_inv = device_fp8_experts(7, groups, depth, width, power_of_two)
    run = lambda variant: np.asarray(grouped_matmul_pallas(lhs, quantized, sizes, scale_inv, interpret=False,
                                                           tiles=VARIANTS[variant]))
    np.testing.assert_array_equal(run("k64-int"), run("k64"))
