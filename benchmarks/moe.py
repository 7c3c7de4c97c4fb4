"""One DeepSeek MoE layer timed on a GPU for the three ways to run its experts (`models/moe.py`), at
the widths of --model:

  * deepseek-v3.2 (default): hidden 7168, 256 experts of 2048, top-8 (group-limited, 4 of 8
    groups), one shared expert, sigmoid scores;
  * deepseek-v4-flash: hidden 4096, 256 experts of 2048, top-6, one shared expert, sqrt(softplus)
    scores, SwiGLU clamped at 10 (a learned-routing layer, as 40 of its 43 are).

The three paths:

  * pallas     — the grouped-matmul Pallas kernel (`pallas_kernels/grouped_matmul_pallas.py`);
  * ragged_dot — `jax.lax.ragged_dot`, which XLA's GPU backend lowers to a matmul over every expert;
  * gathered   — each assignment's expert weights gathered ([T, k, D, H] materialized).

--weights fp8 stores the experts as DeepSeek ships them (float8_e4m3fn with 128 x 128 block
scales, as the end-to-end step runs them) and times the kernel alone (the XLA paths would first
dequantize every expert). --tiles times the kernel once per grouped-matmul tile variant
(`grouped_matmul_pallas.VARIANTS`: the K step, stages, K splits), one row each; --mosaic-tiles adds the
Mosaic GPU kernel (`grouped_matmul_mosaic.py`) under each variant it names.

For T tokens per call (default 8, 32, 128, 1024: decode at batch 8 and 32, verification at k = 3,
prefill) it prints time per layer, the distinct experts the call hit, achieved bandwidth (the bytes
the layer must move at least: each hit expert's three matrices once, the shared expert, the router
and the activations, divided by the time) as GB/s and as a fraction of a device-to-device copy
measured in the same run, TFLOP/s of the routed work, each row's time over the first kernel row's
(the kernel's speedup over each XLA path, a variant's against the first), and each row's largest
difference from that row's output. Weights and inputs are random (bf16: 22.5 GB of experts for
V3.2, 12.9 GB for V4-Flash); a path whose memory would not fit is skipped and said so.

    python benchmarks/moe.py                    # the sweep, on a GPU (H100 / H200)
    python benchmarks/moe.py --tokens 32 128
    python benchmarks/moe.py --model deepseek-v4-flash
    python benchmarks/moe.py --weights fp8 --tiles k64 k128
    python benchmarks/moe.py --smoke            # tiny widths, any machine (interpret mode)

A timing is the best of three runs of --iters back-to-back calls (after --warmup calls), beside
the layer's kernels' device time a call ("dev ms", which the rates use), as in
`benchmarks/attention_kernels.py`, whose timing and copy-bandwidth helpers this script imports (run it as
a script from the repository: `benchmarks/` is on the path then).
"""

from __future__ import annotations

import argparse
import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from attention_kernels import (MEMORY_FRACTION, add_timing_flags, copy_bandwidth, gpu_or_smoke, grouped_matmul_runs,
                               time_cells, timings, write_rows)

from jaxspec import progress
from jaxspec.memory_plan import device_memory
from jaxspec.models.moe import MoE, route
from jaxspec.pallas_kernels import block_fp8
from jaxspec.pallas_kernels.grouped_matmul_mosaic import accepts
from jaxspec.pallas_kernels.grouped_matmul_pallas import DEFAULT_VARIANT, VARIANTS, tile_variant
from jaxspec.presets import preset

# (label, MoE path, backend)
PATHS = (("pallas", "grouped", "pallas"), ("ragged_dot", "grouped", "xla"), ("gathered", "gathered", "xla"))
WEIGHTS = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
MODELS = ("deepseek-v3.2", "deepseek-v4-flash")
# --smoke widths per model: V3.2 keeps group-limited routing; V4 routes ungrouped and its shared
# expert's width (intermediate_size) is the experts'.
SMOKE_WIDTHS = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                    n_shared_experts=1)
SMOKE_MODEL_WIDTHS = {"deepseek-v3.2": dict(n_group=4, topk_group=2), "deepseek-v4-flash": dict(intermediate_size=32)}


