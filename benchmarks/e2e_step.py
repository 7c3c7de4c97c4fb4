"""A measured decode step of a full-width DeepSeek-V3.2 (or V4-Flash) on one GPU, beside the
projection of the same compiled program.

    python benchmarks/e2e_step.py --json e2e.json                    # B 1, 8, 32 x k 0, 1, 3 at ctx 4096
    python benchmarks/e2e_step.py --points 32,3 --layers 5
    python benchmarks/e2e_step.py --points 32,3 --backend mosaic --cache-dtype fp8 --json e2e_mosaic.json
    python benchmarks/e2e_step.py --points 32,3 1,0 --tiles k128-split     # a grouped-matmul tile variant
    python benchmarks/e2e_step.py --smoke --json e2e.json            # preset tiny, any machine
    python benchmarks/e2e_step.py --v4 --points 1,0 32,3 --auto sinkhorn=mosaic   # DeepSeek-V4-Flash
    python benchmarks/e2e_step.py --points 1,0 1,3 --unroll-layers --profile   # the layers unrolled

The model: preset deepseek-v3.2 at full width with DeepSeek's FP8 weights (float8_e4m3fn, 128 x 128
block scales), cut to its dense first layer, as many MoE layers as fit the device (at least 3;
`jaxspec.memory_plan` sizes it for the widest point, B 32, k 3) and the MTP block. The weights are
random, drawn straight into their stored dtypes on the device (FP8 bit patterns with the top
exponent bit cleared: finite values up to 1.875, scales set so a projection keeps unit size,
powers of two where the config's `scale_fmt` is "ue8m0", as V3.2's release), so no bfloat16 copy
of an expert stack is ever made.

A point (B rows, k MTP drafts; `--context` C): the loop state of B one-token prompts is built
without running the prefill (`state_at`: one compile per point, the step's), both caches are
filled with random entries and their lengths set to C, so each step attends over C committed
tokens (the DSA indexer picks its top-k of them). The step program is
`jaxspec.loop._step` jitted as `jaxspec.step` jits it (state donated), lowered and compiled once;
its cost (XLA's cost analysis of that executable plus the Pallas kernels' stated costs) gives the
projection (`benchmarks/projection.py`: max(bytes / HBM bandwidth, flops / peak) of the device's
target, and with `--calibration` the calibrated form); the ratio printed is measured / projected
throughput, i.e. projected time over measured time (1.0: the step runs at its roofline). Timing: before each step the lengths are
reset to C (a separate tiny program, outside the timed region); each step is timed alone from
dispatch to `block_until_ready`, after `--warmup` steps; the median of `--iters` is reported.
With random weights drafts are rarely accepted; a step's work does not depend on it (the window
and the catch-up have fixed widths). `--backend` picks the attention kernels as
`DecodeConfig.backend` does ("auto": what `AUTO_KERNELS` names for the device, Triton where it
names none; "mosaic": the Mosaic GPU kernels), `--cache-dtype fp8` the FP8 caches DeepSeek's
release keeps (drawn as bfloat16 entries and quantized by the pool's rule), `--tiles` the grouped
matmul's tile variant (`grouped_matmul_pallas.VARIANTS`: the experts and every FP8 linear), and
`--auto OP=IMPL` what "auto" runs for an op as if `AUTO_KERNELS` named it (`backend.auto_kernels`;
`--auto grouped_matmul=mosaic`: the experts and the FP8 linears on the Mosaic GPU grouped matmul,
the step as it would run once the table says so); each point records all four.
`--unroll-layers` compiles the layers unrolled (`DecodeConfig.unroll_layers`) instead of as
scans: the same values, and fewer launches where a scan's body copies each layer's small
parameters out of their stacks (`jaxspec aot` counts both), for a longer compile.

`--v4` measures DeepSeek-V4-Flash the same way (no dense layer: as many layers as fit, at least
four, and its MTP block; every cache array drawn at random, the window rings, compressed entries
and compressor states included), `--auto sinkhorn=mosaic` with each mHC site's Sinkhorn rounds in
one Mosaic GPU launch.

On a CPU "auto" runs the XLA references ("pallas" and "mosaic" their kernels, interpreted) and
the projection uses the H100's peaks: the ratio then only shows that the code path runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from kernel_profile import profile_call
from projection import ROOFLINE, compiled_cost, load_calibration, step_seconds, target_peaks

from jaxspec.aot.model import reduced_depth
from jaxspec.batch import prepare
from jaxspec.decode_config import DecodeConfig
from jaxspec.flags import add_kernel_choice_flags
from jaxspec.loop import DecodeState, _step, prefill, row_sampling
from jaxspec.memory_plan import device_memory, plan_memory
from jaxspec.orbax_io import abstract_model
from jaxspec.pallas_kernels.backend import BACKENDS, auto_kernels
from jaxspec.pallas_kernels.grouped_matmul_pallas import DEFAULT_VARIANT, tile_variant
from jaxspec.pallas_kernels.fp8_cache import Fp8Pool, quantize_entries
from jaxspec.presets import preset
from jaxspec.sampling import base_key

FP8 = jnp.float8_e4m3fn
MIN_MOE_LAYERS = 3
# Of the device's allocatable bytes (`memory_plan.device_memory`), what the plan may fill: the
# plan's temporaries are estimates, and XLA's autotuner and the step's own scratch need room.
FILL = 0.9
FULL = dict(preset="deepseek-v3.2", batches=(1, 8, 32), drafts=(0, 1, 3), context=4096, iters=10, warmup=2)
# --v4: the DeepSeek-V4 preset of the same size.
V4_PRESETS = {"deepseek-v3.2": "deepseek-v4-flash", "tiny": "tiny-v4"}
SMOKE = dict(preset="tiny", batches=(2,), drafts=(0, 1), context=64, iters=2, warmup=1)
# FP8 values drawn as e4m3fn bit patterns: root mean square of those values (exponent uniform in
# 0..7 once its top bit is cleared), which the block scales divide out.
FP8_RMS = 0.48


def target_of(device) -> str:
    """The `jaxspec/targets` spec whose peaks project `device`'s steps: "h200" for an H200, else "h100"."""
    return "h200" if "H200" in device.device_kind else "h100"


