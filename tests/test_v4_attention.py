"""DeepSeek-V4 attention (`models.v4_attention`) and its caches (`jaxspec.cache_v4`), one layer at a time.

* parity with transformers 5.23's `DeepseekV4Attention` on the same random weights, fp32: a
  full-sequence call and cached decode step by step, for each layer type (CSA with 8 indexer heads:
  with few heads, indexer scores tie at exactly 0 and transformers' `torch.topk` breaks ties by row
  length, `models/compressor.py`);
* causality and cached == recompute, our own: other tokens from position 17 on change nothing
  before it; chain windows of 1..5 tokens over wrapping rings equal one call over everything;
* rewind: a window whose drafts close compressed blocks and overwrite ring slots, then a shorter
  accepted length and the right continuation, equals a fresh recompute of the committed tokens,
  and after each commit every cache row a later query can read equals the recompute's;
* padding writes nothing and returns finite values;
* window_invariant: a window, chain or tree, is bit for bit its tokens decoded one by one;
* trees: every node equals the chain call of its branch, and after a branch is committed
  (`V4Cache.move`) the next window equals a recompute.
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.cache_v4 import ENTRIES, INDEX_ENTRIES, INDEX_STATE, STATE, init_v4_cache
from jaxspec.model_config import CSA, HCA, SLIDING, ModelConfig
from jaxspec.models.v4_attention import V4Attention
from jaxspec.pallas_kernels import Visibility, read_slots

KINDS = (SLIDING, CSA, HCA)
WINDOW = 6
RATES = {CSA: 4, HCA: 8}
HF_FIELDS = dict(vocab_size=50, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                 head_dim=16, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=8,
                 index_n_heads=8, index_head_dim=8, index_topk=3, sliding_window=WINDOW, mlp_layer_types=["moe"],
                 compress_rates=RATES, hc_mult=2, partial_rotary_factor=0.25, max_position_embeddings=64,
                 rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                  "beta_fast": 32, "beta_slow": 1})
PAGE = 4
CAPACITY = 32
# Two cache geometries: one call over a whole sequence (rings sized for 25 tokens: nothing wraps),
# and calls of at most CHUNK tokens, whose rings (12 slots each here) wrap several times over 30.
MAX_WINDOW, CHUNK = 25, 5


@functools.lru_cache(maxsize=None)
def config_for(kind: str) -> ModelConfig:
    return ModelConfig.from_hf(dict(HF_FIELDS, layer_types=[kind], model_type="deepseek_v4"))


@functools.lru_cache(maxsize=None)
def model_for(kind: str, seed: int = 0) -> V4Attention:
    """(Built once per kind and never changed.) A layer with every parameter drawn at random (norms near 1, sinks and position biases
    nonzero), so no part of the computation hides behind an init value."""
    model = V4Attention(config_for(kind), 0, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1)
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Param):
            key, sub = jax.random.split(key)
            noise = jax.random.normal(sub, variable.shape, variable.dtype)
            is_norm = path[-1] == "weight" and len(path) > 1 and path[-2].endswith("norm")
            variable[...] = 1.0 + 0.2 * noise if is_norm else 0.5 * noise
    return model


@functools.lru_cache(maxsize=None)
def step_fn(kind: str, window_invariant: bool):
    """A jitted (params, x, positions, cache, vis) -> (out, cache) for one layer kind."""
    graphdef, _ = nnx.split(model_for(kind))

    @jax.jit
    def step(params, x, positions, cache, vis):
        return nnx.merge(graphdef, params)(x, positions, cache, 0, vis, window_invariant=window_invariant)

    return step


def run(model, kind, x, start, lengths, cache, window_invariant=False, depths=None, tree_mask=None):
    """One call: x [B, Q, D], rows starting at `start` [B] with `lengths` [B] real tokens; a chain,
    or a tree with `depths` [Q] and ancestor `tree_mask` [Q, Q] (the same for every row)."""
    start = jnp.asarray(start, jnp.int32)
    positions = start[:, None] + jnp.asarray(np.arange(x.shape[1]) if depths is None else depths, jnp.int32)[None]
    mask = None if tree_mask is None else jnp.broadcast_to(jnp.asarray(tree_mask), (x.shape[0],) + tree_mask.shape)
    vis = Visibility(start, jnp.asarray(lengths, jnp.int32), mask)
    return step_fn(kind, window_invariant)(nnx.state(model), x, positions, cache, vis)


def fresh_cache(kind, batch=1, max_window=CHUNK, cache_dtype=None):
    return init_v4_cache(config_for(kind), batch, CAPACITY, max_window=max_window, page_size=PAGE,
                         layer_types=(kind,), cache_dtype=cache_dtype)


def inputs(batch, length, seed=3):
    return jax.random.normal(jax.random.key(seed), (batch, length, HF_FIELDS["hidden_size"]), jnp.float32)


def prefill(model, kind, x, lengths=None):
    """The recompute: `lengths` [B] tokens (default: all of x) in one call padded to MAX_WINDOW
    tokens (padding writes nothing, and every such call of a test shares one compiled shape)."""
    batch, length = x.shape[:2]
    lengths = [length] * batch if lengths is None else lengths
    padded = jnp.pad(x, ((0, 0), (0, MAX_WINDOW - length), (0, 0)))
    out, cache = run(model, kind, padded, [0] * batch, lengths, fresh_cache(kind, batch, MAX_WINDOW))
    return out[:, :length], cache


def chunked(model, kind, x, lengths, widths=(), cache_dtype=None):
    """Row b's first lengths[b] tokens of x [B, T, D] from an empty cache with small rings, in
    CHUNK-wide calls with `widths` real tokens each (then CHUNK) -> (outputs [lengths[b], D] per
    row, cache)."""
    batch = x.shape[0]
    cache, done = fresh_cache(kind, batch, cache_dtype=cache_dtype), np.zeros(batch, int)
    got = [[] for _ in range(batch)]
    widths = list(widths)
    while (done < lengths).any():
        real = np.minimum(widths.pop(0) if widths else CHUNK, np.asarray(lengths) - done)
        window = jnp.stack([jnp.pad(x[b, done[b]:done[b] + real[b]], ((0, CHUNK - real[b]), (0, 0)))
                            for b in range(batch)])
        out, cache = run(model, kind, window, done, real, cache)
        for b in range(batch):
            got[b].append(np.asarray(out[b, :real[b]]))
        done = done + real
    return [np.concatenate(g) for g in got], cache


# -- (a) parity with transformers ------------------------------------------------------------------

def hf_layer(kind, model):
    """transformers' DeepseekV4Attention holding `model`'s weights (linear weights transposed)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

    # A deep copy: transformers standardizes rope_parameters in place (it would write this
    # config's partial_rotary_factor into the shared dict other configs are built from).
    config = transformers.DeepseekV4Config(**copy.deepcopy(HF_FIELDS), layer_types=[kind])
    config._attn_implementation = "eager"
    layer = DeepseekV4Attention(config, 0).eval()
    ours = {".".join(map(str, path)): np.asarray(v[...]) for path, v in nnx.iter_graph(model)
            if isinstance(v, nnx.Param)}
    with torch.no_grad():
        for name, p in layer.named_parameters():
            value = ours[name].T if name.endswith("proj.weight") else ours[name]
            p.copy_(torch.from_numpy(np.array(value)))  # np.array: a writable copy, which torch can wrap
    return layer, config, DeepseekV4RotaryEmbedding(config)


