"""DeepSeek-V4's Sinkhorn rounds on their Mosaic GPU kernel (`pallas_kernels.sinkhorn_mosaic`):
interpreted on the CPU against the reference (`sinkhorn_reference`), a token's bits the same alone
as among others in two programs; compiled for sm_90a without a GPU as one launch where XLA runs a
kernel a round; which implementation each backend runs, and what the op refuses. On a GPU host the
kernel runs natively (`conftest.MOSAIC_INTERPRET`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas_kernels import sinkhorn, sinkhorn_reference
from jaxspec.pallas_kernels.sinkhorn_mosaic import TOKENS, sinkhorn_mosaic
from conftest import MOSAIC_INTERPRET

EPS = 1e-6  # DeepSeek-V4's hc_eps


def random_comb(seed: int, tokens: tuple[int, ...], n: int = 4) -> jax.Array:
    """[*tokens, n, n] as an mHC site makes it: a softmax over each row, plus eps; sharp rows
    (logits over several units) so that the rounds have work to do."""
    logits = 3 * jax.random.normal(jax.random.key(seed), (*tokens, n, n))
    return jax.nn.softmax(logits, axis=-1) + EPS


@pytest.mark.parametrize("iters, tokens, n", [(1, (1, 1), 4), (3, (2, 3), 4), (4, (5, 27), 4), (3, (3, 1), 2)])
def test_kernel_equals_the_reference(iters, tokens, n):
    """Within float32 rounding of the reference (the sums' order is the kernel's own), at V4's
    N = 4 and N = 2, over one program and two (135 tokens), with the columns normalized last."""
    comb = random_comb(iters, tokens, n)
    got = sinkhorn_mosaic(comb, iters, EPS, interpret=MOSAIC_INTERPRET)
    want = sinkhorn_reference(comb, iters, EPS)
    assert got.shape == comb.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum(axis=-2), 1.0, atol=1e-4)


def test_a_tokens_bits_do_not_depend_on_the_tokens_beside_it():
    """Each token is one thread's own arithmetic: alone, its bits equal those it gets among 134
    others, in the first program and in the second."""
    comb = random_comb(7, (5, 27))
    together = np.asarray(sinkhorn_mosaic(comb, 3, EPS, interpret=MOSAIC_INTERPRET)).reshape(-1, 4, 4)
    flat = comb.reshape(-1, 4, 4)
    for token in (0, TOKENS + 2):
        alone = sinkhorn_mosaic(flat[token][None, None], 3, EPS, interpret=MOSAIC_INTERPRET)
        np.testing.assert_array_equal(np.asarray(alone)[0, 0], together[token])


def test_one_launch_a_site_compiled_for_h100(h100):
    """V4's 20 iterations over a decode window's 135 tokens, compiled for sm_90a: on the "mosaic"
    backend one Mosaic launch of two 128-thread programs (8 KiB of shared memory each) between the
    fusions that lay the tokens out and back, stating its cost; on "auto" (no measurement names
    the kernel yet) XLA's rounds, a kernel each."""
    from jaxspec import aot
    from jaxspec.aot.analysis import is_thunk_kind

    kernels = lambda launched: sum(n for name, n in launched.items() if not is_thunk_kind(name))  # noqa: E731
    spec = jax.ShapeDtypeStruct((5, 27, 4, 4), jnp.float32)
    compiled = aot.compile_gpu(lambda c: sinkhorn(c, 20, EPS, backend="mosaic"), spec, devices=h100)
    (launch,) = aot.mosaic_launches(compiled)
    assert (launch.kernel, launch.name) == ("sinkhorn_mosaic_mosaic_gpu_kernel", "sinkhorn")
    assert launch.grid == (2, 1, 1) and launch.threads == (128, 1, 1) and 16 * TOKENS * 4 <= launch.shared_memory
    (call,) = aot.pallas_calls(compiled)
    assert call.flops == 2 * TOKENS * 16 * 39 * 2 and call.bytes_accessed == 2 * 2 * TOKENS * 16 * 4
    assert kernels(aot.launch_counts(compiled)) <= 2
    reference = aot.compile_gpu(lambda c: sinkhorn(c, 20, EPS, backend="auto"), spec, devices=h100)
    assert not aot.mosaic_launches(reference) and kernels(aot.launch_counts(reference)) >= 19


def test_backends_and_refusals():
    """No backend but "mosaic" runs the kernel, and "mosaic" only where the program lowers for a
    GPU: off one the models' "mosaic" runs keep the reference (interpreted, the kernel would cost
    seconds a site). The op refuses a matrix that is not square and fewer than one iteration
    before tracing."""
    comb = random_comb(3, (2, 2))
    want = sinkhorn_reference(comb, 5, EPS)
    for backend in ("auto", "xla", "pallas"):
        np.testing.assert_array_equal(sinkhorn(comb, 5, EPS, backend=backend), want)
    if MOSAIC_INTERPRET:
        np.testing.assert_array_equal(sinkhorn(comb, 5, EPS, backend="mosaic"), want)
    else:
        np.testing.assert_array_equal(sinkhorn(comb, 5, EPS, backend="mosaic"), sinkhorn_mosaic(comb, 5, EPS))
    with pytest.raises(ValueError, match=r"comb: shape \(2, 4, 3\) must end in a square"):
        sinkhorn(jnp.ones((2, 4, 3)), 5, EPS)
    with pytest.raises(ValueError, match="iters=0: must be >= 1"):
        sinkhorn(comb, 0, EPS)
