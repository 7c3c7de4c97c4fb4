"""DeepSeek-V3.2's FP8 experts' grouped matmuls alone, on every kernel side by side: the Triton
kernel and the Mosaic GPU one (weights stored [in, out], as the model does), the transposed-
product Mosaic kernel (`grouped_matmul_mosaic_swapped`: weights stored [out, in], as the
checkpoints do, dequantized in registers as wgmma's A operand) and the W8A8 Mosaic kernel
(`grouped_matmul_mosaic_w8a8`: weights [out, in], activations quantized to e4m3 as DeepSeek's
own inference does, e4m3 products on the tensor cores; other numerics, within FP8's rounding),
each under the tile variants named (--tiles, --mosaic-tiles, --swapped-tiles, --w8a8-tiles).

    python benchmarks/expert_matmuls.py --json expert_matmuls.json     # on a GPU
    python benchmarks/expert_matmuls.py --smoke                        # tiny widths, any machine

Shapes: the experts' up projection (E x 7168 x 2048, the gate's the same) and down projection
(E x 2048 x 7168) with the rows of T tokens routed to 8 of the 256 experts each (group sizes drawn
at random, seeded; default T 128, 32 and 1: verification at B 32, k = 3, decode at B 32 and 1).
FP8 weights with power-of-two block scales, as V3.2's release. A row's "GB/s" counts the weights
of the experts hit and their scales once, plus activations in and out; "% roofline" is against
the copy bandwidth measured in the same run. Timings are `benchmarks/attention_kernels.py`'s: the best of
three runs of --iters back-to-back calls after --warmup, beside the device time of the call's
kernels ("dev ms", which the rates use: the swapped kernel's includes its row gather).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from attention_kernels import (add_timing_flags, copy_bandwidth, first_call, gpu_or_smoke, hang_writer, time_cells,
                               timings, write_rows)

from jaxspec.pallas_kernels import block_fp8
from jaxspec.pallas_kernels.grouped_matmul_mosaic import grouped_matmul_mosaic
from jaxspec.pallas_kernels.grouped_matmul_mosaic_swapped import grouped_matmul_mosaic_swapped, swapped_weights
from jaxspec.pallas_kernels.grouped_matmul_mosaic_w8a8 import W8A8_VARIANTS, grouped_matmul_mosaic_w8a8
from jaxspec.pallas_kernels.grouped_matmul_pallas import VARIANTS, grouped_matmul_pallas

# name: (K, N) of one expert's matrix as the model stores it ([in, out]).
SHAPES = {"expert_up": (7168, 2048), "expert_down": (2048, 7168)}
SMOKE_SHAPES = {"smoke_up": (256, 128)}
EXPERTS, TOPK = 256, 8
SMOKE_EXPERTS, SMOKE_TOPK = 8, 2
KERNELS = {"pallas": grouped_matmul_pallas, "mosaic": grouped_matmul_mosaic,
           "mosaic-swapped": grouped_matmul_mosaic_swapped,
           "mosaic-w8a8": functools.partial(grouped_matmul_mosaic_w8a8, pow2_scales=True)}  # V3.2's ue8m0
TRANSPOSED = ("mosaic-swapped", "mosaic-w8a8")  # the kernels that read the weights [out, in]
SWAPPED_TILES = ("k64", "k64-int", "k128", "k64-split")  # the split last: for one token, whose launch is narrow


def routed_sizes(rng, tokens: int, experts: int, topk: int) -> np.ndarray:
    """[E] int32 rows per expert of `tokens` tokens each routed to `topk` distinct experts."""
    chosen = np.stack([rng.choice(experts, topk, replace=False) for _ in range(tokens)])
    return np.bincount(chosen.reshape(-1), minlength=experts).astype(np.int32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny widths; runs anywhere (interpret mode off a GPU)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 32, 1], help="tokens per call")
    parser.add_argument("--tiles", nargs="*", choices=VARIANTS, default=["k64", "k64-int"],
                        help="tile variants of the Triton kernel")
    parser.add_argument("--mosaic-tiles", nargs="*", choices=VARIANTS, default=["k64", "k64-int"],
                        help="tile variants of the Mosaic GPU kernel")
    parser.add_argument("--swapped-tiles", nargs="*", choices=SWAPPED_TILES, default=list(SWAPPED_TILES),
                        help="tile variants of the transposed-product Mosaic kernel")
    parser.add_argument("--w8a8-tiles", nargs="*", choices=W8A8_VARIANTS, default=list(W8A8_VARIANTS),
                        help="tile variants of the W8A8 Mosaic kernel")
    add_timing_flags(parser)
    args = parser.parse_args(argv)
    if not gpu_or_smoke("benchmarks/expert_matmuls.py", args.smoke):
        return 2
    interpret = jax.default_backend() != "gpu"
    shapes, experts, topk = (SMOKE_SHAPES, SMOKE_EXPERTS, SMOKE_TOPK) if args.smoke else (SHAPES, EXPERTS, TOPK)
    if args.smoke:
        args.tokens, args.iters, args.warmup = [4], 1, 1
    copy_bw = copy_bandwidth((1 << 20) if args.smoke else (1 << 30), args.iters, args.warmup)
    print(f"device: {jax.devices()[0].device_kind}; copy bandwidth {copy_bw / 1e9:.0f} GB/s; {experts} experts, "
          f"top-{topk}, FP8 with power-of-two scales")
    header = f"{'matmul':<14}{'kernel':>24}{'T':>6}{'ms':>10}{'dev ms':>10}{'GB/s':>8}{'%copy':>7}"
    print(header)
    print("-" * len(header))
    rows = []
    # The kernel "auto" runs first, then the transposed-product ones, so that a run cut short has
    # the comparisons that matter most.
    runs = [("pallas", variant) for variant in args.tiles] + [("mosaic-swapped", v) for v in args.swapped_tiles]
    runs += [("mosaic-w8a8", variant) for variant in args.w8a8_tiles]
    runs += [("mosaic", variant) for variant in args.mosaic_tiles]
    rng = np.random.default_rng(0)
    for name, (depth, width) in shapes.items():
        draw = jax.random.normal(jax.random.key(depth), (experts, depth, width)) * depth ** -0.5
        quantized, scale_inv = block_fp8.quantize(draw, power_of_two=True)
        del draw
        transposed = swapped_weights(quantized, scale_inv)
        sizes = {tokens: routed_sizes(rng, tokens, experts, topk) for tokens in args.tokens}
        inputs = {tokens: jax.random.normal(jax.random.key(tokens), (tokens * topk, depth), jnp.bfloat16)
                  for tokens in args.tokens}
        for kernel, variant in runs:
            weights = transposed if kernel in TRANSPOSED else (quantized, scale_inv)
            fn = functools.partial(KERNELS[kernel], tiles=VARIANTS[variant], interpret=interpret)
            hung = hang_writer(args.json, copy_bw, rows, "expert_matmul", f"{kernel}:{variant}")
            calls = {}
            for tokens in args.tokens:
                operands = (inputs[tokens], weights[0], jnp.asarray(sizes[tokens]), weights[1])
                compiled, _ = first_call(fn, *operands, what=f"{name} {kernel}:{variant} at {tokens} tokens",
                                         on_hang=hung)
                calls[tokens] = functools.partial(compiled, *operands)
            for tokens, (seconds, device) in timings(calls, args.iters, args.warmup).items():
                hit = int(np.count_nonzero(sizes[tokens]))
                weight_bytes = hit * (depth * width + 4 * (depth // 128) * (width // 128))
                nbytes = weight_bytes + 2 * tokens * topk * (depth + width)
                impl = f"{kernel}:{variant}"
                rows.append(dict(op="expert_matmul", impl=impl, layer=name, tokens=tokens, seconds=seconds,
                                 device_seconds=device, bytes=nbytes, flops=2 * tokens * topk * depth * width))
                spent, times = time_cells(seconds, device)
                print(f"{name:<14}{impl:>24}{tokens:>6}{times}{nbytes / spent / 1e9:>8.0f}"
                      f"{100 * nbytes / spent / copy_bw:>6.0f}%", flush=True)
            if args.json:  # after each kernel: a run cut short keeps the rows it finished
                write_rows(args.json, copy_bw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