def hf_call(layer, rotary, config, x, start, cache):
    """transformers' layer over x [1, Q, D] at positions start.. (cache: a DynamicCache or None)."""
    import torch
    q = x.shape[1]
    positions = torch.arange(start, start + q)[None]
    past = 0 if cache is None else min(start, WINDOW - 1)  # the sliding keys the cache keeps
    key_pos = torch.arange(start - past, start + q)
    allowed = (key_pos[None] <= positions[0, :, None]) & (key_pos[None] > positions[0, :, None] - WINDOW)
    mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
    xt = torch.from_numpy(np.array(x))
    embeddings = {kind: rotary(xt, positions, layer_type=kind) for kind in ("main", "compress")}
    with torch.no_grad():
        out, _ = layer(xt, embeddings, positions, mask, cache=cache)
    return out.numpy()


@pytest.mark.hf
@pytest.mark.parametrize("kind", KINDS)
def test_parity_with_transformers(kind):
    from transformers import DynamicCache
    model = model_for(kind)
    layer, config, rotary = hf_layer(kind, model)
    x = inputs(1, 25)
    ours, _ = prefill(model, kind, x)
    theirs = hf_call(layer, rotary, config, x, 0, None)
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-5)

    # Cached: transformers prefills 11 tokens then decodes; ours decodes all 25 one by one, with
    # rings of 12 slots (wrapping twice).
    hf_cache = DynamicCache(config=config)
    theirs_prefill = hf_call(layer, rotary, config, x[:, :11], 0, hf_cache)
    cache = fresh_cache(kind)
    for t in range(11):
        ours_step, cache = run(model, kind, x[:, t:t + 1], [t], [1], cache)
        np.testing.assert_allclose(np.asarray(ours_step[0, 0]), theirs_prefill[0, t], rtol=1e-4, atol=1e-5)
    for t in range(11, 25):
        ours_step, cache = run(model, kind, x[:, t:t + 1], [t], [1], cache)
        theirs_step = hf_call(layer, rotary, config, x[:, t:t + 1], t, hf_cache)
        np.testing.assert_allclose(np.asarray(ours_step), theirs_step, rtol=1e-4, atol=1e-5, err_msg=f"step {t}")
        np.testing.assert_allclose(np.asarray(ours_step[0, 0]), theirs[0, t], rtol=1e-4, atol=1e-5)


