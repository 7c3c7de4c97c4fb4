"""Model-level invariants: MLA forms agree, cached decode equals recompute, DSA equals dense when
nothing is dropped, the MoE router equals a per-token loop, RoPE equals complex rotation, padding
rows stay NaN-free and do not touch other rows."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.models import DeepseekV3, route
from jaxspec.models.moe import expert_path
from jaxspec.models.rope import apply_rope, rope_frequencies
from jaxspec.pallas_kernels import Visibility
from jaxspec.presets import preset

jax.config.update("jax_default_matmul_precision", "highest")


@functools.cache
def _forward(graphdef, form):
    @jax.jit
    def run(params, tokens, positions, cache, vis):
        return nnx.merge(graphdef, params)(tokens, positions, cache, vis, form=form, backend="xla")
    return run


def forward(model, tokens, positions, cache, vis, form="absorbed"):
    graphdef, params = nnx.split(model)
    return _forward(graphdef, form)(params, tokens, positions, cache, vis)


def chain_vis(prefix_len, query_len):
    return Visibility(jnp.asarray(prefix_len, jnp.int32), jnp.asarray(query_len, jnp.int32))


def random_tokens(seed, shape, vocab=256):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def arange_positions(batch, start, length):
    return jnp.asarray(np.asarray(start)[:, None] + np.arange(length)[None, :], jnp.int32)


@pytest.fixture(scope="module", params=["tiny", "tiny-v3"])
def model(request):
    return DeepseekV3(preset(request.param), rngs=nnx.Rngs(0))


def test_absorbed_equals_expanded(model):
    """Both MLA forms give the same logits over a prefix + window, padding rows included."""
    batch, prefix, window = 3, [5, 9, 0], 4
    cache = model.init_cache(batch, 32, page_size=8)
    tokens = random_tokens(0, (batch, 9))
    _, _, cache = forward(model, tokens, arange_positions(batch, [0, 0, 0], 9), cache,
                          chain_vis([0, 0, 0], prefix), form="expanded")
    win = random_tokens(1, (batch, window))
    vis = chain_vis(prefix, [4, 2, 0])
    pos = arange_positions(batch, prefix, window)
    logits_abs, hidden_abs, cache_abs = forward(model, win, pos, cache, vis, form="absorbed")
    logits_exp, hidden_exp, cache_exp = forward(model, win, pos, cache, vis, form="expanded")
    np.testing.assert_allclose(logits_abs, logits_exp, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(hidden_abs, hidden_exp, rtol=1e-4, atol=1e-4)
    for a, b in zip(cache_abs.latent, cache_exp.latent):  # later layers inherit float differences
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert np.isfinite(np.asarray(logits_abs)).all()


@pytest.mark.parametrize("window", [1, 3])
def test_cached_decode_equals_full_recompute(model, window):
    """Prefill then windows of `window` tokens through the cache give the logits of one full pass."""
    batch, prompt_lens, total = 2, np.array([6, 3]), 15
    tokens = random_tokens(2, (batch, total + 6))
    page_table = jnp.asarray(np.random.default_rng(3).permutation(2 * 4).reshape(batch, 4), jnp.int32)
    full_cache = model.init_cache(batch, 32, page_size=8)
    full_logits, _, _ = forward(model, tokens[:, :total + 6], arange_positions(batch, [0, 0], total + 6),
                                full_cache, chain_vis([0, 0], [total + 6] * 2), form="expanded")

    cache = model.init_cache(batch, 32, page_size=8, page_table=page_table)
    idx = np.arange(tokens.shape[1])[None, :]
    prompt = jnp.where(idx < prompt_lens[:, None], tokens, 0)[:, :6]
    logits, _, cache = forward(model, prompt, arange_positions(batch, [0, 0], 6), cache,
                               chain_vis([0, 0], prompt_lens), form="expanded")
    for b in range(batch):
        np.testing.assert_allclose(logits[b, :prompt_lens[b]], full_logits[b, :prompt_lens[b]], rtol=2e-4, atol=2e-4)

    length = prompt_lens.copy()
    while length.min() < total:
        win = jnp.stack([jax.lax.dynamic_slice(tokens[b], (int(length[b]),), (window,)) for b in range(batch)])
        logits, _, cache = forward(model, win, arange_positions(batch, length, window), cache,
                                   chain_vis(length, [window] * batch), form="absorbed")
        for b in range(batch):
            np.testing.assert_allclose(logits[b], full_logits[b, length[b]:length[b] + window], rtol=2e-4, atol=2e-4)
        length += window


def _copy_shared_params(source: DeepseekV3, target: DeepseekV3):
    """Give `target` (V3) every parameter of `source` (V3.2) except the indexer's."""
    _, _, rest = nnx.split(source, nnx.PathContains("indexer"), ...)
    nnx.update(target, rest)


