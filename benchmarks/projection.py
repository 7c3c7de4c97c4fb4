"""A projection, not a measurement: DeepSeek-V3.2 speculative decoding on H100 SXM and H200, from
the compiled step's own flops and bytes (`jaxspec.aot`) and a roofline.

    JAX_PLATFORMS=cpu python benchmarks/projection.py                         # the whole grid
    JAX_PLATFORMS=cpu python benchmarks/projection.py --batches 32 --contexts 4096 --drafts 0 3
    JAX_PLATFORMS=cpu python benchmarks/projection.py --devices 8 --dtype fp8 --batches 32 --contexts 4096
    JAX_PLATFORMS=cpu python benchmarks/projection.py --batches 32 --contexts 32768 --drafts 3 --cache-dtype fp8

What is measured: for each batch B, context C and draft length k (0 = plain decoding, else an MTP
chain of k), the decode step `jaxspec.loop._step` is compiled for sm_90a (one device, backend
pallas, bf16 parameters) and its flops and bytes accessed are read from the optimized HLO plus the
Pallas kernels' stated costs (attention kernels at a full context). A full-depth compile takes
minutes, so `jaxspec.aot.model.depth_cost` compiles three 1-2 layer models at full width:
A = one MoE layer, D = one dense + one MoE layer, M = two MoE layers. Layers of a kind compile to
the same ops, so the full model's cost is A + 3 (D - A) + 57 (M - A) for V3.2's 3 dense and 58
MoE layers (embedding, LM head, the MTP block and the step's non-model ops are in each of A, D, M).

The device is compiled as having 1 PiB of memory (`gpu_devices(device_memory=)`). With its own
80 GB, XLA fits a program into 80% of it by rematerializing (recomputing) values, and where the
arguments alone exceed that (M's 74 GB of weights and cache, and every deeper model) it recomputes
whatever it can. A and D fit and recomputed nothing; M recomputed, among others, the merged q_b /
indexer wq_b projection of its layers up to twice more. So 57 (M - A) counted 3.18e11 flops per
MoE layer where one costs 2.35e11 (B = 32, ctx 4096, k = 3): this script said 20.0 TFLOP and
1,686 GB where the direct full-depth compile said 15.9 TFLOP and 1,514 GB (itself recomputing a
different amount: what XLA recomputes depends on what is live around it, not on the layer).
`aot.program_cost(...).rematerialized` counts the clones; `depth_cost` refuses a rematerialized
compile. Without rematerialization the extrapolation equals direct
compiles (B = 32, ctx 4096, k = 3, projected / direct - 1 in brackets; XLA sums in float32):
  4 layers (3 dense + 1 MoE):  1.92963e12 flops (+7e-8), 1.19160e11 bytes (-3e-8)
  8 layers (3 dense + 5 MoE):  2.87123e12 flops (+5e-8), 2.16492e11 bytes (-2e-7)
  61 layers (full depth):      1.53474e13 flops (+2e-6), 1.50615e12 bytes (-7e-8)
(the full-depth compile took 803 s on a busy 2-core host, 1.7 GB of RAM; the three shallow
ones take about 70 s together). `--validate N` repeats the check at N layers.

What is projected: step time = max(bytes / HBM bandwidth, flops / peak bf16 tensor flops), both
from XLA's GpuTargetConfig of the GPU (`jaxspec/targets/`: H100 SXM 3.35 TB/s, H200 4.8 TB/s;
2 x 512 bf16 FMA per clock x 4 tensor cores x 132 SMs x 1.83 GHz = 989 TFLOP/s), as if one GPU
held the whole model (it does not: 1.3 TB of bf16 weights). With `--devices N` the step is
compiled sharded over one node's N GPUs (`jaxspec.sharding`'s default plan, mesh 1 x N; add
`--dtype fp8` for DeepSeek's FP8 weights as served): flops, bytes and the collectives' bytes are
per GPU, and the collectives add their bytes / NVLink bandwidth (450 GB/s per direction, not
overlapped with compute) to the step. Tokens/s per row = accepted length / step time; the
speedup is over plain decoding at the same B and C.

Accepted length (tokens per target call), two columns:
  * published: DeepSeek-V3 Technical Report (arXiv:2412.19437), section 5.4.3 "Multi-Token
    Prediction Evaluation": "the acceptance rate of the second token prediction ranges between
    85% and 90% across various generation topics" (k = 1, hence 1.85-1.90; the report's measured
    end-to-end gain is 1.8x TPS). We take 0.875 and, for k = 2, 3 (DeepSeek publishes none for
    chaining its one MTP module), assume each further draft is accepted with the same 0.875
    given its predecessor: 1 + p + ... + p^k. Override with --acceptance.
  * ours: the shipped tiny-stdlib model's measured per-position acceptance 0.89 / 0.42 / 0.36
    (docs/performance.md, `examples/generate.py --mtp 3`): 1 + a_1 + ... + a_k. Override with --measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec import aot, progress
from jaxspec.aot.model import DepthCost, compile_model, depth_cost, reduced_depth
from jaxspec.decode_config import DecodeConfig
from jaxspec.flags import add_cache_dtype_flag
from jaxspec.presets import preset

PUBLISHED_ACCEPTANCE = 0.875
MEASURED_PER_POSITION = (0.89, 0.42, 0.36)
# Per-device memory the programs are compiled for: more than any of them needs (1.3 TB of weights
# plus at most 0.4 TB of cache at B = 128, ctx 32k), so XLA rematerializes nothing.
DEVICE_MEMORY = 2 ** 50
# NVLink 4 on H100 SXM and H200: 900 GB/s per GPU, both directions together (NVIDIA's H100 and
# H200 datasheets); a collective's bytes leave each GPU at half of that.
NVLINK_BYTES_PER_S = 450e9
DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


def target_peaks(target: str) -> tuple[float, float]:
    """(HBM bytes/s, bf16 tensor-core flops/s) from the target's GpuTargetConfig."""
    spec = aot.target_config(target)
    bandwidth = float(re.search(r"memory_bandwidth: (\d+)", spec).group(1))
    cores = int(re.search(r"core_count: (\d+)", spec).group(1))
    bf16 = re.search(r"rate_infos \{\s*key: 16\s*value \{\s*clock_rate_ghz: ([\d.]+)\s*units_per_core: (\d+)\s*"
                     r"ops_per_clock: (\d+)", spec.split("matrix_unit_description")[1])
    clock, units, fmas = float(bf16.group(1)), int(bf16.group(2)), int(bf16.group(3))
    return bandwidth, 2 * fmas * units * cores * clock * 1e9  # an FMA is 2 flops


