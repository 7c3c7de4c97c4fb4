"""What every Pallas Mosaic GPU kernel here needs beside its body: running it interpreted on the
CPU, and lowering it for a real GPU.

Interpret mode is a private JAX API, `jax._src.pallas.mosaic_gpu.interpret`: it simulates the GPU's
memories, warpgroups, TMA copies, barriers and wgmma on the CPU. It exists from jax 0.10.2 (this
project's CPU CI) and is used on 0.11.x (the lent GPUs run real lowering, not this); `JAX_RANGE`
names that range, and `interpret_params` fails with it when the module is missing. A kernel
interprets inside an abstract mesh whose abstract device is an H100, as JAX's own
`tests/pallas/gpu_pallas_interpret_test.py` runs them: Mosaic GPU asks the device for its kind and
SM count while tracing, and the CPU has neither. Interpretation is not thread-safe (one
interpreted kernel at a time per process), and an exception inside an interpreted kernel leaves
the simulator's shared state behind, which `interpreting` clears.

Off the CPU (a GPU, or `backend.gpu_lowering` for `jaxspec.aot`) a kernel takes the real Mosaic GPU
lowering; its MLIR becomes a cubin when XLA instantiates the custom call on a device, so a
deviceless compile checks the kernel's declared shared memory (Mosaic GPU raises above the 227 KiB
a block may claim) but shows no registers.
"""

from __future__ import annotations

import contextlib

import jax

# The jax versions whose private GPU interpret API this module was written against and run on.
JAX_RANGE = ">=0.10.2,<0.12"

# SMs of the abstract H100 that interpreted kernels see. Kernels here launch an explicit grid, so
# it only sizes the simulator; a real H100 has 132.
INTERPRET_SMS = 4
INTERPRET_DEVICE_KIND = "NVIDIA H100 80GB HBM3"


def _interpret_module():
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, params
    except ImportError as error:
        raise RuntimeError(
            f"Mosaic GPU interpret mode needs jax{JAX_RANGE} (jax._src.pallas.mosaic_gpu.interpret); this is "
            f"jax {jax.__version__}: run the Mosaic kernels on a GPU, or pick backend='pallas' or 'xla'") from error
    return params, gpu_callbacks


def interpret_params():
    """The `interpret=` argument that makes a `plgpu.kernel` run on the CPU simulator."""
    params, _ = _interpret_module()
    return params.InterpretGPUParams()


@contextlib.contextmanager
def interpreting():
    """Trace and run Mosaic GPU kernels interpreted on the CPU inside this context (an abstract H100
    mesh plus the simulator; see the module docstring). After an exception it resets the simulator."""
    params, gpu_callbacks = _interpret_module()
    device = jax.sharding.AbstractDevice(device_kind=INTERPRET_DEVICE_KIND, platform="gpu", num_cores=INTERPRET_SMS)
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
    try:
        with jax.sharding.use_abstract_mesh(mesh), params.force_gpu_interpret_mode(params.InterpretGPUParams()):
            yield
    except BaseException:
        gpu_callbacks.reset_gpu_interpret_mode_state()
        raise