def fitting_layers(config, decode: DecodeConfig, batch: int, memory: int | None) -> int:
    """Decoder layers (1 dense + MoE) of `config` the device holds at `batch` rows under `decode`:
    the most, up to the config's depth, whose `plan_memory` resident bytes and step temporaries
    (no prefill runs here) stay within FILL of `memory` (None, the CPU: the smallest model,
    1 + MIN_MOE_LAYERS). Raises ValueError when even that does not fit."""
    smallest = min(1 + MIN_MOE_LAYERS, config.num_hidden_layers)
    if memory is None:
        return smallest

    def needed(layers: int) -> int:
        plan = plan_memory(shallow(config, layers), decode, batch=batch, prompt_len=1, dtype=FP8)
        return plan.resident + plan.step_temp

    fits = [layers for layers in range(smallest, config.num_hidden_layers + 1) if needed(layers) <= FILL * memory]
    if not fits:
        raise ValueError(f"{smallest} layers of {config.model_type} at batch {batch} do not fit "
                         f"{FILL:.0%} of {memory / 2**30:.1f} GiB")
    return fits[-1]


def shallow(config, layers: int):
    """`config` cut to `layers` decoder layers, the first dense where the model has dense layers
    (V3.2; V4 has none) and the rest MoE, and its MTP block."""
    return reduced_depth(config, layers).replace(first_k_dense_replace=min(config.first_k_dense_replace, 1, layers - 1))