class Calibration(NamedTuple):
    """Measured fraction of the roofline each op class reaches (`aot.OP_CLASSES` and
    "collectives"; a class it does not name counts as 1.0, the roofline), and where it came from."""

    label: str
    fractions: dict[str, float]

    def describe(self) -> str:
        if not self.fractions:
            return self.label
        return f"{self.label} ({', '.join(f'{name} {value:.2f}' for name, value in sorted(self.fractions.items()))})"


ROOFLINE = Calibration("none: every op class at its roofline", {})


def load_calibration(path: str) -> Calibration:
    """The calibration in a JSON file (`benchmarks/gpu_report.py`'s report, or any file) holding
    {"calibration": {"label": str, "fractions": {class: fraction in (0, 1.5]}}}. Raises ValueError
    naming the file for anything else."""
    with open(path) as f:
        found = json.load(f).get("calibration")
    if not isinstance(found, dict) or not isinstance(found.get("fractions"), dict):
        raise ValueError(f"--calibration {path}: no {{'calibration': {{'label', 'fractions'}}}} in it")
    known = set(aot.OP_CLASSES) | {"collectives"}
    fractions = {name: float(value) for name, value in found["fractions"].items() if value is not None}
    bad = {name: value for name, value in fractions.items() if name not in known or not 0 < value <= 1.5}
    if bad:
        raise ValueError(f"--calibration {path}: fractions {bad}: classes must be in {sorted(known)}, "
                         "each fraction in (0, 1.5]")
    return Calibration(str(found.get("label", path)), fractions)


