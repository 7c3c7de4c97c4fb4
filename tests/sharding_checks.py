"""The mesh checks of tests/test_sharding.py, run in their own process with 8 virtual CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, which must be set before JAX initializes,
so the rest of the suite keeps one device). Every check compares a mesh run with the one-device
run of the same model, prompts and key; a failing check raises AssertionError.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python tests/sharding_checks.py
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from jaxspec import sharding
from jaxspec.batch import prepare
from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import compile_generate, generate
from jaxspec.loop import init_state, step
from jaxspec.models import DeepseekV3, moe
from jaxspec.presets import preset

# Three rows: dp's 8 row shards and tp's 2 do not divide them, so every mesh run pads its batch.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [20, 21, 22, 23, 24]]


def same(a, b, what: str) -> None:
    a, b = (np.asarray(x) for x in (a, b))
    assert a.shape == b.shape and (a == b).all(), f"{what}: mesh run differs from one device\n{a}\n{b}"


def same_result(mesh_result, ref, what: str) -> None:
    same(mesh_result.tokens, ref.tokens, what)
    same(mesh_result.num_tokens, ref.num_tokens, what + " (num_tokens)")
    same(mesh_result.accepted, ref.accepted, what + " (accepted)")


def check_param_bytes(model, mesh, plan: str) -> None:
    """Every parameter's per-device block is the plan's: experts split over all devices, attention
    heads over "model" under tp, the rest whole."""
    placed = sharding.shard_params(nnx.split(model)[1], mesh, plan)
    for path, variable in nnx.to_flat_state(placed):
        names = variable.get_metadata()["out_sharding"]
        value = variable.get_value()
        expected = list(value.shape)
        for axis, name in enumerate(names):
            if name == "experts":
                expected[axis] //= mesh.size
            if name == "heads" and plan == "tp":
                expected[axis] //= mesh.shape["model"]
        shapes = {tuple(s.data.shape) for s in value.addressable_shards}
        where = ".".join(map(str, path))
        assert shapes == {tuple(expected)}, f"{plan} {where}: per-device shapes {shapes}, expected {tuple(expected)}"
        per_device = math.prod(expected) * value.dtype.itemsize
        assert all(s.data.nbytes == per_device for s in value.addressable_shards), where


def check_cache_layout(model, config: DecodeConfig, mesh, plan: str) -> None:
    """`prepare` creates the caches split as `cache_shardings` says (rows over the row shards), and
    a second batch of the same shapes compiles nothing: the caches' program is reused."""
    compiled = []
    listener = lambda event, seconds, **kwargs: compiled.append(kwargs.get("fun_name")) if event.endswith(
        "backend_compile_duration") else None
    prepare(model, PROMPTS, config, mesh=mesh, plan=plan)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        batch = prepare(model, PROMPTS[::-1], config, mesh=mesh, plan=plan)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiled == [], f"a second prepare on the mesh compiled {compiled}"
    for cache in (batch.target_cache, batch.mtp_cache):
        planned = jax.tree.leaves(sharding.cache_shardings(cache, mesh, plan))
        leaves = jax.tree.leaves(cache)
        assert len(planned) == len(leaves) > 0
        for leaf, want in zip(leaves, planned):
            assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (plan, leaf.shape, leaf.sharding, want)


def main() -> None:
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    # Tiny expert-parallel chunks, so the mesh runs exchange tokens in several chunks (every prefill
    # here, tp's decode windows) and in one (dp's decode windows).
    moe.EP_CHUNK_TOKENS = 4
    v32 = DeepseekV3(preset("tiny"), rngs=nnx.Rngs(0))
    v3 = DeepseekV3(preset("tiny-v3"), rngs=nnx.Rngs(1))
    meshes = {shape: sharding.make_mesh(*shape) for shape in ((1, 8), (2, 4))}

    for plan in sharding.PLANS:
        check_param_bytes(v32, meshes[(2, 4)], plan)
        check_cache_layout(v32, DecodeConfig(num_draft=3, max_new_tokens=8), meshes[(2, 4)], plan)

    # Seven compiles in all (the bulk of the time), so each mesh shape and plan appears once.
    chain = DecodeConfig(num_draft=3, max_new_tokens=8, backend="xla")
    same_result(compile_generate(v32, PROMPTS, chain, mesh=meshes[(2, 4)], plan="tp")(),
                generate(v32, PROMPTS, chain), "V3.2 k=3 tp on 2x4 (compile_generate)")

    tree = DecodeConfig(num_draft=1, tree="2,3,6", max_new_tokens=8, backend="xla")
    same_result(generate(v3, PROMPTS, tree, mesh=meshes[(2, 4)]), generate(v3, PROMPTS, tree), "V3 dynamic tree dp on 2x4")

    # Sampled, driven by init_state / step on the mesh: the row keys do not depend on the mesh.
    # 1x8 under dp splits rows over the model axis, so every expert exchange spans all 8 devices.
    # The prompts run through the loop's own steps (prefill_in_loop), the padding rows never start.
    sampled = DecodeConfig(num_draft=3, max_new_tokens=8, temperature=1.0, backend="xla", prefill_in_loop=True)
    ref = generate(v32, PROMPTS, sampled, key=7)
    # The state holds its mesh: the first step names it (checked), the others do not, and another
    # mesh is refused (a mesh state stepped as one device's read its page tables wrongly).
    state = init_state(v32, PROMPTS, sampled, key=7, mesh=meshes[(1, 8)])
    assert (state.mesh, state.plan) == (meshes[(1, 8)], "dp"), (state.mesh, state.plan)
    try:
        step(v32, state, mesh=meshes[(2, 4)])
        raise AssertionError("a step on another mesh than the state's was not refused")
    except ValueError as refused:
        assert "the state was made with mesh=" in str(refused), refused
    state = step(v32, state, sampled, mesh=meshes[(1, 8)], plan="dp")
    while not bool(state.done.all()):
        state = step(v32, state)
    assert state.mesh == meshes[(1, 8)]
    rows = len(PROMPTS)
    same(state.tokens[:rows, :sampled.max_new_tokens], ref.tokens, "V3.2 k=3 sampled dp on 1x8, prompts in the loop (init_state/step)")
    same(state.num_generated[:rows], ref.num_tokens, "V3.2 k=3 sampled dp on 1x8 (num_tokens)")
    print("sharding checks passed")


if __name__ == "__main__":
    main()
