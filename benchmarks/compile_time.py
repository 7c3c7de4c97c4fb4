"""Deviceless compile time of DeepSeek-V3.2's programs: the layers as scans (the default) against
the same layers unrolled (`DecodeConfig.unroll_layers`, the program before the layers were
stacked) and against a 4-layer model, side by side in one run.

    JAX_PLATFORMS=cpu python benchmarks/compile_time.py                       # decode, one H100
    JAX_PLATFORMS=cpu python benchmarks/compile_time.py --phase prefill --context 1024
    JAX_PLATFORMS=cpu python benchmarks/compile_time.py --devices 8 --target h200 --dtype fp8 --mesh 1x8

Every row compiles `jaxspec.aot.model.compile_model` (the decode step `generate` runs, or its
prefill) for the target without a GPU, and reports XLA's compile seconds beside the facts that must
not change with the program's shape: per-device memory (arguments, aliased, temporaries) and the
step's flops and bytes (`jaxspec.aot.program_cost`). Compile times depend on the host and its
load (the same command took 62 s on a quiet 2-core host and 127-184 s on a loaded one), so compare
the ratios of one run, never figures of different runs. `--cases` picks rows: scan (full depth,
scanned), unrolled (full depth, unrolled), shallow (4 layers, scanned).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxspec import aot  # noqa: E402
from jaxspec.aot.model import compile_model, reduced_depth  # noqa: E402
from jaxspec.decode_config import DecodeConfig  # noqa: E402
from jaxspec.cli import mesh_shape  # noqa: E402
from jaxspec.flags import positive_int  # noqa: E402
from jaxspec.presets import preset  # noqa: E402

CASES = ("scan", "unrolled", "shallow")
DTYPES = {"bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
SHALLOW_LAYERS = 4


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="deepseek-v3.2")
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--target", choices=("h100", "h200"), default="h100")
    parser.add_argument("--devices", type=positive_int, default=1)
    parser.add_argument("--mesh", type=mesh_shape, metavar="DATAxMODEL", help="a mesh over the devices (default none)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--batch", type=positive_int, default=32)
    parser.add_argument("--context", type=positive_int, default=4096)
    parser.add_argument("--mtp", type=int, default=3, help="MTP draft length k (default 3)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = parser.parse_args(argv)
    # Each row is a compile, never a load or a store: a JAX_COMPILATION_CACHE_DIR in the environment
    # (the test suite sets one) would add writing the program to the time.
    jax.config.update("jax_enable_compilation_cache", False)

    config = preset(args.preset)
    devices = aot.gpu_devices(args.target, args.devices)
    rows = []
    for case in args.cases:
        model_config = reduced_depth(config, SHALLOW_LAYERS) if case == "shallow" else config
        decode = DecodeConfig(num_draft=args.mtp, backend="pallas", unroll_layers=case == "unrolled")
        print(f"compiling {case} ({model_config.num_hidden_layers} layers) ...", file=sys.stderr, flush=True)
        compiled = compile_model(model_config, decode, phase=args.phase, batch=args.batch, context=args.context,
                                 devices=devices, dtype=DTYPES[args.dtype], mesh_shape=args.mesh)
        memory, cost = aot.memory(compiled), aot.program_cost(compiled)
        rows.append((case, model_config.num_hidden_layers, compiled.compile_seconds, memory, cost))

    gib = 2 ** 30
    print(f"{args.phase} of {args.preset} ({args.dtype}), batch {args.batch}, context {args.context}, MTP k={args.mtp}, "
          f"{args.devices} x {devices[0].device_kind}{f', mesh {args.mesh[0]}x{args.mesh[1]}' if args.mesh else ''}")
    base = next((seconds for case, _, seconds, _, _ in rows if case == "scan"), None)
    print(f"{'case':10} {'layers':>6} {'compile s':>10} {'/ scan':>7} {'args GiB':>10} {'aliased GiB':>12} "
          f"{'temp GiB':>9} {'flops':>10} {'bytes':>10}")
    for case, layers, seconds, memory, cost in rows:
        ratio = f"{seconds / base:7.2f}" if base else f"{'':>7}"
        print(f"{case:10} {layers:6d} {seconds:10.1f} {ratio} {memory.argument / gib:10.2f} {memory.alias / gib:12.2f} "
              f"{memory.temp / gib:9.3f} {cost.flops:10.3e} {cost.bytes_accessed:10.3e}")


if __name__ == "__main__":
    main()