def compiled_cost(compiled) -> DepthCost:
    """A compiled program's own cost in `depth_cost`'s form (flops, bytes, collectives' bytes, the
    split by op class), for projecting a program compiled directly (or on a real GPU)."""
    cost = aot.program_cost(compiled)
    return DepthCost(flops=cost.flops, bytes_accessed=cost.bytes_accessed, compile_seconds=0.0,
                     collective_bytes=sum(c.bytes * c.runs for c in aot.collectives(compiled)),
                     by_class=aot.op_class_costs(compiled))


def step_seconds(cost: DepthCost, peaks: tuple[float, float], calibration: Calibration = ROOFLINE) -> float:
    """The projected step: without a calibration max(bytes / bandwidth, flops / peak) of the whole
    program; with one, each op class's max(bytes / bandwidth, flops / peak) divided by its measured
    fraction, summed. Collectives add their bytes / NVLink bandwidth (divided by their fraction)."""
    bandwidth, peak = peaks
    roofline = lambda flops, nbytes: max(nbytes / bandwidth, flops / peak)
    fraction = lambda name: calibration.fractions.get(name, 1.0)
    if calibration.fractions:
        compute = sum(roofline(*cost.by_class[name]) / fraction(name) for name in aot.OP_CLASSES)
    else:
        compute = roofline(cost.flops, cost.bytes_accessed)
    return compute + cost.collective_bytes / NVLINK_BYTES_PER_S / fraction("collectives")


def note(line: str) -> None:
    progress.write(f"[{time.strftime('%H:%M:%S')}] {line}")


def validate(layers: int, batch: int, context: int, drafts: int, devices) -> None:
    """Compile `layers` layers directly and compare with the extrapolation from A, D, M."""
    config = reduced_depth(preset("deepseek-v3.2"), layers)
    decode = DecodeConfig(num_draft=drafts, backend="pallas")
    point = dict(phase="decode", batch=batch, context=context, devices=devices)
    projected = depth_cost(config, decode, **point, on_compile=lambda name, seconds: note(
        f"validate {layers} layers: {name} compiled in {seconds:.0f} s"))
    compiled = compile_model(config, decode, **point)
    direct = aot.program_cost(compiled)
    note(f"validate {layers} layers: direct compile in {compiled.compile_seconds:.0f} s")
    print(f"validate B={batch} ctx={context} k={drafts}, {layers} layers ({config.first_k_dense_replace} dense): "
          f"direct {direct.flops:.5e} flops {direct.bytes_accessed:.5e} bytes ({compiled.compile_seconds:.0f} s), "
          f"projected/direct - 1: flops {projected.flops / direct.flops - 1:+.1e}, "
          f"bytes {projected.bytes_accessed / direct.bytes_accessed - 1:+.1e}")


