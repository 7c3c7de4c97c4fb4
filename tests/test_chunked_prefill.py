"""Chunked prefill (`DecodeConfig.prefill_chunk`; greedy decoding after chunks of 5 equals plain
greedy in test_v4_loop's (tiny-v4, k = 1) and test_loop's (tiny V3.2, k = 2 and 4) greedy tests):
with window_invariant the target caches after chunks of 5 equal those after the whole prompt in
one chunk bit for bit (tiny-v4 and tiny V3.2); V4's rings are sized by the chunk, which takes
exactly their bytes off the V4-Flash memory plan; bad chunk values are refused when the config is
built.

The prompts (test_v4_loop's: 2 .. 31 tokens) put chunk boundaries (every 5 positions) inside CSA
(m = 4) and HCA (m' = 8) blocks and the sliding window (8), and the 2-token rows finish their
prompt in the first chunk, riding along with empty (query_len 0) chunks after it.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxspec.aot.model import reduced_depth
from jaxspec.batch import cache_geometry, prepare
from jaxspec.cache import pages_per_row
from jaxspec.cache_v4 import ring_capacities
from jaxspec.decode_config import DecodeConfig
from jaxspec.loop import prefill
from jaxspec.memory_plan import plan_memory
from jaxspec.model_config import CSA, HCA, SLIDING
from jaxspec.presets import preset
from jaxspec.sampling import base_key
from test_v4_loop import PAGE, PROMPTS, config

CHUNK = 5  # below the sliding window (8), not a multiple of the compress rates (4, 8)
WIDTH = max(map(len, PROMPTS))  # 31: the prompts' padded width, a one-chunk prefill
_prefill = jax.jit(prefill, static_argnames=("graphdef", "config"))


def run_prefill(model, dcfg: DecodeConfig, max_window: int | None = None):
    """`prefill` of PROMPTS as `generate` prepares it; max_window: V4 rings that wide instead (so
    two runs' caches have one layout: V4's attention reduces over the whole ring)."""
    batch = prepare(model, PROMPTS, dcfg)
    caches = (batch.target_cache, batch.mtp_cache)
    if max_window is not None:
        caches = tuple(model.init_cache(len(PROMPTS), batch.target_cache.capacity, page_size=PAGE, mtp=mtp,
                                        max_window=max_window) for mtp in (False, True))
    graphdef, params = nnx.split(model)
    return _prefill(graphdef, params, batch.prompts, batch.prompt_lens, *caches, base_key(0), dcfg)


def assert_trees(actual, expected, what: str, **tolerance) -> None:
    """Every leaf equal (bit for bit without tolerance)."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True):
        where = f"{what}{jax.tree_util.keystr(path)}"
        if tolerance:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), err_msg=where, **tolerance)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)


@pytest.mark.parametrize("model_name", ["trained_v4", "trained_v32"])
def test_window_invariant_chunks_write_the_whole_prompts_caches(model_name, request):
    """window_invariant: chunks of 5 and one chunk of the whole prompt (a one-call prefill through
    the chunk loop) leave the same target cache (every array, every layer) and first token, bit
    for bit; the MTP's calls are not window-invariant (`draft`), so its cache and seeds agree to
    rounding. V4's rings are 31 wide in both (see `run_prefill`). (The one-call prefill's expanded
    form agrees with these to 1e-5; the greedy tests cover it.)"""
    model = request.getfixturevalue(model_name)
    rings = WIDTH if model.config.is_v4 else None  # a paged V3 cache ignores max_window
    chunked = run_prefill(model, config(2, window_invariant=True, prefill_chunk=CHUNK), max_window=rings)
    whole = run_prefill(model, config(2, window_invariant=True, prefill_chunk=WIDTH))
    np.testing.assert_array_equal(np.asarray(chunked.last_token), np.asarray(whole.last_token))
    assert_trees(chunked.target_cache, whole.target_cache, "target_cache")
    for name in ("mtp_cache", "seed_logits", "seed_hidden"):
        assert_trees(getattr(chunked, name), getattr(whole, name), name, rtol=1e-5, atol=1e-5)


