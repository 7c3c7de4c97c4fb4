"""Which JAX platform an entry point runs on when the user names none.

JAX's CUDA plugin is in many environments that have no NVIDIA driver: the test command installs
it (`jaxspec aot` compiles for H100/H200 on a CPU-only host with it), and so does the `cuda12`
extra. JAX discovers every installed plugin on each run, and when no platform is named the plugin
checks the driver, fails `cuInit(0)` and logs a ten-line "Jax plugin configuration error"
traceback before JAX falls back to the CPU. Nothing is wrong, yet every run looks broken.

An install-time fix (the plugin in an extra of its own) would not help: the tests and the user's
runs share one environment, so whatever installs the plugin for the tests puts it in the way of
every later run. So the entry points (`examples/generate.py`, `examples/train_tiny.py`, the
`jaxspec` command line, the CPU benchmarks; a notebook may call it too) choose the platform
themselves, before JAX initializes its backends: the CPU, exactly when a CUDA plugin is installed
and no NVIDIA driver answers. The plugin then skips its driver check and still registers, so
deviceless GPU compiles keep working. `import jaxspec` changes no global setting, and a user's
own `JAX_PLATFORMS` (or `jax.config.update("jax_platforms", ...)`) always wins.
"""

from __future__ import annotations

import ctypes
import importlib.util

CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def cuda_plugin_installed() -> bool:
    """Whether one of JAX's CUDA plugins (`jax[cuda12]`, `jax[cuda13]`) is installed."""
    try:
        return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)
    except ModuleNotFoundError:  # no `jax_plugins` namespace at all
        return False


def nvidia_driver_present() -> bool:
    """Whether an NVIDIA driver answers: `libcuda.so.1` loads and `cuInit(0)` succeeds.

    That is the call the CUDA plugin's check fails on, so it is the exact condition; it is false
    where the library is absent (a CPU-only host) and where it finds no device (no GPU, or
    `CUDA_VISIBLE_DEVICES=""`). On a GPU host it initializes the driver JAX initializes next.
    """
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return libcuda.cuInit(0) == 0  # CUDA_SUCCESS


def use_cpu_without_nvidia_driver() -> bool:
    """Make the CPU JAX's platform when none is chosen, a CUDA plugin is installed and no NVIDIA
    driver answers; returns whether it did. Call it before the first computation: JAX reads the
    setting when it initializes its backends."""
    import jax

    if jax.config.jax_platforms or not cuda_plugin_installed() or nvidia_driver_present():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
