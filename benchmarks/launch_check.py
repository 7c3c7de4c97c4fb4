"""The launches `jaxspec aot` counts without a GPU beside the device events a GPU's profile saw, for
each profiled end-to-end point of a GPU report.

    JAX_PLATFORMS=cpu python benchmarks/launch_check.py docs/gpu-report/report.json

The projection's launch floor (`projection.py`: each op class at least its launches x a launch's
time) rests on `aot.launch_counts`, read from the thunk sequence of a program compiled for an H100
or H200 on this host. The GPU report's e2e points (`gpu_report.py`'s e2e and gmm parts, run with
`e2e_step.py --profile`) record how many device events, kernels and copies on the GPU's streams,
one step showed the profiler (`kernel_profile.summarize`), and per op class where the profile
counted them. This script compiles each profiled point's step here as `e2e_step.py` built it (the
model cut to the point's layers, FP8 weights, its backend, cache dtype, grouped-matmul tiles,
`--auto` choices and layer unrolling) for the point's GPU at that GPU's memory, and prints both
counts, per class where it can. Run it on the tree and the jax version the GPU run used: the
compiled program is theirs, and another XLA fuses otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax.numpy as jnp
from e2e_step import shallow, step_decode

from jaxspec import aot
from jaxspec.aot.model import compile_model
from jaxspec.pallas_kernels.backend import auto_kernels
from jaxspec.pallas_kernels.grouped_matmul_pallas import DEFAULT_VARIANT, tile_variant
from jaxspec.presets import preset

# Points recorded before e2e_step.py named its model or unrolled layers were V3.2's, as scans.
DEFAULT_MODEL = "deepseek-v3.2"


def profiled_points(report: dict) -> list[tuple[str, str, dict]]:
    """(device, unit, point) for every e2e point of a gpu_report.py report.json (units "e2e/...",
    V4-Flash's "e2e_v4/..." and "gmm/e2e-.../...") whose profile counted its device events, in the
    report's order."""
    return [(device, unit, point) for device, record in report.get("devices", {}).items()
            for unit, point in record.items()
            if unit.startswith(("e2e/", "e2e_v4/", "gmm/e2e-")) and _profiled_events(point) > 0]


def _profiled_events(point: dict) -> int:
    """The device events a point's profile counted (0 without a profile or a count)."""
    events = (point.get("profile") or {}).get("kernels")
    return events if isinstance(events, int) else 0


def counted_launches(point: dict) -> tuple[int, dict[str, int]]:
    """A point's step compiled here for its GPU -> (launches a step, {op class: launches})."""
    config = shallow(preset(point.get("model", DEFAULT_MODEL)), point["layers"])
    cache_dtype = point.get("cache_dtype")
    decode = step_decode(point["drafts"], point["context"], point["backend"],
                         None if cache_dtype in (None, "bfloat16") else cache_dtype, point.get("unrolled", False))
    with tile_variant(point.get("tiles", DEFAULT_VARIANT)), auto_kernels(**point.get("auto", {})):
        compiled = compile_model(config, decode, phase="decode", batch=point["batch"], context=point["context"],
                                 devices=aot.gpu_devices(point["target"], 1), dtype=jnp.float8_e4m3fn)
    return sum(aot.launch_counts(compiled).values()), aot.op_class_launches(compiled)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", help="a gpu_report.py report.json")
    args = parser.parse_args(argv)
    try:
        with open(args.report) as f:
            report = json.load(f)
    except (OSError, ValueError) as bad:
        parser.error(f"{args.report}: {bad}")
    points = profiled_points(report)
    if not points:
        print(f"{args.report}: no e2e point with a profiled kernel count")
        return 1
    print(f"{'device':<22} {'point':<34} {'profiled':>8} {'counted':>8} {'counted/profiled':>16}  per class "
          "(counted / profiled)")
    for device, unit, point in points:
        total, by_class = counted_launches(point)
        profiled = point["profile"]["kernels"]
        seen = point["profile"].get("by_class_kernels") or {}
        classes = ", ".join(f"{name} {by_class[name]} / {seen[name]}" for name in by_class if name in seen)
        print(f"{device:<22} {unit:<34} {profiled:>8} {total:>8} {total / profiled:>16.3f}  {classes or '-'}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
