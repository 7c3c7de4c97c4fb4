"""Decode-shape benchmark of the Pallas kernels against their XLA references (GPU).

For every shape (B rows x context x Q window tokens, H heads) it times, for each op, the Pallas
Triton kernel ("pallas"), the Mosaic GPU kernel where the op has one ("mosaic") and the pure-jnp
reference, and prints time, achieved HBM bandwidth (the bytes the op must move at least: its
cache reads, queries and outputs), TFLOP/s, and the bandwidth as a fraction of a device-to-device
copy measured in the same run; on a device kind `PEAKS` knows, a roofline row gives the time the
op's bytes and flops allow. The indexer's top-k is timed separately on the
kernel's scores: `lax.top_k` and the count of ranks (`ranks.top_k_indices`), the two ways
`select_topk` selects (it counts up to `SELECT_COUNT_LIMIT` comparisons a call), beside
`lax.approx_max_k` and a full stable sort, with approx_max_k's recall against the exact top-k.

The ops: DeepSeek-V3.2's `mla_attention`, `sparse_mla` and `indexer_scores` (with its top-k), and
DeepSeek-V4's `sliding_compressed_attention` in its two compressed layer kinds, `v4_csa` (the
sliding window plus each token's indexer top-k of the entries closed every 4 tokens) and `v4_hca`
(the window plus every entry closed every 128 tokens): one 512-wide K = V entry per key shared by
all heads, per-head attention sinks, at DeepSeek-V4-Flash's widths by default (--v4-preset).
Queries and keys are random: RoPE (on their last 64 dims) is applied before the op, which does not
see it. The V4 caches are laid out as `jaxspec.cache_v4` sizes them (ring of window - 1 + Q slots,
entries for the context), in random page order.

    python benchmarks/attention_kernels.py                       # the full sweep, on a GPU
    python benchmarks/attention_kernels.py --batch 8 --context 16384 --queries 2
    python benchmarks/attention_kernels.py --ops v4_csa v4_hca   # only DeepSeek-V4's attention
    python benchmarks/attention_kernels.py --ops mla_attention --part-slots 2048 4096   # Mosaic split-KV parts
    python benchmarks/attention_kernels.py --smoke               # tiny shapes, any machine (interpret mode)

Shapes whose inputs (or a reference's intermediates) do not fit in device memory are skipped and
said so. A timing ("ms") is the best of three runs of --iters back-to-back calls (after --warmup
calls; under --smoke one call after the op's first); "dev ms" is the op's kernels' device time a
call, from JAX's profiler (`kernel_profile.device_seconds`), which the rates, the ratio to XLA and
the GPU report's verdicts use: a call from Python pays tens of microseconds of dispatch that a
compiled decode step does not, and the smaller shapes' calls take that long whatever their kernels do.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import os
import sys
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from kernel_profile import device_seconds

from jaxspec import progress
from jaxspec.cache_v4 import ring_capacities
from jaxspec.memory_plan import device_memory
from jaxspec.model_config import CSA, HCA, ModelConfig
from jaxspec.pallas_kernels import (Visibility, indexer_scores_reference, mla_attention_reference, ranks,
                                    sliding_compressed_attention_reference, sparse_mla_attention_reference)
from jaxspec.pallas_kernels.fp8_cache import (INDEX_RULE, LATENT_RULE, V4_RULE, cache_token_bytes, fp8_index_queries,
                                              quantize_entries)
from jaxspec.pallas_kernels.grouped_matmul_pallas import DEFAULT_VARIANT
from jaxspec.pallas_kernels.indexer_mosaic import indexer_scores_mosaic
from jaxspec.pallas_kernels.indexer_pallas import indexer_scores_pallas
from jaxspec.pallas_kernels.mla_attention_mosaic import BLOCK_N, mla_attention_mosaic
from jaxspec.pallas_kernels.mla_attention_pallas import mla_attention_pallas
from jaxspec.pallas_kernels.sliding_compressed_attention_pallas import sliding_compressed_attention_pallas
from jaxspec.pallas_kernels.sliding_compressed_attention_mosaic import sliding_compressed_attention_mosaic
from jaxspec.pallas_kernels.sparse_mla_attention_mosaic import sparse_mla_attention_mosaic
from jaxspec.pallas_kernels.sparse_mla_attention_pallas import sparse_mla_attention_pallas
from jaxspec.presets import preset


class Dims(NamedTuple):
    """Model dims the benchmark runs at: DeepSeek-V3.2 by default, tiny for --smoke."""

    heads: int
    latent: int
    rope: int
    index_heads: int
    index_dim: int
    topk: int
    page_size: int


DEEPSEEK_V32 = Dims(heads=128, latent=512, rope=64, index_heads=64, index_dim=128, topk=2048, page_size=64)
# The smallest widths every Mosaic GPU kernel takes: Dl a multiple of 128 (two warpgroups split it),
# Dr and the indexer's width multiples of 64 (64-wide swizzled rows), pages of 64.
SMOKE = Dims(heads=4, latent=128, rope=64, index_heads=4, index_dim=64, topk=32, page_size=64)
V32_OPS = ("mla_attention", "sparse_mla", "indexer_scores")
TUNED_OPS = ("mla_attention", "sparse_mla")  # what --block-m / --block-n / --num-splits / --num-stages tune (Triton)
V4_OPS = {"v4_csa": CSA, "v4_hca": HCA}  # op name -> the V4 layer kind it times
V4_PRESETS = ("deepseek-v4-flash", "deepseek-v4-pro")
# device kind -> (HBM bytes/s, dense bf16 tensor-core FLOP/s) from the vendor's datasheet: the
# roofline row's time is max(bytes / bandwidth, flops / compute).
PEAKS = {"NVIDIA H100 80GB HBM3": (3.35e12, 989e12), "NVIDIA H200": (4.8e12, 989e12)}
# Keep inputs plus the largest intermediate under this fraction of device memory.
MEMORY_FRACTION = 0.7
ITEM = 2  # bf16 bytes


def slot_bytes(width: int, rope: int, rule: str, cache_dtype=None) -> int:
    """Bytes a cache slot of `width` values takes: bfloat16, or with cache_dtype="fp8" the token of
    a pool of `rule` with `rope` bfloat16 RoPE values (the pool's own count, `Fp8Pool.token_bytes`)."""
    if cache_dtype != "fp8":
        return width * ITEM
    return cache_token_bytes(jax.eval_shape(
        lambda: quantize_entries(jnp.zeros((1, 1, width), jnp.bfloat16), rule, width - rope)))


def gpu_or_smoke(script: str, smoke: bool) -> bool:
    """Whether `script` can run here: on a GPU, or anywhere with --smoke (interpret mode); says why
    not on stderr otherwise."""
    if jax.default_backend() == "gpu" or smoke:
        if jax.default_backend() != "gpu":
            print("(interpret mode on CPU: the numbers only show the benchmark runs)")
        return True
    print(f"{script} needs a GPU (jax.default_backend() is {jax.default_backend()!r}); "
          "use --smoke for a quick interpret-mode run at tiny sizes.", file=sys.stderr)
    return False


def add_timing_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every timing benchmark takes: --iters, --warmup, --json."""
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", metavar="PATH", help="also write every timed row (and the copy bandwidth) here")


def grouped_matmul_runs(variants: list[str], mosaic_variants: list[str]) -> list[tuple[str, str, str]]:
    """The grouped-matmul kernel rows of moe.py and matmuls.py: (impl label, backend, tile variant),
    the Triton kernel once per variant of `variants` ("pallas", or "pallas:NAME" for one not the
    default), then the Mosaic GPU kernel once per variant of `mosaic_variants` ("mosaic",
    "mosaic:NAME"): both kernels take a variant's K step, stages and K splits."""
    return [(backend if name == DEFAULT_VARIANT else f"{backend}:{name}", backend, name)
            for backend, names in (("pallas", variants), ("mosaic", mosaic_variants)) for name in names]


RUNS = 3  # `timed`'s runs, of which the best counts


def timed(fn, *args, iters: int, warmup: int, runs: int = RUNS) -> float:
    """Seconds per call: `iters` calls dispatched back to back and synchronised once (so host
    dispatch overlaps device work, as in a decode loop), best of `runs` such runs, after warmup."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        seconds.append((time.perf_counter() - start) / iters)
    return min(seconds)


# On a GPU a call gets this long to return once compiled (`first_call`, `watchdog`): the benchmarks'
# calls take milliseconds, and a kernel that never returns (on an H200 the three-warpgroup Mosaic
# kernels once waited for registers their block did not have) would otherwise hold its benchmark
# until the GPU report's --unit-timeout, minutes of a lent GPU's few.
CALL_SECONDS = 30.0
HUNG_EXIT = 3  # the exit status of a run a hung call ended (`gpu_report.py` says so)


def call_limit() -> float | None:
    """Seconds a `watchdog` block may take: CALL_SECONDS on a GPU; no limit elsewhere, where the
    Mosaic simulator's time is not the kernel's."""
    return CALL_SECONDS if jax.default_backend() == "gpu" else None


@contextlib.contextmanager
def watchdog(what: str, on_hang=None):
    """Within the block, work on the device must be done in `call_limit()` seconds. Past it the
    process prints that `what` hung, calls on_hang(message) (a benchmark writes its JSON there) and
    ends with status HUNG_EXIT at once: a kernel that waits forever on the device cannot be stopped
    from the host, and every later call would queue behind it."""
    seconds = call_limit()
    if seconds is None:
        yield
        return

    def hung():
        message = f"hung: {what} did not return within {seconds:.0f} s"
        print(message, flush=True)
        try:
            if on_hang is not None:
                on_hang(message)
        finally:
            sys.stdout.flush()
            os._exit(HUNG_EXIT)

    timer = threading.Timer(seconds, hung)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def first_call(fn, *args, what: str, on_hang=None):
    """(fn compiled for args, its first result, ready): compiled first, so that `watchdog` limits
    the run alone (a compile may take longer than any call should); the compiled function is the
    one to time afterwards. what, on_hang: as `watchdog`'s."""
    compiled = jax.jit(fn).lower(*args).compile()
    with watchdog(what, on_hang):
        return compiled, jax.block_until_ready(compiled(*args))


def hang_writer(path: str | None, copy_bw: float, rows: list[dict], op: str, impl: str):
    """A `watchdog` on_hang for a benchmark without a failures list of its own: writes --json
    (`write_rows`, when path is given) with the rows so far and the hang of `op`'s `impl`."""
    def write(message: str) -> None:
        if path:
            write_rows(path, copy_bw, rows, [dict(op=op, impl=impl, message=message)])

    return write


def timings(calls: dict, iters: int, warmup: int) -> dict[object, tuple[float, float | None]]:
    """name -> (seconds a call by the wall clock, `timed`; its kernels' seconds a call on the
    device, `kernel_profile.device_seconds`, one profiler trace for all of `calls`) for calls, name ->
    a function of no arguments."""
    seconds = {name: timed(call, iters=iters, warmup=warmup) for name, call in calls.items()}
    device = device_seconds(calls, iters)
    return {name: (seconds[name], device[name]) for name in calls}


def time_cells(seconds: float, device: float | None) -> tuple[float, str]:
    """(the seconds a row's rates use: its kernels' device time where measured, else its wall time;
    its printed "ms" and "dev ms" cells, 10 characters each)."""
    shown = f"{device * 1e3:>10.3f}" if device is not None else f"{'-':>10}"
    return device or seconds, f"{seconds * 1e3:>10.3f}{shown}"


def copy_bandwidth(nbytes: int, iters: int, warmup: int) -> float:
    """Bytes/s of a device-to-device elementwise copy (read + write) of `nbytes`."""
    x = jnp.zeros((nbytes // ITEM,), jnp.bfloat16)
    seconds = timed(jax.jit(lambda v: v + 1), x, iters=iters, warmup=warmup)
    return 2 * nbytes / seconds


def write_rows(path: str, copy_bw: float, rows: list[dict], failures: list[dict] | None = None) -> None:
    """--json: the device, the copy bandwidth, every timed row and every kernel that failed
    (`benchmarks/gpu_report.py` reads it). Written whole each time, so that a run cut short leaves
    the rows it finished."""
    with open(path, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "copy_bytes_per_s": copy_bw, "rows": rows,
                   "failures": failures or []}, f, indent=1)


class Case(NamedTuple):
    batch: int
    context: int
    queries: int


def inputs(case: Case, dims: Dims, key, cache_dtype=None):
    """Device arrays for one shape: a chain window of Q tokens at the end of `context` slots. With
    cache_dtype="fp8", V3.2's FP8 caches as DeepSeek's release keeps them: the latent cache an FP8
    pool (FlashMLA's token), the indexer keys e4m3 with one power-of-two scale each and the
    indexer queries e4m3, their scales folded into the weights (`fp8_cache.fp8_index_queries`)."""
    batch, context, queries = case
    pages_per_row = -(-context // dims.page_size)
    num_pages = batch * pages_per_row
    keys = jax.random.split(key, 8)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.bfloat16)  # noqa: E731
    page_table = jax.random.permutation(keys[0], num_pages).reshape(batch, pages_per_row).astype(jnp.int32)
    vis = Visibility(jnp.full((batch,), context - queries, jnp.int32), jnp.full((batch,), queries, jnp.int32))
    # Indices as the indexer would give them: distinct visible slots.
    slot_scores = jax.random.uniform(keys[1], (batch, queries, pages_per_row * dims.page_size))
    slot_scores = jnp.where(jnp.arange(slot_scores.shape[-1]) < context, slot_scores, -1.0)
    indices = jax.lax.top_k(slot_scores, min(dims.topk, context))[1].astype(jnp.int32)
    latent_cache = normal(keys[4], (num_pages, dims.page_size, dims.latent + dims.rope))
    q_idx = normal(keys[5], (batch, queries, dims.index_heads, dims.index_dim))
    raw_weights = jax.random.normal(keys[6], (batch, queries, dims.index_heads), jnp.float32)
    key_cache = normal(keys[7], (num_pages, dims.page_size, dims.index_dim))
    if cache_dtype == "fp8":
        latent_cache = quantize_entries(latent_cache, LATENT_RULE, dims.latent)
        key_cache = quantize_entries(key_cache, INDEX_RULE, dims.index_dim)
        q_idx, weights = fp8_index_queries(q_idx, raw_weights, pow2_scales=True)
    else:
        weights = raw_weights
    return dict(
        q_nope=normal(keys[2], (batch, queries, dims.heads, dims.latent)),
        q_rope=normal(keys[3], (batch, queries, dims.heads, dims.rope)),
        latent_cache=latent_cache, q_idx=q_idx, weights=weights, key_cache=key_cache,
        page_table=page_table, vis=vis, indices=indices)


class Op(NamedTuple):
    """One op at one shape: its implementations, their operands, and the work it must do."""

    name: str
    pallas: object
    xla: object
    args: tuple
    bytes: float  # minimal HBM traffic
    flops: float
    xla_bytes: float  # the reference's largest float32 intermediate (for the memory check)
    mosaic: object = None  # the Mosaic GPU kernel, where the op has one (interpreted off a GPU)


def ops(case: Case, dims: Dims, arrays: dict, tuning: dict) -> list[Op]:
    batch, context, queries = case
    rows = batch * queries * dims.heads
    width = dims.latent + dims.rope
    scale = width ** -0.5
    topk = arrays["indices"].shape[-1]
    q_bytes = rows * width * ITEM + rows * dims.latent * ITEM  # queries in, outputs out
    slot_bytes = cache_token_bytes(arrays["latent_cache"])  # 1152 in bfloat16, 656 in FP8
    key_bytes = cache_token_bytes(arrays["key_cache"])  # 256 in bfloat16, 132 in FP8
    latent_args = (arrays["q_nope"], arrays["q_rope"], arrays["latent_cache"], arrays["page_table"])
    index_args = (arrays["q_idx"], arrays["weights"], arrays["key_cache"], arrays["page_table"], arrays["vis"])
    interpret = jax.default_backend() != "gpu"  # the Mosaic kernels run on the CPU simulator off a GPU
    return [
        Op("mla_attention",
           jax.jit(functools.partial(mla_attention_pallas, softmax_scale=scale, **tuning)),
           jax.jit(functools.partial(mla_attention_reference, softmax_scale=scale)),
           (*latent_args, arrays["vis"]),
           bytes=batch * context * slot_bytes + q_bytes,
           flops=2 * rows * context * (width + dims.latent),
           xla_bytes=4 * (batch * context * width + 2 * rows * context),
           mosaic=functools.partial(mla_attention_mosaic, softmax_scale=scale,
                                    interpret=jax.default_backend() != "gpu")),
        Op("sparse_mla",
           jax.jit(functools.partial(sparse_mla_attention_pallas, softmax_scale=scale, **tuning)),
           jax.jit(functools.partial(sparse_mla_attention_reference, softmax_scale=scale)),
           (*latent_args, arrays["indices"]),
           bytes=batch * queries * topk * (slot_bytes + 4) + q_bytes,
           flops=2 * rows * topk * (width + dims.latent),
           xla_bytes=4 * (batch * queries * topk * width + 2 * rows * topk),
           mosaic=functools.partial(sparse_mla_attention_mosaic, softmax_scale=scale, interpret=interpret)),
        Op("indexer_scores", jax.jit(indexer_scores_pallas), jax.jit(indexer_scores_reference), index_args,
           bytes=batch * context * key_bytes + batch * queries * context * 4,
           flops=2 * batch * queries * dims.index_heads * context * dims.index_dim,
           xla_bytes=4 * (batch * context * dims.index_dim + batch * queries * dims.index_heads * context),
           mosaic=functools.partial(indexer_scores_mosaic, interpret=interpret)),
    ]


def v4_input_bytes(case: Case, config: ModelConfig, page_size: int, cache_dtype=None) -> int:
    """Bytes of the V4 ops' inputs at one shape: each row's window ring and both entry arrays."""
    pages = ring_capacities(config, case.context, case.queries, page_size)
    slots = pages["window"] + pages["csa_entries"] + pages["hca_entries"]
    entry_bytes = slot_bytes(config.head_dim, config.qk_rope_head_dim, V4_RULE, cache_dtype)
    return case.batch * slots * page_size * entry_bytes


def v4_inputs(case: Case, config: ModelConfig, page_size: int, key, cache_dtype=None) -> dict:
    """Device arrays for V4's attention at one shape: a chain of Q tokens at positions
    [context - Q, context), the window ring and the CSA / HCA entries paged as `jaxspec.cache_v4`
    sizes them (random page order; FP8 pools of FlashMLA's MODEL1 token with cache_dtype="fp8"),
    CSA's indices as the indexer gives them (each token's top-k of the entries it sees, entry j
    closing at position (j + 1) * rate - 1; -1 padded) and HCA's counts (every entry the token
    sees)."""
    batch, context, queries = case
    pages = ring_capacities(config, context, queries, page_size)
    rates = dict(config.compress_rates)
    keys = jax.random.split(key, 6)

    def paged(k, count):  # [B * count, page, D] pages (bf16 or FP8) and a [B, count] table over them
        kv_key, table_key = jax.random.split(k)
        kv = jax.random.normal(kv_key, (batch * count, page_size, config.head_dim), jnp.bfloat16)
        if cache_dtype == "fp8":
            kv = quantize_entries(kv, V4_RULE, config.head_dim - config.qk_rope_head_dim)
        return kv, jax.random.permutation(table_key, batch * count).reshape(batch, count).astype(jnp.int32)

    positions = jnp.broadcast_to(jnp.arange(context - queries, context, dtype=jnp.int32), (batch, queries))
    entries = pages["csa_entries"] * page_size
    width = max(entries, config.index_topk)  # top_k needs index_topk columns even with fewer entries
    seen = jnp.arange(width) < ((positions + 1) // rates[CSA])[..., None]
    scores = jnp.where(seen, jax.random.uniform(keys[0], (batch, queries, width)), -1.0)
    top, chosen = jax.lax.top_k(scores, config.index_topk)
    window_kv, window_pages = paged(keys[1], pages["window"])
    csa_kv, csa_pages = paged(keys[2], pages["csa_entries"])
    hca_kv, hca_pages = paged(keys[3], pages["hca_entries"])
    return dict(
        q=jax.random.normal(keys[4], (batch, queries, config.num_attention_heads, config.head_dim), jnp.bfloat16),
        window_kv=window_kv, window_pages=window_pages, positions=positions,
        vis=Visibility(jnp.full((batch,), context - queries, jnp.int32), jnp.full((batch,), queries, jnp.int32)),
        sinks=jax.random.normal(keys[5], (config.num_attention_heads,), jnp.float32),
        **{CSA: (csa_kv, csa_pages, jnp.where(top >= 0, chosen, -1).astype(jnp.int32)),
           HCA: (hca_kv, hca_pages, (positions + 1) // rates[HCA])})


def v4_ops(config: ModelConfig, arrays: dict) -> list[Op]:
    """Both V4 ops on one set of inputs (`v4_inputs`)."""
    return [v4_op(name, config, arrays) for name in V4_OPS]


def v4_op(name: str, config: ModelConfig, arrays: dict) -> Op:
    """One V4 layer kind's attention: sliding window plus CSA's selected or HCA's counted entries."""
    kind = V4_OPS[name]
    q, positions = arrays["q"], arrays["positions"]
    entry_kv, entry_pages, selection = arrays[kind]
    batch, queries, heads, dim = q.shape
    ring = arrays["window_pages"].shape[1] * arrays["window_kv"].shape[1]
    slot_bytes = cache_token_bytes(arrays["window_kv"])
    window_keys = int(jnp.sum(jnp.minimum(positions + 1, config.sliding_window)))  # ring keys, summed over tokens
    if kind == CSA:  # each token's own selected entries: every distinct one read once, every number read
        chosen = np.asarray(selection).reshape(batch, -1)
        entry_keys = int(np.sum(chosen >= 0))
        distinct = sum(np.unique(numbers[numbers >= 0]).size for numbers in chosen)
        entry_bytes = distinct * slot_bytes + chosen.size * 4
        xla_keys = queries * selection.shape[-1]  # the reference gathers [B, Q, K, D]
    else:  # the tokens share one prefix of entries
        entry_keys = int(jnp.sum(selection))
        entry_bytes = batch * int(jnp.max(selection)) * slot_bytes
        xla_keys = entry_pages.shape[1] * entry_kv.shape[1]  # [B, 1, E, D]
    slots = min(config.sliding_window - 1 + queries, int(positions[0, -1]) + 1)  # ring slots a row's tokens see

    def call(impl):
        option = "compressed_indices" if kind == CSA else "compressed_count"
        return jax.jit(lambda q, kv, pages, pos, vis, sinks, entries, entry_pages, selection: impl(
            q, kv, pages, pos, vis, sinks, sliding_window=config.sliding_window, scale=dim ** -0.5,
            compressed_kv=entries, compressed_pages=entry_pages, **{option: selection}))

    @functools.cache
    def mosaic_with(tuning: tuple):  # one jitted call per tuning, so that a timed call is never a compile
        return call(functools.partial(sliding_compressed_attention_mosaic, interpret=jax.default_backend() != "gpu",
                                      **dict(tuning)))

    def mosaic(*args, **tuning):  # the kernel's tunings as keywords, as the MLA ops' Mosaic calls take them
        return mosaic_with(tuple(sorted(tuning.items())))(*args)

    return Op(name, call(sliding_compressed_attention_pallas), call(sliding_compressed_attention_reference),
              (q, arrays["window_kv"], arrays["window_pages"], positions, arrays["vis"], arrays["sinks"],
               entry_kv, entry_pages, selection),
              bytes=batch * slots * slot_bytes + entry_bytes + 2 * q.size * ITEM,  # K = V: each key read once
              flops=4 * heads * dim * (window_keys + entry_keys),  # scores and values, D wide each
              xla_bytes=4 * (batch * (ring + xla_keys) * dim + 2 * batch * queries * heads * (ring + xla_keys)),
              mosaic=mosaic)


def max_error(got, want) -> float:
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    errors = []
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        finite = np.isfinite(w) & (np.abs(w) < 1e29)  # skip -inf scores and EMPTY_LSE
        errors.append(float(np.max(np.abs(g[finite] - w[finite]), initial=0.0)))
    return max(errors)


def topk_rows(scores, topk: int, iters: int, warmup: int):
    """Time exact and approximate top-k on the kernel's scores [B, Q, S] -> [(name, seconds a call,
    device seconds a call, recall)]."""
    k = min(topk, scores.shape[-1])
    variants = {
        "lax.top_k": jax.jit(lambda s: jax.lax.top_k(s, k)[1]),
        # counted at every shape here (no limit), to find where the sort overtakes it
        "rank count": jax.jit(lambda s: ranks.top_k_indices(s, k, limit=s.size * s.shape[-1])),
        "lax.approx_max_k": jax.jit(lambda s: jax.lax.approx_max_k(s, k, recall_target=0.95)[1]),
        "stable sort": jax.jit(lambda s: jnp.argsort(-s, axis=-1, stable=True)[..., :k]),
    }
    exact = np.sort(np.asarray(variants["lax.top_k"](scores)), axis=-1)
    results = []
    for name, fn in variants.items():
        seconds = timed(fn, scores, iters=iters, warmup=warmup)
        got = np.sort(np.asarray(fn(scores)), axis=-1)
        hits = [np.intersect1d(g, e).size for g, e in zip(got.reshape(-1, k), exact.reshape(-1, k))]
        results.append((name, seconds, sum(hits) / exact.size))
    device = device_seconds({name: functools.partial(fn, scores) for name, fn in variants.items()}, iters)
    return [(name, seconds, device[name], recall) for name, seconds, recall in results]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs anywhere (interpret mode off a GPU)")
    parser.add_argument("--ops", nargs="+", choices=(*V32_OPS, *V4_OPS), default=[*V32_OPS, *V4_OPS],
                        help="the ops to time (default: all; indexer_scores includes its top-k)")
    parser.add_argument("--v4-preset", choices=V4_PRESETS, default=V4_PRESETS[0],
                        help="the DeepSeek-V4 widths of v4_csa / v4_hca (--smoke: tiny-v4)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 2, 4])
    add_timing_flags(parser)
    parser.add_argument("--block-m", type=int, default=None, help="query rows per MLA program (default: kernel's)")
    parser.add_argument("--block-n", type=int, default=None,
                        help="cache slots per tile of the Triton MLA kernels (default: kernel's, 16)")
    parser.add_argument("--num-splits", type=int, default=None,
                        help="split-KV parts of the MLA kernels (default: kernel's heuristic)")
    parser.add_argument("--num-stages", type=int, default=None,
                        help="cache tiles in flight in the Triton MLA kernels' loop (default: kernel's, 2)")
    parser.add_argument("--no-xla", action="store_true", help="skip the XLA references")
    parser.add_argument("--no-mosaic", action="store_true", help="skip the Mosaic GPU kernels")
    parser.add_argument("--part-slots", type=int, nargs="+", default=[], metavar="N",
                        help="also time the Mosaic attention kernels (mla_attention, sparse MLA, V4's) with split-KV "
                             "parts of N slots (a multiple of 64; their defaults: 1024, 512, 256), rows "
                             "'mosaic part_slots=N'")
    parser.add_argument("--no-auto-barriers", action="store_true",
                        help="also time the Mosaic sparse MLA kernel lowered without Pallas' automatic barriers "
                             "(auto_barriers=False), rows 'mosaic no auto barriers'")
    parser.add_argument("--copies-by-warp", action="store_true",
                        help="also time the Mosaic sparse MLA and V4 kernels with their key copies issued by each of "
                             "the scorer's four warps (copies_by_warp=True), rows 'mosaic copies by warp'")
    parser.add_argument("--copies-by-thread", action="store_true",
                        help="also time the Mosaic sparse MLA and V4 kernels with each key's copies issued by its "
                             "own thread, one arrival a key (copies_by_thread=True; compiled only), rows "
                             "'mosaic copies by thread'")
    parser.add_argument("--cache-dtype", choices=["fp8"], default=None,
                        help="fp8: the ops read FP8 caches (the latent in FlashMLA's tokens, the indexer's keys "
                             "and queries e4m3, as DeepSeek's release keeps them)")
    args = parser.parse_args(argv)
    if any(n < BLOCK_N or n % BLOCK_N for n in args.part_slots):
        parser.error(f"--part-slots {args.part_slots}: each must be a positive multiple of {BLOCK_N} (the kernel's tile)")

    if not gpu_or_smoke("benchmarks/attention_kernels.py", args.smoke):
        return 2
    dims = SMOKE if args.smoke else DEEPSEEK_V32
    v4 = preset("tiny-v4" if args.smoke else args.v4_preset)
    # No warmup under --smoke: the ops' timings follow a first call (`run_case`), and the others'
    # best of RUNS leaves out the run that compiled.
    if args.smoke:
        args.batch, args.context, args.queries, args.iters, args.warmup = [2], [128], [2], 1, 0
    tuning = {k: v for k, v in (("block_m", args.block_m), ("block_n", args.block_n), ("num_splits", args.num_splits),
                                ("num_stages", args.num_stages)) if v is not None}
    memory = device_memory()

    copy_bytes = (1 << 20) if args.smoke else (1 << 30)
    copy_bw = copy_bandwidth(copy_bytes, args.iters, args.warmup)
    print(f"device: {jax.devices()[0].device_kind}; copy bandwidth {copy_bw / 1e9:.0f} GB/s "
          f"(read + write of {copy_bytes >> 20} MiB); page {dims.page_size}; "
          f"{'FP8' if args.cache_dtype == 'fp8' else 'bfloat16'} caches")
    if set(args.ops) & set(V32_OPS):
        print(f"V3.2: heads {dims.heads}, latent {dims.latent}+{dims.rope}, indexer {dims.index_heads}x"
              f"{dims.index_dim}, top-k {dims.topk}")
    if set(args.ops) & set(V4_OPS):
        rates = dict(v4.compress_rates)
        print(f"V4 ({'tiny-v4' if args.smoke else args.v4_preset}): heads {v4.num_attention_heads}, head_dim "
              f"{v4.head_dim} (K = V), window {v4.sliding_window}, CSA every {rates[CSA]} (top-{v4.index_topk}), "
              f"HCA every {rates[HCA]}, sinks")
    header = (f"{'op':<16}{'impl':<22}{'B':>5}{'ctx':>7}{'Q':>3}{'ms':>10}{'dev ms':>10}{'GB/s':>9}{'TFLOP/s':>9}"
              f"{'%copy':>7}{'vs xla':>8}{'max err':>10}")
    print(header)
    print("-" * len(header))

    key = jax.random.key(0)
    cases = [Case(*point) for point in itertools.product(args.batch, args.context, args.queries)]
    rows, failures = [], []

    def save(more_rows=()):
        if args.json:
            write_rows(args.json, copy_bw, rows + list(more_rows), failures)

    for case in progress.bar(cases, "cases"):
        rows += run_case(case, dims, v4, key, tuning, memory, copy_bw, args, failures, save)
        gc.collect()
        save()
    return 0


def run_case(case: Case, dims: Dims, v4: ModelConfig, key, tuning: dict, memory: int | None, copy_bw: float, args,
             failures: list[dict], save):
    """Time the chosen ops at one shape: V3.2's on one set of inputs, V4's on another (each skipped,
    and said so, when its inputs do not fit). Returns the printed rows as dicts (for --json), each
    with its largest difference from the reference where one was computed (`max_error`). A Mosaic
    kernel that fails on the device (it has never run on one before its first lent GPU) is printed
    and appended to `failures`, and the other rows go on; one that hangs (`watchdog`) is appended
    too, then save(this shape's rows so far) writes the JSON and the run ends (`HUNG_EXIT`)."""
    batch, context, queries = case
    label = f"{batch:>5}{context:>7}{queries:>3}"
    shape = f"at B {batch}, ctx {context}, Q {queries}"  # in a hung call's message
    # An op's kernels and reference are timed after a first call compiled and ran them: under
    # --smoke one more call shows the timing runs (interpreted, a Mosaic call takes tenths of a second).
    runs = 1 if args.smoke else RUNS
    timed_rows = []

    def failure(op, impl, message):
        failures.append(dict(op=op, impl=impl, batch=batch, context=context, queries=queries, message=message[:2000]))

    def hang_recorder(op, impl):
        return lambda message: (failure(op, impl, message), save(timed_rows))

    def row(op, impl, seconds, nbytes, flops, device=None, xla=None, error=None):
        """One printed and recorded row: seconds a call (wall), device its kernels' seconds a call
        (`kernel_profile.device_seconds`), which the rates and the ratio to xla's (its device
        time, else its wall) use where it was measured."""
        timed_rows.append(dict(op=op, impl=impl, batch=batch, context=context, queries=queries, seconds=seconds,
                               device_seconds=device, bytes=nbytes, flops=flops,
                               cache_dtype=args.cache_dtype or "bfloat16", max_error=error))
        spent, times = time_cells(seconds, device)
        bandwidth = nbytes / spent
        speedup = f"{xla / spent:>7.2f}x" if xla else f"{'':>8}"
        err = f"{error:>10.2e}" if error is not None else ""
        print(f"{op:<16}{impl:<22}{label}{times}{bandwidth / 1e9:>9.0f}"
              f"{flops / spent / 1e12:>9.1f}{100 * bandwidth / copy_bw:>6.0f}%{speedup}{err}")

    families = []  # (name, input bytes, the family's ops at this shape)
    if set(args.ops) & set(V32_OPS):
        latent_bytes = slot_bytes(dims.latent + dims.rope, dims.rope, LATENT_RULE, args.cache_dtype)
        key_bytes = slot_bytes(dims.index_dim, 0, INDEX_RULE, args.cache_dtype)
        families.append(("(V3.2)", batch * context * (latent_bytes + key_bytes),
                         lambda: ops(case, dims, inputs(case, dims, key, args.cache_dtype), tuning)))
    if set(args.ops) & set(V4_OPS):
        # V4's caches in pages of the V3.2 cache's size (64, init_v4_cache's default).
        families.append(("(V4)", v4_input_bytes(case, v4, dims.page_size, args.cache_dtype),
                         lambda: v4_ops(v4, v4_inputs(case, v4, dims.page_size, key, args.cache_dtype))))
    for family, input_bytes, build in families:
        if memory is not None and input_bytes > MEMORY_FRACTION * memory:
            print(f"{family:<16}{'skipped: memory':<22}{label}")
            continue
        for op in build():
            if op.name not in args.ops:
                continue
            pallas_out = jax.block_until_ready(op.pallas(*op.args))
            pallas_seconds = timed(op.pallas, *op.args, iters=args.iters, warmup=args.warmup, runs=runs)
            # The Mosaic kernel, with the split-KV part lengths --part-slots asks for (the attention
            # ops: not the indexer), for sparse MLA its lowering without automatic barriers
            # (--no-auto-barriers), for sparse MLA and V4 its copies issued by warp (--copies-by-warp), and
            # by thread on a GPU (--copies-by-thread: the simulator cannot run them).
            mosaic = []
            if op.mosaic is not None and not args.no_mosaic:
                mosaic.append(("mosaic", op.mosaic))
                if op.name != "indexer_scores":
                    mosaic += [(f"mosaic part_slots={n}", functools.partial(op.mosaic, part_slots=n))
                               for n in args.part_slots]
                if op.name == "sparse_mla" and args.no_auto_barriers:
                    mosaic.append(("mosaic no auto barriers", functools.partial(op.mosaic, auto_barriers=False)))
                if op.name in ("sparse_mla", *V4_OPS) and args.copies_by_warp:
                    mosaic.append(("mosaic copies by warp", functools.partial(op.mosaic, copies_by_warp=True)))
                if op.name in ("sparse_mla", *V4_OPS) and args.copies_by_thread and jax.default_backend() == "gpu":
                    mosaic.append(("mosaic copies by thread", functools.partial(op.mosaic, copies_by_thread=True)))
            mosaic_outs, compiled = {}, {}
            for impl, fn in mosaic:
                try:  # a Mosaic kernel refuses shapes it cannot tile (tiny-v4's D 32, FP8 dense MLA below 512)
                    compiled[impl], mosaic_outs[impl] = first_call(fn, *op.args, what=f"{op.name} {impl} {shape}",
                                                                   on_hang=hang_recorder(op.name, impl))
                except ValueError as refused:
                    print(f"{op.name:<16}{impl + ': refused':<22}{label}  {str(refused)[:120]}")
                except Exception as problem:  # noqa: BLE001 (a compile or launch error on the device)
                    message = f"{type(problem).__name__}: {problem}"
                    print(f"{op.name:<16}{impl + ': FAILED':<22}{label}  {message[:300]}")
                    failure(op.name, impl, message)
            mosaic = list(compiled.items())  # the kernels that ran, compiled
            xla_seconds = error = None
            mosaic_errors = {}
            fits = memory is None or input_bytes + op.xla_bytes < MEMORY_FRACTION * memory
            if not args.no_xla and fits:
                try:
                    with jax.default_matmul_precision("highest"):
                        want = op.xla(*op.args)
                    error = max_error(pallas_out, want)
                    mosaic_errors = {impl: max_error(out, want) for impl, out in mosaic_outs.items()}
                    del want
                    xla_seconds = timed(op.xla, *op.args, iters=args.iters, warmup=args.warmup, runs=runs)
                except jax.errors.JaxRuntimeError as failure:  # out of memory after all
                    print(f"{op.name:<16}{'xla: ' + type(failure).__name__:<22}{label}")
            mosaic_seconds = {}
            for impl, fn in mosaic:  # a kernel that returned once may still hang in a later call
                with watchdog(f"{op.name} {impl} {shape} (timing)", hang_recorder(op.name, impl)):
                    mosaic_seconds[impl] = timed(fn, *op.args, iters=args.iters, warmup=args.warmup, runs=runs)
            del mosaic_outs
            calls = {"pallas": functools.partial(op.pallas, *op.args),
                     **{impl: functools.partial(fn, *op.args) for impl, fn in mosaic}}
            if xla_seconds:
                calls["xla"] = functools.partial(op.xla, *op.args)
            device = device_seconds(calls, args.iters)
            xla = device.get("xla") or xla_seconds
            # A tuned Triton kernel's rows say their tuning ("pallas block_n=32"): only untuned rows
            # calibrate the projection (benchmarks/gpu_report.py).
            pallas = " ".join(["pallas", *(f"{k}={v}" for k, v in tuning.items())]) if op.name in TUNED_OPS else "pallas"
            row(op.name, pallas, pallas_seconds, op.bytes, op.flops, device["pallas"], xla, error)
            for impl, seconds in mosaic_seconds.items():
                row(op.name, impl, seconds, op.bytes, op.flops, device[impl], xla, mosaic_errors.get(impl))
            if jax.devices()[0].device_kind in PEAKS:
                bandwidth, compute = PEAKS[jax.devices()[0].device_kind]
                row(op.name, "roofline", max(op.bytes / bandwidth, op.flops / compute), op.bytes, op.flops)
            if xla_seconds:
                row(op.name, "xla", xla_seconds, op.bytes, op.flops, device["xla"])
            elif not args.no_xla and not fits:
                print(f"{op.name:<16}{'xla: skip memory':<22}{label}")
            if op.name == "indexer_scores":
                score_bytes = batch * queries * pallas_out.shape[-1] * 4
                for name, seconds, kernel_seconds, recall in topk_rows(pallas_out, dims.topk, args.iters, args.warmup):
                    row("indexer_topk", name, seconds, score_bytes, 0.0, kernel_seconds)
                    if recall < 1:
                        print(f"{'':<16}{'  recall':<22}{label}{recall:>10.4f}")
            del pallas_out
    return timed_rows


if __name__ == "__main__":
    sys.exit(main())