def _draw(key, shape, dtype, kind: str, scale_fmt: str | None = None):
    """One parameter's random value, drawn in its own dtype (see the module docstring); scale_fmt:
    the config's, "ue8m0" rounding the FP8 block scales to the nearest power of two."""
    if kind == "fp8":
        bits = jax.random.bits(key, shape, jnp.uint8) & 0xBF  # clear the exponent's top bit: finite, |x| <= 1.875
        return jax.lax.bitcast_convert_type(bits, FP8)
    if kind == "scale":  # [..., in / 128, out / 128]: unit-sized outputs for unit-sized inputs
        scale = 1.0 / (FP8_RMS * np.sqrt(shape[-2] * 128))
        return jnp.full(shape, 2.0 ** np.round(np.log2(scale)) if scale_fmt == "ue8m0" else scale, dtype)
    if kind == "norm":
        return jnp.ones(shape, dtype)
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_fp8_model(config, seed: int = 0) -> nnx.Module:
    """`config` built in DeepSeek's FP8 layout with random values, each parameter drawn on the
    default device in its stored dtype (`_draw`; one program for all of them, whose temporaries
    are one parameter's at a time); nothing is initialized in a wider dtype."""
    graphdef, abstract, _ = abstract_model(config, FP8)
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)

    def draw(key, index, path, leaf):
        name = jax.tree_util.keystr(path)
        if leaf.dtype == FP8:
            kind = "fp8"
        elif "scale_inv" in name:
            kind = "scale"
        elif "norm" in name and "weight" in name:
            kind = "norm"
        elif "bias" in name or not jnp.issubdtype(leaf.dtype, jnp.floating):
            kind = "zeros"
        else:
            kind = "normal"
        return _draw(jax.random.fold_in(key, index), tuple(leaf.shape), leaf.dtype, kind, config.scale_fmt)

    build = jax.jit(lambda key: [draw(key, i, path, leaf) for i, (path, leaf) in enumerate(paths)])
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, build(jax.random.key(seed))))


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("context",))
def _at_context(state, context: int):
    """`state` with every row at `context` committed tokens in both caches."""
    full = jnp.full_like(state.target_cache.lengths, context)
    mtp = None if state.mtp_cache is None else state.mtp_cache.replace(lengths=full)
    return state.replace(target_cache=state.target_cache.replace(lengths=full), mtp_cache=mtp)


@functools.partial(jax.jit, donate_argnums=0)
def _random_caches(state, key):
    """`state` with random entries in every cache array of both caches (V3.2's latents and indexer
    keys, V4's window rings, compressed entries and compressor states; an FP8 pool's quantized by
    its rule): attention reads real-looking data, not the zeros `init_cache` wrote. Integer arrays
    (page tables, lengths) stay."""
    def drawn(pool, key):  # a stacked pool [L, ...], drawn a layer at a time: float32 for one layer only
        if not (isinstance(pool, Fp8Pool) or jnp.issubdtype(pool.dtype, jnp.floating)):
            return pool

        def layer(k):  # `Fp8Pool.shape` is its entries' (dequantized) shape, as a plain pool's
            values = jax.random.normal(k, pool.shape[1:], jnp.float32)
            if isinstance(pool, Fp8Pool):
                return quantize_entries(values, pool.rule, pool.values.shape[-1])
            return values.astype(pool.dtype)

        return jax.lax.map(layer, jax.random.split(key, pool.shape[0]))

    def fill(cache, key):  # None (no MTP cache) has no leaves
        leaves, treedef = jax.tree.flatten(cache, is_leaf=lambda x: isinstance(x, Fp8Pool))
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(treedef, [drawn(leaf, k) for leaf, k in zip(leaves, keys)])

    target_key, mtp_key = jax.random.split(key)
    return state.replace(target_cache=fill(state.target_cache, target_key), mtp_cache=fill(state.mtp_cache, mtp_key))


