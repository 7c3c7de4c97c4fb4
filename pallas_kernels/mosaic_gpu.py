"""What every Pallas Mosaic GPU kernel here needs beside its body: running it interpreted on the
CPU, and lowering it for a real GPU.

Interpret mode is a private JAX API, `jax._src.pallas.mosaic_gpu.interpret`: it simulates the GPU's
memories, warpgroups, TMA copies, barriers and wgmma on the CPU. It exists from jax 0.10.2 (this
project's CPU CI) and is used on 0.11.x and 0.12.x (the lent GPUs run real lowering, not this);
`JAX_RANGE` names that range, and `interpret_params` fails with it when the module is missing. A
kernel interprets inside an abstract mesh whose abstract device is an H100, as JAX's own
`tests/pallas/gpu_pallas_interpret_test.py` runs them: Mosaic GPU asks the device for its kind and
SM count while tracing, and the CPU has neither. Interpretation is not thread-safe (one
interpreted kernel at a time per process), and an exception inside an interpreted kernel leaves
the simulator's shared state behind, which `interpreting` clears.

Off the CPU (a GPU, or `backend.gpu_lowering` for `jaxspec.aot`) a kernel takes the real Mosaic GPU
lowering, and a deviceless compile checks the kernel's declared shared memory (Mosaic GPU raises
above the 227 KiB a block may claim). Mosaic GPU also runs ptxas there; its report (registers,
spills) is written only where the process started with `MOSAIC_GPU_DUMP_PTXAS=1
MOSAIC_GPU_DUMP_TO=DIR` (docs/kernels.md gives the kernels' figures).
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from .backend import abstract_gpu
from .fp8_cache import E4M3, SCALE_BLOCK, Fp8Pool

# The jax versions whose private GPU interpret API this module was written against and run on.
JAX_RANGE = ">=0.10.2,<0.13"

# SMs of the abstract H100 that interpreted kernels see. Kernels here launch an explicit grid, so
# it only sizes the simulator; a real H100 has 132.
INTERPRET_SMS = 4
# The widest SMEM swizzle, in bytes: 128-byte rows (64 bfloat16, 128 e4m3).
SWIZZLE = 128
# The register layout an 8-bit tile is read in when it is widened into a 16-bit wgmma operand in
# SMEM: Mosaic GPU's layout for upcasting 8-bit values, in which a thread loads four e4m3 values
# at a time (32-bit shared loads) and stores four 16-bit ones (64-bit), half the shared-memory
# instructions of the WGMMA layout's 16-bit loads and 32-bit stores.
UPCAST_8BIT = plgpu.Layout.WGMMA_UPCAST_2X
# Set to "gpu", interpreted kernels run the warpgroups they run on a GPU (`interpreted_warpgroups`).
WARPGROUPS_VARIABLE = "JAXSPEC_INTERPRET_WARPGROUPS"


def warp_map_interpretable() -> bool:
    """Whether this jax's Mosaic GPU interpreter runs `plgpu.warp_map` (a `core_map` over the
    warps): 0.10.2's has no `core_map`, 0.11.2's runs it. Both lower it for a GPU."""
    return jax.__version_info__ >= (0, 11)


def xla_cpu_threads() -> int:
    """The threads of XLA's CPU client pool in this process: XLA sizes it from the NPROC
    environment variable where set, else from the CPUs the process may run on."""
    nproc = os.environ.get("NPROC", "")
    return int(nproc) if nproc.isdigit() and int(nproc) > 0 else len(os.sched_getaffinity(0))


def interpreted_warpgroups(gpu_warpgroups: int) -> int:
    """The warpgroups an interpreted kernel runs where a GPU runs `gpu_warpgroups`: by default 1
    (warpgroup 0 owns every output column and there is no handshake), on any host; with
    JAXSPEC_INTERPRET_WARPGROUPS=gpu the GPU's own, handshake and barriers included
    (`tests/test_mosaic_warpgroups.py`). Read when a kernel is traced.

    The simulator runs a launch's warpgroups as threads, each executing an XLA program on the CPU
    client's thread pool (`xla_cpu_threads`), and a warpgroup waiting at a barrier holds its pool
    thread. With fewer threads than the warpgroups plus the call that waits for them, the waiting
    warpgroups can hold them all while the one they wait for never starts (on 2 CPUs, a watchdog over
    the barriers showed the dense MLA kernel stopped so for good). So "gpu" needs
    gpu_warpgroups + 1 pool threads (NPROC=4 for three warpgroups, set before JAX starts), and is
    refused with a ValueError below that rather than left to hang. It is also 3 to 10 times slower
    than one warpgroup (a program per warpgroup thread and launch): a setting for one test, not the
    suite."""
    asked = os.environ.get(WARPGROUPS_VARIABLE, "1")
    if asked == "1":
        return 1
    if asked != "gpu":
        raise ValueError(f"{WARPGROUPS_VARIABLE}={asked!r}: must be '1' (the default) or 'gpu'")
    if xla_cpu_threads() < gpu_warpgroups + 1:
        raise ValueError(f"{WARPGROUPS_VARIABLE}=gpu interprets {gpu_warpgroups} warpgroups, which needs "
                         f"{gpu_warpgroups + 1} threads in XLA's CPU pool; it has {xla_cpu_threads()}: start the "
                         f"process with NPROC={gpu_warpgroups + 1} (XLA sizes the pool from it) or leave "
                         f"{WARPGROUPS_VARIABLE} unset")
    return gpu_warpgroups


def _interpret_module():
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, params
    except ImportError as error:
        raise RuntimeError(
            f"Mosaic GPU interpret mode needs jax{JAX_RANGE} (jax._src.pallas.mosaic_gpu.interpret); this is "
            f"jax {jax.__version__}: run the Mosaic kernels on a GPU, or pick backend='pallas' or 'xla'") from error
    return params, gpu_callbacks


@functools.cache
def _interpret_layout_casts() -> None:
    """Teach the interpreter `plgpu.layout_cast`: jax 0.10.2's simulator executes the kernel's jaxpr
    on the CPU and has no rule for it, yet a layout only says how a value is spread over a
    warpgroup's registers, so on the CPU it is the identity. Registered once, for the CPU only."""
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic_gpu import core as mosaic_core
    mlir.register_lowering(mosaic_core.layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")


@functools.cache
def _interpret_transposed_wgmma_operands() -> None:
    """Teach the interpreter wgmma operands read through a transposed ref (`ref.transpose`): on the
    GPU the transpose is a bit of the wgmma instruction (how `S = Q K^T` reads a `[slots, D]` tile),
    but jax 0.10.2's simulator only reads operands through indexers. The replacement callback reads
    each operand's indexed buffer, applies a trailing transpose, and otherwise does exactly what the
    simulator's own wgmma does: `acc += a @ b` in the accumulator's dtype. jax 0.11's simulator
    reads transposed operands itself (its wgmma callback takes a mesh location, not a device id)
    and is left as it is."""
    import inspect

    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    if "device_id" not in inspect.signature(gpu_callbacks.wgmma).parameters:
        return
    from jax._src.pallas.mosaic.interpret import utils
    from jax._src.state.types import TransposeTransform
    import numpy as np

    def split(transforms):
        transforms = gpu_callbacks._remove_noop_transforms(transforms)
        if transforms and isinstance(transforms[-1], TransposeTransform):
            return jax.tree.map(int, transforms[:-1]), transforms[-1].permutation
        return jax.tree.map(int, transforms), None

    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
              acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
              source_info=None):
        shared_memory = gpu_callbacks._get_shared_memory()
        global_thread = shared_memory.get_global_thread_id(int(device_id), int(thread_id))
        logging_info = utils.GPULoggingInfo(device_id=int(device_id), thread_id=int(thread_id),
                                            grid_point_coords=tuple(int(x) for x in grid_point_coords),
                                            source_info=source_info)

        def read(key, transforms):
            indexers, permutation = split(transforms)
            value, _, _ = shared_memory.get_buffer_content(
                gpu_callbacks.HostAllocationKey.from_array(key), utils.to_range(indexers), global_thread,
                logging_info=logging_info)
            return value if permutation is None else np.transpose(value, permutation)

        a, b = read(a_allocation_key_as_array, a_transforms), read(b_allocation_key_as_array, b_transforms)
        acc_key = gpu_callbacks.HostAllocationKey.from_array(acc_allocation_key_as_array)
        acc_range = utils.to_range(split(acc_transforms)[0])
        acc, _, _ = shared_memory.get_buffer_content(acc_key, acc_range, global_thread, logging_info=logging_info)
        shared_memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype), global_thread,
                                           logging_info=logging_info)
        return token

    gpu_callbacks.wgmma = wgmma


