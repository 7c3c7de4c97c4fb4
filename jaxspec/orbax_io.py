"""Saving and restoring a `DeepseekV3` as an orbax checkpoint plus its Hugging Face `config.json`.

A saved model is a directory:

    config.json    ModelConfig.to_hf() (plus `torch_dtype`, the storage dtype, for information)
    params/        an orbax (OCDBT) checkpoint of a flat dict {"moe_layers.self_attn.o_proj.weight": array, ...}

The params are keyed by their dotted NNX path (the same names as `nnx.state(model, nnx.Param)`),
flat so the files carry no integer-keyed pytree structure and any tool that reads an orbax
checkpoint sees the Hugging Face-like parameter names. The decoder layers are stacked
(`models.stack`): `moe_layers.self_attn.o_proj.weight` is [n, in, out], row r being layer
`start + r` of its run (`jaxspec.models.layer_runs`). Arrays may be stored in a narrower dtype
(bfloat16 halves the size) and are cast back to the model's parameter dtypes on restore.

Saves from before the layers were stacked hold one array per layer (`layers.{i}.<path>`):
`restore_model` stacks them as it reads them (each layer's array read once, onto its devices),
and `jaxspec convert OLD NEW` rewrites such a save in today's layout.

    save_model(model, "ckpt/", dtype=jnp.bfloat16)
    model = restore_model("ckpt/")                    # float32 parameters
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from jaxspec import progress, sharding
from jaxspec.model_config import ModelConfig
from jaxspec.models import DeepseekV3, layer_runs, model_class
from jaxspec.models.stack import row_sharding

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
# A parameter of one layer as saves wrote it before the layers were stacked.
_PER_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _param_name(path) -> str:
    return ".".join(str(part) for part in path)


def abstract_model(config: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State, dict[str, nnx.Variable]]:
    """The model's structure without allocating it (`nnx.eval_shape`, no random init): graphdef,
    abstract state, and each abstract parameter by dotted path (`moe_layers.self_attn.o_proj.weight`)."""
    abstract = nnx.eval_shape(lambda: model_class(config)(config, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(abstract)
    return graphdef, state, {_param_name(path): variable for path, variable in nnx.to_flat_state(state)}


def param_placement(state: nnx.State, mesh: jax.sharding.Mesh, plan: str) -> dict[str, jax.sharding.Sharding]:
    """Each parameter's sharding on `mesh` under `plan` (`jaxspec.sharding.param_shardings`), by
    dotted path: the form both loaders address parameters by."""
    shardings = sharding.param_shardings(state, mesh, plan)
    return {_param_name(path): variable.get_value() for path, variable in nnx.to_flat_state(shardings)}


def save_model(model: DeepseekV3, directory: str | os.PathLike, *, dtype=None) -> None:
    """Write `model`'s config and parameters to `directory` (created; an existing save is replaced).

    dtype: storage dtype for floating-point parameters (e.g. `jnp.bfloat16`); None keeps each
    parameter's own dtype. Several processes (a multi-host mesh): every process calls it with the
    same `directory` on a file system they share; each writes its own devices' shards.
    """
    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    params = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = variable.get_value()
        if dtype is not None and jnp.issubdtype(value.dtype, jnp.floating):
            value = value.astype(dtype)
        params[_param_name(path)] = value
    config = model.config.to_hf()
    config["torch_dtype"] = str(jnp.dtype(dtype if dtype is not None else model.dtype))
    if jax.process_index() == 0:  # one writer; orbax's save below waits for every process
        with open(os.path.join(directory, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(directory, PARAMS_DIR), params, force=True)


def _holds_fp8_scales(names) -> bool:
    """Whether stored parameter `names` include FP8 weights' 128 x 128 block scales."""
    return any(name.endswith("_scale_inv") for name in names)


def saved_dtype(directory: str | os.PathLike) -> jnp.dtype:
    """The dtype to restore `directory`'s save in without changing it: float8_e4m3fn for a save
    of FP8 weights (it holds their `_scale_inv` block scales; such a model computes in bfloat16,
    which its config.json names), else config.json's `torch_dtype`, float32 where a save does not
    say (which holds any floating-point save exactly)."""
    directory = os.fspath(directory)
    with ocp.StandardCheckpointer() as checkpointer:
        names = checkpointer.metadata(os.path.abspath(os.path.join(directory, PARAMS_DIR))).item_metadata.keys()
    if _holds_fp8_scales(names):
        return jnp.dtype(jnp.float8_e4m3fn)
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        return jnp.dtype(json.load(f).get("torch_dtype", "float32"))


def _stacked(*rows: jax.Array) -> jax.Array:
    """A per-layer save's rows of one parameter as its stack [n, ...]. One function for every
    parameter, so that parameters of one shape and layer count share one compiled program (a lambda
    per parameter compiled a program each: a trained 4-layer tiny V4 saved in this layout took
    7.7 s and 120 programs to restore that way, 2.4 s and 21 programs this way)."""
    return jnp.stack(rows)