def state_at(model, batch: int, decode: DecodeConfig) -> DecodeState:
    """A loop state of `batch` one-token prompts as `init_state` would return it, without running
    (and compiling) the prefill: caches as `generate` builds them (`jaxspec.batch.prepare`),
    every other field of the prefill's output shape, drawn at random where a step reads values
    (last token, MTP seeds), the config's sampling parameters, zeros elsewhere (counters, the output
    buffer)."""
    rng = np.random.default_rng(batch * 10 + decode.num_draft)
    prompts = rng.integers(2, model.config.vocab_size, (batch, 1)).tolist()
    prepared = prepare(model, prompts, decode)
    graphdef, params = nnx.split(model)
    shapes = jax.eval_shape(functools.partial(prefill, graphdef, config=decode), params, prepared.prompts,
                            prepared.prompt_lens, prepared.target_cache, prepared.mtp_cache, base_key(0))
    keys = iter(jax.random.split(jax.random.key(batch), 2))
    # prompts / prompt_lens are None outside prefill_in_loop: they stay None. The static fields
    # (config, mesh, plan) are not arrays: the prefill's own.
    fields = {field.name: jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), getattr(shapes, field.name))
              for field in dataclasses.fields(DecodeState)
              if field.name not in ("target_cache", "mtp_cache", "rng_key", "sampling") and not field.metadata.get("static")}
    fields["last_token"] = jnp.asarray(rng.integers(2, model.config.vocab_size, batch), jnp.int32)
    for name in ("seed_logits", "seed_hidden"):
        fields[name] = jax.random.normal(next(keys), fields[name].shape, jnp.float32).astype(fields[name].dtype)
    return DecodeState(target_cache=prepared.target_cache, mtp_cache=prepared.mtp_cache, rng_key=base_key(0),
                       sampling=row_sampling(decode, batch), config=shapes.config, mesh=shapes.mesh, plan=shapes.plan,
                       **fields)


@dataclasses.dataclass
class Point:
    """One measured point: the preset, batch, drafts, context, the model's depth, the backend,
    cache dtype, grouped-matmul tile variant and `auto_kernels` choices it ran with, the step's median and
    spread (seconds), the compiled program's flops and bytes, the projections (seconds) and, with
    `--profile`, one more step's kernel times by op class (`kernel_profile.profile_call`;
    {"error": ...} where the profiler failed)."""

    model: str
    batch: int
    drafts: int
    context: int
    layers: int
    backend: str
    cache_dtype: str
    tiles: str
    auto: dict
    measured_s: float
    spread_s: tuple[float, float]
    compile_s: float
    flops: float
    bytes: float
    by_class: dict
    target: str
    projected_s: float
    calibrated_s: float | None
    calibration: str
    profile: dict | None = None
    unrolled: bool = False

    @property
    def ratio(self) -> float:
        """Measured / projected throughput (= projected step time / measured step time): the
        fraction of the roofline projection the real step reaches."""
        return self.projected_s / self.measured_s


def step_decode(drafts: int, context: int, backend: str = "auto", cache_dtype: str | None = None,
                unrolled: bool = False) -> DecodeConfig:
    """The decode settings a point's step is compiled with (`measure_point`; `launch_check.py`
    compiles a recorded point's step again with them)."""
    return DecodeConfig(num_draft=drafts, max_new_tokens=context, backend=backend, cache_dtype=cache_dtype,
                        unroll_layers=unrolled)