def accepted_length(per_position) -> float:
    return 1.0 + sum(per_position)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--acceptance", type=float, default=PUBLISHED_ACCEPTANCE,
                        help="published per-draft acceptance p (accepted length 1 + p + ... + p^k)")
    parser.add_argument("--measured", type=float, nargs="+", default=list(MEASURED_PER_POSITION),
                        help="our measured per-position acceptance a_1 .. a_k")
    parser.add_argument("--validate", type=int, nargs="+", default=[], metavar="LAYERS",
                        help="also compile these depths directly at the first grid point and compare")
    parser.add_argument("--devices", type=int, default=1,
                        help="GPUs of one node the model is sharded over (jaxspec.sharding, default plan; "
                             "default 1: one GPU holding everything)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weights (fp8: DeepSeek's, kept)")
    add_cache_dtype_flag(parser)
    parser.add_argument("--calibration", metavar="JSON", default=None,
                        help="scale each op class by its measured fraction of the roofline (gpu_report.py's report.json)")
    args = parser.parse_args()
    if args.devices < 1:
        parser.error(f"--devices {args.devices}: must be >= 1")
    try:
        calibration = ROOFLINE if args.calibration is None else load_calibration(args.calibration)
    except (OSError, ValueError) as bad:
        parser.error(str(bad))
    if max(args.drafts) > len(args.measured):
        parser.error(f"--measured gives {len(args.measured)} positions; --drafts asks for {max(args.drafts)}")
    # Both targets are sm_90a and, at the same device memory, differ only in HBM bandwidth (and the
    # cuDNN version): one compile serves both.
    devices = aot.gpu_devices("h100", args.devices, device_memory=DEVICE_MEMORY)
    sharded = dict(mesh_shape=(1, args.devices)) if args.devices > 1 else {}
    for layers in args.validate:
        validate(layers, args.batches[0], args.contexts[0], sorted(args.drafts)[-1], devices)
    peaks = {target: target_peaks(target) for target in ("h100", "h200")}
    full = preset("deepseek-v3.2")
    print("PROJECTION (roofline of the compiled step's flops and bytes; not a measurement)")
    print(f"  calibration: {calibration.describe()}")
    print(f"  {args.dtype} weights, {args.cache_dtype or 'bf16'} caches, " + (f"{args.devices} GPUs of one node (mesh 1x{args.devices}, plan dp; flops, bytes "
                                         f"and collectives per GPU; collectives at NVLink {NVLINK_BYTES_PER_S / 1e9:.0f} "
                                         "GB/s per direction, not overlapped)" if args.devices > 1 else "one GPU"))
    for target, (bandwidth, flops) in peaks.items():
        print(f"  {target}: HBM {bandwidth / 1e12:.2f} TB/s, bf16 {flops / 1e12:.0f} TFLOP/s (XLA GpuTargetConfig)")
    print(f"  accepted length: published p = {args.acceptance} per draft (DeepSeek-V3 report, section 5.4.3); "
          f"ours = 1 + {' + '.join(map(str, args.measured))} (tiny-stdlib model, docs/performance.md)")
    header = (f"{'B':>4} {'ctx':>6} {'k':>2} {'TFLOP':>8} {'GB':>8} {'coll GB':>7} {'compile s':>9} | {'gpu':>4} {'step ms':>8} "
              f"{'bound':>5} | {'len pub':>7} {'tok/s/row':>9} {'speedup':>7} | {'len ours':>8} {'tok/s/row':>9} {'speedup':>7}")
    print(header, flush=True)
    for batch, context in progress.bar(list(itertools.product(args.batches, args.contexts)), "grid points"):
        plain = {}
        for drafts in sorted(args.drafts):
            point = f"B={batch} ctx={context} k={drafts}"
            try:
                decode = DecodeConfig(num_draft=drafts, backend="pallas", cache_dtype=args.cache_dtype)
                cost = depth_cost(full, decode, phase="decode", batch=batch,
                                  context=context, devices=devices, dtype=DTYPES[args.dtype], **sharded,
                                  on_compile=lambda name, seconds: note(f"{point}: {name} compiled in {seconds:.0f} s"))
            except jax.errors.JaxRuntimeError as failed:  # a point XLA cannot compile: say so, go on
                reason = str(failed).splitlines()[0]
                note(f"{point}: compile failed: {reason}")
                print(f"{batch:>4} {context:>6} {drafts:>2} does not compile for sm_90a: {reason[:150]}", flush=True)
                continue
            lengths = (accepted_length(args.acceptance ** j for j in range(1, drafts + 1)),
                       accepted_length(args.measured[:drafts]))
            for target, (bandwidth, peak) in peaks.items():
                step = step_seconds(cost, (bandwidth, peak), calibration)
                bound = "HBM" if cost.bytes_accessed / bandwidth >= cost.flops / peak else "flops"
                rates = [length / step for length in lengths]
                base = plain.setdefault(target, rates[0] if drafts == 0 else None)
                speedups = [f"{r / base:.2f}x" if base else "-" for r in rates]
                print(f"{batch:>4} {context:>6} {drafts:>2} {cost.flops / 1e12:>8.2f} "
                      f"{cost.bytes_accessed / 1e9:>8.1f} {cost.collective_bytes / 1e9:>7.2f} {cost.compile_seconds:>9.0f} | "
                      f"{target:>4} {step * 1e3:>8.2f} {bound:>5} | {lengths[0]:>7.2f} "
                      f"{rates[0]:>9.1f} {speedups[0]:>7} | {lengths[1]:>8.2f} {rates[1]:>9.1f} {speedups[1]:>7}",
                      flush=True)


if __name__ == "__main__":
    main()
