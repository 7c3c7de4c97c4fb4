"""The Pallas lowerings for CUDA on a host without a GPU, as the kernel tests check them: Triton's
StableHLO, and the PTX and ptxas report of a Mosaic GPU kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax

from jaxspec.pallas_kernels.backend import gpu_lowering
from virtual_devices import virtual_devices_env


def triton_calls(fn, *args, **kwargs) -> list[str]:
    """The lines of `fn(*args, **kwargs)`'s StableHLO, lowered for CUDA, that launch a Triton kernel.

    The lowering runs inside `gpu_lowering()`, which names an H100 as the abstract device: jax 0.11's
    Triton lowering asks for the device's compute capability, and a CPU host has none."""
    with gpu_lowering():
        text = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
    return [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]


def mosaic_gpu_dump(directory: Path, probe: str, kernel: str) -> tuple[str, str]:
    """Run `probe` (Python source that compiles a Mosaic GPU kernel for sm_90a, `jaxspec.aot`) in
    a process of its own, whose Mosaic GPU writes its dump into `directory`, and return the PTX and
    the ptxas report of the one kernel whose name starts with `kernel`. Mosaic GPU reads its dump
    settings when it is imported, hence the process."""
    env = {**virtual_devices_env(1), "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1",
           "MOSAIC_GPU_DUMP_TO": str(directory)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (ptx,) = Path(directory).glob(f"{kernel}*.ptx")
    (report,) = Path(directory).glob(f"{kernel}*.ptxas")
    return ptx.read_text(), report.read_text()
