"""The online softmax of the Mosaic GPU kernels that gather their keys, in two warpgroups.

`sparse_mla_attention_mosaic` (a token's top-k slots) and `sliding_compressed_attention_mosaic`
(DeepSeek-V4's ring, compressed entries and extra keys) both run a program as one token's 64 heads
over a list of gathered key tiles, and split the output's columns between two warpgroups as
FlashMLA does: warpgroup 0 (`scorer`) waits for a tile's copies, moves the tile into the wgmma's
operand, issues the next tile's copies, computes `S = Q K^T` and the float32 online softmax, and
hands P and the rescale to warpgroup 1 (`follower`) through SMEM; each accumulates `P V` over its
own columns. The kernels differ in how a tile is gathered and moved (their callbacks) and in where
the softmax starts (a sink, or nothing); the handshake is this module's, once.

The handshake, per tile t (barriers of one arrival each):

    warpgroup 0: wait `gathered`; t > 0: wait `consumed` (warpgroup 1 is done with tile t - 1's
                 keys and P); operand, copies of t + 1, S, softmax; P and rescale to SMEM;
                 arrive `p_ready`
    warpgroup 1: wait `p_ready`; P V with the rescale; arrive `consumed`

and after the last tile warpgroup 0 waits for `consumed` once more, writes the denominator where the
rescale was and arrives `p_ready`, which warpgroup 1 waits for before its store.

Interpreted on the CPU the kernels run one warpgroup, which owns every column and makes no
handshake (`handshake=False`): the simulator runs warpgroups as threads whose XLA executions share
the host's thread pool, and two waiting on each other deadlocked on a 2-core host.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def tile_scores(q_smem, kv_smem, shape: tuple[int, int], scale, bias):
    """One key tile's scores in a warpgroup: q_smem [M, D] . kv_smem [T, D]^T on the tensor cores
    (float32 accumulator, shape = (M, T)), times `scale`, plus bias [T] (0 for a seen key, -inf for
    an unseen one) on every row -> [M, T] float32."""
    def scores(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, kv_smem.transpose((1, 0)))
        return acc_ref[...]

    s = pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))
    return s * scale + jax.lax.broadcast_in_dim(bias, s.shape, [1])


def accumulate_values(acc, alpha, p_smem, values_smem):
    """acc [M, C] float32 * alpha [M] + P V: p_smem [M, T] . values_smem [T, C] on the tensor cores.

    A fresh accumulator added in registers, not an in-place one (`pl.run_state` with
    `plgpu.ACC.init`): jax 0.10.2's interpreter runs neither, and every kernel here must run
    interpreted in the tests."""
    def product(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, values_smem)
        return acc_ref[...]

    tile_out = pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))
    return acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0]) + tile_out


def scorer(*, num_tiles, init, prepare: Callable, prefetch: Callable, accumulate: Callable, q_smem, kv_smem,
           p_smem, alpha_smem, scale: float, gathered, p_ready, consumed, handshake: bool):
    """Warpgroup 0's loop over a program's key tiles -> (row_max [M], denom [M], acc).

    num_tiles: the tiles to walk (a Python int or a traced int32; tile 0's copies are issued, when
      there is one, before the call); init: (row_max [M], denom [M], acc) float32 in the WGMMA row
      layout, acc any pytree `accumulate` carries: -inf, 0 and zeros for no keys seen yet, or a
      sink's (max = sink, denominator 1);
    prepare(t) -> bias [T] (0 seen, -inf not; WGMMA column layout): after tile t's copies landed,
      moves it into kv_smem (its unseen rows zeroed);
    prefetch(t): issues tile t's copies, arriving on `gathered`;
    accumulate(acc, alpha [M]) -> acc: `accumulate_values` over warpgroup 0's columns;
    q_smem [M, D], kv_smem [T, D], p_smem [M, T] (the keys' dtype), alpha_smem [M] float32: the
      rescale, then the denominator, handed to warpgroup 1; handshake: two warpgroups (False:
      warpgroup 0 alone, owning every column).

    A row that has seen no key yet keeps max -inf and denominator 0, and its rescale is exp(-inf) =
    0 rather than NaN, so an empty row ends with denominator 0 for the caller to handle."""
    def step(tile, carry):
        row_max, denom, acc = carry
        plgpu.barrier_wait(gathered)
        if handshake:  # warpgroup 1 is done with the last tile's keys and P
            pl.when(tile > 0)(lambda: plgpu.barrier_wait(consumed))
        bias = prepare(tile)
        plgpu.commit_smem()
        pl.when(tile + 1 < num_tiles)(lambda: prefetch(tile + 1))

        s = tile_scores(q_smem, kv_smem, p_smem.shape, scale, bias)
        new_max = jnp.maximum(row_max, jnp.max(s, axis=1))
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        alpha = jnp.exp(row_max - safe_max)
        p = jnp.exp(s - jax.lax.broadcast_in_dim(safe_max, s.shape, [0]))
        p_smem[...] = p.astype(p_smem.dtype)
        if handshake:
            alpha_smem[...] = alpha
        plgpu.commit_smem()
        if handshake:
            plgpu.barrier_arrive(p_ready)
        return new_max, denom * alpha + jnp.sum(p, axis=1), accumulate(acc, alpha)

    row_max, denom, acc = jax.lax.fori_loop(0, num_tiles, step, init)
    if handshake:  # warpgroup 1 has read the last rescale: hand it the denominator
        pl.when(num_tiles > 0)(lambda: plgpu.barrier_wait(consumed))
        alpha_smem[...] = denom
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready)
    return row_max, denom, acc


def follower(*, num_tiles, acc0, accumulate: Callable, alpha_smem, row_layout, p_ready, consumed):
    """Warpgroup 1's loop: `P V` over its columns with warpgroup 0's P and rescales -> (acc, denom
    [M]). acc0: its zero accumulator; accumulate(acc, alpha) -> acc over its columns; the rest as in
    `scorer`."""
    def step(_, acc):
        plgpu.barrier_wait(p_ready)
        acc = accumulate(acc, plgpu.layout_cast(alpha_smem[...], row_layout))
        plgpu.barrier_arrive(consumed)
        return acc

    acc = jax.lax.fori_loop(0, num_tiles, step, acc0)
    plgpu.barrier_wait(p_ready)
    return acc, plgpu.layout_cast(alpha_smem[...], row_layout)