def compiler_params(**options) -> plgpu.CompilerParams:
    """The kernels' Mosaic GPU compiler parameters: `options` plus Lane lowering semantics, named
    explicitly. The kernels are written per thread with explicit register layouts
    (`plgpu.layout_cast` to the WGMMA layouts), which is Lane semantics: jax 0.10.2's default.
    jax 0.11 defaults to Warpgroup semantics, whose layout inference refuses a swizzled tile read
    through a column slice ("cannot apply swizzle to non-contiguous refs")."""
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, **options)


def store(ref, value) -> None:
    """`ref[...] = value` into an untiled shared-memory buffer or global memory (slice the ref with
    `.at[...]`), lowered on every jax as jax 0.10.2 and 0.11 lower that assignment.

    Written as `ref[...] = value`, a store is a swap whose old value nobody reads. jax 0.11 lowers
    a swap into an untiled buffer without bank-conflict avoidance (`optimized=False`); jax 0.12
    reads the old value first and asks for a conflict-free transfer, which a WGMMA-layout value has
    neither to an untiled shared buffer ("Failed to synthesize a transfer pattern that avoids bank
    conflicts") nor to global memory ("GMEM transfer does not access a whole number of complete
    32 byte sectors"), so the kernel would not lower. jax 0.12's `plgpu.store` writes without the
    read; `optimized=False` keeps 0.11's transfer (each such store is a block's output, once per
    block). Stores into tiled, swizzled buffers stay `ref[...] = value`: every jax lowers those
    conflict-free."""
    if hasattr(plgpu, "store"):
        plgpu.store(ref, value, optimized=False)
    else:
        ref[...] = value


