"""`sinkhorn` as one Mosaic GPU kernel: every round of an mHC site in one launch.

XLA compiles the reference's rounds as a kernel a round (it fuses no two), each a few
microseconds of launch for 16 numbers a token: compiled for an H200, the full-depth
DeepSeek-V4-Flash decode step at B 1 launches 1,462 fewer kernels on this one (17 a site, 86
sites: 4,762 a step against 6,224, `aot.launch_counts`). Here a program takes 128 tokens,
one a thread: the matrix's N * N entries arrive as N * N rows of a shared-memory tile (the caller
hands the op its tokens component-major, [N * N, T], which XLA writes in the fusion that makes
them), each row one value a thread, and every round is straight-line arithmetic on those values in
registers. A row or column sum adds its N entries left to right, so a token's bits depend on its
own entries only (the reference's `jnp.sum` may add them in another order: the two agree to
float32 rounding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .cost import stating
from .mosaic_gpu import compiler_params, interpret_params, interpreting, store

TOKENS = 128  # a program's tokens: one a thread of its warpgroup


def _normalized(entries: list, n: int, eps: float, *, rows: bool) -> list:
    """entries: the N * N values of each thread's token, row-major -> the same with each row
    (`rows`) or each column divided by its sum plus eps, the sum added left to right."""
    at = (lambda line, k: entries[line * n + k]) if rows else (lambda line, k: entries[k * n + line])
    sums = [functools.reduce(lambda a, b: a + b, [at(line, k) for k in range(n)]) + eps for line in range(n)]
    return [entries[i * n + j] / sums[i if rows else j] for i in range(n) for j in range(n)]


def _sinkhorn_kernel(comb_gmem, out_gmem, tile, arrived, *, n: int, iters: int, eps: float):
    """One program's 128 tokens. comb_gmem, out_gmem [N * N, T] float32 (T a multiple of 128,
    component-major); tile: SMEM [N * N, 128] float32, in then out; arrived: the copy's barrier."""
    tokens = pl.ds(jax.lax.axis_index("tile") * TOKENS, TOKENS)
    plgpu.copy_gmem_to_smem(comb_gmem.at[:, tokens], tile, arrived)
    plgpu.barrier_wait(arrived)
    entries = _normalized([tile[k] for k in range(n * n)], n, eps, rows=False)
    for _ in range(iters - 1):
        entries = _normalized(_normalized(entries, n, eps, rows=True), n, eps, rows=False)
    for k, value in enumerate(entries):
        store(tile.at[k], value)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, out_gmem.at[:, tokens])
    plgpu.wait_smem_to_gmem(0)


def sinkhorn_mosaic(comb: jax.Array, iters: int, eps: float, *, interpret: bool = False) -> jax.Array:
    """`sinkhorn` on the Mosaic GPU kernel: comb [..., N, N] positive -> [..., N, N] float32 (the
    reference's arguments and result). `interpret` runs it on the CPU simulator
    (`mosaic_gpu.interpreting`)."""
    if not interpret:
        return _sinkhorn_mosaic(comb, iters, eps, interpret=False)
    with interpreting():
        return _sinkhorn_mosaic(comb, iters, eps, interpret=True)


# `interpret` also keys the jit cache: a kernel traced for the simulator is never reused for a GPU.
@functools.partial(jax.jit, static_argnames=("iters", "eps", "interpret"))
def _sinkhorn_mosaic(comb: jax.Array, iters: int, eps: float, *, interpret: bool) -> jax.Array:
    """Tokens past the last whole program are padded with ones, which the rounds keep finite, and
    dropped."""
    n = comb.shape[-1]
    flat = comb.reshape(-1, n * n).astype(jnp.float32).T  # [N * N, T]
    count = flat.shape[1]
    tiles = pl.cdiv(count, TOKENS)
    flat = jnp.pad(flat, ((0, 0), (0, tiles * TOKENS - count)), constant_values=1.0)
    kernel = plgpu.kernel(
        functools.partial(_sinkhorn_kernel, n=n, iters=iters, eps=eps), kernel_name="sinkhorn_mosaic",
        out_type=jax.ShapeDtypeStruct(flat.shape, jnp.float32), grid=(tiles,), grid_names=("tile",),
        scratch_types=[plgpu.SMEM((n * n, TOKENS), jnp.float32), plgpu.Barrier(num_arrivals=1)],
        compiler_params=compiler_params(), interpret=interpret_params() if interpret else None)
    # Per token a sum of N and a division per entry and normalization; the tile in and out once.
    cost = pl.CostEstimate(flops=flat.size * (2 * iters - 1) * 2, transcendentals=0, bytes_accessed=2 * flat.size * 4)
    with stating(cost, "sinkhorn"):
        out = kernel(flat)
    return out[:, :count].T.reshape(comb.shape)