def mosaic_takes(config, weight_dtype) -> bool:
    """Whether the Mosaic grouped matmul takes the layer's expert matmuls (gate and up [E, D, H],
    down [E, H, D]); where it does not, the op would run them on Triton."""
    dim, hidden, experts = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts
    lhs = jax.ShapeDtypeStruct((1, dim), jnp.bfloat16)

    def fits(depth, width):
        rhs = jax.ShapeDtypeStruct((experts, depth, width), weight_dtype)
        fp8 = jnp.dtype(weight_dtype) == jnp.dtype(block_fp8.FP8)
        scales = jax.ShapeDtypeStruct(block_fp8.scale_shape(rhs.shape), jnp.float32) if fp8 else None
        return accepts(lhs, rhs, scales)

    return fits(dim, hidden) and fits(hidden, dim)


def extra_memory(label: str, config, num_tokens: int) -> int:
    """Bytes a path needs beyond the weights, roughly: the gathered path's [T, k, D, H] weights; the
    dense ragged_dot's [T * k, E, H] partial products (what XLA's GPU lowering allocates, in f32)."""
    dim, hidden, experts, topk = (config.hidden_size, config.moe_intermediate_size, config.n_routed_experts,
                                  config.num_experts_per_tok)
    if label == "gathered":
        return 3 * num_tokens * topk * dim * hidden * 2
    if label == "ragged_dot":
        return num_tokens * topk * experts * max(dim, hidden) * 4
    return 16 * num_tokens * topk * dim * 4


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny widths; runs anywhere (interpret mode off a GPU)")
    parser.add_argument("--model", choices=MODELS, default=MODELS[0], help="whose MoE layer widths and routing")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128, 1024], help="tokens per MoE call")
    parser.add_argument("--weights", choices=WEIGHTS, default="bf16",
                        help="the experts' stored dtype (fp8: block-scaled, the kernel path only)")
    parser.add_argument("--tiles", nargs="+", choices=VARIANTS, default=[DEFAULT_VARIANT],
                        help="the kernel's tile variants, a row each")
    parser.add_argument("--mosaic-tiles", nargs="*", choices=VARIANTS, default=[],
                        help="also the Mosaic GPU grouped matmul under these tile variants, a row each")
    add_timing_flags(parser)
    args = parser.parse_args(argv)

    if not gpu_or_smoke("benchmarks/moe.py", args.smoke):
        return 2
    config = preset(args.model, **({**SMOKE_WIDTHS, **SMOKE_MODEL_WIDTHS[args.model]} if args.smoke else {}))
    if args.smoke:
        args.tokens, args.iters, args.warmup = [8], 1, 1
    dim, hidden, experts, topk = (config.hidden_size, config.moe_intermediate_size, config.n_routed_experts,
                                  config.num_experts_per_tok)
    fp8 = args.weights == "fp8"
    # An FP8 expert is 1 byte a weight plus a float32 scale per 128 x 128 block.
    expert_bytes = 3 * dim * hidden * (1 + 4 / 128 ** 2 if fp8 else 2)
    shared_bytes = 3 * dim * hidden * 2 * config.n_shared_experts / (2 if fp8 else 1)
    moe = MoE(config, rngs=nnx.Rngs(0), dtype=WEIGHTS[args.weights])
    graphdef, params = nnx.split(moe)
    memory = device_memory()
    weight_bytes = experts * expert_bytes
    # The kernel once per tile variant (and the Mosaic kernel), then (bf16 weights) the XLA paths.
    paths = [(label, "grouped", backend, tiles)
             for label, backend, tiles in grouped_matmul_runs(args.tiles, args.mosaic_tiles)]
    paths += [] if fp8 else [(label, path, backend, DEFAULT_VARIANT) for label, path, backend in PATHS[1:]]
    op = "moe_layer_fp8" if fp8 else "moe_layer"
    mosaic_ok = mosaic_takes(config, WEIGHTS[args.weights])

    copy_bytes = (1 << 20) if args.smoke else (1 << 30)
    copy_bw = copy_bandwidth(copy_bytes, args.iters, args.warmup)
    print(f"device: {jax.devices()[0].device_kind}; copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write of "
          f"{copy_bytes >> 20} MiB); {args.model}{' (smoke widths)' if args.smoke else ''}: hidden {dim}, "
          f"{experts} experts of {hidden}, top-{topk} by {config.scoring_func}, {config.n_shared_experts} shared; "
          f"expert weights ({args.weights}) {weight_bytes / 2**30:.1f} GiB")
    header = f"{'T':>6}  {'path':<17}{'hit':>5}{'ms':>10}{'dev ms':>10}{'GB/s':>8}{'%copy':>7}{'TFLOP/s':>9}{'vs pallas':>10}{'max diff':>10}"
    print(header)
    print("-" * len(header))

    rows = []
    for num_tokens in progress.bar(args.tokens, "token counts"):
        x = jax.random.normal(jax.random.key(num_tokens), (1, num_tokens, dim), jnp.bfloat16)
        _, chosen = route(config, x[0], moe.gate_weight[...], moe.e_score_correction_bias[...])
        hit = len(np.unique(np.asarray(chosen)))
        shared = config.n_shared_experts
        min_bytes = round(hit * expert_bytes + shared_bytes + dim * experts * 4 + 2 * num_tokens * dim * 2)
        flops = 2 * (3 * dim * hidden * num_tokens * (topk + shared) + dim * experts * num_tokens)
        kernel_out = kernel_seconds = None
        for label, path, backend, tiles in paths:
            prefix = f"{num_tokens:>6}  {label:<17}{hit:>5}"
            if backend == "mosaic" and not mosaic_ok:
                print(f"{prefix}  skipped: the Mosaic kernel needs hidden and expert widths in 128-blocks")
                continue
            if memory is not None and weight_bytes + extra_memory(label, config, num_tokens) > MEMORY_FRACTION * memory:
                print(f"{prefix}  skipped: memory")
                continue
            fn = jax.jit(lambda p, x, path=path, backend=backend: nnx.merge(graphdef, p)(x, path=path, backend=backend))
            try:
                with tile_variant(tiles):
                    out = jax.block_until_ready(fn(params, x))
                    (seconds, device), = timings({label: lambda: fn(params, x)}, args.iters, args.warmup).values()
            except jax.errors.JaxRuntimeError as failure:  # out of memory after all
                print(f"{prefix}  {type(failure).__name__}")
                continue
            spent, times = time_cells(seconds, device)  # the rates and ratios use the device's time where measured
            if backend == "pallas" and kernel_out is None:  # the first kernel row: what the others compare with
                kernel_out, kernel_seconds = out, spent
            versus = diff = ""
            if kernel_out is not None:  # time / the kernel's time, and the largest output difference
                versus = f"{spent / kernel_seconds:>9.2f}x"
                diff = f"{float(jnp.max(jnp.abs(out.astype(jnp.float32) - kernel_out.astype(jnp.float32)))):>10.2e}"
            bandwidth = min_bytes / spent
            rows.append(dict(op=op, impl=label, tokens=num_tokens, experts_hit=hit, seconds=seconds,
                             device_seconds=device, bytes=min_bytes, flops=flops))
            print(f"{prefix}{times}{bandwidth / 1e9:>8.0f}{100 * bandwidth / copy_bw:>6.0f}%"
                  f"{flops / spent / 1e12:>9.1f}{versus}{diff}")
            del out
            gc.collect()
    if args.json:
        write_rows(args.json, copy_bw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
