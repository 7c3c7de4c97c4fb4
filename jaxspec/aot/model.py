"""The model's own programs compiled for a GPU target: prefill and one speculative decode step of
a DeepSeek-V3 / V3.2 at a given batch and context, with abstract parameters (nothing allocated).

    compiled = compile_model(preset("deepseek-v3.2"), DecodeConfig(num_draft=3, backend="pallas"),
                             phase="decode", batch=32, context=4096, devices=gpu_devices("h100"))

The decode step is `jaxspec.loop._step` exactly as `generate` runs it inside its while loop, with
the loop state donated as at `step`'s jit boundary; prefill is `jaxspec.loop.prefill` over a
prompt of `context` tokens with its caches donated. Cache geometry: a step sees caches of
`required_capacity` slots per row for `context` tokens (the context plus one step's window), so
its attention kernels' stated costs are those of a full context.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec import sharding
from jaxspec.batch import cache_geometry, required_capacity
from jaxspec.decode_config import DecodeConfig
from jaxspec.loop import _prefill_mesh, _step, _step_mesh, prefill, row_sampling, state_specs
from jaxspec.model_config import ModelConfig
from jaxspec.orbax_io import abstract_model
from jaxspec.sampling import base_key

from .compile import GpuCompiled, compile_gpu

PHASES = ("prefill", "decode")


def reduced_depth(config: ModelConfig, layers: int) -> ModelConfig:
    """`config` with `layers` decoder layers at full width, keeping at least one MoE layer (the
    dense prefix shrinks to layers - 1 when it would cover them all). Per-layer kinds, where the
    config lists them, are cut to the first `layers` (V4-Flash's first 4: sliding, sliding, CSA,
    HCA over hash, hash, hash, learned routing: every kind once)."""
    if not 1 <= layers <= config.num_hidden_layers:
        raise ValueError(f"layers={layers}: must be in [1, num_hidden_layers={config.num_hidden_layers}]")
    kinds = {field: getattr(config, field)[:layers] for field in ("layer_types", "mlp_layer_types")
             if getattr(config, field) is not None}
    return config.replace(num_hidden_layers=layers,
                          first_k_dense_replace=min(config.first_k_dense_replace, layers - 1), **kinds)


def _abstract_caches(model, batch: int, capacity: int, decode: DecodeConfig, prompt_width: int, row_shards: int = 1):
    """The target's and the MTP's caches as `generate` builds them (`jaxspec.batch.cache_geometry`),
    as shapes."""
    geometry = cache_geometry(prompt_width, decode, batch_size=batch, capacity=capacity, row_shards=row_shards)
    cache = lambda mtp: jax.eval_shape(lambda: model.init_cache(batch, capacity, mtp=mtp, **geometry.kwargs()))
    return cache(False), cache(True) if decode.draft_tree is not None else None


def _placed(tree, shardings):
    """ShapeDtypeStructs of `tree` carrying `shardings` (a tree of the same structure, or a prefix)."""
    return jax.tree.map(lambda spec, sub: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=spec), sub), shardings, tree,
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


def compile_model(config: ModelConfig, decode: DecodeConfig, *, phase: str, batch: int, context: int,
                  devices: Sequence, dtype=jnp.bfloat16, dump_dir: str | None = None,
                  fail_on_spill: bool = True, mesh_shape: tuple[int, int] | None = None,
                  plan: str = sharding.DEFAULT_PLAN) -> GpuCompiled:
    """Compile prefill (a `context`-token prompt) or one decode step (at `context` cached tokens)
    of `config` for `devices`, parameters in `dtype`, decoding as `decode` says (draft chain or
    tree, backend: "pallas" for the GPU kernels). Raises ValueError on a bad phase, batch or context.

    mesh_shape: (data, model) to compile the programs `generate` runs on a mesh of `devices`
    (`jaxspec.sharding`, split as `plan` says: parameters, caches and loop state placed per device,
    the whole program in the loop's shard_map, collectives included); batch is then padded to the
    row shards as `generate` pads it. None: one device, no sharding."""
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r}: must be one of {PHASES}")
    if batch < 1:
        raise ValueError(f"batch={batch}: must be >= 1")
    if not 1 <= context <= config.max_position_embeddings:
        raise ValueError(f"context={context}: must be in [1, max_position_embeddings={config.max_position_embeddings}]")
    graphdef, params, _ = abstract_model(config, dtype)
    model = nnx.merge(graphdef, params)
    prompt_width = context if phase == "prefill" else 1
    # The programs `generate` and `step` run: sampling's values are an argument (`program_config`).
    decode = decode.replace(max_new_tokens=1 if phase == "prefill" else context, max_cache_len=None).program_config()
    if mesh_shape is not None:
        return _compile_on_mesh(graphdef, params, model, decode, phase=phase, batch=batch, prompt_width=prompt_width,
                                devices=devices, dump_dir=dump_dir, fail_on_spill=fail_on_spill,
                                mesh_shape=mesh_shape, plan=plan)
    target_cache, mtp_cache = _abstract_caches(model, batch, required_capacity(prompt_width, decode), decode, prompt_width)
    prompts = jax.ShapeDtypeStruct((batch, prompt_width), jnp.int32)
    prompt_lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    rng_key = jax.eval_shape(lambda: base_key(0))
    sampling = jax.eval_shape(lambda: row_sampling(decode, batch))
    options = dict(devices=devices, dump_dir=dump_dir, fail_on_spill=fail_on_spill,
                   static_argnames=("graphdef", "config"))
    if phase == "prefill":
        return compile_gpu(prefill, graphdef=graphdef, params=params, prompts=prompts, prompt_lens=prompt_lens,
                           target_cache=target_cache, mtp_cache=mtp_cache, rng_key=rng_key, config=decode,
                           sampling=sampling, donate_argnames=("target_cache", "mtp_cache"), **options)
    # The loop state after prefill, as shapes (its tokens buffer sized by max_new_tokens = context).
    state = jax.eval_shape(functools.partial(prefill, graphdef, config=decode), params, prompts, prompt_lens,
                           target_cache, mtp_cache, rng_key, sampling=sampling)
    return compile_gpu(_step, graphdef=graphdef, params=params, state=state, config=decode,
                       donate_argnames=("state",), **options)


def _compile_on_mesh(graphdef, params, model, decode: DecodeConfig, *, phase: str, batch: int, prompt_width: int,
                     devices: Sequence, dump_dir, fail_on_spill: bool, mesh_shape: tuple[int, int], plan: str):
    """`compile_model` on a (data, model) mesh of `devices`: `jaxspec.loop`'s mesh programs with
    every argument placed as `generate` places it."""
    if len(mesh_shape) != 2 or mesh_shape[0] * mesh_shape[1] != len(devices):
        raise ValueError(f"mesh_shape={tuple(mesh_shape)}: needs two sizes whose product is the {len(devices)} devices")
    mesh = sharding.make_mesh(*mesh_shape, devices=devices)
    sharding.check_plan(plan)
    shards = sharding.row_shards(mesh, plan)
    padded = -(-batch // shards) * shards
    params = _placed(params, sharding.param_shardings(params, mesh, plan))
    caches = _abstract_caches(model, padded, required_capacity(prompt_width, decode), decode, prompt_width,
                              row_shards=shards)
    caches = [None if c is None else _placed(c, sharding.cache_shardings(c, mesh, plan)) for c in caches]
    rows = NamedSharding(mesh, sharding.row_spec(plan))
    prompts = jax.ShapeDtypeStruct((padded, prompt_width), jnp.int32, sharding=rows)
    prompt_lens = jax.ShapeDtypeStruct((padded,), jnp.int32, sharding=rows)
    key = jax.eval_shape(lambda: base_key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    sampling = _placed(jax.eval_shape(lambda: row_sampling(decode, padded)), rows)
    options = dict(devices=devices, dump_dir=dump_dir, fail_on_spill=fail_on_spill,
                   static_argnames=("graphdef", "config", "mesh", "plan", "num_rows"))
    prefill_args = dict(graphdef=graphdef, params=params, prompts=prompts, prompt_lens=prompt_lens,
                        target_cache=caches[0], mtp_cache=caches[1], rng_key=key, sampling=sampling, config=decode,
                        mesh=mesh, plan=plan, num_rows=batch)
    if phase == "prefill":
        return compile_gpu(_prefill_mesh, donate_argnames=("target_cache", "mtp_cache"), **prefill_args, **options)
    state = jax.eval_shape(lambda *args: _prefill_mesh(graphdef, *args, decode, mesh, plan, batch),
                           params, prompts, prompt_lens, *caches, key, sampling)
    specs = state_specs(state.target_cache, state.mtp_cache, state.config, plan)
    state = _placed(state, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                                        is_leaf=lambda x: isinstance(x, PartitionSpec)))
    options["static_argnames"] = ("graphdef", "config", "mesh", "plan")
    return compile_gpu(_step_mesh, graphdef=graphdef, params=params, state=state, config=decode, mesh=mesh,
                       plan=plan, donate_argnames=("state",), **options)
