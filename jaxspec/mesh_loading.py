"""A Hugging Face checkpoint read straight into the shards of a mesh, parameter by parameter.

`jaxspec.checkpoint.load_hf_checkpoint(dir, mesh=...)` plans the load as for one device (every
tensor checked against the model from the shard headers first) and then, instead of filling whole
parameters on one device, builds each parameter with `jax.make_array_from_callback`: JAX asks for
the block each of this process's devices holds, and the block is read from the safetensors files
and converted (transposed, FP8 dequantized or kept, cast) on the host. So

  * a device receives only its slice: a routed-expert stack split 8 ways reads 32 of its 256
    experts' tensors for each device, never the other 224;
  * a process of a multi-host run reads only the tensors its own devices hold;
  * the host holds one parameter's block at a time (a replicated parameter is read once and handed
    to each of this process's devices; a tensor that fills two parameters, transformers' fused
    `gate_up_proj`, is read for each). A stacked parameter (`models.stack`, layers first, that axis
    never split) is built one layer row at a time, each row written in place into the placed stack
    (`models.stack.write_row`), so the host holds one layer's block, never the whole stack's.

Conversion runs on the host here, where the one-device loader converts on the device, because a
block must arrive on its device already in its final layout.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import fp8, progress, shards
from jaxspec.models.stack import row_sharding, write_row


def _host_tensor(name: str, write, tensors: Mapping[str, shards.TensorInfo], block: tuple[int, int],
                 scale: bool, dtype) -> np.ndarray:
    """Checkpoint tensor `name` converted by `write` into the parameter's layout and `dtype` on the
    host: its FP8 weight as stored (`write.fp8`), its scale (`scale=True`), or a float tensor
    (FP8 dequantized)."""
    info = tensors[name]
    if scale:
        return np.asarray(write.convert(shards.read(tensors[name + fp8.SCALE_SUFFIX]))).astype(dtype)
    array = shards.read(info)
    if info.dtype in fp8.QUANTIZED_DTYPES and not write.fp8:
        array = np.asarray(fp8.dequantize(array, shards.read(tensors[name + fp8.SCALE_SUFFIX]), block))
    return np.asarray(write.convert(array)).astype(dtype)


def load_onto_mesh(loads: Sequence[tuple[str, list]], tensors: Mapping[str, shards.TensorInfo],
                   specs: Mapping[str, jax.ShapeDtypeStruct], placement: Mapping[str, jax.sharding.Sharding],
                   block: tuple[int, int], log: Callable[[str], None]) -> dict[str, jax.Array]:
    """Every parameter named in `loads` ((checkpoint tensor, its `checkpoint._Write`s) pairs, as
    `checkpoint._plan` made them) as a global array laid out by `placement[param]`, keyed by param
    path. specs: each parameter's shape and dtype. Progress goes to `log` every 10% of parameters."""
    # param -> the (tensor, write, is_scale) parts that fill it.
    parts: dict[str, list[tuple[str, object, bool]]] = {}
    for name, writes in loads:
        for w in writes:
            if w.shared:
                continue
            parts.setdefault(w.param, []).append((name, w, False))
            if w.fp8:
                parts.setdefault(w.param + fp8.SCALE_SUFFIX, []).append((name, w, True))

    values, start, done_bytes = {}, time.perf_counter(), 0
    report_every = max(1, len(parts) // 10)
    for count, (param, sources) in enumerate(progress.bar(parts.items(), "loading parameters", unit="param"), 1):
        spec = specs[param]
        if sources[0][1].layer is None:
            values[param] = _unit(sources, spec.shape, spec.dtype, placement[param], tensors, block)
        else:
            unit_sharding = row_sharding(placement[param])
            # jnp.zeros itself, not a lambda per parameter: stacks of one shape share a program.
            stack = jax.jit(jnp.zeros, static_argnums=(0, 1), out_shardings=placement[param])(spec.shape, spec.dtype)
            for row in range(spec.shape[0]):
                value = _unit([s for s in sources if s[1].layer == row], spec.shape[1:], spec.dtype, unit_sharding,
                              tensors, block)
                stack = write_row(stack, value, np.array([row], np.int32))
            values[param] = stack
        done_bytes += sum(s.data.nbytes for s in values[param].addressable_shards)
        if count % report_every == 0 or count == len(parts):
            log(f"[{count}/{len(parts)} parameters] {done_bytes / 2**30:.2f} GiB onto this process's devices "
                f"in {time.perf_counter() - start:.1f} s")
    return values


def _unit(sources: Sequence[tuple[str, object, bool]], shape: tuple[int, ...], dtype,
          sharding: jax.sharding.Sharding, tensors: Mapping[str, shards.TensorInfo],
          block: tuple[int, int]) -> jax.Array:
    """One parameter, or one layer row of a stacked one, of `shape` laid out by `sharding`, from its
    (tensor, write, is_scale) `sources`: one whole tensor, or one per expert (leading axis)."""
    if sources[0][1].expert is None:
        whole: dict[str, np.ndarray] = {}  # replicated: read once for all local devices

        def block_of(index: tuple[slice, ...]) -> np.ndarray:
            if "value" not in whole:
                name, w, scale = sources[0]
                whole["value"] = _host_tensor(name, w, tensors, block, scale, dtype)
            return whole["value"][index]
    else:
        by_expert = {w.expert: (name, w, scale) for name, w, scale in sources}

        def block_of(index: tuple[slice, ...]) -> np.ndarray:
            experts = range(shape[0])[index[0]]
            stack = np.stack([_host_tensor(*by_expert[e][:2], tensors, block, by_expert[e][2], dtype)
                              for e in experts])
            return stack[(slice(None), *index[1:])]

    return jax.make_array_from_callback(shape, sharding, block_of)
