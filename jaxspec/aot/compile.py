"""Compiling for NVIDIA GPUs on a host without one: abstract H100 / H200 devices and `compile_gpu`.

JAX's CUDA plugin can compile for a GPU topology it does not have: `jax.experimental.topologies`
builds N abstract devices from XLA's `GpuTargetConfig` of a GPU (the public specs of
openxla/xla `xla/backends/gpu/target_config/specs/`, copied into `jaxspec/targets/`), and a
program lowered with its arguments on those devices compiles to the same optimized HLO, PTX and
buffer assignment a real GPU would get. Nothing runs; what is measured is what the compiler
decided (memory, flops, kernels' registers and shared memory), never time.

Requirements (checked by `gpu_devices`, which says what is missing):
  * the CUDA plugin of the installed jax: `pip install "jax[cuda12]==<jax version>"`;
  * the process's JAX platforms must exclude "cuda" where there is no GPU driver: run with
    `JAX_PLATFORMS=cpu`, or call `jax.config.update("jax_platforms", "cpu")` before anything
    initializes JAX's backends. Without it the plugin fails `cuInit`, logs an error and never
    registers, and JAX cannot re-register it later in the same process. (On a host with a GPU the
    plugin registers either way.) `jaxspec aot` sets it itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.resources
import re
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxspec.pallas_kernels.backend import gpu_lowering

# Target name -> XLA GpuTargetConfig text proto shipped in jaxspec/targets/.
TARGETS = {"h100": "h100.txtpb", "h200": "h200.txtpb"}


def target_config(target: str) -> str:
    """The GpuTargetConfig text proto of `target` ("h100" = H100 SXM 80 GB, "h200" = H200 141 GB)."""
    if target not in TARGETS:
        raise ValueError(f"target={target!r}: must be one of {sorted(TARGETS)}")
    return (importlib.resources.files("jaxspec") / "targets" / TARGETS[target]).read_text()


# JAX's CUDA plugin distributions: CUDA 12 (the CPU hosts and CI) or CUDA 13 (the lent GPU machines).
CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")


def _plugin_missing_error() -> RuntimeError:
    return RuntimeError(f"compiling for a GPU needs JAX's CUDA plugin: pip install 'jax[cuda12]=={jax.__version__}'")


def _cuda_plugin_installed() -> bool:
    for name in CUDA_PLUGINS:
        try:
            importlib.metadata.version(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


def gpu_devices(target: str = "h100", num_devices: int = 1, *, device_memory: int | None = None,
                hosts: int = 1) -> list:
    """`num_devices` abstract devices of `target` ("h100" or "h200"), in one node or spread evenly
    over `hosts` nodes (topology 1 x hosts x devices-per-host; a program over them is compiled as
    the multi-process program each host would run).

    device_memory: bytes of memory per device in place of the GPU's own, to cost a program that
    does not fit. XLA squeezes a program into 80% of a device's memory by rematerializing
    (recomputing) values, and when the arguments alone exceed that it recomputes whatever it can:
    flops and bytes then grow with how far the program overflows, not with what it computes.

    Raises ValueError for an unknown target, a device count below 1, hosts that do not divide it or
    a device_memory below 1,
    RuntimeError naming the fix when the CUDA plugin is missing or could not register (see the
    module docstring).
    """
    config = target_config(target)
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices}: must be >= 1")
    if hosts < 1 or num_devices % hosts:
        raise ValueError(f"hosts={hosts}: must be >= 1 and divide num_devices={num_devices}")
    if device_memory is not None:
        if device_memory < 1:
            raise ValueError(f"device_memory={device_memory}: must be >= 1 (bytes) or None")
        config, found = re.subn(r"device_memory_size: \d+", f"device_memory_size: {device_memory}", config)
        if found != 1:
            raise RuntimeError(f"target {target!r}: its GpuTargetConfig has no single device_memory_size")
    if not _cuda_plugin_installed():
        raise _plugin_missing_error()
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=config,
                                                topology=f"1x{hosts}x{num_devices // hosts}")
    except NotImplementedError:
        raise RuntimeError(
            "the CUDA plugin is installed but did not register in this process (no GPU driver): run with "
            "JAX_PLATFORMS=cpu, or call jax.config.update('jax_platforms', 'cpu') before JAX initializes "
            "its backends") from None
    return list(topology.devices)


def _place(tree, devices: Sequence):
    """Give every `ShapeDtypeStruct` leaf without a sharding one on `devices`: the device itself for
    one device, replicated over all of them otherwise (shard explicitly for anything else)."""
    if len(devices) == 1:
        sharding = SingleDeviceSharding(devices[0])
    else:
        sharding = NamedSharding(Mesh(list(devices), ("devices",)), PartitionSpec())

    def place(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding, weak_type=leaf.weak_type)
        return leaf

    return jax.tree.map(place, tree)


@contextlib.contextmanager
def _not_persistently_cached():
    """Compiles inside write nothing to JAX's persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`).

    Off a GPU a deviceless program cannot be loaded back: the next identical compile fails to read
    its entry, warns ("Error reading persistent compilation cache entry") and compiles again, so the
    entry is only disk and a warning. On a GPU host one that loaded would skip the compile whose
    dump `jaxspec.aot` reads. JAX decides once per process whether the cache is used, so the switch
    here is its write threshold (a compile's seconds), raised for the compile and restored: process-
    wide while it lasts, so another thread's compile in that window is not cached either.
    """
    option = "jax_persistent_cache_min_compile_time_secs"
    previous = getattr(jax.config, option)
    jax.config.update(option, float("inf"))
    try:
        yield
    finally:
        jax.config.update(option, previous)


@dataclasses.dataclass
class GpuCompiled:
    """A program compiled for a GPU target: the `jax.stages.Compiled` (its attributes are reachable
    on this object too), the directory XLA dumped it into (optimized HLO, thunk sequence, PTX) and
    the wall time of lowering plus compiling. `fail_on_spill`: whether XLA refused any kernel of its
    PTX that spills registers (then none does; else `analysis.register_spills` names those that do)."""

    compiled: jax.stages.Compiled
    dump_dir: str
    compile_seconds: float
    fail_on_spill: bool
    _dump_owner: Any = dataclasses.field(default=None, repr=False)  # keeps a temporary dump alive

    def __getattr__(self, name):
        if name == "compiled":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.compiled, name)


def compile_gpu(fn: Callable, *args, devices: Sequence | None = None, static_argnames: Sequence[str] = (),
                donate_argnums: Sequence[int] = (), donate_argnames: Sequence[str] = (), dump_dir: str | None = None,
                fail_on_spill: bool = True, **kwargs) -> GpuCompiled:
    """Compile `fn(*args, **kwargs)` for a GPU target without a GPU.

    args / kwargs: `jax.ShapeDtypeStruct`s or pytrees of them (leaves without a sharding are put
    on `devices`, see `_place`), and the static arguments named in `static_argnames`.
    devices: from `gpu_devices` (default: one H100). donate_argnums / donate_argnames: as in `jax.jit`.
    dump_dir: where XLA dumps the compilation (default: a temporary directory kept as long as the
    result). fail_on_spill: a kernel of XLA's PTX (its own kernels and the Triton ones) that spills
    registers fails the compile (XLA's `xla_gpu_fail_ptx_compilation_on_register_spilling`, which
    does not say which kernel: `analysis.register_spills` of a compile without it does); over-budget
    shared memory always fails it.
    Large sorts use XLA's sort kernel instead of CUB's (see below). The ops trace inside
    `gpu_lowering(device kind)`: "auto" picks the kernels `backend.AUTO_KERNELS` names for the
    target (Triton by default), and they take the GPU lowering although the process's default
    backend is the CPU.
    """
    devices = gpu_devices() if devices is None else list(devices)
    owner = None
    if dump_dir is None:
        owner = tempfile.TemporaryDirectory(prefix="jaxspec-aot-")
        dump_dir = owner.name
    static = set(static_argnames)
    args = _place(args, devices)
    kwargs = {k: v if k in static else _place(v, devices) for k, v in kwargs.items()}
    start = time.perf_counter()
    with gpu_lowering(devices[0].device_kind):
        lowered = jax.jit(fn, static_argnames=tuple(static_argnames),
                          donate_argnums=tuple(donate_argnums),
                          donate_argnames=tuple(donate_argnames)).lower(*args, **kwargs)
    with _not_persistently_cached():
        compiled = lowered.compile(compiler_options={
            "xla_gpu_fail_ptx_compilation_on_register_spilling": fail_on_spill, "xla_dump_to": dump_dir,
            # The PTX, which `analysis.kernel_launches` gives to ptxas: from jax 0.11 XLA dumps it only
            # for the emitters this names ("ptx": the PTX alone, no per-fusion logs).
            "xla_dump_emitter_re": "ptx",
            # XLA sizes a CUB radix sort's scratch by asking the CUDA runtime, which fails without a
            # device ("invalid device ordinal"): large sorts (top-k of the DSA indexer) use XLA's own
            # sort kernel here, where a GPU host's compile would call CUB.
            "xla_gpu_enable_cub_radix_sort": False,
            # The instrument measures the program a GPU host would build, whatever the process's
            # XLA_FLAGS say (the test suite lowers XLA's optimization level for its CPU programs; at
            # level 0 ptxas spills kernels that fit at the default level).
            "xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False})
    return GpuCompiled(compiled, dump_dir, time.perf_counter() - start, fail_on_spill, owner)
