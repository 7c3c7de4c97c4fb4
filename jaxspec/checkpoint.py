"""Hugging Face DeepSeek-V3 / V3.2 / V4 checkpoint directories loaded into a model, tensor by tensor.

    model = load_hf_checkpoint("DeepSeek-V3.2-Exp/", dtype=jnp.bfloat16)
    model = load_model(path)      # a Hugging Face directory, or one written by `jaxspec convert`

A directory holds `config.json` and `model.safetensors` (or shards listed by
`model.safetensors.index.json`), as DeepSeek releases them or as transformers' `save_pretrained`
writes them. Checkpoint names map to parameter paths (`nnx.state(model)`) as follows; every 2-D
weight is transposed from the checkpoint's [out, in] to our [in, out]:

    model.embed_tokens.weight                       -> embed_tokens.embedding
    lm_head.weight, model.norm.weight               -> lm_head.weight, norm.weight
    model.layers.{i}.<path>  (i < num_hidden_layers) -> row r of <run>.<path>, where the decoder's
        layer stacks hold layer i (`jaxspec.models.layer_runs(config)`, `LayerRun.locate(i)`: layer
        i < first_k_dense_replace is row i of `dense_layers.`, any other row i - first_k_dense_replace
        of `moe_layers.`), except
        mlp.gate.weight, mlp.gate.e_score_correction_bias -> mlp.gate_weight, mlp.e_score_correction_bias
        mlp.experts.{e}.{gate,up,down}_proj.weight  -> [r, e] of mlp.experts_{gate,up,down}_proj [n, E, in, out]
        mlp.experts.gate_up_proj [E, 2I, D], mlp.experts.down_proj [E, D, I]
                                                    -> row r of the same, from transformers' fused form
    model.layers.{N}.<path>  (N = num_hidden_layers, the MTP layer):
        enorm, hnorm, eh_proj, shared_head.norm     -> mtp.enorm, mtp.hnorm, mtp.eh_proj, mtp.shared_head_norm
        embed_tokens, shared_head.head              -> none: DeepSeek shares them with the target, so
                                                       they are shape-checked and not read
        anything else (the decoder block)           -> mtp.block.<path>, as for a layer

DeepSeek-V4 directories (`model_type` "deepseek_v4") hold DeepSeek's own names (`layers.{i}.attn.wq_a`,
`mtp.0.e_proj`, `<module>.scale`, ...) or the ones transformers' `save_pretrained` writes
(`model.layers.{i}.attn.wq_a`, ...): `jaxspec.checkpoint_v4` renames them to transformers' modules
(which our V4 tree mirrors), and then

    model.embed_tokens.weight, lm_head.weight, model.norm.weight -> as for V3
    model.hc_head.<p>                               -> hc_head.<p>
    model.layers.{i}.<path>                         -> row r of <run>.<path> (the layer's stack, as
        for V3; V4's runs are `layer_groups.{k}.` or, for a two-layer unit, `layer_groups.{k}.{j}.`):
        `.weight`s as for V3 (2-D transposed, experts stacked, router renamed), mlp.gate.tid2eid
        -> mlp.tid2eid, and the raw parameters (sinks, position_bias, attn_hc.*, ffn_hc.*) as stored
    mtp.0.{enorm, hnorm, e_proj, h_proj, norm}.weight, mtp.0.hc_head.<p>
                                                    -> mtp.<same>; the rest of mtp.0. -> mtp.block.<path>
    (no embedding or head under mtp.0.: V4's MTP uses the target's)

FP8 weights (`float8_e4m3fn` + `<name>_scale_inv`) are dequantized by `jaxspec.fp8` into a float
`dtype`. With `dtype=jnp.float8_e4m3fn` they stay as they are: the model is built in DeepSeek's FP8
layout (`jaxspec.fp8` lists its FP8 weights), each FP8 weight fills its parameter as stored and its
scale, transposed like the weight, fills `<parameter>_scale_inv` (per-expert scales their row of
`mlp.experts_*_proj_scale_inv`); a checkpoint without FP8 weights, with other than 128 x 128
blocks, or with a weight in bf16 that the layout has in FP8 is refused before anything is read.
A checkpoint without any `model.layers.{N}.` (V4: `mtp.0.`) tensor loads with the MTP module off (and
says so). V4-Flash's and -Pro's routed experts are MXFP4 (int8 + `float8_e8m0fnu` scales, `jaxspec.fp8`):
dequantized into a float dtype; an FP8-layout model cannot keep them and refuses them (V4-Flash-Base's
FP8 experts it keeps).

Everything is checked from the shard headers before any tensor is read: missing, unexpected and
mis-shaped tensors raise one `ValueError` listing them by the checkpoint's own names, so a load
never half-succeeds. Then shards are read one after the other, each tensor read, moved to the
device and converted there (FP8 dequantized, transposed, cast) before the next is touched: memory
beyond the model itself stays at a few copies of the largest tensor, far below one shard (a
layer's tensors, and each expert's, are written into their row of the stacked parameter in place,
through a donated buffer: `models.stack.write_row`). Progress goes to `log` (default:
stderr), a line per shard, and to a bar of shards on stderr when it is a terminal (`jaxspec.progress`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec import checkpoint_v4, fp8, progress, sharding, shards
from jaxspec.mesh_loading import load_onto_mesh
from jaxspec.model_config import ModelConfig
from jaxspec.models import DeepseekV3, layer_runs
from jaxspec.models.stack import LayerRun, run_of, write_row
from jaxspec.orbax_io import PARAMS_DIR, abstract_model, param_placement, restore_model

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_V4_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_V4_MTP_OWN = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight",
               "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_TOP_LEVEL = {"model.embed_tokens.weight": "embed_tokens.embedding", "lm_head.weight": "lm_head.weight",
              "model.norm.weight": "norm.weight"}
_MTP_OWN = {"enorm.weight": "mtp.enorm.weight", "hnorm.weight": "mtp.hnorm.weight",
            "eh_proj.weight": "mtp.eh_proj.weight", "shared_head.norm.weight": "mtp.shared_head_norm.weight"}
_MTP_SHARED = {"embed_tokens.weight": "embed_tokens.embedding", "shared_head.head.weight": "lm_head.weight"}
_ROUTER = {"mlp.gate.weight": "mlp.gate_weight", "mlp.gate.e_score_correction_bias": "mlp.e_score_correction_bias"}
# Buffers some older exports include; they are recomputed from the config.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)
_SHOWN_PER_KIND = 8
# Conversions run on device arrays when loading, and on zero-byte numpy views to check shapes.
Array = jax.Array | np.ndarray


def _stderr(line: str) -> None:
    progress.write(line)


# -- checkpoint layout -> ours --------------------------------------------------------------------

def _as_is(array: Array) -> Array:
    return array


def _transposed(array: Array) -> Array:
    """[out, in] -> [in, out]; 1-D tensors (norms, biases) unchanged."""
    return array.T if array.ndim == 2 else array


def _experts_transposed(array: Array) -> Array:
    """[E, out, in] -> [E, in, out]."""
    return array.transpose(0, 2, 1)


def _fused_gate(array: Array) -> Array:
    """transformers' gate_up_proj [E, 2I, D]: the gate is its first I rows -> [E, D, I]."""
    return array[:, : array.shape[1] // 2].transpose(0, 2, 1)


def _fused_up(array: Array) -> Array:
    return array[:, array.shape[1] // 2:].transpose(0, 2, 1)


_FUSED = {"mlp.experts.gate_up_proj": (("mlp.experts_gate_proj", _fused_gate), ("mlp.experts_up_proj", _fused_up)),
          "mlp.experts.down_proj": (("mlp.experts_down_proj", _experts_transposed),)}


@dataclasses.dataclass(frozen=True)
class _Write:
    """The part of parameter `param` one checkpoint tensor fills, and how to convert it."""

    param: str
    convert: Callable[[Array], Array]
    expert: int | None = None  # the expert of a per-expert tensor; None = all of the parameter's experts
    shared: bool = False       # a duplicate of a target parameter: shape-checked, never read
    fp8: bool = False          # kept FP8: the tensor's scale fills `param + "_scale_inv"` the same way
    layer: int | None = None   # the row of a layer stack (`models.stack`); None = an unstacked parameter

    @property
    def index(self) -> tuple[int, ...]:
        """The leading indices of `param` this tensor fills: (), (layer row,), (expert,) or (row, expert)."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def _block_writes(prefix: str, rest: str, layer: int | None = None) -> list[_Write]:
    """A decoder block's tensor `rest` (relative to its layer) -> writes under parameter path
    `prefix`, into row `layer` of a layer stack (None: the block is not stacked, the MTP's)."""
    if match := _EXPERT.fullmatch(rest):
        return [_Write(f"{prefix}mlp.experts_{match[2]}", _transposed, expert=int(match[1]), layer=layer)]
    if rest in _FUSED:
        return [_Write(prefix + param, convert, layer=layer) for param, convert in _FUSED[rest]]
    return [_Write(prefix + _ROUTER.get(rest, rest), _transposed, layer=layer)]


def _v4_block_writes(prefix: str, rest: str, layer: int | None = None) -> list[_Write]:
    """A V4 block's tensor (transformers' name `rest`) -> writes under `prefix` (into row `layer` of
    a layer stack; None: the MTP's block): Linear weights, norms and the MoE as V3's; the hash table
    and the raw parameters (sinks, position_bias, attn_hc.*, ffn_hc.*) as stored."""
    if rest == "mlp.gate.tid2eid":
        return [_Write(prefix + "mlp.tid2eid", _as_is, layer=layer)]
    if rest.endswith(".weight") or rest in _ROUTER:
        return _block_writes(prefix, rest, layer)
    return [_Write(prefix + rest, _as_is, layer=layer)]


def _located(config: ModelConfig, layer: int) -> tuple[str, int]:
    """Decoder layer `layer`'s stack prefix and row (`LayerRun.locate` of the run holding it)."""
    _, run = run_of(layer_runs(config), layer, config.num_hidden_layers)
    return run.locate(layer)


def _v4_writes(name: str, config: ModelConfig) -> list[_Write]:
    """`_writes` for DeepSeek-V4, `name` in transformers' form (`checkpoint_v4.to_transformers`)."""
    if name.startswith("model.hc_head."):
        return [_Write(name.removeprefix("model."), _as_is)]
    if match := _LAYER.fullmatch(name):
        layer = int(match[1])
        if layer >= config.num_hidden_layers:
            return []
        prefix, row = _located(config, layer)
        return _v4_block_writes(prefix, match[2], row)
    if (match := _V4_MTP.fullmatch(name)) and int(match[1]) < min(config.num_nextn_predict_layers, 1):
        if match[2] in _V4_MTP_OWN:
            return [_Write("mtp." + match[2], _transposed if match[2].endswith(".weight") else _as_is)]
        return _v4_block_writes("mtp.block.", match[2])
    return []


def _writes(name: str, config: ModelConfig) -> list[_Write]:
    """What checkpoint tensor `name` fills (unchecked: a parameter name may not exist)."""
    if name in _TOP_LEVEL:
        return [_Write(_TOP_LEVEL[name], _as_is if name == "model.embed_tokens.weight" else _transposed)]
    if config.is_v4:
        return _v4_writes(name, config)
    match = _LAYER.fullmatch(name)
    if match is None:
        return []
    layer, rest = int(match[1]), match[2]
    if layer < config.num_hidden_layers:
        prefix, row = _located(config, layer)
        return _block_writes(prefix, rest, row)
    if layer == config.num_hidden_layers and config.num_nextn_predict_layers > 0:
        if rest in _MTP_OWN:
            return [_Write(_MTP_OWN[rest], _transposed)]
        if rest in _MTP_SHARED:
            param = _MTP_SHARED[rest]
            return [_Write(param, _as_is if param == "embed_tokens.embedding" else _transposed, shared=True)]
        return _block_writes("mtp.block.", rest)
    return []


def _converted_shape(write: _Write, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape `write.convert` gives a (dequantized) tensor of `shape`, computed on a zero-byte view."""
    try:
        return write.convert(np.broadcast_to(np.int8(0), shape)).shape
    except ValueError:  # e.g. a 2-D tensor where the fused [E, ...] form is expected
        return None


# -- the plan: every tensor checked against the model before anything is read --------------------

@dataclasses.dataclass
class _Plan:
    """The tensors to read (each with the parameter parts it fills) and, one line each, what is wrong."""

    loads: list[tuple[str, list[_Write]]] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    misshaped: list[str] = dataclasses.field(default_factory=list)
    not_fp8: list[str] = dataclasses.field(default_factory=list)

    def report(self, directory: str) -> str | None:
        groups = {"missing": self.missing, "unexpected": self.unexpected, "mis-shaped": self.misshaped,
                  "not FP8": self.not_fp8}
        if not any(groups.values()):
            return None
        counts = ", ".join(f"{len(items)} {kind}" for kind, items in groups.items() if items)
        lines = [f"checkpoint {directory} does not match its config.json ({counts} tensor(s)):"]
        for kind, items in groups.items():
            lines += [f"  {kind}: {item}" for item in items[:_SHOWN_PER_KIND]]
            if len(items) > _SHOWN_PER_KIND:
                lines.append(f"  ... and {len(items) - _SHOWN_PER_KIND} more {kind}")
        return "\n".join(lines)


def _plan(tensors: Mapping[str, shards.TensorInfo], expected: Mapping[str, jax.ShapeDtypeStruct],
          config: ModelConfig, block: tuple[int, int], origin: Mapping[str, str] | None = None) -> _Plan:
    """Match every checkpoint tensor (from its header) to the parameters `expected` by path.
    origin: the checkpoint's own name of a renamed tensor (V4), shown beside it in the report."""
    plan = _Plan()
    filled: dict[str, list[tuple[int | None, int | None]]] = {}  # param -> the (layer row, expert) of each part

    def label(name: str) -> str:
        own = (origin or {}).get(name)
        return name if own is None else f"{own} (= {name})"

    for name, info in sorted(tensors.items()):
        if name.endswith(fp8.SCALE_SUFFIX):
            weight = tensors.get(name[: -len(fp8.SCALE_SUFFIX)])
            if weight is None or weight.dtype not in fp8.QUANTIZED_DTYPES:
                plan.unexpected.append(f"{label(name)} {info.describe()} (a scale without an FP8 or FP4 weight)")
            continue
        if name.endswith(_DERIVED_SUFFIXES):
            continue
        writes = _writes(name, config)
        if not writes or any(w.param not in expected for w in writes):
            plan.unexpected.append(f"{label(name)} {info.describe()}")
            continue
        # An FP8-layout model has a scale beside each parameter it keeps in FP8.
        writes = [dataclasses.replace(w, fp8=w.param + fp8.SCALE_SUFFIX in expected) for w in writes]
        # Counted before the checks below, so a bad tensor is reported once, not also as missing.
        for w in writes:
            if not w.shared:
                filled.setdefault(w.param, []).append((w.layer, w.expert))
            if w.fp8:
                filled.setdefault(w.param + fp8.SCALE_SUFFIX, []).append((w.layer, w.expert))
        if any(w.fp8 for w in writes) and info.dtype not in fp8.FP8_DTYPES:
            why = ("MXFP4 (int8) has no lossless FP8 form: load with dtype=bfloat16" if info.dtype in fp8.FP4_DTYPES
                   else "FP8 with a scale in DeepSeek's layout (jaxspec.fp8), as a float8_e4m3fn model keeps it")
            plan.not_fp8.append(f"{label(name)} {info.describe()}: {why}")
            continue
        if info.dtype in fp8.QUANTIZED_DTYPES:
            scale = tensors.get(name + fp8.SCALE_SUFFIX)
            want = list(fp8.scale_shape(info.shape, block, info.dtype))
            if scale is None:
                kind = "FP4" if info.dtype in fp8.FP4_DTYPES else "FP8"
                plan.missing.append(f"{label(name + fp8.SCALE_SUFFIX)} {want} (the scale of {kind} {label(name)})")
                continue
            if list(scale.shape) != want:
                blocks = f"1x{fp8.FP4_BLOCK}" if info.dtype in fp8.FP4_DTYPES else f"{block[0]}x{block[1]}"
                plan.misshaped.append(f"{label(name + fp8.SCALE_SUFFIX)} {list(scale.shape)}: expected {want} "
                                      f"for {list(info.shape)} {info.dtype} in {blocks} blocks")
                continue
        bad = []
        shape = fp8.logical_shape(info.shape, info.dtype)
        for w in writes:
            param = expected[w.param]
            want = param.shape[len(w.index):]
            got = _converted_shape(w, shape)
            if got != tuple(want) or any(i >= n for i, n in zip(w.index, param.shape)):
                row = f" {list(w.index)} of" if w.index else ""
                bad.append(f"{label(name)} {list(shape)} does not fit{row} {w.param} {list(param.shape)}")
            elif w.fp8:
                scale_param = expected[w.param + fp8.SCALE_SUFFIX]
                scale_want = scale_param.shape[len(w.index):]
                scale_got = _converted_shape(w, tensors[name + fp8.SCALE_SUFFIX].shape)
                if scale_got != tuple(scale_want):
                    bad.append(f"{label(name + fp8.SCALE_SUFFIX)} {list(tensors[name + fp8.SCALE_SUFFIX].shape)} does not fit "
                               f"{w.param}{fp8.SCALE_SUFFIX} {list(scale_param.shape)}")
        if bad:
            plan.misshaped += bad
            continue
        plan.loads.append((name, writes))

    runs = layer_runs(config)
    for param, spec in sorted(expected.items()):
        by_row: dict[int | None, list[int | None]] = {}
        for row, expert in filled.get(param, []):
            by_row.setdefault(row, []).append(expert)
        stack = _stack_of(param, runs)
        for row in [None] if stack is None else range(spec.shape[0]):
            # Named as the checkpoint names the row's tensor (a stack's row is one layer's).
            where = param if row is None else f"{_checkpoint_name(stack[1](row), param.removeprefix(stack[0]))} " \
                                              f"(row {row} of {param})"
            experts = by_row.get(row, [])
            if not experts:
                plan.missing.append(f"{where} {list(spec.shape)}")
            elif experts != [None]:
                rows = sorted(e for e in experts if e is not None)
                count = spec.shape[0 if row is None else 1]
                if None in experts or len(rows) != len(set(rows)):
                    plan.unexpected.append(f"{where} is given more than once (fused and per-expert, or twice)")
                elif len(rows) != count:
                    absent = sorted(set(range(count)) - set(rows))
                    plan.missing.append(f"{where}: experts {absent[:10]}{' ...' if len(absent) > 10 else ''} "
                                        f"of {count}")
    return plan


def _stack_of(param: str, runs: tuple[LayerRun, ...]) -> tuple[str, Callable[[int], int]] | None:
    """For a parameter of a layer stack: (its unit's path prefix, row -> the decoder layer that row
    holds); None for a parameter outside the stacks."""
    for run in runs:
        for offset in range(run.period):
            prefix = run.locate(run.start + offset)[0]
            if param.startswith(prefix):
                return prefix, lambda row, run=run, offset=offset: run.start + row * run.period + offset
    return None


def _checkpoint_name(layer: int, rest: str) -> str:
    """The checkpoint's name of decoder layer `layer`'s block parameter `rest` (experts as `{e}`),
    for the error report: the inverse of `_block_writes`."""
    base = rest.removesuffix(fp8.SCALE_SUFFIX)
    if base.startswith("mlp.experts_"):
        base = f"mlp.experts.{{e}}.{base.removeprefix('mlp.experts_')}.weight"
    base = {param: name for name, param in _ROUTER.items()}.get(base, base)
    return f"model.layers.{layer}.{base}{fp8.SCALE_SUFFIX if rest.endswith(fp8.SCALE_SUFFIX) else ''}"


# -- reading --------------------------------------------------------------------------------------

def _read(name: str, tensors: Mapping[str, shards.TensorInfo], block: tuple[int, int],
          keep_fp8: bool) -> tuple[jax.Array, jax.Array | None]:
    """The tensor on the device as stored, and its scale when it stays FP8 (`keep_fp8`); otherwise
    FP8 is dequantized to float32 and the scale is None. Converting on the device rather than in
    numpy runs the transposes, casts and dequantization on the accelerator (or XLA's threads on a
    CPU); the host holds only the tensor's bytes, until the transfer."""
    info = tensors[name]
    array = jax.device_put(shards.read(info))
    if info.dtype not in fp8.QUANTIZED_DTYPES:
        return array, None
    scale_inv = jax.device_put(shards.read(tensors[name + fp8.SCALE_SUFFIX]))
    return (array, scale_inv) if keep_fp8 else (fp8.dequantize(array, scale_inv, block), None)


def _store(values: dict[str, jax.Array], param: str, spec: jax.ShapeDtypeStruct, value: jax.Array,
           index: tuple[int, ...]) -> None:
    """Put a converted tensor into `values[param]`: the whole parameter (index ()), or its entry at
    the leading indices `index` (`_Write.index`), written in place."""
    value = value.astype(spec.dtype)
    if not index:
        values[param] = value
        return
    stacked = values.get(param)
    if stacked is None:
        stacked = jnp.zeros(spec.shape, spec.dtype)
    values[param] = write_row(stacked, value, jnp.asarray(index, jnp.int32))


def _check_fp8_layout(directory: str, tensors: Mapping[str, shards.TensorInfo], block: tuple[int, int]) -> None:
    """ValueError unless the checkpoint can fill an FP8-layout model: FP8 weights in 128 x 128 blocks."""
    if not any(info.dtype in fp8.FP8_DTYPES for info in tensors.values()):
        raise ValueError(f"dtype=float8_e4m3fn keeps a checkpoint's FP8 weights, but {directory} has none (no "
                         "F8_E4M3 tensor): load it with dtype=bfloat16 or float32")
    if block != fp8.DEFAULT_BLOCK:
        raise ValueError(f"dtype=float8_e4m3fn needs DeepSeek's 128x128 scale blocks; {directory} has "
                         f"weight_block_size {list(block)}: load it with dtype=bfloat16 (dequantized)")


def _mtp_setting(config: ModelConfig, tensors: Mapping[str, shards.TensorInfo], log) -> ModelConfig:
    """MTP is on exactly when the config asks for it and the checkpoint has the layer."""
    prefix = "mtp.0." if config.is_v4 else f"model.layers.{config.num_hidden_layers}."
    if config.num_nextn_predict_layers > 0 and not any(n.startswith(prefix) for n in tensors):
        log(f"no MTP layer ({prefix}*) in the checkpoint: loading with MTP off (num_nextn_predict_layers=0)")
        return config.replace(num_nextn_predict_layers=0)
    return config


def load_hf_checkpoint(directory: str | os.PathLike, *, dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None,
                       plan: str = sharding.DEFAULT_PLAN, log: Callable[[str], None] = _stderr) -> DeepseekV3:
    """Build the model `directory/config.json` describes and fill it from the directory's safetensors.

    dtype: the parameters' dtype (the MoE router stays float32, as the model declares it);
    `jnp.float8_e4m3fn` keeps the checkpoint's FP8 weights and their scales (module docstring).
    mesh: load onto this `jaxspec.sharding` mesh, each parameter split as `plan` says, every device receiving only its block (`jaxspec.mesh_loading`).
    log: receives the progress lines (default: stderr). Raises ValueError, before reading any tensor
    data, when the checkpoint does not match its config.
    """
    directory = os.fspath(directory)
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{directory}: no config.json; not a Hugging Face checkpoint directory")
    with open(config_path) as f:
        hf_config = json.load(f)
    config = ModelConfig.from_hf(hf_config)
    block = fp8.block_size(hf_config)
    tensors = shards.read_headers(directory)
    origin, unknown = {}, []
    if config.is_v4:
        stored = tensors
        tensors, origin, unknown = checkpoint_v4.renamed_headers(stored)
        unknown = [f"{name} {stored[name].describe()} (not a DeepSeek-V4 tensor name)" for name in unknown]
    keep_fp8 = jnp.dtype(dtype) == jnp.float8_e4m3fn
    if keep_fp8:
        _check_fp8_layout(directory, tensors, block)
    config = _mtp_setting(config, tensors, log)
    graphdef, state, variables = abstract_model(config, dtype)
    specs = {name: variable.get_value() for name, variable in variables.items()}
    reads = _plan(tensors, specs, config, block, origin)
    reads.unexpected[:0] = unknown
    if (problems := reads.report(directory)) is not None:
        raise ValueError(problems)

    files = shards.checkpoint_files(directory)
    by_file: dict[str, list[tuple[str, list[_Write]]]] = {path: [] for path in files}
    for name, writes in reads.loads:
        if not all(w.shared for w in writes):
            by_file[tensors[name].file].append((name, writes))
    total = sum(tensors[name].nbytes for entries in by_file.values() for name, _ in entries)
    log(f"loading {directory}: {config.model_type}, {config.num_hidden_layers} layers"
        f"{' + MTP' if config.num_nextn_predict_layers else ''}, {len(files)} file(s), {total / 2**30:.2f} GiB -> "
        f"{'FP8 weights kept, bfloat16 elsewhere' if keep_fp8 else jnp.dtype(dtype)}")

    if mesh is not None:
        values = load_onto_mesh(reads.loads, tensors, specs, param_placement(state, mesh, plan), block, log)
        return _merged(graphdef, state, values)
    values: dict[str, jax.Array] = {}
    start = time.perf_counter()
    for index, path in enumerate(progress.bar(files, "reading shards", unit="shard"), 1):
        shard_start, shard_bytes = time.perf_counter(), 0
        # File order keeps the reads sequential.
        for name, writes in sorted(by_file[path], key=lambda entry: tensors[entry[0]].start):
            array, scale_inv = _read(name, tensors, block, keep_fp8=any(w.fp8 for w in writes))
            shard_bytes += tensors[name].nbytes
            for w in writes:
                if w.shared:
                    continue
                _store(values, w.param, specs[w.param], w.convert(array), w.index)
                if w.fp8:
                    scale_param = w.param + fp8.SCALE_SUFFIX
                    _store(values, scale_param, specs[scale_param], w.convert(scale_inv), w.index)
            del array, scale_inv
        seconds = time.perf_counter() - shard_start
        log(f"[{index}/{len(files)}] {os.path.basename(path)}: {len(by_file[path])} tensors, "
            f"{shard_bytes / 2**30:.2f} GiB in {seconds:.1f} s")
    log(f"loaded {len(values)} parameters in {time.perf_counter() - start:.1f} s")

    return _merged(graphdef, state, values)


def _merged(graphdef: nnx.GraphDef, state: nnx.State, values: Mapping[str, jax.Array]) -> DeepseekV3:
    """The model of `graphdef` with each abstract parameter of `state` replaced by `values[its path]`."""
    loaded = nnx.from_flat_state({path: variable.replace(values[".".join(map(str, path))])
                                  for path, variable in nnx.to_flat_state(state)})
    return nnx.merge(graphdef, loaded)


def is_orbax_checkpoint(directory: str | os.PathLike) -> bool:
    """True for a directory written by `jaxspec convert` / `jaxspec.orbax_io.save_model`."""
    return os.path.isdir(os.path.join(os.fspath(directory), PARAMS_DIR))


def load_model(directory: str | os.PathLike, *, dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None,
               plan: str = sharding.DEFAULT_PLAN, log: Callable[[str], None] = _stderr) -> DeepseekV3:
    """A model from either kind of directory: converted (orbax, fast) or Hugging Face safetensors;
    onto `mesh`, split as `plan` says, when one is given (see `load_hf_checkpoint`, `restore_model`)."""
    if is_orbax_checkpoint(directory):
        start = time.perf_counter()
        model = restore_model(directory, dtype=dtype, mesh=mesh, plan=plan, log=log)
        log(f"restored {os.fspath(directory)} (orbax) in {time.perf_counter() - start:.1f} s")
        return model
    return load_hf_checkpoint(directory, dtype=dtype, mesh=mesh, plan=plan, log=log)
