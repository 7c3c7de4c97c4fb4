"""A projection, not a measurement: DeepSeek-V3.2 speculative decoding on H100 SXM and H200, from
the compiled step's own flops and bytes (`jaxspec.aot`) and a roofline.

    JAX_PLATFORMS=cpu python benchmarks/projection.py                         # the whole grid
    JAX_PLATFORMS=cpu python benchmarks/projection.py --batches 32 --contexts 4096 --drafts 0 3
    JAX_PLATFORMS=cpu python benchmarks/projection.py --devices 8 --dtype fp8 --batches 32 --contexts 4096
    JAX_PLATFORMS=cpu python benchmarks/projection.py --batches 32 --contexts 32768 --drafts 3 --cache-dtype fp8

What is measured: for each batch B, context C and draft length k (0 = plain decoding, else an MTP
chain of k), the decode step `jaxspec.loop._step` is compiled for sm_90a at full depth (one device,
backend pallas, bf16 parameters unless `--dtype`), and its flops and bytes accessed are read from
the optimized HLO plus the Pallas kernels' stated costs (attention kernels at a full context), its
launches per op class from its thunk sequence (`aot.op_class_launches`). The layers compile as
scans, so a full-depth compile takes 12 s (B 1, plain) to 74 s (B 32, k = 3) on a busy 2-core
host. This replaced an extrapolation from three compiles of one or two layers, which matched
direct compiles in flops and bytes to 2e-6 but not in launches: a stack of one layer compiles
without its loop, and the extrapolated full-depth step launched 4,666 kernels where the direct
compile launched 4,171 (B 1, plain, FP8 weights; both counts then included the layer scans'
conditions, which never run: without them the direct compile launched 4,108).

The device is compiled as having 1 PiB of memory (`gpu_devices(device_memory=)`). With its own
80 GB, XLA fits a program into 80% of it by rematerializing (recomputing) values, and where the
arguments alone exceed that (every full-depth step: 628 GiB of FP8 weights at B 1) it recomputes
whatever it can, which adds flops, bytes and 660 to 1,610 launches a step that a device holding
its weights does not pay. `aot.program_cost(...).rematerialized` counts the clones; a
rematerialized compile is refused.

What is projected: step time = max(bytes / HBM bandwidth, flops / peak bf16 tensor flops), both
from XLA's GpuTargetConfig of the GPU (`jaxspec/targets/`: H100 SXM 3.35 TB/s, H200 4.8 TB/s;
2 x 512 bf16 FMA per clock x 4 tensor cores x 132 SMs x 1.83 GHz = 989 TFLOP/s), as if one GPU
held the whole model (it does not: 1.3 TB of bf16 weights). With `--devices N` the step is
compiled sharded over one node's N GPUs (`jaxspec.sharding`'s default plan, mesh 1 x N; add
`--dtype fp8` for DeepSeek's FP8 weights as served): flops, bytes and the collectives' bytes are
per GPU, and the collectives add their bytes / NVLink bandwidth (450 GB/s per direction, not
overlapped with compute) to the step. With `--calibration` (gpu_report.py's report.json) each op
class's roofline is divided by the fraction of it the class reached on a GPU, and, where the
calibration measured a launch's time (or `--launch-us` gives it), each class takes at least its
launches x that: at B = 1 the step is a few thousand small kernels, bound by their launches rather
than by bytes (the launches column; bound "launch" where they alone outlast the roofline). Tokens/s per row = accepted length / step time; the
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
import dataclasses
import itertools
import json
import re
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec import aot, progress
from jaxspec.aot.model import compile_model
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
# The most a calibration's time a launch may say (1 ms): a kernel's launch-bound floor is
# microseconds; anything near this is a misread profile.
MAX_LAUNCH_SECONDS = 1e-3


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
    "collectives"; a class it does not name counts as 1.0, the roofline), where it came from, and
    `launch_seconds`: the device time a kernel takes at the least, measured (the mean of XLA's
    kernels in a one-token step's profile: `gpu_report.calibration`), or None."""

    label: str
    fractions: dict[str, float]
    launch_seconds: float | None = None

    def describe(self) -> str:
        parts = [f"{name} {value:.2f}" for name, value in sorted(self.fractions.items())]
        if self.launch_seconds is not None:
            parts.append(f"{self.launch_seconds * 1e6:.1f} us a launch")
        return f"{self.label} ({', '.join(parts)})" if parts else self.label


