"""Choosing between an op's pure-jnp reference ("xla") and its Pallas kernel ("pallas"), and how
the kernel lowers (Triton for a GPU, or interpret mode)."""

from __future__ import annotations

import contextlib

import jax

BACKENDS = ("auto", "xla", "pallas")

# Set by `gpu_lowering()`: the program being traced is compiled for a GPU target although the
# process's default backend is the CPU (ahead-of-time compilation, `jaxspec.aot`).
_gpu_lowering = False


@contextlib.contextmanager
def gpu_lowering():
    """Inside this context the ops lower for a GPU whatever the default backend: "auto" picks the
    Pallas kernels and they take the Triton lowering, not interpret mode (`jaxspec.aot` traces
    inside it)."""
    global _gpu_lowering
    previous, _gpu_lowering = _gpu_lowering, True
    try:
        yield
    finally:
        _gpu_lowering = previous


def _lowers_for_gpu() -> bool:
    return _gpu_lowering or jax.default_backend() == "gpu"


def resolve_backend(backend: str) -> str:
    """"auto" -> "pallas" on a GPU (or inside `gpu_lowering`), "xla" elsewhere; "xla" / "pallas" pass through."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {BACKENDS}")
    if backend == "auto":
        return "pallas" if _lowers_for_gpu() else "xla"
    return backend


def interpret_mode() -> bool:
    """Pallas kernels run in interpret mode wherever there is no GPU (CPU tests), except inside
    `gpu_lowering`. The ops pass the answer to their jitted kernels as the static `interpret`
    argument, so a kernel traced one way is never reused from the jit cache the other way."""
    return not _lowers_for_gpu()