def union(*buffers, interpret: bool):
    """Shared-memory buffers (each a pytree of `plgpu.SMEM`) whose lifetimes do not overlap, in one
    region on a GPU. The interpreter does not implement `plgpu.RefUnion` (jax 0.10.2) and has no
    shared-memory limit: separate buffers there."""
    return buffers if interpret else plgpu.RefUnion(*buffers)


def interpret_params():
    """The `interpret=` argument that makes a `plgpu.kernel` run on the CPU simulator."""
    params, _ = _interpret_module()
    return params.InterpretGPUParams()


@contextlib.contextmanager
def interpreting():
    """Trace and run Mosaic GPU kernels interpreted on the CPU inside this context (an abstract H100
    mesh plus the simulator; see the module docstring). After an exception it resets the simulator."""
    params, gpu_callbacks = _interpret_module()
    _interpret_layout_casts()
    _interpret_transposed_wgmma_operands()
    try:
        with abstract_gpu(num_cores=INTERPRET_SMS), params.force_gpu_interpret_mode(params.InterpretGPUParams()):
            yield
    except BaseException:
        gpu_callbacks.reset_gpu_interpret_mode_state()
        raise


def dequantize_rows(values, scales, dtype):
    """An FP8 cache's values as its readers see them, in registers: values [R, C] e4m3, scales [R]
    float32 (the scale of each row's block) -> [R, C] dtype, each value times its row's scale in
    float32, rounded to dtype: what `fp8_cache.entries` computes (e4m3 -> float32 is exact, one
    float32 product, one rounding), so a kernel reads the reference's entries bit for bit."""
    return (values.astype(jnp.float32) * jax.lax.broadcast_in_dim(scales, values.shape, [0])).astype(dtype)


def check_fp8_pool(name: str, pool: Fp8Pool, *, what: str = "latent", block: int = SCALE_BLOCK) -> None:
    """ValueError unless `pool` is an FP8 pool a Mosaic kernel reads: e4m3 values in whole blocks
    of `block` (one float32 scale each), and a bfloat16 RoPE part (the entries' dtype, which the
    tensor cores read). what: the pool's name in the message."""
    width = pool.values.shape[-1]
    if pool.rope is None or jnp.dtype(pool.rope.dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(f"{name}: an FP8 {what} cache needs a bfloat16 rope part, got "
                         f"{None if pool.rope is None else pool.rope.dtype}")
    if jnp.dtype(pool.values.dtype) != jnp.dtype(E4M3) or jnp.dtype(pool.scales.dtype) != jnp.dtype(jnp.float32):
        raise ValueError(f"{name}: FP8 cache values must be float8_e4m3fn and scales float32, got "
                         f"{pool.values.dtype} and {pool.scales.dtype}")
    if width % block or pool.scales.shape[-1] != width // block:
        raise ValueError(f"{name}: FP8 {what} width {width} must be a multiple of {block} with one scale per "
                         f"{block} values (scales last dim {pool.scales.shape[-1]})")


def swizzled(dtype, width: int):
    """How a [rows, width] tile of `dtype` sits in SMEM for the TMA and the wgmma: 8-row tiles of
    rows as wide as the swizzle: the row's bytes up to SWIZZLE (64 e4m3 values take 64)."""
    row_bytes = min(SWIZZLE, width * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, row_bytes // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(row_bytes))