def test_dsa_equals_dense_when_nothing_is_dropped():
    """With at most index_topk visible tokens the V3.2 model equals the same weights without DSA;
    past index_topk it differs (the indexer really drops tokens)."""
    sparse = DeepseekV3(preset("tiny", index_topk=12), rngs=nnx.Rngs(0))
    dense = DeepseekV3(preset("tiny-v3"), rngs=nnx.Rngs(1))
    _copy_shared_params(sparse, dense)
    batch, length = 2, 20
    tokens = random_tokens(4, (batch, length))
    pos = arange_positions(batch, [0, 0], length)
    vis = chain_vis([0, 0], [length, length])
    sparse_logits, _, _ = forward(sparse, tokens, pos, sparse.init_cache(batch, 24, page_size=8), vis, form="expanded")
    dense_logits, _, _ = forward(dense, tokens, pos, dense.init_cache(batch, 24, page_size=8), vis, form="expanded")
    seen = np.arange(length) + 1
    np.testing.assert_allclose(sparse_logits[:, seen <= 12], dense_logits[:, seen <= 12], rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(sparse_logits[:, seen > 12] - dense_logits[:, seen > 12])).max() > 1e-3

    # The absorbed (sparse_mla_attention) path agrees with the expanded (masked) one.
    cache = sparse.init_cache(batch, 24, page_size=8)
    _, _, cache = forward(sparse, tokens[:, :16], arange_positions(batch, [0, 0], 16), cache,
                          chain_vis([0, 0], [16, 16]), form="expanded")
    win_vis = chain_vis([16, 16], [4, 4])
    absorbed, _, _ = forward(sparse, tokens[:, 16:], pos[:, 16:], cache, win_vis, form="absorbed")
    expanded, _, _ = forward(sparse, tokens[:, 16:], pos[:, 16:], cache, win_vis, form="expanded")
    np.testing.assert_allclose(absorbed, expanded, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(absorbed, sparse_logits[:, 16:], rtol=2e-4, atol=2e-4)


def _route_loop(config, x, gate_weight, bias):
    """Per-token numpy re-statement of DeepSeek-V3's noaux_tc routing."""
    weights_out, experts_out = [], []
    per_group = config.n_routed_experts // config.n_group
    for token in x:
        scores = 1.0 / (1.0 + np.exp(-(token @ gate_weight)))
        choice = scores + bias
        group_scores = [sorted(choice[g * per_group:(g + 1) * per_group])[-2:] for g in range(config.n_group)]
        group_scores = [sum(s) for s in group_scores]
        kept = sorted(range(config.n_group), key=lambda g: -group_scores[g])[:config.topk_group]
        candidates = [e for e in range(config.n_routed_experts) if e // per_group in kept]
        chosen = sorted(candidates, key=lambda e: -choice[e])[:config.num_experts_per_tok]
        w = np.array([scores[e] for e in chosen])
        if config.norm_topk_prob:
            w = w / w.sum()
        weights_out.append(w * config.routed_scaling_factor)
        experts_out.append(chosen)
    return np.array(weights_out), np.array(experts_out)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_router_equals_loop(norm_topk_prob):
    config = preset("tiny", n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                    norm_topk_prob=norm_topk_prob)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(40, config.hidden_size)).astype(np.float32)
    gate = rng.normal(size=(config.hidden_size, config.n_routed_experts)).astype(np.float32) * 0.2
    bias = rng.normal(size=(config.n_routed_experts,)).astype(np.float32) * 0.5
    weights, experts = jax.jit(functools.partial(route, config))(x, gate, bias)
    ref_weights, ref_experts = _route_loop(config, x.astype(np.float64), gate.astype(np.float64), bias.astype(np.float64))
    np.testing.assert_array_equal(np.asarray(experts), ref_experts)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-5)
    # Group limiting really binds: some token's top-k without it would use a dropped group.
    scores = 1 / (1 + np.exp(-(x @ gate))) + bias
    assert (np.sort(np.argsort(-scores, axis=1)[:, :3], axis=1) != np.sort(ref_experts, axis=1)).any()


@pytest.mark.parametrize("backend,extra_tokens", [("xla", -2), ("xla", 0), ("xla", 1), ("xla", 9), ("pallas", -2),
                                                   ("pallas", 9)])
