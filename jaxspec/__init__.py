"""jaxspec: lossless speculative decoding for DeepSeek-V3 / V3.2 in JAX.

The public names are imported lazily so that `jaxspec.config`, `jaxspec.cache` and the
`jaxspec.pallas_kernels` / `jaxspec.models` subpackages load without the engine.
"""

import importlib

_PUBLIC = {
    "ModelConfig": "jaxspec.config",
    "DecodeConfig": "jaxspec.config",
    "preset": "jaxspec.config",
    "PagedCache": "jaxspec.cache",
    "init_cache": "jaxspec.cache",
    "DeepseekV3": "jaxspec.models",
    "generate": "jaxspec.generate",
    "GenerateResult": "jaxspec.generate",
    "init_state": "jaxspec.loop",
    "step": "jaxspec.loop",
    "DecodeState": "jaxspec.loop",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")
