"""The environment of a test's subprocess on virtual CPU devices.

JAX fixes a process's device count when it initializes its backends, so the tests that need a mesh
run their checks in a subprocess started with `--xla_force_host_platform_device_count`, and the
rest of the suite keeps one device.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def virtual_devices_env(count: int) -> dict[str, str]:
    """This process's environment for a subprocess that sees `count` CPU devices: conftest's
    `XLA_FLAGS` (its cheaper code generation, which both sides of a comparison then share) plus the
    device count, `JAX_PLATFORMS=cpu`, and the repository first on `PYTHONPATH`, so the subprocess
    imports the jaxspec this process imported."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    path = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
