"""Choosing between an op's pure-jnp reference ("xla") and its Pallas kernel ("pallas")."""

from __future__ import annotations

import jax

BACKENDS = ("auto", "xla", "pallas")


def resolve_backend(backend: str) -> str:
    """"auto" -> "pallas" on a GPU, "xla" elsewhere; "xla" / "pallas" pass through."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {BACKENDS}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return backend


def interpret_mode() -> bool:
    """Pallas kernels run in interpret mode wherever there is no GPU (CPU tests)."""
    return jax.default_backend() != "gpu"