def test_rings_are_sized_by_the_chunk(trained_v4):
    """With a chunk the widest call is max(chunk, window, MTP draft slots), not the prompt: at k = 3
    (window 4) rings for 5 with a chunk of 5, for 4 with a chunk of 2, and for the prompt (31) with
    a chunk longer than it; `generate`'s caches are built for it (`ring_capacities`' rules:
    test_v4_loop; their bytes: the V4-Flash test below)."""
    for chunk, widest in [(CHUNK, CHUNK), (2, 4), (64, WIDTH)]:
        geometry = cache_geometry(WIDTH, config(3, prefill_chunk=chunk), batch_size=1, capacity=64)
        assert (geometry.max_window, geometry.lookback) == (widest, 4)
    batch = prepare(trained_v4, PROMPTS, config(3, prefill_chunk=CHUNK))
    pages = ring_capacities(trained_v4.config, batch.target_cache.capacity, CHUNK, PAGE)
    for cache in (batch.target_cache, batch.mtp_cache):
        assert cache.max_window == CHUNK
        assert {name: table.shape[1] for name, table in cache.page_table.items()} == {
            name: pages[name] for name in cache.page_table}


def v4_ring_bytes(config, rows: int, widest: int, page_size: int, act: int) -> int:
    """Bytes of `rows` rows of V4's rings (target and MTP) and their page tables, from the ring
    rules of `jaxspec.cache_v4`: window ring sliding_window - 1 + W slots of head_dim (activation
    dtype); CSA projection rings 2m - 1 + 2W slots of 4 head_dim (kv and score of two series) plus
    the indexer's 4 index_head_dim, HCA m' - 1 + 2W slots of 2 head_dim, both float32; whole
    pages; one int32 page-table entry per page and row, per structure and cache."""
    rates = dict(config.compress_rates)
    pages = {SLIDING: pages_per_row(config.sliding_window - 1 + widest, page_size),
             CSA: pages_per_row(2 * rates[CSA] - 1 + 2 * widest, page_size),
             HCA: pages_per_row(rates[HCA] - 1 + 2 * widest, page_size)}
    window = pages[SLIDING] * page_size * config.head_dim * act
    per_layer = {SLIDING: window,
                 CSA: window + pages[CSA] * page_size * 4 * (config.head_dim + config.index_head_dim) * 4,
                 HCA: window + pages[HCA] * page_size * 2 * config.head_dim * 4}
    target = sum(per_layer[kind] for kind in config.layer_types)
    tables = sum(pages[kind] for kind in {SLIDING, *config.layer_types}) * 4
    mtp = window + pages[SLIDING] * 4  # the MTP block: one sliding layer
    return rows * (target + tables + mtp)


def test_a_chunk_shrinks_the_v4_flash_memory_plan_by_its_rings():
    """V4-Flash at full width, its first four layers (sliding, sliding, CSA, HCA: every kind), B = 32 on a 1 x 8 mesh (4 rows a device), a
    4096-token prompt, k = 3: a 512-token chunk takes exactly the rings' difference off the caches,
    and the prefill temporaries shrink, planned for the kernels a GPU runs (on the references, the
    experts' `ragged_dot` copies per group, which do not depend on the chunk, are most of them)."""
    flash = reduced_depth(preset("deepseek-v4-flash"), 4)
    decode = DecodeConfig(num_draft=3, max_new_tokens=256, backend="pallas")
    plans = {chunk: plan_memory(flash, decode.replace(prefill_chunk=chunk), batch=32, prompt_len=4096, mesh=(1, 8),
                                dtype=jax.numpy.float8_e4m3fn) for chunk in (None, 512)}
    rings = {widest: v4_ring_bytes(flash, 4, widest, decode.page_size, act=2) for widest in (4096, 512)}
    assert plans[None].caches - plans[512].caches == rings[4096] - rings[512]
    assert plans[512].prefill_temp < plans[None].prefill_temp / 4
    assert plans[512].weights == plans[None].weights


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True, "8"])
def test_bad_chunks_are_refused(chunk):
    with pytest.raises(ValueError, match=r"DecodeConfig.prefill_chunk=.*must be None \(one call\) or an integer >= 1"):
        DecodeConfig(prefill_chunk=chunk)
