"""jaxspec: lossless speculative decoding for DeepSeek-V3 / V3.2 / V4 in JAX.

The public API (each name's docstring gives its arguments, shapes and errors):

    ModelConfig, preset        model shapes from a Hugging Face config.json, or a named preset
    DeepseekV3                 the Flax NNX model of V3 / V3.2 (target + MTP draft module)
    DeepseekV4                 the V4 model (sliding / CSA / HCA attention, mHC, hash MoE, MTP)
    DecodeConfig               draft length or tree, sampling, token budget, cache geometry, backend
    generate                   prompts -> GenerateResult, one jitted prefill + while_loop
    compile_generate           `generate` compiled ahead of time, returns a runner
    GenerateResult             emitted tokens and speculative statistics
    init_state, step           the same loop driven one speculative step at a time
    DecodeState                the loop carry that `init_state` / `step` pass around
    PagedCache, init_cache     the paged MLA / indexer cache (V3 / V3.2)
    V4Cache                    V4's paged rings and compressed entries (`model.init_cache`)
    restore_model, save_model  orbax checkpoints of a model

    from jaxspec import DecodeConfig, DeepseekV3, generate, preset

The names resolve lazily (PEP 562 `__getattr__`), so `import jaxspec` and the leaf modules
(`jaxspec.model_config`, `jaxspec.presets`, `jaxspec.decode_config`, `jaxspec.cache`,
`jaxspec.pallas_kernels`) load without flax or the engine. No
public name is also a submodule name: importing a submodule binds it as an attribute of this
package, and a function and a module under one name would make `from jaxspec import generate`
return whichever was bound last (the module `jaxspec/generate.py` did exactly that; it is now
`jaxspec/generation.py`). Each name is cached in the package namespace on first use.
"""

import importlib

_PUBLIC = {
    "ModelConfig": "jaxspec.model_config",
    "DecodeConfig": "jaxspec.decode_config",
    "preset": "jaxspec.presets",
    "PagedCache": "jaxspec.cache",
    "init_cache": "jaxspec.cache",
    "DeepseekV3": "jaxspec.models",
    "DeepseekV4": "jaxspec.models",
    "V4Cache": "jaxspec.cache_v4",
    "generate": "jaxspec.generation",
    "compile_generate": "jaxspec.generation",
    "GenerateResult": "jaxspec.generation",
    "init_state": "jaxspec.loop",
    "step": "jaxspec.loop",
    "DecodeState": "jaxspec.loop",
    "restore_model": "jaxspec.orbax_io",
    "save_model": "jaxspec.orbax_io",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
