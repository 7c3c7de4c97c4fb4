"""Choosing an op's implementation: its pure-jnp reference ("xla"), its Pallas Triton kernel
("pallas") or its Pallas Mosaic GPU kernel ("mosaic"), and how the kernel lowers (for a GPU, or
interpreted on the CPU).

"auto" is the reference off a GPU. On a GPU it looks the op up in `AUTO_KERNELS` by the device
kind: an entry names the implementation measured fastest there (`benchmarks/attention_kernels.py` on a lent
GPU); an op with no entry takes its Triton kernel. A measurement that finds a Mosaic kernel faster
flips one entry, nothing else. "mosaic" asks for the Mosaic GPU kernels; an op that has none
(it is not in `MOSAIC_OPS`) runs its Triton kernel instead, so one backend name serves a whole model.
"""

from __future__ import annotations

import contextlib

import jax

BACKENDS = ("auto", "xla", "pallas", "mosaic")

# Ops with a Mosaic GPU kernel (`mla_attention_mosaic.py`, ...). `sinkhorn` and the MoE `router`
# (`router_mosaic.py`) have no Triton kernel: their "pallas" is their reference.
MOSAIC_OPS = frozenset({"mla_attention", "indexer_topk", "sparse_mla_attention", "sliding_compressed_attention",
                        "grouped_matmul", "sinkhorn", "router"})

# device kind (as `jax.Device.device_kind` spells it) -> {op: implementation "auto" picks}; an op
# or a device it does not name runs on Triton ("pallas"). Each entry is a measurement's verdict
# (`benchmarks/gpu_report.py`, docs/gpu-report/report.md): the Mosaic kernel faster than the Triton
# kernel at every measured shape, as close to the reference. Empty today. On an H200 (jax 0.11.2)
# the two-warpgroup Mosaic dense MLA kernel took 0.25-0.78 of Triton's time and had the H200's
# entry; its sparse MLA (1.5-3.6x) and indexer (1.25-1.5x) kernels were slower. The
# three-warpgroup kernels (a scorer and two followers) that replaced them did not return on the
# next H200 (their register split asked for more than the launch had, since fixed), so no Mosaic
# kernel has an entry until one is timed. The H100 has the same SM but is named only once a run
# there measures it.
AUTO_KERNELS: dict[str, dict[str, str]] = {}

# Set by `auto_kernels()`: {op: implementation} that "auto" picks on any GPU before `AUTO_KERNELS`.
_auto_choices: dict[str, str] = {}

# Set by `gpu_lowering()`: the program being traced is compiled for a GPU target although the
# process's default backend is the CPU (ahead-of-time compilation, `jaxspec.aot`); the value is the
# target's device kind ("" when not known).
_gpu_lowering: str | None = None

# The GPU a lowering without a device and without a named kind is for, and its SM count (an H200
# has as many).
DEFAULT_DEVICE_KIND = "NVIDIA H100 80GB HBM3"
HOPPER_SMS = 132


