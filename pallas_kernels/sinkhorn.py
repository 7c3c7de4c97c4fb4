"""DeepSeek-V4's Sinkhorn normalization of an mHC site's stream-mixing matrix.

    comb [..., N, N] positive -> approximately doubly stochastic

as transformers iterates it: columns normalized once, then `iters - 1` rounds of rows then columns,
each sum plus `eps`. Every token's N x N matrix is its own (N = `hc_mult`, 4 in DeepSeek-V4), so
the op is tiny: what it costs on a GPU is its kernel launches, about 20 an mHC site as XLA
compiles the rounds (a kernel a round), two sites a layer. The Mosaic GPU kernel
(`sinkhorn_mosaic`) runs a site's rounds in one launch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .backend import interpret_mode, resolve_backend


def sinkhorn_reference(comb: jax.Array, iters: int, eps: float) -> jax.Array:
    """The definition (pure jnp): comb [..., N, N] positive float32 -> [..., N, N] float32."""
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def round_(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def loop(c):
        return jax.lax.fori_loop(0, iters - 1, round_, c)

    def unrolled(c):
        return jax.lax.fori_loop(0, iters - 1, round_, jax.lax.optimization_barrier(c), unroll=True)

    # On a GPU the rounds are unrolled: as a loop each round is a while trip of one-thread kernels
    # whose predicate the host reads, outside the step's CUDA graph (19 trips at each mHC site, two
    # a layer). The full-depth V4-Flash decode step at B 1, compiled for an H200, launched 14,414
    # kernels and copies with the loops (each trip's predicate read counted), 6,244 unrolled, in
    # 21.0 s of compile against 18.9. The barrier keeps XLA from fusing the 19 rounds into the
    # softmax that makes `comb`: that fusion saved another 1,500 launches but took 33.9 s to
    # compile. On the CPU the loop stays: no launch to save, and unrolled a tiny V4's speculative
    # loop took 60% longer to compile.
    return jax.lax.platform_dependent(comb, cpu=loop, default=unrolled)


def sinkhorn(comb: jax.Array, iters: int, eps: float, *, backend: str = "auto") -> jax.Array:
    """Sinkhorn-normalize each token's mixing matrix: comb [..., N, N] positive -> [..., N, N]
    float32 (see the module docstring).

    backend: as the other ops (`backend.resolve_backend`). "mosaic" runs the Mosaic GPU kernel where
    the program lowers for a GPU; interpreted on the CPU it would cost seconds a call site for an
    op its own test interprets (tests/test_sinkhorn_mosaic.py), so a model run on the "mosaic"
    backend there keeps the reference. This op has no Triton kernel: "pallas", and "auto" until a
    measurement names the Mosaic kernel in `AUTO_KERNELS`, run the reference.
    """
    if comb.ndim < 2 or comb.shape[-1] != comb.shape[-2]:
        raise ValueError(f"comb: shape {comb.shape} must end in a square [N, N]")
    if iters < 1:
        raise ValueError(f"iters={iters}: must be >= 1")
    if resolve_backend(backend, "sinkhorn") == "mosaic" and not interpret_mode():
        from .sinkhorn_mosaic import sinkhorn_mosaic

        return sinkhorn_mosaic(comb, iters, eps)
    return sinkhorn_reference(comb.astype(jnp.float32), iters, eps)