# -- (b) causality, cached == recompute --------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_causal_and_chain_windows_equal_recompute(kind):
    model = model_for(kind)
    x = inputs(2, 25)
    full, _ = prefill(model, kind, x)
    # Other tokens from position 17 on change nothing before it.
    changed, _ = prefill(model, kind, x.at[:, 17:].set(inputs(2, 8, seed=5)))
    np.testing.assert_array_equal(np.asarray(changed[:, :17]), np.asarray(full[:, :17]))

    # Row 1 runs one token behind row 0, so the rows close blocks in different calls; windows of
    # 1..5 real tokens in calls 5 wide (one compiled shape), rings wrapping.
    got, _ = chunked(model, kind, x, [25, 24], widths=(5, 5, 1, 1, 2, 3, 4, 1, 3, 2))
    for b in range(2):
        np.testing.assert_allclose(got[b], np.asarray(full[b, :len(got[b])]), rtol=1e-5, atol=1e-5)


def test_window_invariant_chain_equals_single_steps():
    """window_invariant=True: a CSA window of 5 tokens is bit for bit the same tokens decoded one by
    one, cache included (so speculative greedy decoding is exact in bfloat16 too); 13..17 closes
    entry 3 inside the window."""
    model, x = model_for(CSA), inputs(2, 18)
    _, cache = chunked(model, CSA, x, [13, 13])
    window, window_cache = run(model, CSA, x[:, 13:18], [13, 13], [5, 5], cache, window_invariant=True)
    for t in range(13, 18):
        step, cache = run(model, CSA, x[:, t:t + 1], [t, t], [1, 1], cache, window_invariant=True)
        np.testing.assert_array_equal(np.asarray(step[:, 0]), np.asarray(window[:, t - 13]))
    for ours, theirs in zip(jax.tree.leaves(cache), jax.tree.leaves(window_cache)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


# -- (c) rewind ----------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=1)
def readable_rows(cache, kind, length):
    """What a later query can still read after `length` committed tokens: ring rows of the last
    window - 1 slots, projection rows of the blocks still to close, the entries closed so far
    (fixed shapes: slots out of range read as -1, zeros)."""
    before = lambda count: (length - count + jnp.arange(count))[None]
    rows = {"window": cache.read_ring("window", 0, jnp.maximum(before(WINDOW - 1), -1))}
    if kind != SLIDING:
        m = RATES[kind]
        span = 2 * m if kind == CSA else m
        tail = jnp.maximum(before(span - 1), -1)
        entries = jnp.arange(CAPACITY // m)
        entries = jnp.where(entries < length // m, entries, -1)[None]
        names = [(STATE[kind], ENTRIES[kind])] + ([(INDEX_STATE, INDEX_ENTRIES)] if kind == CSA else [])
        for state, entry in names:
            rows[state] = cache.read_ring(state, 0, tail)
            rows[entry] = read_slots(*cache.layer_pages(entry, 0), entries)
    return rows


@pytest.mark.parametrize("kind", KINDS)
def test_rewind_after_rejected_drafts(kind):
    model = model_for(kind)
    x = inputs(2, 30)
    drafts = inputs(2, 30, seed=7)  # wrong tokens: what rejected drafts would feed
    full, _ = prefill(model, kind, x[:, :25])
    _, cache = chunked(model, kind, x, [11, 11])
    length = np.array([11, 11])
    # Windows of 5 from each row's length; the first `accepted` + 1 tokens are right, the rest
    # drafts. From 11, drafts at 12..15 (row 0) or 15 (row 1) close CSA block 3 and HCA block 1
    # (e = 15) and are rejected; drafts and later windows overwrite ring slots (12 per ring) of
    # rejected drafts and of committed tokens that no later query reads.
    for accepted in ((0, 3), (2, 1), (4, 0), (1, 4), (2, 0)):
        window = jnp.stack([jnp.concatenate([x[b, length[b]:length[b] + a + 1],
                                             drafts[b, length[b] + a + 1:length[b] + 5]]) for b, a in enumerate(accepted)])
        out, cache = run(model, kind, window, length, [5, 5], cache)
        for b, a in enumerate(accepted):
            np.testing.assert_allclose(np.asarray(out[b, :a + 1]), np.asarray(full[b, length[b]:length[b] + a + 1]),
                                       rtol=1e-5, atol=1e-5)
        length = length + np.array(accepted) + 1
        _, recompute = prefill(model, kind, x[:, :25], length)
        for b in range(2):
            row = lambda c: c.replace(page_table={k: t[b:b + 1] for k, t in c.page_table.items()},
                                      lengths=c.lengths[b:b + 1])
            ours, theirs = readable_rows(row(cache), kind, length[b]), readable_rows(row(recompute), kind, length[b])
            for name in theirs:
                np.testing.assert_allclose(np.asarray(ours[name]), np.asarray(theirs[name]), rtol=1e-5, atol=1e-5,
                                           err_msg=f"{name} of row {b} after {length[b]} committed")


# -- (d) padding -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_padding_writes_nothing(kind):
    model = model_for(kind)
    x = inputs(2, 16)
    _, cache = chunked(model, kind, x, [11, 7])
    window = x[:, 11:16]
    noise = 1e3 * inputs(2, 5, seed=11)
    lengths = jnp.array([2, 0])
    pad = (jnp.arange(5)[None, :] >= lengths[:, None])[..., None]
    out_a, cache_a = run(model, kind, window, [11, 7], lengths, cache)
    out_b, cache_b = run(model, kind, jnp.where(pad, noise, window), [11, 7], lengths, cache)
    assert np.isfinite(np.asarray(out_a)).all() and np.isfinite(np.asarray(out_b)).all()
    np.testing.assert_array_equal(np.asarray(out_a)[~np.asarray(pad[..., 0])], np.asarray(out_b)[~np.asarray(pad[..., 0])])
    for a, b in zip(jax.tree.leaves(cache_a), jax.tree.leaves(cache_b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Row 1 had no real token: none of its pages changed.
    for name in ["window"] + ([STATE[kind], ENTRIES[kind]] if kind != SLIDING else []):
        flat, pages = cache.layer_pages(name, 0)
        np.testing.assert_array_equal(np.asarray(cache_a.layer_pages(name, 0)[0][pages[1]]), np.asarray(flat[pages[1]]))


# -- trees -----------------------------------------------------------------------------------------

PARENTS = (-1, 0, 0, 1, 2)  # two branches 0-1-3 and 0-2-4; depths 0, 1, 1, 2, 2


def ancestors_of(parents) -> np.ndarray:
    """[N, N] bool: node i's ancestors, itself included (parents listed before children)."""
    mask = np.eye(len(parents), dtype=bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
    return mask


def tree_case(kind, cache_dtype=None):
    """The trees' setup: a layer, 30 inputs, 5 tree nodes, rows committed to 13 and 11 tokens in
    chunks -> (model, x, nodes, prefix [B], cache, PARENTS' ancestor mask, depths)."""
    model = model_for(kind)
    x, nodes = inputs(2, 30), inputs(2, 5, seed=13)
    prefix = np.array([13, 11])
    _, cache = chunked(model, kind, x, prefix, cache_dtype=cache_dtype)
    mask = ancestors_of(PARENTS)
    return model, x, nodes, prefix, cache, mask, mask.sum(1) - 1


def check_nodes_equal_branches(model, kind, nodes, prefix, cache, mask, out):
    """Every node's output in a tree call `out` [B, N, D] equals the chain call of its branch."""
    for node in range(len(mask)):
        branch = np.nonzero(mask[node])[0]
        window = jnp.pad(nodes[:, branch], ((0, 0), (0, CHUNK - len(branch)), (0, 0)))
        chain, _ = run(model, kind, window, prefix, [len(branch)] * 2, cache)
        np.testing.assert_allclose(np.asarray(out[:, node]), np.asarray(chain[:, len(branch) - 1]), rtol=1e-5,
                                   atol=1e-5, err_msg=f"node {node}")


@pytest.mark.parametrize("kind", KINDS)
def test_tree_equals_its_branches_and_commits(kind):
    """Every node of a tree call equals the chain call of its branch (row 0: both depth-2 nodes,
    at position 15, close CSA block 3 and HCA block 1, each from its own branch); after branch
    0-2-4 is committed (`move`) the next chain window, which closes those blocks from the rings,
    equals a recompute of the committed tokens, as does every cache row a later query reads."""
    model, x, nodes, prefix, cache, mask, depths = tree_case(kind)
    out, tree_cache = run(model, kind, nodes, prefix, [5, 5], cache, depths=depths, tree_mask=mask)
    check_nodes_equal_branches(model, kind, nodes, prefix, cache, mask, out)

    accepted = np.array([0, 2, 4])
    moved = tree_cache.move(jnp.asarray(prefix[:, None] + accepted), jnp.asarray(prefix[:, None] + np.arange(3)))
    committed = prefix + 3
    follow = jnp.stack([x[b, committed[b]:committed[b] + CHUNK] for b in range(2)])
    out, moved = run(model, kind, follow, committed, [CHUNK] * 2, moved)
    sequences = jnp.stack([jnp.concatenate([x[b, :prefix[b]], nodes[b, accepted], follow[b],
                                            jnp.zeros((MAX_WINDOW - committed[b] - CHUNK, x.shape[-1]))])
                           for b in range(2)])
    full, recompute = prefill(model, kind, sequences, committed + CHUNK)
    for b in range(2):
        np.testing.assert_allclose(np.asarray(out[b]), np.asarray(full[b, committed[b]:committed[b] + CHUNK]),
                                   rtol=1e-5, atol=1e-5)
        row = lambda c: c.replace(page_table={k: t[b:b + 1] for k, t in c.page_table.items()},
                                  lengths=c.lengths[b:b + 1])
        ours = readable_rows(row(moved), kind, committed[b] + CHUNK)
        theirs = readable_rows(row(recompute), kind, committed[b] + CHUNK)
        for name in theirs:
            np.testing.assert_allclose(np.asarray(ours[name]), np.asarray(theirs[name]), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} of row {b}")


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_window_invariant_tree_equals_its_branches_decoded_alone(kind):
    """window_invariant=True: every node of a tree call is bit for bit its branch decoded one token
    per call (row 0's depth-2 nodes close CSA block 3 and HCA block 1 from their own branch), and
    the tree call writes what the same call without the switch writes, up to rounding (its
    token-local rows computed alone)."""
    model, x, nodes, prefix, cache, mask, depths = tree_case(kind)
    out, tree_cache = run(model, kind, nodes, prefix, [5, 5], cache, window_invariant=True, depths=depths,
                          tree_mask=mask)
    for node in range(5):
        step_cache = cache
        for depth, ancestor in enumerate(np.nonzero(mask[node])[0]):
            step, step_cache = run(model, kind, nodes[:, ancestor:ancestor + 1], prefix + depth, [1, 1], step_cache,
                                   window_invariant=True)
        np.testing.assert_array_equal(np.asarray(out[:, node]), np.asarray(step[:, 0]), err_msg=f"node {node}")
    _, plain_tree_cache = run(model, kind, nodes, prefix, [5, 5], cache, depths=depths, tree_mask=mask)
    for ours, theirs in zip(jax.tree.leaves(tree_cache), jax.tree.leaves(plain_tree_cache)):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-5)
