"""The Mosaic GPU grouped matmul (`grouped_matmul_mosaic`): interpreted on the CPU against the
reference and a float64 loop, FP8 weights against their dequantized bfloat16 values bit for bit, a
row's bits alone and among other rows, a stack's row read in place, K splits; which operands it
takes and how the op dispatches to it; and compiled for an H100 without a GPU at DeepSeek-V3.2's
widths (grid, shared memory, stated cost). On a GPU host these tests run it natively
(`conftest.MOSAIC_INTERPRET`), and the `gpu` test at DeepSeek-V3.2's expert width.

Inputs are seeded random; group sizes include empty groups, a group of more than one 16-row tile,
rows past the groups' total, and fewer rows than a tile.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas_kernels import block_fp8, grouped_matmul, grouped_matmul_backend, grouped_matmul_reference
from jaxspec.pallas_kernels.backend import auto_kernels, gpu_lowering
from jaxspec.pallas_kernels.grouped_matmul_mosaic import accepts, check_operands, grouped_matmul_mosaic
from jaxspec.pallas_kernels.grouped_matmul_pallas import (BLOCK_N, DEFAULT_VARIANT, VARIANTS, Tiles, k_splits,
                                                           num_work_items, tile_variant)
from conftest import MOSAIC_INTERPRET, ON_GPU
from test_grouped_matmul import V32_WEIGHTS, device_fp8_experts, grouped_loop, random_sizes
from virtual_devices import virtual_devices_env

SM90_SMEM = 227 * 1024

CASES = {
    # name: (rows, K, N, groups, rows in groups, empty fraction)
    "mixed": (60, 256, 256, 6, 52, 0.3),  # a group past one 16-row tile, empty groups, 8 rows past the total
    "decode": (8, 384, 128, 16, 8, 0.0),  # fewer rows than a tile, mostly one row a group
    # 10 column blocks: a block's FP8 scales are the 3rd of its box of 4 (blocks 8 and 9 in the
    # padded columns' box)
    "wide": (24, 256, 1280, 3, 24, 0.0),
}


def fp8_weights(rng, shape):
    """Block-quantized FP8 weights with scales spread over three decades, and their bfloat16 values."""
    groups, depth, width = shape[-3:]
    weights = rng.normal(size=shape) * rng.uniform(0.01, 10, (*shape[:-2], 1, width)) * depth ** -0.5
    quantized, scale_inv = block_fp8.quantize(jnp.asarray(weights, jnp.float32))
    return quantized, scale_inv, block_fp8.dequantize(quantized, scale_inv)


def check_rows_alone_and_in_a_crowd(rng, run, reference_weights, reference=grouped_matmul_reference) -> None:
    """Three rows, one of group 1 and two of group 3 of four groups, give the same bits alone
    (sizes [0, 1, 0, 2]) as among 30 others (5 rows of group 0, then 1 + 16 of group 1, the row
    first, then 2 + 9 of group 3), and that batch is within rounding of the reference.
    run(lhs, group_sizes) -> [M, N]: the kernel on its weights; reference_weights: (rhs [G, K, N],
    rhs_scale_inv) as the model stores them; reference(lhs, rhs, group_sizes, rhs_scale_inv): the
    kernel's definition (the op's, unless its numerics are another's)."""
    rhs, rhs_scale_inv = reference_weights
    depth = rhs.shape[1]
    mine = jnp.asarray(rng.normal(size=(3, depth)), jnp.bfloat16)
    crowd = jnp.asarray(rng.normal(size=(30, depth)), jnp.bfloat16)
    batch = jnp.concatenate([crowd[:5], mine[:1], crowd[5:21], mine[1:], crowd[21:30]])
    sizes = jnp.asarray([5, 17, 0, 11])
    together = run(batch, sizes)
    np.testing.assert_array_equal(np.asarray(together[jnp.asarray([5, 22, 23])]),
                                  np.asarray(run(mine, jnp.asarray([0, 1, 0, 2]))))
    np.testing.assert_allclose(np.asarray(together, np.float32),
                               np.asarray(reference(batch, rhs, sizes, rhs_scale_inv), np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("variant", ["k64", "k128"])
def test_matches_reference(case, variant):
    """At either K step: bfloat16 weights (an FP8 draw's dequantized values) within bfloat16
    rounding of the reference and of a float64 loop (the reference sums K in another order), rows
    past the total zero; the FP8 weights bit for bit the kernel's own result for those bfloat16
    values, and within rounding of the reference."""
    rows, depth, width, groups, total, empty = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    sizes = random_sizes(rng, groups, total, empty)
    lhs = jnp.asarray(rng.normal(size=(rows, depth)), jnp.bfloat16)
    quantized, scale_inv, dense = fp8_weights(rng, (groups, depth, width))
    group_sizes = jnp.asarray(sizes)
    call = functools.partial(grouped_matmul_mosaic, tiles=VARIANTS[variant], interpret=MOSAIC_INTERPRET)
    got = call(lhs, dense, group_sizes)
    want = grouped_matmul_reference(lhs, dense, group_sizes)
    assert got.dtype == want.dtype == jnp.bfloat16 and got.shape == (rows, width)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(got, np.float32), grouped_loop(np.asarray(lhs, np.float32),
                               np.asarray(dense, np.float32), sizes), rtol=2e-2, atol=2e-2)
    assert np.all(np.asarray(got)[total:] == 0)

    fp8 = call(lhs, quantized, group_sizes, scale_inv)
    np.testing.assert_array_equal(np.asarray(fp8), np.asarray(got))
    np.testing.assert_allclose(np.asarray(fp8, np.float32),
                               np.asarray(grouped_matmul_reference(lhs, quantized, group_sizes, scale_inv), np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("variant", ["k64", "k128-split", "k64-s3"])
def test_a_rows_result_does_not_depend_on_the_other_rows(variant):
    """The same rows give the same bits alone, among more rows of their groups and after other
    groups (speculative decoding's bit-exactness rests on this), with FP8 weights, without and with
    K splits (K = 2048 in steps of 128: 16, split in two), and with a ring of 3 (the 64-row window
    of a step's wgmma then reads other steps' rows past its own 16, which are never stored); the
    result is within rounding of the reference."""
    rng = np.random.default_rng(7)
    depth, tiles = 2048, VARIANTS[variant]
    quantized, scale_inv, _ = fp8_weights(rng, (4, depth, 128))
    assert (k_splits(depth, 128, 4, tiles) == 2) == tiles.split_k
    call = functools.partial(grouped_matmul_mosaic, tiles=tiles, interpret=MOSAIC_INTERPRET)
    check_rows_alone_and_in_a_crowd(rng, lambda lhs, sizes: call(lhs, quantized, sizes, scale_inv),
                                    (quantized, scale_inv))


def test_stack_row_read_in_place_and_op_dispatch():
    """rhs_row r of an FP8 stack [n, G, K, N] gives the bits of the call on row r's matrices; the
    op runs the Mosaic kernel on "mosaic" (interpreted here) under the current tile variant, with a
    stack row too, and the Triton kernel for operands the Mosaic one does not take."""
    rng = np.random.default_rng(3)
    quantized, scale_inv, _ = fp8_weights(rng, (3, 4, 256, 128))
    lhs = jnp.asarray(rng.normal(size=(21, 256)), jnp.bfloat16)
    sizes = jnp.asarray([4, 0, 9, 8])
    row = grouped_matmul_mosaic(lhs, quantized, sizes, scale_inv, jnp.int32(2), interpret=MOSAIC_INTERPRET)
    np.testing.assert_array_equal(np.asarray(row), np.asarray(grouped_matmul_mosaic(
        lhs, quantized[2], sizes, scale_inv[2], interpret=MOSAIC_INTERPRET)))
    np.testing.assert_array_equal(np.asarray(grouped_matmul(lhs, quantized, sizes, scale_inv, rhs_row=jnp.int32(2),
                                                            backend="mosaic")), np.asarray(row))
    np.testing.assert_array_equal(np.asarray(grouped_matmul(lhs, quantized[2], sizes, scale_inv[2], backend="mosaic")),
                                  np.asarray(row))
    with tile_variant("k128"):
        np.testing.assert_array_equal(
            np.asarray(grouped_matmul(lhs, quantized[2], sizes, scale_inv[2], backend="mosaic")),
            np.asarray(grouped_matmul_mosaic(lhs, quantized[2], sizes, scale_inv[2], tiles=VARIANTS["k128"],
                                             interpret=MOSAIC_INTERPRET)))

    assert grouped_matmul_backend("mosaic", lhs, quantized[0], scale_inv[0]) == "mosaic"
    assert grouped_matmul_backend("mosaic", lhs, quantized, scale_inv) == "mosaic"  # a stack
    odd = jnp.zeros((4, 256, 576), jnp.bfloat16)  # kv_a_proj's 576 columns
    assert grouped_matmul_backend("mosaic", lhs, odd) == "pallas"
    assert grouped_matmul_backend("mosaic", lhs.astype(jnp.float32), odd[..., :128].astype(jnp.float32)) == "pallas"
    assert grouped_matmul_backend("pallas", lhs, quantized[0], scale_inv[0]) == "pallas"
    # "auto": Triton on a GPU (no `AUTO_KERNELS` entry), the reference off one
    assert grouped_matmul_backend("auto", lhs, quantized[0], scale_inv[0]) == ("pallas" if ON_GPU else "xla")
    wide = jnp.asarray(rng.normal(size=(4, 256, 576)) / 16, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(grouped_matmul(lhs, wide, sizes, backend="mosaic")),
                                  np.asarray(grouped_matmul(lhs, wide, sizes, backend="pallas")))
    empty = grouped_matmul(lhs[:0], quantized[0], jnp.zeros_like(sizes), scale_inv[0], backend="mosaic")
    assert empty.shape == (0, 128) and empty.dtype == jnp.bfloat16


def test_auto_kernels_choose_the_mosaic_kernel_where_the_table_does_not():
    """`auto_kernels(grouped_matmul="mosaic")` makes "auto", lowered for a GPU, run the Mosaic
    kernel (for operands it takes; Triton for the others) as an `AUTO_KERNELS` entry would, and
    only inside the context; off a GPU "auto" stays the reference (on one, the Mosaic kernel inside
    the context); bad choices are refused."""
    spec = jax.ShapeDtypeStruct
    args = (spec((8, 256), jnp.bfloat16), spec((2, 256, 128), jnp.bfloat16), spec((2,), jnp.int32))
    odd = (args[0], spec((2, 256, 576), jnp.bfloat16), args[2])
    trace = lambda *a: str(jax.make_jaxpr(functools.partial(grouped_matmul, backend="auto"))(*a))  # noqa: E731
    with gpu_lowering("NVIDIA H200"):
        assert "_grouped_matmul_mosaic" not in trace(*args)
        with auto_kernels(grouped_matmul="mosaic"):
            assert "_grouped_matmul_mosaic" in trace(*args)
            assert "_grouped_matmul_mosaic" not in trace(*odd) and "grouped_matmul_pallas" in trace(*odd)
        assert "_grouped_matmul_mosaic" not in trace(*args)
    with auto_kernels(grouped_matmul="mosaic"):
        assert grouped_matmul_backend("auto", *args[:2]) == ("mosaic" if ON_GPU else "xla")
    for bad in ({"grouped_matmul": "cuda"}, {"matmul": "mosaic"}):
        with pytest.raises(ValueError, match="auto_kernels"):
            with auto_kernels(**bad):
                pass


def test_operands_it_does_not_take_are_refused_before_tracing():
    lhs, sizes = jnp.zeros((8, 256), jnp.bfloat16), jnp.asarray([8, 0])
    bf16, (quantized, scale_inv) = jnp.zeros((2, 256, 128), jnp.bfloat16), block_fp8.quantize(jnp.zeros((2, 256, 128)))
    assert accepts(lhs, bf16) and accepts(lhs, quantized, scale_inv)
    refusals = [((lhs.astype(jnp.float32), bf16.astype(jnp.float32)),
                 r"lhs.dtype=float32: must be bfloat16 or float16"),
                ((lhs.astype(jnp.float16), quantized, scale_inv),
                 r"lhs.dtype=float16: with FP8 weights must be bfloat16"),
                ((lhs, bf16.astype(jnp.float16)), r"rhs.dtype=float16: must be lhs's dtype bfloat16"),
                ((lhs[:, :192], bf16[:, :192]), r"rhs \[\.\.\., 192, 128\]: K must be a multiple of 128"),
                ((lhs, bf16[..., :64]), r"rhs \[\.\.\., 256, 64\]: K must be a multiple of 128 and N of 128"),
                ((jnp.zeros((8, 32896), jnp.bfloat16), jnp.zeros((2, 32896, 128), jnp.float8_e4m3fn),
                  jnp.zeros((2, 257, 1), jnp.float32)), r"rhs \[\.\.\., 32896, 128\]: FP8 weights with K over 32768")]
    for args, message in refusals:
        assert not accepts(*args)
        with pytest.raises(ValueError, match=message):
            check_operands(*args)
        with pytest.raises(ValueError, match="grouped_matmul_mosaic: " + message):
            grouped_matmul_mosaic(args[0], args[1], sizes, *args[2:], interpret=MOSAIC_INTERPRET)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul_mosaic(lhs, bf16, sizes[:1], interpret=MOSAIC_INTERPRET)
    for tiles in (Tiles(block_k=32), Tiles(stages=1), Tiles(stages=9)):
        with pytest.raises(ValueError, match=re.escape(f"tiles={tiles!r}: must be a Tiles with block_k in (64, 128) "
                                                       "and stages in [2, 8]")):
            grouped_matmul_mosaic(lhs, bf16, sizes, tiles=tiles, interpret=MOSAIC_INTERPRET)


def test_integer_upcast_replaces_the_loops_conversion(h100, tmp_path):
    """Compiled for sm_90a (the PTX in Mosaic GPU's dump, its own process): the `k64-int` loop
    unpacks e4m3 by byte permutes and has no e4m3 conversion left, where `k64`'s has one a pair of
    weights. Its two routes: one bfloat16 multiply a pair of weights (power-of-two scales), or,
    as k64, the float32 product and the rounding to bfloat16 pairs."""
    env = {**virtual_devices_env(1), "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_TO": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", UPCAST_PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = {}
    for path in tmp_path.glob("grouped_matmul_mosaic*.ptx"):
        text = path.read_text()
        ptx["k64-int" if "0x9180" in text else "k64"] = text  # the sign-extending byte permute
    assert sorted(ptx) == ["k64", "k64-int"]
    count = {name: {op: len(re.findall(re.escape(op) + r"\s", text)) for op in
                    ("cvt.rn.f16x2.e4m3x2", "prmt.b32", "cvt.rn.bf16x2.f32", "mul.f32", "mul.bf16x2")}
             for name, text in ptx.items()}
    weights = 64 * BLOCK_N // 128  # a thread's weights a K step of 64
    assert count["k64"]["cvt.rn.f16x2.e4m3x2"] == weights // 2 and count["k64-int"]["cvt.rn.f16x2.e4m3x2"] == 0
    assert count["k64-int"]["prmt.b32"] == 2 * weights // 2  # both routes
    assert count["k64-int"]["mul.bf16x2"] == weights // 2 and count["k64"]["mul.bf16x2"] == 0
    for name in ptx:
        assert count[name]["mul.f32"] >= weights and count[name]["cvt.rn.bf16x2.f32"] >= weights // 2


UPCAST_PROBE = """
import functools, jax, jax.numpy as jnp
from jaxspec import aot
from jaxspec.pallas_kernels.grouped_matmul_mosaic import grouped_matmul_mosaic
from jaxspec.pallas_kernels.grouped_matmul_pallas import VARIANTS
spec = jax.ShapeDtypeStruct
args = (spec((16, 256), jnp.bfloat16), spec((2, 256, 128), jnp.float8_e4m3fn), spec((2,), jnp.int32),
        spec((2, 2, 1), jnp.float32))
for variant in ("k64", "k64-int"):
    aot.compile_gpu(functools.partial(grouped_matmul_mosaic, tiles=VARIANTS[variant]), *args,
                    devices=aot.gpu_devices("h100"))
"""


# How many programs of each variant share an SM by their shared memory (the module docstring):
# 228 KiB an SM, less 1 KiB reserved for each program.
PROGRAMS_PER_SM = {"k64": 2, "k128": 1, "k64-split": 2, "k128-split": 1, "k64-s7": 2, "k64-s3": 3, "k64-int": 2}


@pytest.mark.parametrize("weight,rows,variant", [("expert_up", 256, "k64"), ("expert_down", 256, "k128"),
                                                 ("expert_up", 256, "k64-s7"), ("expert_down", 256, "k64-s3"),
                                                 ("expert_up", 256, "k64-int"), ("o_proj", 8, "k128-split"),
                                                 ("q_a_proj", 21, "k64")])
def test_compiled_for_h100_at_v32_shapes(h100, weight, rows, variant):
    """FP8 weights at DeepSeek-V3.2's widths (256 experts with 256 rows: decode at batch 32, top-8;
    o_proj with 8 tokens, K split; q_a_proj with 21 tokens, rows that are no whole number of the
    TMA's 8-row tiles): one Mosaic launch, a block per (work item, column block,
    split) of one warpgroup, within the H100's shared memory at the programs an SM the variant
    is for (PROGRAMS_PER_SM),
    and the op's stated cost equal to the Triton kernel's statement of the same work (1 byte a
    weight of the groups that can be hit, their scales, the activations, the work table, the
    split's partial sums)."""
    from jaxspec import aot

    depth, width, groups = V32_WEIGHTS[weight]
    args = (jax.ShapeDtypeStruct((rows, depth), jnp.bfloat16),
            jax.ShapeDtypeStruct((groups, depth, width), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((groups,), jnp.int32),
            jax.ShapeDtypeStruct((groups, depth // 128, width // 128), jnp.float32))
    tiles = VARIANTS[variant]
    compiled = aot.compile_gpu(functools.partial(grouped_matmul_mosaic, tiles=tiles), *args, devices=h100)
    (launch,) = aot.mosaic_launches(compiled)
    assert launch.kernel == "grouped_matmul_mosaic_mosaic_gpu_kernel"  # the profiler's name for it
    splits = k_splits(depth, width, groups, tiles)
    assert (splits > 1) == tiles.split_k
    # Mosaic GPU launches the grid reversed: the work items are CUDA's x, a group's tiles adjacent.
    assert launch.grid == (num_work_items(rows, groups), width // BLOCK_N, splits)
    assert launch.threads == (128, 1, 1) and 0 < launch.shared_memory <= SM90_SMEM
    per_sm = PROGRAMS_PER_SM[variant]
    assert per_sm * (launch.shared_memory + 1024) <= 228 * 1024 < (per_sm + 1) * (launch.shared_memory + 1024)
    (call,) = aot.pallas_calls(compiled)
    assert (call.name, call.lowering) == ("grouped_matmul", "mosaic")
    weights = min(groups, rows) * (depth * width + 4 * (depth // 128) * (width // 128))
    activations = rows * (depth + width) * 2 + 3 * 4 * num_work_items(rows, groups)
    partials = 0 if splits == 1 else 2 * splits * rows * width * 4
    assert call.flops == 2 * rows * depth * width
    assert call.bytes_accessed == weights + activations + partials


@pytest.mark.gpu
@pytest.mark.parametrize("rows,empty,variant,power_of_two",
                         [(256, 0.0, DEFAULT_VARIANT, False), (1024, 0.5, "k128", False), (8, 0.0, "k128-split", False),
                          (256, 0.0, "k64-s7", False), (256, 0.0, "k64-s3", False), (256, 0.0, "k64-int", False),
                          (256, 0.0, "k64-int", True)],
                         ids=["decode", "prefill-half-empty", "one-token-split", "decode-s7", "decode-s3",
                              "decode-int", "decode-int-ue8m0"])
def test_mosaic_compiled_on_gpu(rows, empty, variant, power_of_two):
    """Natively on a GPU, FP8 experts of DeepSeek-V3.2's up-projection shape: within bfloat16
    rounding of the reference, and a row's bits the same alone as among the others; variants that
    change only how the loop runs (stages, the integer unpacking of e4m3, on both its routes:
    power-of-two scales, as DeepSeek's "ue8m0" releases, or amax / 448 ones) give k64's bits.
    The weights hold e4m3 subnormals (about ten a 128 x 128 block), whose bfloat16 route passes
    through subnormal bfloat16. 16 experts, drawn on the device (940 MB of float32 before
    quantizing): all 256 drawn with numpy took longer than a suite's patience on the lent H200."""
    rng = np.random.default_rng(rows)
    depth, width, _ = V32_WEIGHTS["expert_up"]
    groups = 16
    sizes = jnp.asarray(random_sizes(rng, groups, rows, empty))
    lhs = jnp.asarray(rng.normal(size=(rows, depth)), jnp.bfloat16)
    quantized, scale_inv = device_fp8_experts(rows, groups, depth, width, power_of_two)
    tiles = VARIANTS[variant]
    got = jax.jit(functools.partial(grouped_matmul_mosaic, tiles=tiles))(lhs, quantized, sizes, scale_inv)
    want = grouped_matmul_reference(lhs, quantized, sizes, scale_inv)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    first = int(np.flatnonzero(np.asarray(sizes))[0])
    alone = grouped_matmul_mosaic(lhs[:1], quantized, jnp.zeros_like(sizes).at[first].set(1), scale_inv, tiles=tiles)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(got[:1]))
    if tiles._replace(stages=4, integer_upcast=False) == VARIANTS[DEFAULT_VARIANT]:
        default = grouped_matmul_mosaic(lhs, quantized, sizes, scale_inv)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(default))