def measure_point(model, model_name: str, batch: int, drafts: int, context: int, *, iters: int, warmup: int,
                  calibration=ROOFLINE, backend: str = "auto", cache_dtype: str | None = None,
                  tiles: str = DEFAULT_VARIANT, auto: dict | None = None, profile: bool = False,
                  unrolled: bool = False) -> Point:
    """Build the state at `context`, compile the step, time it, project it (module docstring) and,
    if asked, profile one more step."""
    decode = step_decode(drafts, context, backend, cache_dtype, unrolled)
    graphdef, params = nnx.split(model)
    state = _at_context(_random_caches(state_at(model, batch, decode), jax.random.key(drafts)), context)
    start = time.perf_counter()
    auto = auto or {}
    with tile_variant(tiles), auto_kernels(**auto):  # read while tracing
        compiled = jax.jit(_step, static_argnames=("graphdef", "config"), donate_argnames=("state",)).lower(
            graphdef, params, state, config=decode).compile()
    compile_s = time.perf_counter() - start
    times = []
    for i in range(warmup + iters):
        state = jax.block_until_ready(_at_context(state, context))
        start = time.perf_counter()
        state = jax.block_until_ready(compiled(params, state))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    found = None
    if profile:
        state = jax.block_until_ready(_at_context(state, context))
        try:
            found = profile_call(lambda: compiled(params, state))
        except Exception as error:  # the measured point stands without it; the error is kept and printed
            found = {"error": f"{type(error).__name__}: {error}"[:500]}
    cost = compiled_cost(compiled, launches=(found or {}).get("by_class_kernels"))
    target = target_of(jax.devices()[0])
    peaks = target_peaks(target)
    return Point(model=model_name, batch=batch, drafts=drafts, context=context, layers=model.config.num_hidden_layers,
                 backend=backend, cache_dtype=cache_dtype or "bfloat16", tiles=tiles, auto=auto,
                 measured_s=statistics.median(times), spread_s=(min(times), max(times)), compile_s=compile_s,
                 flops=cost.flops, bytes=cost.bytes_accessed, by_class=cost.by_class, target=target,
                 projected_s=step_seconds(cost, peaks),
                 calibrated_s=step_seconds(cost, peaks, calibration)
                 if calibration.fractions or calibration.launch_seconds else None,
                 calibration=calibration.describe(), profile=found, unrolled=unrolled)


def profile_line(profile: dict) -> str:
    """A point's profile (`Point.profile`) in one line."""
    if "error" in profile:
        return f"profile failed: {profile['error']}"
    counts = profile.get("by_class_kernels", {})  # profiles recorded before the counts have none
    classes = ", ".join(f"{name} {ms:.2f}" + (f" ({counts[name]} kernels)" if name in counts else "")
                        for name, ms in profile["by_class_ms"].items())
    return (f"profile (ms): {classes}; kernels {profile['busy_ms']:.2f} busy of {profile['span_ms']:.2f} "
            f"from first to last ({profile['kernels']} kernels)")