ROOFLINE = Calibration("none: every op class at its roofline", {})


def load_calibration(path: str) -> Calibration:
    """The calibration in a JSON file (`benchmarks/gpu_report.py`'s report, or any file) holding
    {"calibration": {"label": str, "fractions": {class: fraction in (0, 1.5]}, "launch_seconds":
    seconds in (0, MAX_LAUNCH_SECONDS] or null (optional)}}. Raises ValueError naming the file for
    anything else."""
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
    launch = found.get("launch_seconds")
    if launch is not None and not (isinstance(launch, (int, float)) and 0 < launch <= MAX_LAUNCH_SECONDS):
        raise ValueError(f"--calibration {path}: launch_seconds {launch!r}: must be in (0, {MAX_LAUNCH_SECONDS}] "
                         "or null")
    return Calibration(str(found.get("label", path)), fractions, None if launch is None else float(launch))


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What a compiled program costs, as the projection reads it: flops and bytes accessed (XLA's
    ops plus the Pallas kernels' stated costs), the seconds its compile took, the bytes its
    collectives produce (per device), the same split by op class (`aot.op_class_costs`: class ->
    (flops, bytes)) and its launches per op class (empty where not counted)."""

    flops: float
    bytes_accessed: float
    compile_seconds: float = 0.0
    collective_bytes: float = 0.0
    by_class: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    launches: dict[str, float] = dataclasses.field(default_factory=dict)


def compiled_cost(compiled, launches: dict[str, float] | None = None) -> StepCost:
    """A compiled program's own cost (a `compile_gpu` result, or one compiled on a real GPU).
    launches: its launches per op class where known: `aot.op_class_launches` of a deviceless
    compile, or the kernels a profile of it counted (a program compiled on a GPU keeps no thunk
    sequence to count)."""
    cost = aot.program_cost(compiled)
    return StepCost(flops=cost.flops, bytes_accessed=cost.bytes_accessed,
                    compile_seconds=getattr(compiled, "compile_seconds", 0.0),
                    collective_bytes=sum(c.bytes * c.runs for c in aot.collectives(compiled)),
                    by_class=aot.op_class_costs(compiled), launches=dict(launches or {}))


def step_seconds(cost: StepCost, peaks: tuple[float, float], calibration: Calibration = ROOFLINE) -> float:
    """The projected step: without a calibration max(bytes / bandwidth, flops / peak) of the whole
    program; with one, per op class max(its roofline / its measured fraction, its launches x
    `launch_seconds`), summed. Collectives add their bytes / NVLink bandwidth (divided by their
    fraction).

    The launch term is the floor a class of many small kernels sits on however few bytes they move
    (at B 1, XLA's norms, pads and routing: about 70 launches a V3.2 layer); it counts where the
    calibration has `launch_seconds` and the cost its `launches`."""
    bandwidth, peak = peaks
    roofline = lambda flops, nbytes: max(nbytes / bandwidth, flops / peak)
    fraction = lambda name: calibration.fractions.get(name, 1.0)
    launch = calibration.launch_seconds or 0.0
    if calibration.fractions or launch:
        compute = sum(max(roofline(*cost.by_class[name]) / fraction(name), cost.launches.get(name, 0) * launch)
                      for name in aot.OP_CLASSES)
    else:
        compute = roofline(cost.flops, cost.bytes_accessed)
    return compute + cost.collective_bytes / NVLINK_BYTES_PER_S / fraction("collectives")


def note(line: str) -> None:
    progress.write(f"[{time.strftime('%H:%M:%S')}] {line}")


def step_cost(config, decode: DecodeConfig, *, batch: int, context: int, devices, dtype, **sharded) -> StepCost:
    """The full-depth decode step of `config` compiled for `devices` (`compile_model`), as a
    `StepCost` with its launches. Raises RuntimeError where XLA rematerialized anything: the
    devices must have room for the program (`DEVICE_MEMORY`)."""
    compiled = compile_model(config, decode, phase="decode", batch=batch, context=context, devices=devices,
                             dtype=dtype, **sharded)
    rematerialized = aot.program_cost(compiled).rematerialized
    if rematerialized:
        raise RuntimeError(f"XLA rematerialized {rematerialized} instructions to fit the device's memory: compile "
                           "for devices with room for the program")
    return compiled_cost(compiled, launches=aot.op_class_launches(compiled))


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
    parser.add_argument("--devices", type=int, default=1,
                        help="GPUs of one node the model is sharded over (jaxspec.sharding, default plan; "
                             "default 1: one GPU holding everything)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weights (fp8: DeepSeek's, kept)")
    add_cache_dtype_flag(parser)
    parser.add_argument("--calibration", metavar="JSON", default=None,
                        help="scale each op class by its measured fraction of the roofline (gpu_report.py's report.json)")
    parser.add_argument("--launch-us", type=float, default=None, metavar="US",
                        help="a kernel launch's device time at the least, in microseconds (replaces the "
                             "calibration's): each op class then takes at least its launches x this")
    args = parser.parse_args()
    if args.devices < 1:
        parser.error(f"--devices {args.devices}: must be >= 1")
    if args.launch_us is not None and not 0 < args.launch_us <= MAX_LAUNCH_SECONDS * 1e6:
        parser.error(f"--launch-us {args.launch_us}: must be in (0, {MAX_LAUNCH_SECONDS * 1e6:.0f}]")
    try:
        calibration = ROOFLINE if args.calibration is None else load_calibration(args.calibration)
    except (OSError, ValueError) as bad:
        parser.error(str(bad))
    if args.launch_us is not None:
        calibration = calibration._replace(label=f"{calibration.label}; launches at --launch-us {args.launch_us:g}",
                                           launch_seconds=args.launch_us * 1e-6)
    if max(args.drafts) > len(args.measured):
        parser.error(f"--measured gives {len(args.measured)} positions; --drafts asks for {max(args.drafts)}")
    # Both targets are sm_90a and, at the same device memory, differ only in HBM bandwidth (and the
    # cuDNN version): one compile serves both.
    devices = aot.gpu_devices("h100", args.devices, device_memory=DEVICE_MEMORY)
    sharded = dict(mesh_shape=(1, args.devices)) if args.devices > 1 else {}
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
    header = (f"{'B':>4} {'ctx':>6} {'k':>2} {'TFLOP':>8} {'GB':>8} {'coll GB':>7} {'launches':>8} {'compile s':>9} | "
              f"{'gpu':>4} {'step ms':>8} "
              f"{'bound':>6} | {'len pub':>7} {'tok/s/row':>9} {'speedup':>7} | {'len ours':>8} {'tok/s/row':>9} {'speedup':>7}")
    print(header, flush=True)
    for batch, context in progress.bar(list(itertools.product(args.batches, args.contexts)), "grid points"):
        plain = {}
        for drafts in sorted(args.drafts):
            point = f"B={batch} ctx={context} k={drafts}"
            try:
                decode = DecodeConfig(num_draft=drafts, backend="pallas", cache_dtype=args.cache_dtype)
                cost = step_cost(full, decode, batch=batch, context=context, devices=devices,
                                 dtype=DTYPES[args.dtype], **sharded)
                note(f"{point}: compiled in {cost.compile_seconds:.0f} s")
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
                if sum(cost.launches.values()) * (calibration.launch_seconds or 0.0) > max(
                        cost.bytes_accessed / bandwidth, cost.flops / peak):
                    bound = "launch"  # its kernels' launches alone take longer than its roofline
                rates = [length / step for length in lengths]
                base = plain.setdefault(target, rates[0] if drafts == 0 else None)
                speedups = [f"{r / base:.2f}x" if base else "-" for r in rates]
                print(f"{batch:>4} {context:>6} {drafts:>2} {cost.flops / 1e12:>8.2f} "
                      f"{cost.bytes_accessed / 1e9:>8.1f} {cost.collective_bytes / 1e9:>7.2f} "
                      f"{sum(cost.launches.values()):>8.0f} {cost.compile_seconds:>9.0f} | "
                      f"{target:>4} {step * 1e3:>8.2f} {bound:>6} | {lengths[0]:>7.2f} "
                      f"{rates[0]:>9.1f} {speedups[0]:>7} | {lengths[1]:>8.2f} {rates[1]:>9.1f} {speedups[1]:>7}",
                      flush=True)


if __name__ == "__main__":
    main()
