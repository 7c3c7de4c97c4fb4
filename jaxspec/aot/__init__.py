"""Ahead-of-time compilation for NVIDIA GPUs on a host without one: the project's instrument.

    import os; os.environ["JAX_PLATFORMS"] = "cpu"   # before JAX initializes (see compile.py)
    from jaxspec import aot
    devices = aot.gpu_devices("h100", num_devices=1)
    compiled = aot.compile_gpu(fn, *shape_dtype_structs, devices=devices)
    aot.memory(compiled), aot.program_cost(compiled), aot.kernel_launches(compiled), aot.collectives(compiled)
    aot.mosaic_launches(compiled), aot.kernel_ptx(compiled, launch.name)

What is measured is what the compiler decided (memory, flops, bytes, kernels' registers and
shared memory, collectives): facts that tests may assert. Run times derived from them are
projections (`benchmarks/projection.py`).
"""

from .analysis import (OP_CLASSES, Collective, KernelLaunch, Memory, MosaicLaunch, PallasCall, ProgramCost, collectives,
                       kernel_launches, kernel_name, kernel_ptx, launch_counts, memory, mosaic_launches, op_class_costs,
                       op_class_launches, pallas_calls, program_cost, ptxas_path, register_spills, shape_bytes)
from .compile import TARGETS, GpuCompiled, compile_gpu, gpu_devices, target_config
from .report import report

__all__ = [
    "OP_CLASSES", "TARGETS", "Collective", "GpuCompiled", "KernelLaunch", "Memory", "MosaicLaunch", "PallasCall",
    "ProgramCost", "collectives", "compile_gpu", "gpu_devices", "kernel_launches", "kernel_name", "kernel_ptx",
    "launch_counts", "memory", "mosaic_launches", "op_class_costs", "op_class_launches", "pallas_calls",
    "program_cost", "ptxas_path", "register_spills", "report", "shape_bytes", "target_config",
]