def parse_point(text: str) -> tuple[int, int]:
    try:
        batch, drafts = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected B,K (e.g. 32,3)") from None
    if batch < 1 or drafts < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: B must be >= 1 and K >= 0")
    return batch, drafts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="preset tiny at tiny sizes; runs anywhere")
    parser.add_argument("--v4", action="store_true",
                        help="DeepSeek-V4-Flash instead of V3.2 (under --smoke tiny-v4 instead of tiny)")
    parser.add_argument("--points", type=parse_point, nargs="+", metavar="B,K",
                        help="(batch, drafts) points (default: B 1, 8, 32 x k 0, 1, 3; --smoke: 2,0 2,1)")
    parser.add_argument("--context", type=int, help="committed tokens per row (default 4096; --smoke 64)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: as many as fit, at least 4)")
    parser.add_argument("--iters", type=int, help="timed steps per point (default 10; --smoke 2)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="the kernels' implementation, as DecodeConfig.backend (default auto)")
    parser.add_argument("--cache-dtype", choices=["fp8"], default=None,
                        help="fp8: FP8 caches (the latent in FlashMLA's tokens, the indexer keys e4m3)")
    add_kernel_choice_flags(parser)
    parser.add_argument("--calibration", metavar="JSON", help="also project with this calibration (projection.py)")
    parser.add_argument("--json", metavar="PATH", help="write the points here as they finish (existing points kept)")
    parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                        help="start no new point after this many seconds")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more step per point: kernel time by op class, time between kernels")
    parser.add_argument("--unroll-layers", action="store_true",
                        help="compile the decoder layers unrolled instead of as scans (DecodeConfig.unroll_layers)")
    args = parser.parse_args(argv)
    setting = SMOKE if args.smoke else FULL
    context = args.context or setting["context"]
    points = args.points or [(b, k) for b in setting["batches"] for k in setting["drafts"]]
    iters = args.iters or setting["iters"]
    if iters < 1 or context < 1:
        parser.error("--iters and --context must be >= 1")
    calibration = ROOFLINE if args.calibration is None else load_calibration(args.calibration)
    name = V4_PRESETS[setting["preset"]] if args.v4 else setting["preset"]
    config = preset(name)
    widest = DecodeConfig(num_draft=max(k for _, k in points), max_new_tokens=context, backend=args.backend,
                          cache_dtype=args.cache_dtype)
    layers = args.layers or fitting_layers(config, widest, max(b for b, _ in points), device_memory())
    if not 1 + MIN_MOE_LAYERS <= layers <= config.num_hidden_layers and not args.smoke:
        parser.error(f"--layers {layers}: must be in [{1 + MIN_MOE_LAYERS}, {config.num_hidden_layers}]")
    started = time.perf_counter()
    model = random_fp8_model(shallow(config, layers))
    dense = f" ({model.config.first_k_dense_replace} dense)" if model.config.first_k_dense_replace else ""
    print(f"device: {jax.devices()[0].device_kind}; {name} FP8, {layers} layers{dense} + MTP, "
          f"random weights built in {time.perf_counter() - started:.1f} s; context {context}; "
          f"backend {args.backend}; {'FP8' if args.cache_dtype else 'bfloat16'} caches; tiles {args.tiles}; "
          f"auto {dict(args.auto) or 'as AUTO_KERNELS'}; layers {'unrolled' if args.unroll_layers else 'as scans'}; "
          f"calibration {calibration.describe()}", flush=True)
    print(f"{'B':>4} {'k':>2} {'measured ms':>11} {'min-max':>15} {'projected ms':>12} {'m/p':>6} "
          f"{'calibrated ms':>13} {'TFLOP':>7} {'GB':>7} {'compile s':>9}", flush=True)
    done = {}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            done = json.load(f)
    for batch, drafts in points:
        if args.deadline is not None and time.perf_counter() - started > args.deadline:
            print(f"deadline: B={batch} k={drafts} not started", flush=True)
            continue
        point = measure_point(model, name, batch, drafts, context, iters=iters, warmup=setting["warmup"],
                              calibration=calibration, backend=args.backend, cache_dtype=args.cache_dtype,
                              tiles=args.tiles, auto=dict(args.auto), profile=args.profile,
                              unrolled=args.unroll_layers)
        calibrated = f"{point.calibrated_s * 1e3:>13.3f}" if point.calibrated_s else f"{'-':>13}"
        print(f"{batch:>4} {drafts:>2} {point.measured_s * 1e3:>11.3f} "
              f"{point.spread_s[0] * 1e3:>7.2f}-{point.spread_s[1] * 1e3:<7.2f} {point.projected_s * 1e3:>12.3f} "
              f"{point.ratio:>6.2f} {calibrated} {point.flops / 1e12:>7.3f} {point.bytes / 1e9:>7.2f} "
              f"{point.compile_s:>9.1f}", flush=True)
        if point.profile is not None:
            print(f"{'':>7} {profile_line(point.profile)}", flush=True)
        if args.json:
            # Keyed by everything that sets the program, so runs with other settings add to the file.
            key = f"B={batch},k={drafts},ctx={context},backend={point.backend},cache={point.cache_dtype}" + (
                "" if args.tiles == DEFAULT_VARIANT else f",tiles={args.tiles}") + "".join(
                f",auto={op}={impl}" for op, impl in sorted(args.auto)) + (f",model={name}" if args.v4 else "") + (
                ",unrolled" if args.unroll_layers else "")
            done[key] = {**dataclasses.asdict(point), "ratio": point.ratio,
                                                          "device": jax.devices()[0].device_kind}
            with open(args.json, "w") as f:
                json.dump(done, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