def abstract_gpu(device_kind: str = "", num_cores: int = HOPPER_SMS):
    """A context whose abstract mesh (no axes) names a GPU of `device_kind` (an H100 when "") with
    `num_cores` SMs: what Pallas asks for while tracing or lowering for a GPU on a host without one."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind or DEFAULT_DEVICE_KIND, platform="gpu",
                                         num_cores=num_cores)
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


@contextlib.contextmanager
def gpu_lowering(device_kind: str = ""):
    """Inside this context the ops lower for a GPU whatever the default backend: "auto" picks the
    kernels `AUTO_KERNELS` names for `device_kind` (Triton where it names none) and they take the
    GPU lowering, not interpret mode (`jaxspec.aot` traces and lowers inside it).

    Off a GPU it also names the target as an abstract device (`jax.sharding.AbstractDevice` of
    `device_kind`, an H100 when "" ): from jax 0.11 the Triton lowering asks the default device for
    its compute capability and fails on a CPU host unless the abstract mesh names a GPU."""
    global _gpu_lowering
    previous, _gpu_lowering = _gpu_lowering, device_kind
    target = contextlib.nullcontext() if jax.default_backend() == "gpu" else abstract_gpu(device_kind)
    try:
        with target:
            yield
    finally:
        _gpu_lowering = previous


def check_auto_choices(choices: dict[str, str]) -> None:
    """ValueError unless every {op: implementation} names an op with a Mosaic kernel and "pallas"
    or "mosaic" (what `auto_kernels` takes)."""
    for op, implementation in choices.items():
        if op not in MOSAIC_OPS or implementation not in ("pallas", "mosaic"):
            raise ValueError(f"auto_kernels({op}={implementation!r}): the op must be one of {sorted(MOSAIC_OPS)} "
                             "and the implementation 'pallas' or 'mosaic'")


@contextlib.contextmanager
def auto_kernels(**choices: str):
    """Inside this context "auto" runs `choices[op]` ("pallas" or "mosaic") for each op named, on
    any GPU, as an `AUTO_KERNELS` entry would: how a benchmark times a whole step on a kernel
    before a measurement puts it in the table (`benchmarks/e2e_step.py --auto`). Off a GPU "auto"
    stays the reference. The choice is read while tracing, and JAX keys its traces by function and
    arguments, not by this setting, so entering and leaving clear JAX's caches (`jax.clear_caches`),
    as `grouped_matmul_pallas.tile_variant` does; a program compiled inside keeps its kernels."""
    global _auto_choices
    check_auto_choices(choices)
    previous, _auto_choices = _auto_choices, {**_auto_choices, **choices}
    jax.clear_caches()
    try:
        yield
    finally:
        _auto_choices = previous
        jax.clear_caches()


def lowers_for_gpu() -> bool:
    """Whether what is traced now lowers for a GPU: a GPU is JAX's default backend, or the trace
    runs inside `gpu_lowering` (`jaxspec.aot`)."""
    return _gpu_lowering is not None or jax.default_backend() == "gpu"


def _device_kind() -> str:
    if _gpu_lowering is not None:
        return _gpu_lowering
    return jax.devices()[0].device_kind


def resolve_backend(backend: str, op: str | None = None) -> str:
    """The implementation an op runs: "xla", "pallas" or "mosaic".

    backend: one of BACKENDS, as the caller asked. op: the op's name, so that "auto" can look it up
    in `AUTO_KERNELS` and "mosaic" can tell whether it has a Mosaic kernel (None: an op with only a
    Triton kernel). "auto" -> the reference off a GPU, else an enclosing `auto_kernels` choice or
    the table's ("pallas" without an entry); "mosaic" -> "pallas" for an op not in `MOSAIC_OPS`;
    "xla" / "pallas" pass through. An op's wrapper may keep Triton where the table's Mosaic kernel
    does not take its operands (`mla_attention_backend`, `grouped_matmul_backend`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {BACKENDS}")
    if backend == "auto":
        if not lowers_for_gpu():
            return "xla"
        backend = _auto_choices.get(op) or AUTO_KERNELS.get(_device_kind(), {}).get(op, "pallas")
    if backend == "mosaic" and op not in MOSAIC_OPS:
        return "pallas"
    return backend


def window_invariant_kernels(backend: str, *ops: str) -> bool:
    """Whether `backend` runs every one of `ops` on its Mosaic GPU kernel. Those kernels are
    window-invariant by construction (fixed tiles, split counts set by the cache's capacity): a
    query row's bits do not depend on B, Q or the rows beside it, so a window-invariant caller may
    hand them a whole chain window in one call. The Triton kernels tile a window's query rows
    together and are not; the references run under `per_position` instead."""
    return all(resolve_backend(backend, op) == "mosaic" for op in ops)


def interpret_mode() -> bool:
    """Pallas kernels run in interpret mode wherever there is no GPU (CPU tests), except inside
    `gpu_lowering`. The ops pass the answer to their jitted kernels as the static `interpret`
    argument, so a kernel traced one way is never reused from the jit cache the other way."""
    return not lowers_for_gpu()
