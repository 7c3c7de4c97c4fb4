"""DeepSeek-V3.2's linear layers at decode shapes on a GPU: a bfloat16 weight through XLA's dot and
an FP8 weight (128 x 128 block scales) through the grouped-matmul kernel, as `models.layers.Linear`
runs them on the pallas backend, and through XLA (its dot of the dequantized weight, as on "xla").

    python benchmarks/matmuls.py --json matmuls.json     # on a GPU
    python benchmarks/matmuls.py --smoke                 # tiny widths, any machine (interpret mode)

Shapes (in x out): the attention's q_a_proj (7168 x 1536), kv_a_proj_with_mqa (7168 x 576: not
whole 128-column blocks, so the kernel's last block is the slice that ends at column 576),
q_b_proj (1536 x 24576) and o_proj (16384 x 7168), and the dense MLP's gate_proj (7168 x 18432)
and down_proj (18432 x 7168), for T tokens per call (default 8, 32, 128: decode at B 8, 32 and
verification at B 32, k = 3). Each row prints time, the bytes the layer must move at least (the
weight once, in its stored dtype with its scales, plus activations in and out), achieved GB/s and
TFLOP/s. Weights and inputs are random (FP8 weights with V3.2's power-of-two block scales, its
`scale_fmt`). --tiles times the FP8 layers once per grouped-matmul tile
variant (`grouped_matmul_pallas.VARIANTS`: the K step, stages, K splits that fill the GPU where a layer
has few column blocks), a row each; --mosaic-tiles adds the FP8 layers on the Mosaic GPU kernel
(`grouped_matmul_mosaic.py`: kv_a_proj's 576 columns are not whole blocks, and stay on Triton)
under each variant it names; --w8a8-tiles adds them on the W8A8 Mosaic kernel
(`grouped_matmul_mosaic_w8a8`: activations quantized to e4m3 as DeepSeek's inference does, on a
copy of the weight stored [out, in], made before the timing; rows `fp8:w8a8:VARIANT`, other
numerics within FP8's rounding); --dtypes picks the weights' rows. A timing is
`benchmarks/attention_kernels.py`'s: the best of three runs of --iters back-to-back calls after --warmup,
beside the device time of the layer's kernels a call ("dev ms", which the rates use).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from attention_kernels import (add_timing_flags, copy_bandwidth, gpu_or_smoke, grouped_matmul_runs, time_cells, timings,
                               write_rows)

from jaxspec.models.layers import Linear
from jaxspec.pallas_kernels.grouped_matmul_mosaic import accepts
from jaxspec.pallas_kernels.grouped_matmul_mosaic_swapped import swapped_weights
from jaxspec.pallas_kernels.grouped_matmul_mosaic_w8a8 import W8A8_VARIANTS, grouped_matmul_mosaic_w8a8
from jaxspec.pallas_kernels.grouped_matmul_pallas import DEFAULT_VARIANT, VARIANTS, tile_variant
from jaxspec.presets import preset

SHAPES = {"q_a_proj": (7168, 1536), "kv_a_proj_with_mqa": (7168, 576), "q_b_proj": (1536, 24576),
          "o_proj": (16384, 7168), "mlp_gate_proj": (7168, 18432), "mlp_down_proj": (18432, 7168)}
SMOKE_SHAPES = {"smoke_256x384": (256, 384)}
V32_SCALE_FMT = preset("deepseek-v3.2").scale_fmt
DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


def min_bytes(layer: Linear, tokens: int) -> int:
    """The weight (and its scales) read once, bfloat16 activations in and out."""
    weight = layer.weight[...]
    scales = 0 if layer.weight_scale_inv is None else layer.weight_scale_inv[...].nbytes
    return weight.nbytes + scales + 2 * tokens * (weight.shape[0] + weight.shape[1])


def w8a8_layer(layer: Linear, variant: str):
    """An FP8 layer on the W8A8 kernel: (params, x [T, in]) -> [T, out], its weight [out, in]
    copied once here (`swapped_weights`), as a model that ran the kernel would store it."""
    rhs_t, scales = swapped_weights(layer.weight[...][None], layer.weight_scale_inv[...][None])
    run = jax.jit(functools.partial(grouped_matmul_mosaic_w8a8, pow2_scales=V32_SCALE_FMT == "ue8m0",
                                    tiles=VARIANTS[variant], interpret=jax.default_backend() != "gpu"))
    return lambda params, x: run(x, rhs_t, jnp.asarray([x.shape[0]], jnp.int32), scales)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny widths; runs anywhere (interpret mode off a GPU)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128], help="tokens per call")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="the weights' dtypes")
    parser.add_argument("--tiles", nargs="+", choices=VARIANTS, default=[DEFAULT_VARIANT],
                        help="the FP8 kernel's tile variants, a row each")
    parser.add_argument("--mosaic-tiles", nargs="*", choices=VARIANTS, default=[],
                        help="also the FP8 layers on the Mosaic GPU grouped matmul under these tile variants")
    parser.add_argument("--w8a8-tiles", nargs="*", choices=W8A8_VARIANTS, default=[],
                        help="also the FP8 layers on the W8A8 Mosaic GPU kernel under these tile variants")
    add_timing_flags(parser)
    args = parser.parse_args(argv)
    if not gpu_or_smoke("benchmarks/matmuls.py", args.smoke):
        return 2
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.smoke:
        args.tokens, args.iters, args.warmup = [4], 1, 1
    copy_bytes = (1 << 20) if args.smoke else (1 << 30)
    copy_bw = copy_bandwidth(copy_bytes, args.iters, args.warmup)
    print(f"device: {jax.devices()[0].device_kind}; copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    header = f"{'layer':<20}{'weight':>16}{'T':>6}{'ms':>10}{'dev ms':>10}{'GB/s':>8}{'%copy':>7}{'TFLOP/s':>9}"
    print(header)
    print("-" * len(header))
    rows = []
    for name, (fan_in, fan_out) in shapes.items():
        for label in args.dtypes:
            layer = Linear(fan_in, fan_out, rngs=nnx.Rngs(0), dtype=DTYPES[label], scale_fmt=V32_SCALE_FMT)
            graphdef, params = nnx.split(layer)
            # A bfloat16 weight is XLA's dot on "pallas". An FP8 weight also runs on "xla" (XLA
            # dequantizes it into a bfloat16 copy, then its dot reads that: 5 bytes a weight against
            # the kernel's 1), the model's other way to multiply by it.
            runs = (grouped_matmul_runs(args.tiles, args.mosaic_tiles) + [("xla", "xla", DEFAULT_VARIANT)]
                    + [(f"w8a8:{variant}", "w8a8", variant) for variant in args.w8a8_tiles]
                    if label == "fp8" else [("xla", "pallas", DEFAULT_VARIANT)])
            for impl, backend, tiles in runs:
                shown = label if (label, impl) in (("bf16", "xla"), ("fp8", "pallas")) else \
                    f"{label}:{impl.removeprefix('pallas:')}"
                if backend in ("mosaic", "w8a8") and not accepts(jax.ShapeDtypeStruct((1, fan_in), jnp.bfloat16),
                                                                 layer.weight[...][None],
                                                                 layer.weight_scale_inv[...][None]):
                    print(f"{name:<20}{shown:>16}  skipped: not whole 128-blocks, the op runs it on Triton")
                    continue
                if backend == "w8a8":
                    fn = w8a8_layer(layer, tiles)
                else:
                    fn = jax.jit(lambda p, x, backend=backend: nnx.merge(graphdef, p)(x, backend=backend))
                calls = {tokens: functools.partial(fn, params, jax.random.normal(jax.random.key(tokens),
                                                                                  (tokens, fan_in), jnp.bfloat16))
                         for tokens in args.tokens}
                with tile_variant(tiles):
                    found = timings(calls, args.iters, args.warmup)
                for tokens, (seconds, device) in found.items():
                    nbytes, flops = min_bytes(layer, tokens), 2 * tokens * fan_in * fan_out
                    rows.append(dict(op=f"linear_{label}", impl=impl, layer=name, tokens=tokens, seconds=seconds,
                                     device_seconds=device, bytes=nbytes, flops=flops))
                    spent, times = time_cells(seconds, device)
                    print(f"{name:<20}{shown:>16}{tokens:>6}{times}"
                          f"{nbytes / spent / 1e9:>8.0f}{100 * nbytes / spent / copy_bw:>6.0f}%"
                          f"{flops / spent / 1e12:>9.1f}", flush=True)
    if args.json:
        write_rows(args.json, copy_bw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
