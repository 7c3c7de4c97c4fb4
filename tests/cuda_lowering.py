"""The Pallas-to-Triton lowering for CUDA on a host without a GPU, as the kernel tests check it."""

from __future__ import annotations

import jax

from jaxspec.pallas_kernels.backend import gpu_lowering


def triton_calls(fn, *args, **kwargs) -> list[str]:
    """The lines of `fn(*args, **kwargs)`'s StableHLO, lowered for CUDA, that launch a Triton kernel.

    The lowering runs inside `gpu_lowering()`, which names an H100 as the abstract device: jax 0.11's
    Triton lowering asks for the device's compute capability, and a CPU host has none."""
    with gpu_lowering():
        text = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
    return [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
