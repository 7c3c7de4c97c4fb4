"""The MoE router on its Mosaic GPU kernel (`pallas_kernels.router_mosaic`): interpreted on the CPU,
the experts and weights of the jnp router (`models.moe.choose`) bit for bit, at DeepSeek's shapes
(V3.2's groups, V4-Pro's 384 experts in two TMA pieces, a tiny model's padded row) with ties,
infinities and NaN; a token's bits the same alone as among others; compiled for sm_90a without a
GPU as one launch where XLA runs a kernel per reduction; which backend runs it, and what it refuses.
On a GPU host the kernel runs natively (`conftest.MOSAIC_INTERPRET`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import moe
from jaxspec.pallas_kernels.router_mosaic import router_mosaic
from jaxspec.presets import preset
from conftest import MOSAIC_INTERPRET


def kernel_args(config) -> dict:
    return dict(n_group=config.n_group, topk_group=config.topk_group, top_k=config.num_experts_per_tok,
                norm_topk_prob=config.norm_topk_prob, scaling=config.routed_scaling_factor)


def random_scores(seed: int, tokens: int, experts: int, coarse: bool = True):
    """Sigmoid scores [T, E] and a bias [E]; `coarse` puts both on a grid, so that long rows hold
    ties (between experts, and between groups' sums)."""
    key_s, key_b = jax.random.split(jax.random.key(seed))
    logits = jax.random.normal(key_s, (tokens, experts)) * 4
    bias = jax.random.normal(key_b, (experts,)) / 8
    if coarse:
        logits, bias = jnp.round(logits) / 4, jnp.round(bias * 32) / 32
    return jax.nn.sigmoid(logits), bias


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.int32)


def assert_routes_as_the_reference(config, scores, bias):
    weights, experts = router_mosaic(scores, bias, interpret=MOSAIC_INTERPRET, **kernel_args(config))
    want_weights, want_experts = moe.choose(config, scores, bias, backend="xla")
    assert experts.dtype == jnp.int32 and weights.dtype == jnp.float32
    assert experts.shape == weights.shape == (scores.shape[0], config.num_experts_per_tok)
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_array_equal(bits(weights), bits(want_weights))


@pytest.mark.parametrize("name, overrides, tokens", [
    ("deepseek-v3.2", {}, 3),  # 8 groups of 32, the best 4, top-8
    ("deepseek-v4-pro", {}, 2),  # 384 experts: a row in two TMA pieces; no groups, top-6
    ("tiny", {}, 2),  # 8 experts in 4 groups, padded to 128 lanes
    ("tiny", {"n_group": 8, "topk_group": 3, "norm_topk_prob": False}, 3),  # one expert a group, no norm
])
def test_kernel_routes_as_the_reference_bit_for_bit(name, overrides, tokens):
    config = preset(name, **overrides)
    scores, bias = random_scores(tokens, tokens, config.n_routed_experts)
    # Experts 0 and 1 tie in every row (and so may their groups), beside the grid's chance ties.
    scores, bias = scores.at[:, 1].set(scores[:, 0]), bias.at[1].set(bias[0])
    assert_routes_as_the_reference(config, scores, bias)


def test_kernel_takes_the_sigmoid_of_logits_as_the_reference_does():
    """Given the gate's logits (V3's scoring, `logits=True`), the kernel's own sigmoid routes as the
    reference's `jax.nn.sigmoid` then `choose`: the same bits, ties included."""
    config = preset("deepseek-v3.2")
    logits = jnp.round(jax.random.normal(jax.random.key(4), (3, config.n_routed_experts)) * 8) / 4
    _, bias = random_scores(4, 3, config.n_routed_experts)
    weights, experts = router_mosaic(logits, bias, logits=True, interpret=MOSAIC_INTERPRET, **kernel_args(config))
    want_weights, want_experts = moe.choose(config, jax.nn.sigmoid(logits), bias, backend="xla")
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_array_equal(bits(weights), bits(want_weights))