def restore_model(directory: str | os.PathLike, *, dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None,
                  plan: str = sharding.DEFAULT_PLAN, log: Callable[[str], None] = progress.write) -> DeepseekV3:
    """Build the model `directory/config.json` describes and load its parameters.

    The model is built abstractly (`nnx.eval_shape`, no random init), then every parameter is read
    from the orbax checkpoint and cast to the dtype the model declares for it (`dtype` for the
    weights; the MoE router stays float32). Raises `ValueError` listing every missing, unexpected
    or mis-shaped parameter when the checkpoint does not match the config.

    mesh: a `jaxspec.sharding` mesh to restore onto, each parameter split as `plan` says: orbax reads each device's slice straight into it, so no
    device (and, on several hosts, no process) ever holds more than its own shards. None: the
    whole model on this process's first device.

    A save in the per-layer layout of older versions (`layers.{i}.<path>`) is restacked as it is
    read, and `log` (default: stderr) says so, naming `jaxspec convert`, which rewrites it once.
    """
    directory = os.path.abspath(os.fspath(directory))
    config_path = os.path.join(directory, CONFIG_FILE)
    params_path = os.path.join(directory, PARAMS_DIR)
    if not os.path.isfile(config_path) or not os.path.isdir(params_path):
        raise ValueError(f"{directory} is not a saved model: expected {CONFIG_FILE} and {PARAMS_DIR}/ in it")
    config = ModelConfig.from_hf(config_path)
    graphdef, abstract_state, expected = abstract_model(config, dtype)
    if mesh is None:
        # Onto this process's default device, whatever device the checkpoint was written from.
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        placement = dict.fromkeys(expected, device)
    else:
        placement = param_placement(abstract_state, mesh, plan)

    with ocp.StandardCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(params_path).item_metadata
        if metadata is None:
            raise ValueError(f"{params_path} holds no complete orbax save (no array metadata: an interrupted save?); "
                             "save the model again")
        stored = {name: (tuple(meta.shape), meta.dtype) for name, meta in metadata.items()}
        sources = _per_layer_sources(config, stored)
        if sources:
            log(f"{directory} holds one array per decoder layer (saved before the layers were stacked): "
                f"stacking them as they are read; `jaxspec convert {directory} NEW` rewrites it in today's "
                "layout, which restores without this step")
        row_of = {row: name for name, rows in sources.items() for row in rows}
        available = {name: shape for name, (shape, _) in stored.items() if name not in row_of}
        available.update({name: (len(rows), *stored[rows[0]][0]) for name, rows in sources.items()})
        problems = [f"missing {name} {tuple(expected[name].shape)}" for name in sorted(expected.keys() - available.keys())]
        problems += [f"unexpected {name} {available[name]}" for name in sorted(available.keys() - expected.keys())]
        problems += [f"{name}: checkpoint {available[name]} != model {tuple(expected[name].shape)}"
                     for name in sorted(expected.keys() & available.keys())
                     if available[name] != tuple(expected[name].shape)]
        if jnp.dtype(dtype) == jnp.float8_e4m3fn and not _holds_fp8_scales(stored):
            raise ValueError(f"dtype=float8_e4m3fn restores FP8 weights with their scales, but {params_path} was saved "
                             "without them (from a float model): restore it with dtype=bfloat16, or convert the "
                             "Hugging Face checkpoint again with `jaxspec convert --dtype fp8`")
        if problems:
            raise ValueError(f"checkpoint {params_path} does not match its config.json ({len(problems)} problem(s)):\n  "
                             + "\n  ".join(problems))
        target = {name: jax.ShapeDtypeStruct(shape, dtype_,
                                             sharding=row_sharding(placement[row_of[name]]) if name in row_of
                                             else placement[name])
                  for name, (shape, dtype_) in stored.items()}
        restored = checkpointer.restore(params_path, target)
    for name, rows in sources.items():
        restored[name] = jax.jit(_stacked, out_shardings=placement[name])(*(restored.pop(row) for row in rows))

    state = nnx.from_flat_state({
        path: variable.replace(restored[_param_name(path)].astype(variable.get_value().dtype))
        for path, variable in nnx.to_flat_state(abstract_state)})
    return nnx.merge(graphdef, state)


def _per_layer_sources(config: ModelConfig, stored: dict) -> dict[str, list[str]]:
    """For a save written before the layers were stacked (names `layers.{i}.<path>`): each stacked
    parameter's name -> the per-layer names of its rows, in order. {} for a save in today's layout,
    and for a model without layer stacks (`layer_runs` empty: its `layers.{i}.` names are its own)."""
    runs = layer_runs(config)
    if not runs:
        return {}
    per_layer = {}
    for name in stored:
        if match := _PER_LAYER.fullmatch(name):
            per_layer.setdefault(int(match[1]), set()).add(match[2])
    sources: dict[str, list[str]] = {}
    for run in runs:
        for layer in range(run.start, run.stop):
            prefix, _ = run.locate(layer)
            for rest in sorted(per_layer.pop(layer, ())):
                sources.setdefault(prefix + rest, []).append(f"layers.{layer}.{rest}")
    if per_layer:
        raise ValueError(f"the save holds layers {sorted(per_layer)} that the config's {config.num_hidden_layers} "
                         "decoder layers do not have")
    return sources