def test_moe_layer_equals_loop(backend, extra_tokens):
    """Every expert path equals a per-token sum over the chosen experts: on xla the gathered path
    (T * k <= E, here T = E / k + extra_tokens with extra_tokens <= 0) and the grouped ragged-dot
    path; on pallas the grouped-matmul kernel (interpret mode) at both sizes."""
    config = preset("tiny", n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=2)
    model = DeepseekV3(config, rngs=nnx.Rngs(0))
    moe = model.layer(1).mlp
    num_tokens = config.n_routed_experts // config.num_experts_per_tok + extra_tokens
    assert expert_path(num_tokens * config.num_experts_per_tok, config.n_routed_experts, backend) == (
        "gathered" if backend == "xla" and extra_tokens <= 0 else "grouped")
    x = jnp.asarray(np.random.default_rng(6).normal(size=(1, num_tokens, 64)), jnp.float32)
    out = nnx.jit(lambda m, x: m(x, backend=backend))(moe, x)
    with pytest.raises(ValueError, match="path"):
        moe(x, backend=backend, path="dense")
    tokens = np.asarray(x).reshape(-1, 64)
    weights, experts = _route_loop(moe.config, tokens, np.asarray(moe.gate_weight[...]),
                                   np.asarray(moe.e_score_correction_bias[...]))
    wg, wu, wd = (np.asarray(moe.experts_gate_proj[...]), np.asarray(moe.experts_up_proj[...]),
                  np.asarray(moe.experts_down_proj[...]))
    silu = lambda v: v / (1 + np.exp(-v))
    expected = []
    for t, token in enumerate(tokens):
        acc = np.zeros(64)
        for w, e in zip(weights[t], experts[t]):
            acc += w * (silu(token @ wg[e]) * (token @ wu[e])) @ wd[e]
        expected.append(acc)
    shared = moe.shared_experts
    expected = np.array(expected) + np.asarray(shared(jnp.asarray(tokens), backend="xla"))
    np.testing.assert_allclose(np.asarray(out).reshape(-1, 64), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_equals_complex_rotation(interleaved):
    config = preset("tiny")
    rng = np.random.default_rng(7)
    x = rng.normal(size=(2, 5, 3, config.qk_rope_head_dim)).astype(np.float32)
    positions = rng.integers(0, 900, (2, 5))
    inv_freq, magnitude = rope_frequencies(config)
    angles = positions[..., None] * np.asarray(inv_freq, np.float64)
    out = apply_rope(jnp.asarray(x), jnp.asarray(np.cos(angles) * magnitude, jnp.float32),
                     jnp.asarray(np.sin(angles) * magnitude, jnp.float32), interleaved=interleaved)
    half = config.qk_rope_head_dim // 2
    as_complex = x[..., 0::2] + 1j * x[..., 1::2] if interleaved else x[..., :half] + 1j * x[..., half:]
    rotated = as_complex * np.exp(1j * angles)[:, :, None, :] * magnitude
    expected = (np.stack([rotated.real, rotated.imag], -1).reshape(x.shape) if interleaved
                else np.concatenate([rotated.real, rotated.imag], -1))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_yarn_frequencies():
    """YaRN keeps fast dims, divides slow dims by the factor, ramps between (DeepSeek's formula)."""
    config = preset("tiny")
    rs = config.rope_scaling
    inv_freq, magnitude = rope_frequencies(config)
    dim, base = config.qk_rope_head_dim, config.rope_theta
    plain = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    correction = lambda rot: dim * math.log(rs.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(correction(rs.beta_fast)), 0), min(math.ceil(correction(rs.beta_slow)), dim - 1)
    for i, f in enumerate(np.asarray(inv_freq)):
        if i < low:
            assert f == pytest.approx(plain[i], rel=1e-6)
        elif i >= high:
            assert f == pytest.approx(plain[i] / rs.factor, rel=1e-6)
    assert magnitude == 1.0
    mscale = 0.1 * math.log(rs.factor) + 1
    assert config.softmax_scale == pytest.approx(config.qk_head_dim ** -0.5 * mscale ** 2)


def test_padding_rows_are_finite_and_isolated(model):
    """A row with an empty window returns finite values, writes nothing, and does not change row 0."""
    tokens = random_tokens(8, (2, 6))
    pos = arange_positions(2, [0, 0], 6)
    cache = model.init_cache(2, 16, page_size=8)
    for form in ("expanded", "absorbed"):
        logits, hidden, new_cache = forward(model, tokens, pos, cache, chain_vis([0, 0], [6, 0]), form=form)
        alone, _, _ = forward(model, tokens[:1], pos[:1], model.init_cache(1, 16, page_size=8),
                              chain_vis([0], [6]), form=form)
        assert np.isfinite(np.asarray(logits)).all() and np.isfinite(np.asarray(hidden)).all()
        np.testing.assert_allclose(logits[0], alone[0], rtol=1e-5, atol=1e-5)
        row1_pages = np.asarray(new_cache.page_table[1])
        for layer in [layer for pool in jax.tree.leaves((new_cache.latent, new_cache.index_keys)) for layer in pool]:
            assert not np.asarray(layer)[row1_pages].any()