def test_nan_and_infinities_route_by_the_total_order():
    """A NaN score (either sign) and infinite bias: the kernel orders them as the reference's keys
    do (+NaN first, -NaN last, an infinite choice beside them), in a group's sum as among experts."""
    config = preset("deepseek-v3.2")
    scores, bias = random_scores(5, 2, config.n_routed_experts, coarse=False)
    nan = jnp.float32(jnp.nan)
    scores = scores.at[0, 3].set(nan).at[0, 40].set(-nan).at[1, 200].set(nan)
    bias = bias.at[70].set(jnp.inf).at[100].set(-jnp.inf)
    assert_routes_as_the_reference(config, scores, bias)


def test_a_tokens_route_does_not_depend_on_the_tokens_beside_it():
    """One program a token: alone, a token gets the bits it gets among five others."""
    config = preset("deepseek-v3.2")
    scores, bias = random_scores(9, 6, config.n_routed_experts, coarse=False)
    args = kernel_args(config)
    together = router_mosaic(scores, bias, interpret=MOSAIC_INTERPRET, **args)
    for token in (0, 4):
        alone = router_mosaic(scores[token:token + 1], bias, interpret=MOSAIC_INTERPRET, **args)
        np.testing.assert_array_equal(alone[1][0], together[1][token])
        np.testing.assert_array_equal(bits(alone[0][0]), bits(together[0][token]))


def test_one_launch_a_layer_compiled_for_h100(h100):
    """V3.2's routing after the gate for a B 32, k 3 window (128 tokens), compiled for sm_90a: on
    the "mosaic" backend one Mosaic launch of a 128-thread program a token, stating its cost, and
    at most two XLA kernels beside it (the results' slices to k lanes, which a model's readers
    fuse); on "auto" (no measurement names the kernel yet) XLA's chain of reductions, at least
    four kernels."""
    from jaxspec import aot
    from jaxspec.aot.analysis import is_thunk_kind

    config = preset("deepseek-v3.2")
    kernels = lambda launched: sum(n for name, n in launched.items() if not is_thunk_kind(name))  # noqa: E731
    specs = (jax.ShapeDtypeStruct((128, 256), jnp.float32), jax.ShapeDtypeStruct((256,), jnp.float32))
    compiled = aot.compile_gpu(lambda s, b: moe.choose(config, s, b, backend="mosaic"), *specs, devices=h100)
    (launch,) = aot.mosaic_launches(compiled)
    assert (launch.kernel, launch.name) == ("router_mosaic_mosaic_gpu_kernel", "router")
    assert launch.grid == (128, 1, 1) and launch.threads == (128, 1, 1) and launch.shared_memory <= 8 * 1024
    (call,) = aot.pallas_calls(compiled)
    assert call.bytes_accessed == 128 * (256 + 2 * 128) * 4 + 256 * 4
    assert kernels(aot.launch_counts(compiled)) <= 2
    reference = aot.compile_gpu(lambda s, b: moe.choose(config, s, b, backend="auto"), *specs, devices=h100)
    assert not aot.mosaic_launches(reference) and kernels(aot.launch_counts(reference)) >= 4


def test_backends_and_refusals():
    """Off a GPU every backend runs the jnp router ("mosaic" too: interpreted, the kernel would cost
    seconds a layer), and hash routing never runs the kernel. The kernel refuses a bias of another
    length, groups that do not divide the experts, and k outside [1, min(E, 128)], before tracing."""
    config = preset("tiny")
    scores, bias = random_scores(3, 4, config.n_routed_experts)
    want = moe.choose(config, scores, bias, backend="xla")
    for backend in ("auto", "pallas", "mosaic"):
        got = moe.choose(config, scores, bias, backend=backend)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(bits(got[0]), bits(want[0]))
    args = kernel_args(config)
    with pytest.raises(ValueError, match=r"bias: shape \(7,\) must be \(8,\)"):
        router_mosaic(scores, bias[:7], **args)
    with pytest.raises(ValueError, match=r"n_group=3, topk_group=2: n_group must divide the 8 experts"):
        router_mosaic(scores, bias, **{**args, "n_group": 3})
    with pytest.raises(ValueError, match=r"top_k=9: must be in \[1, 8\]"):
        router_mosaic(scores, bias, **{**args, "top_k": 9})
