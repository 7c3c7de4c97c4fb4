"""A projection, not a measurement: DeepSeek-V3.2 speculative decoding on H100 SXM and H200, from
the compiled step's own flops and bytes (`jaxspec.aot`) and a roofline.

    JAX_PLATFORMS=cpu python benchmarks/projection.py                         # the whole grid
    JAX_PLATFORMS=cpu python benchmarks/projection.py --batches 32 --contexts 4096 --drafts 0 3

What is measured: for each batch B, context C and draft length k (0 = plain decoding, else an MTP
chain of k), the decode step `jaxspec.loop._step` is compiled for sm_90a (one device, backend
pallas, bf16 parameters) and its flops and bytes accessed are read from the optimized HLO plus the
Pallas kernels' stated costs (attention kernels at a full context). A full-depth compile takes
minutes, so each point compiles three 1-2 layer models at full width: A = one MoE layer,
D = one dense + one MoE layer, M = two MoE layers. Layers of a kind are identical programs, so
the full model's cost is exactly A + 3 (D - A) + 57 (M - A) for V3.2's 3 dense and 58 MoE layers
(embedding, LM head and the MTP block are in A).

What is projected: step time = max(bytes / HBM bandwidth, flops / peak bf16 tensor flops), both
from XLA's GpuTargetConfig of the GPU (`jaxspec/targets/`: H100 SXM 3.35 TB/s, H200 4.8 TB/s;
2 x 512 bf16 FMA per clock x 4 tensor cores x 132 SMs x 1.83 GHz = 989 TFLOP/s), as if one GPU
held the whole model (it does not: 1.3 TB of bf16 weights; until issue 9 shards it there are no
collectives to add, and an 8-GPU node would divide the bytes per GPU by about 8). Tokens/s per
row = accepted length / step time; the speedup is over plain decoding at the same B and C.

Accepted length (tokens per target call), two columns:
  * published: DeepSeek-V3 Technical Report (arXiv:2412.19437), section 5.4.3 "Multi-Token
    Prediction Evaluation": "the acceptance rate of the second token prediction ranges between
    85% and 90% across various generation topics" (k = 1, hence 1.85-1.90; the report's measured
    end-to-end gain is 1.8x TPS). We take 0.875 and, for k = 2, 3 (DeepSeek publishes none for
    chaining its one MTP module), assume each further draft is accepted with the same 0.875
    given its predecessor: 1 + p + ... + p^k. Override with --acceptance.
  * ours: the shipped tiny-stdlib model's measured per-position acceptance 0.89 / 0.42 / 0.36
    (README, `examples/generate.py --mtp 3`): 1 + a_1 + ... + a_k. Override with --measured.
"""

from __future__ import annotations

import argparse
import itertools
import re

from jaxspec import aot
from jaxspec.aot.model import compile_model
from jaxspec.config import DecodeConfig, preset

PUBLISHED_ACCEPTANCE = 0.875
MEASURED_PER_POSITION = (0.89, 0.42, 0.36)


def target_peaks(target: str) -> tuple[float, float]:
    """(HBM bytes/s, bf16 tensor-core flops/s) from the target's GpuTargetConfig."""
    spec = aot.target_config(target)
    bandwidth = float(re.search(r"memory_bandwidth: (\d+)", spec).group(1))
    cores = int(re.search(r"core_count: (\d+)", spec).group(1))
    bf16 = re.search(r"rate_infos \{\s*key: 16\s*value \{\s*clock_rate_ghz: ([\d.]+)\s*units_per_core: (\d+)\s*"
                     r"ops_per_clock: (\d+)", spec.split("matrix_unit_description")[1])
    clock, units, fmas = float(bf16.group(1)), int(bf16.group(2)), int(bf16.group(3))
    return bandwidth, 2 * fmas * units * cores * clock * 1e9  # an FMA is 2 flops


def step_cost(batch: int, context: int, drafts: int, devices) -> tuple[float, float, float]:
    """(flops, bytes, compile seconds) of one full-depth V3.2 decode step, from three shallow compiles."""
    full = preset("deepseek-v3.2")
    dense, moe = full.first_k_dense_replace, full.num_hidden_layers - full.first_k_dense_replace
    decode = DecodeConfig(num_draft=drafts, backend="pallas")
    costs, seconds = [], 0.0
    for layers, dense_layers in ((1, 0), (2, 1), (2, 0)):
        config = full.replace(num_hidden_layers=layers, first_k_dense_replace=dense_layers)
        compiled = compile_model(config, decode, phase="decode", batch=batch, context=context, devices=devices)
        cost = aot.program_cost(compiled)
        costs.append((cost.flops, cost.bytes_accessed))
        seconds += compiled.compile_seconds
    (fa, ba), (fd, bd), (fm, bm) = costs
    return (fa + dense * (fd - fa) + (moe - 1) * (fm - fa), ba + dense * (bd - ba) + (moe - 1) * (bm - ba), seconds)


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
    args = parser.parse_args()
    if max(args.drafts) > len(args.measured):
        parser.error(f"--measured gives {len(args.measured)} positions; --drafts asks for {max(args.drafts)}")
    devices = aot.gpu_devices("h100")  # both targets are sm_90a: one compile serves both
    peaks = {target: target_peaks(target) for target in ("h100", "h200")}
    print("PROJECTION (roofline of the compiled step's flops and bytes; not a measurement)")
    for target, (bandwidth, flops) in peaks.items():
        print(f"  {target}: HBM {bandwidth / 1e12:.2f} TB/s, bf16 {flops / 1e12:.0f} TFLOP/s (XLA GpuTargetConfig)")
    header = (f"{'B':>4} {'ctx':>6} {'k':>2} {'TFLOP':>8} {'GB':>8} {'compile s':>9} | {'gpu':>4} {'step ms':>8} "
              f"{'bound':>5} | {'len pub':>7} {'tok/s/row':>9} {'speedup':>7} | {'len ours':>8} {'tok/s/row':>9} {'speedup':>7}")
    print(header)
    for batch, context in itertools.product(args.batches, args.contexts):
        plain = {}
        for drafts in sorted(args.drafts):
            flops, nbytes, seconds = step_cost(batch, context, drafts, devices)
            lengths = (accepted_length(args.acceptance ** j for j in range(1, drafts + 1)),
                       accepted_length(args.measured[:drafts]))
            for target, (bandwidth, peak) in peaks.items():
                step = max(nbytes / bandwidth, flops / peak)
                bound = "HBM" if nbytes / bandwidth >= flops / peak else "flops"
                rates = [length / step for length in lengths]
                base = plain.setdefault(target, rates[0] if drafts == 0 else None)
                speedups = [f"{r / base:.2f}x" if base else "-" for r in rates]
                print(f"{batch:>4} {context:>6} {drafts:>2} {flops / 1e12:>8.2f} {nbytes / 1e9:>8.1f} {seconds:>9.0f} | "
                      f"{target:>4} {step * 1e3:>8.2f} {bound:>5} | {lengths[0]:>7.2f} {rates[0]:>9.1f} {speedups[0]:>7} | "
                      f"{lengths[1]:>8.2f} {rates[1]:>9.1f} {speedups[1]:>7}")


if __name__ == "__main__":
    main()
