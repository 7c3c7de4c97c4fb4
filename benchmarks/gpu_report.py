"""One command that turns a lent GPU into evidence: the test suite on the GPU, the kernel, MoE,
matmul and exactness benchmarks, the main job, and a measured full-width decode step beside its
projection, written to OUT/report.json and OUT/report.md.

    python benchmarks/gpu_report.py --out gpu-report                        # every part
    python benchmarks/gpu_report.py --out gpu-report --parts suite          # one part (or several: suite,e2e)
    python benchmarks/gpu_report.py --out gpu-report --deadline 530 --parts suite:200,e2e:250,kernels
    python benchmarks/gpu_report.py --out /tmp/smoke --smoke                # every part at tiny sizes, any machine

Parts run in the order --parts lists them (by default the order below); `part:SECONDS` gives a part
at most that many seconds of the run, so that a short lease moves every listed part forward.
Each part runs its work as subprocesses, so this process never holds the GPU:
  suite      pytest on the GPU (`-n --workers`): one run of every module not yet recorded,
             lightest first (or --suite-chunk modules a run); each test's outcome is logged as it
             finishes (`suite_log`), so a run the clock ends keeps the modules whose every test
             finished and notes the others' progress (smoke: `--collect-only` of one module);
  kernels    benchmarks/attention_kernels.py, one unit per op (V3.2's mla_attention, sparse_mla, indexer_scores,
             V4's v4_csa, v4_hca) at B 32, 8, 1, context 4096, Q 1, 4, each row with its error
             against the reference, then mla_attention at context 32768 (B 32, 1);
  moe        benchmarks/moe.py (one V3.2 MoE layer, 8 to 1024 tokens);
  matmuls    benchmarks/matmuls.py (bf16 and FP8 linear layers at decode shapes);
  exactness  benchmarks/exactness.py (rows equal to plain greedy per backend and window_invariant);
  mainjob    examples/generate.py --mtp 0 and --mtp 3 (the shipped model, 96 new tokens), and --mtp 3
             once more with XLA keeping the generation loop on the device as a CUDA graph
             (LOOP_GRAPH_FLAGS; XLA's default reads the loop's predicate on the host every step);
  gather     benchmarks/gather_copies.py: the Mosaic kernels' gather of scattered rows alone (one
             copy a row, with and without Pallas' automatic barriers, issued by two
             warpgroups, by four warps or by one thread a row) beside a tile copy; then the
             sparse MLA kernels at B 32, 1, Q 1, 4: Triton, Mosaic, Mosaic without automatic
             barriers (attention_kernels.py --no-auto-barriers), Mosaic with its copies issued by warp
             (--copies-by-warp) or by thread (--copies-by-thread), and Mosaic with split-KV
             parts of 256 and 2048 slots beside
             its 512 (--part-slots; 2048 is one part at top-2048);
  tiles      benchmarks/attention_kernels.py's Triton MLA kernels again with three tiles in flight
             (--num-stages 3), sparse MLA with both 32-slot tiles and three in flight, and with
             32-slot tiles (--block-n 32), to set against the kernels
             part's two and 16 (the defaults), Triton's sparse MLA at B 8 and 1 with 16
             parts of its top-k list (--num-splits 16) beside its 4, the Mosaic mla_attention
             with split-KV parts of 2048 and 4096 slots beside its 1024 (--part-slots), ctx 4096 and 32k,
             and V4's (v4_csa) with parts of 64 and 1024 slots beside its 256 and with its copies
             issued by warp or by thread (--copies-by-warp, --copies-by-thread);
  gmm        the grouped matmul's tile variants (`grouped_matmul_pallas.VARIANTS`: K step 64 or 128,
             K splits that fill the GPU for one decoded token, steps in flight) and its Mosaic GPU
             kernel under GMM_MOSAIC_TILES (--mosaic-tiles), side by side: first the e2e step at
             B 32, k 3 and B 1, k 0 with the Mosaic kernel as "auto"'s (e2e_step.py --auto
             grouped_matmul=mosaic, which decides its AUTO_KERNELS entry), then one MoE layer with
             FP8 experts (moe.py --weights fp8) and the FP8 linears (matmuls.py --tiles), then the
             step with k64-int and with GMM_E2E_TILES (the steps against the e2e part's default
             points; not under --smoke, where the e2e part runs the same code);
  flashmla   benchmarks/flashmla.py: FlashMLA's dense (bf16 cache) and sparse (FP8 caches: V3.2's
             top-2048, V4-Flash's CSA and HCA) decode kernels at the kernels part's shapes, the
             ground truth beside ours (its harness binary must be there: built with
             `flashmla.py --build` and carried), then our sparse MLA and V4 kernels on FP8 caches
             (attention_kernels.py --cache-dtype fp8); report.md sets each FlashMLA row beside our rows of
             the same op, shape and cache (not under --smoke);
  e2e        benchmarks/e2e_step.py: full-width DeepSeek-V3.2 in FP8, B 1, 8, 32 x k 0, 1, 3 at
             context 4096, each step measured beside its projection (and the calibrated one),
             and one more step profiled (`kernel_profile`: the kernels' time per op class, and the
             time outside them); a point recorded without a profile is measured again;
  e2e_v4     the same for DeepSeek-V4-Flash (`e2e_step.py --v4`: as many MoE layers as fit, and its
             MTP block) at V4_E2E_POINTS (B 32, k 3 and B 1, k 0), after V3.2's: V4's step measured
             beside its projection (the calibration is V3.2's kernels' and stays so).

Resuming: every finished unit (a test module, a benchmark, an e2e point) goes into OUT/report.json
at once, under the device it ran on (`nvidia-smi`'s name, "cpu" without one); a later run on the
same kind of device skips what is there, so a run cut short loses only the unit in flight, and a
benchmark cut short keeps the rows it finished (recorded as incomplete: the next run measures it
again). `--retry-failed` runs the failed units again, after a fix; `--redo NAMES` measures the
named parts or benchmark units again (after a change to what they measure), `--redo` alone
everything; their old records stay, marked stale, until new ones replace them.
`--deadline` (seconds) stops starting units near the end of a time limit; what is left is listed.
`--unit-timeout` (seconds) ends one subprocess that runs longer (a kernel that hangs on the device:
the Mosaic kernels' warpgroup handshakes run on a GPU only) and records it as failed, so the next
run goes past it; a suite chunk ended so marks its modules, and `--retry-failed` runs them one per
chunk to find the one that hangs. Sooner than that, the kernel, gather and expert-matmul
benchmarks give each Mosaic call `attention_kernels.CALL_SECONDS` once compiled (`attention_kernels.watchdog`): one
that has not returned by then ends its benchmark with status `attention_kernels.HUNG_EXIT` and the hang in
its JSON, which report.md names; an attention_kernels.py unit so ended runs again at once with --no-mosaic,
for the Triton and XLA rows of the shapes the hang left. OUT/report.md is rewritten from the JSON
at the end of every run.

Calibration: from the kernel, MoE and matmul rows, the fraction of the roofline each op class
reached (`aot.OP_CLASSES`: roofline time max(bytes / HBM bandwidth, flops / peak) of the device's
target over measured time, summed over the class's rows; attention from the rows of the kernel
backend="auto" runs for each op on the device, as the e2e step does); report.json's "calibration"
is the input of `projection.py --calibration`, and report.md projects every e2e point with the
calibration of the moment (whichever part ran first). The calibration's time a launch comes from
the e2e profile with the fewest tokens a step (`launch_seconds`): each class then takes at least
its launches x that, the floor of a one-token step. Collectives are not measured on one GPU and
stay at 1.0 (said so).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from attention_kernels import HUNG_EXIT
from projection import Calibration, StepCost, note, step_seconds, target_peaks
from suite_log import COMPILE_KEYS, empty_outcome, suite_outcomes

from jaxspec.pallas_kernels.backend import AUTO_KERNELS
from jaxspec.pallas_kernels.grouped_matmul_pallas import DEFAULT_VARIANT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, "benchmarks")
PARTS = ("suite", "kernels", "moe", "matmuls", "exactness", "mainjob", "tiles", "gather", "gmm", "e2e", "flashmla",
         "e2e_v4")
# The headline point first, then the rest of its batch: a short lease measures what matters most.
E2E_POINTS = [(b, k) for b in (32, 8, 1) for k in (3, 0, 1)]
SMOKE_E2E_POINTS = [(2, 1)]  # one step with a draft: the part's code path
HEADLINE = (32, 3)  # the e2e point whose measured / projected the report states
# DeepSeek-V4-Flash's points: the headline and the one-token step, whose time is mostly launches.
V4_E2E_POINTS = [HEADLINE, (1, 0)]
E2E_POINT_SECONDS = 60  # the most one e2e point (compile, timing, profile) is given to finish
GOAL = 0.7  # measured / projected the headline aims at; op classes under it are named
# The grouped-matmul tile variant the gmm part runs the e2e step with, at these points: K splits
# with the K step of 64, which at one token gives the narrow FP8 linears (kv_a_proj 5 column
# blocks, the indexer's wk 1, q_a_proj 12) twice the programs k128-split does (its ranges keep
# MIN_SPLIT_STEPS steps of 128), and on the Mosaic kernel keeps two programs an SM where a K step
# of 128 keeps one (docs/performance.md, "B 1").
GMM_E2E_TILES = "k64-split"
GMM_E2E_POINTS = [HEADLINE, (1, 0)]
# The gmm part's e2e variants: name -> e2e_step.py's flags. Beside that tile variant, the step with
# "auto" running the Mosaic GPU grouped matmul (experts and FP8 linears), as it would run once
# `AUTO_KERNELS` names it, and the step with e4m3 unpacked by integer operations on the kernel
# "auto" runs (V3.2's power-of-two scales: the bfloat16 route, no conversion in the loop).
# The Mosaic step first: it decides the op's `AUTO_KERNELS` entry, so a short lease measures it first.
GMM_E2E_VARIANTS = {"mosaic": ["--auto", "grouped_matmul=mosaic"], "k64-int": ["--tiles", "k64-int"],
                    GMM_E2E_TILES: ["--tiles", GMM_E2E_TILES]}
# The tile variants the gmm part times the Triton grouped matmul under: K steps of 64 and 128, each
# without and with K splits (o_proj's 56 column blocks), and e4m3 unpacked by integer operations.
GMM_TRITON_TILES = (DEFAULT_VARIANT, "k128", "k128-split", "k64-int", GMM_E2E_TILES)
# And the Mosaic one, at a K step of 64 (two blocks an SM; one of 128 claims 157 KiB, one block):
# its default, the three variants that tell what bounds its FP8 loop (`VARIANTS`: 7 steps in
# flight at two blocks an SM, three blocks an SM at 3, or e4m3 unpacked by integer operations
# instead of conversions), and the step's K splits. Under --smoke the last only, to keep the
# suite's time: a variant's row runs the default's code path, and the kernel at its default tiles
# is tests/test_grouped_matmul_mosaic.py's.
GMM_MOSAIC_TILES = (DEFAULT_VARIANT, "k64-s7", "k64-s3", "k64-int", GMM_E2E_TILES)
SMOKE_GMM_MOSAIC_TILES = (GMM_E2E_TILES,)
KERNELS_SCRIPT = "benchmarks/attention_kernels.py"  # the benchmark whose Mosaic rows --no-mosaic leaves out
# Each part's benchmark command: (unit, argv, argv under --smoke). "{json}" is replaced by a path.
# A None smoke argv: the unit is not run under --smoke. The kernels run one op a unit, so that a
# kernel failing or hanging on the device costs its own op's rows only.
KERNEL_OPS = ("mla_attention", "sparse_mla", "indexer_scores", "v4_csa", "v4_hca")
BENCHMARK_UNITS = {
    "kernels": [(f"kernels/{op}", [KERNELS_SCRIPT, "--batch", "32", "8", "1", "--context", "4096", "--queries",
                                   "1", "4", "--ops", op, "--json", "{json}"],
                 # (smoke: with --part-slots, the path of the part kernels_part_slots, whose own
                 # smoke would start a process to repeat these rows)
                 [KERNELS_SCRIPT, "--smoke", "--ops", op, "--no-xla", "--part-slots", "64", "--json",
                  "{json}"] if op == "mla_attention" else None)
                for op in KERNEL_OPS]
               # Dense MLA at the long context the issue names (sparse MLA reads its top-k whatever the
               # context): after every op's 4096, so that a short lease has those first.
               + [("kernels/mla_attention_32k", [KERNELS_SCRIPT, "--batch", "32", "1", "--context", "32768",
                                                 "--queries", "1", "4", "--ops", "mla_attention", "--json", "{json}"],
                   None)],
    # The Triton MLA kernels with three cache tiles in flight (default two): the sparse kernel's
    # loop waits for every copy at each 16-slot tile (PTX: cp.async.wait_group 0), so its tiles
    # in flight bound its bandwidth; then with 32-slot tiles (their default is 16: 32 spills
    # registers in dense MLA with jax 0.11's Triton); both against the kernels part's rows.
    "tiles": [("kernels_stages3", [KERNELS_SCRIPT, "--batch", "32", "8", "1", "--context", "4096",
                                   "--queries", "1", "4", "--ops", "mla_attention", "sparse_mla", "--num-stages", "3",
                                   "--no-xla", "--no-mosaic", "--json", "{json}"],
               None),  # (smoke: --num-stages is a Triton setting, which interpret mode ignores)
              # Sparse MLA with both: 32-slot tiles, three in flight (sm_90a, jax 0.10.2: 207
              # registers, no spills, no synchronous load in its loop), half the tiles to wait for.
              ("kernels_n32_stages3", [KERNELS_SCRIPT, "--batch", "32", "8", "1", "--context", "4096",
                                       "--queries", "1", "4", "--ops", "sparse_mla", "--block-n", "32",
                                       "--num-stages", "3", "--no-xla", "--no-mosaic", "--json", "{json}"], None),
              ("kernels_block_n32", [KERNELS_SCRIPT, "--batch", "32", "8", "1", "--context", "4096",
                                     "--queries", "1", "4", "--ops", "mla_attention", "sparse_mla", "--block-n", "32",
                                     "--no-xla", "--no-mosaic", "--json", "{json}"],
               [KERNELS_SCRIPT, "--smoke", "--ops", "mla_attention", "--block-n", "32", "--no-xla",
                "--no-mosaic", "--json", "{json}"]),
              # Triton's sparse MLA at small B with 16 parts of the top-k list (128 slots each) where its
              # default keeps parts of MIN_PART_SLOTS (512: 4 parts, 8 programs at B 1, a launch of
              # 99 us on the H200 for 2.4 MB): a byte rule, where one token's launch is latency-bound.
              ("kernels_sparse_parts16", [KERNELS_SCRIPT, "--batch", "8", "1", "--context", "4096",
                                          "--queries", "1", "4", "--ops", "sparse_mla", "--num-splits", "16",
                                          "--no-xla", "--no-mosaic", "--json", "{json}"], None),
              # The Mosaic MLA kernel's split-KV parts (PART_SLOTS, 1024) against longer ones: the float32
              # partials they write are 45% of the cache's bytes at Q 1 and twice them at Q 4 (docs/kernels.md).
              ("kernels_part_slots", [KERNELS_SCRIPT, "--batch", "32", "1", "--context", "4096", "32768",
                                      "--queries", "1", "4", "--ops", "mla_attention", "--part-slots", "2048", "4096",
                                      "--no-xla", "--json", "{json}"], None),
              # V4's Mosaic kernel with split-KV parts of one tile (the most programs) and of 16 (one part
              # for V4-Flash's 12-tile CSA list: the layout before the split) beside its 4, and with its
              # key copies issued by warp or by thread (as the gather part's sparse MLA rows).
              ("kernels_v4_tunings", [KERNELS_SCRIPT, "--batch", "32", "8", "1", "--context", "4096",
                                      "--queries", "1", "4", "--ops", "v4_csa", "--part-slots", "64", "1024",
                                      "--copies-by-warp", "--copies-by-thread", "--no-xla", "--json", "{json}"],
               None)],
    # The Mosaic kernels' gather of scattered rows timed alone, beside its candidate fixes and a tile
    # copy; then the sparse MLA kernel with those fixes and other part lengths beside itself and Triton.
    "gather": [("gather", ["benchmarks/gather_copies.py", "--json", "{json}"],
                ["benchmarks/gather_copies.py", "--smoke", "--json", "{json}"]),
               ("gather/sparse_mla", [KERNELS_SCRIPT, "--batch", "32", "1", "--context", "4096", "--queries",
                                      "1", "4", "--ops", "sparse_mla", "--no-auto-barriers", "--copies-by-warp",
                                      "--copies-by-thread", "--part-slots", "256", "2048", "--json", "{json}"],
                None)],
    # With bfloat16 experts, beside the Triton kernel's rows the Mosaic kernel's at its default tiles:
    # against its FP8 rows (the gmm part) the cost of its dequantization.
    "moe": [("moe", ["benchmarks/moe.py", "--mosaic-tiles", DEFAULT_VARIANT, "--json", "{json}"],
             ["benchmarks/moe.py", "--smoke", "--json", "{json}"])],
    "matmuls": [("matmuls", ["benchmarks/matmuls.py", "--json", "{json}"],
                 ["benchmarks/matmuls.py", "--smoke", "--json", "{json}"])],
    # The grouped matmul's tile variants: the MoE layer with FP8 experts as the e2e step runs them
    # (most of the step's grouped-matmul time; under k64-split / k128-split their gate and up
    # projections split K in two, their down projection does not), then every FP8 linear under
    # each, at the tokens a call of the gmm part's e2e points has: B 1 decode, B 32 k 3 verification
    # (a linear's launch is the same for 1 and 8 tokens, and 8 is what the matmuls part measured).
    # Beside them the Mosaic GPU kernel (GMM_MOSAIC_TILES). First the experts' matmuls alone on
    # every kernel, the two that read the weights [out, in] among them (the transposed product,
    # dequantized in registers; W8A8, e4m3 activations as DeepSeek's inference).
    "gmm": [("gmm/expert_matmuls", ["benchmarks/expert_matmuls.py", "--tokens", "128", "1", "--json", "{json}"],
             # (smoke: the Mosaic kernel's code path is the moe_fp8 and matmuls units')
             ["benchmarks/expert_matmuls.py", "--smoke", "--tiles", DEFAULT_VARIANT, "--mosaic-tiles",
              "--swapped-tiles", DEFAULT_VARIANT, "--w8a8-tiles", "k128", "--json", "{json}"]),
            ("gmm/moe_fp8", ["benchmarks/moe.py", "--weights", "fp8", "--tiles", *GMM_TRITON_TILES, "--mosaic-tiles",
                             *GMM_MOSAIC_TILES, "--tokens", "1", "128", "--json", "{json}"],
             ["benchmarks/moe.py", "--smoke", "--weights", "fp8", "--tiles", "k128", "--json", "{json}"]),
            ("gmm/matmuls", ["benchmarks/matmuls.py", "--dtypes", "fp8", "--tiles", *GMM_TRITON_TILES,
                             "--mosaic-tiles", *GMM_MOSAIC_TILES, "--w8a8-tiles", "k128", "k128-split",
                             "--tokens", "8", "128", "--json", "{json}"],
             ["benchmarks/matmuls.py", "--smoke", "--dtypes", "fp8", "--tiles", DEFAULT_VARIANT, GMM_E2E_TILES,
              "--mosaic-tiles", *SMOKE_GMM_MOSAIC_TILES, "--w8a8-tiles", "k128", "--json", "{json}"])],
    # FlashMLA, DeepSeek's CUDA decode kernels, at the kernels part's MLA and V4 shapes (its harness,
    # built where nvcc is and carried: benchmarks/flashmla.py), then jaxspec's sparse MLA and V4
    # kernels on the FP8 caches FlashMLA's sparse decode reads, so that its rows have ours beside them.
    "flashmla": [("flashmla", ["benchmarks/flashmla.py", "--json", "{json}"], None),
                 ("flashmla/fp8_caches", [KERNELS_SCRIPT, "--batch", "32", "8", "1", "--context", "4096",
                                          "--queries", "1", "4", "--ops", "sparse_mla", "v4_csa", "v4_hca",
                                          "--cache-dtype", "fp8", "--json", "{json}"], None)],
    "exactness": [("exactness", ["benchmarks/exactness.py", "--json", "{json}"],
                   ["benchmarks/exactness.py", "--backend", "xla", "--drafts", "k=1", "--invariant-only", "--prompts",
                    "2", "--max-new-tokens", "2", "--json", "{json}"])],
}
# XLA's command buffers for while loops and conditionals (CUDA graph conditional nodes), which its
# defaults leave out: the generation loop then runs on the device without the host reading its
# predicate every step (docs/aot.md#loops).
LOOP_GRAPH_FLAGS = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
# (unit, argv, smoke argv, XLA flags added to the environment's). Smoke: k = 3 only, on a random
# tiny model: the part's code path once, at the least CPU.
MAINJOB_UNITS = [(f"mtp{k}", ["examples/generate.py", "--mtp", str(k), "--max-new-tokens", "96"],
                  None if k == 0 else ["examples/generate.py", "--random", "--preset", "tiny", "--mtp", str(k),
                                       "--max-new-tokens", "2"], None)
                 for k in (0, 3)] + [("mtp3-loop-graph", ["examples/generate.py", "--mtp", "3", "--max-new-tokens", "96"],
                                      None, LOOP_GRAPH_FLAGS)]
# attention_kernels.py's attention rows (by op name prefix) -> the op `AUTO_KERNELS` names.
AUTO_OPS = {"mla_attention": "mla_attention", "sparse_mla": "sparse_mla_attention", "indexer_scores": "indexer_topk"}
# Every attention row's op, V4's included (which do not calibrate the V3.2 step), for the choice
# between its Triton and Mosaic kernels.
KERNEL_AUTO_OPS = {**AUTO_OPS, "v4_csa": "sliding_compressed_attention", "v4_hca": "sliding_compressed_attention"}
# The suite module that holds the Mosaic grouped matmul to the reference on a GPU (its `gpu` test).
MOSAIC_GMM_TESTS = "test_grouped_matmul_mosaic.py"
# A Mosaic kernel is as close to the reference as the Triton one when its largest error is within
# this factor of Triton's, plus this much (bfloat16 outputs round at about 4e-3 near 1).
ERROR_FACTOR, ERROR_SLACK = 2.0, 1e-3
# Which benchmark rows calibrate which op class: (unit, op name prefix, impl); a unit's rows include
# those of its per-op units ("kernels/mla_attention", `unit_rows`). impl "auto": the
# implementation backend="auto" runs for the row's op on the report's device (`AUTO_KERNELS`, Triton
# where it names none), which is what the e2e step runs.
CLASS_ROWS = {"attention": [("kernels", tuple(AUTO_OPS), "auto")],
              "grouped_matmul": [("moe", ("moe_layer",), "pallas"), ("gmm/moe_fp8", ("moe_layer_fp8",), "pallas"),
                                 ("matmuls", ("linear_fp8",), "pallas")],
              "xla": [("matmuls", ("linear_bf16",), "xla")]}
TAIL = 4000  # characters of a command's output kept in the report


def device_name() -> str:
    """The GPU's name from nvidia-smi (without initializing JAX here), or "cpu"."""
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    names = found.stdout.strip().splitlines()
    return names[0].strip() if found.returncode == 0 and names else "cpu"


def target_of(device: str) -> str:
    """The `jaxspec/targets` spec for a device name ("h200" for an H200, else "h100")."""
    return "h200" if "H200" in device else "h100"


class Report:
    """report.json: {"runs": [...], "devices": {device: {unit: record}}, "calibration": {...}},
    written after every change (to a temporary file, then renamed: never half written)."""

    def __init__(self, out: str, device: str, retry_failed: bool = False):
        self.path = os.path.join(out, "report.json")
        self.device = device
        self.retry_failed = retry_failed
        self.data = {"runs": [], "devices": {}}
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.data = json.load(f)
        self.units = self.data["devices"].setdefault(device, {})

    def has(self, unit: str) -> bool:
        """Whether `unit` is recorded for this device, complete (not a benchmark cut short), not
        stale (`redo`) and, with retry_failed, successful."""
        record = self.units.get(unit)
        return (record is not None and not record.get("incomplete") and not record.get("stale")
                and (not self.retry_failed or record["ok"]))

    def redo(self, units: list[str]) -> None:
        """Mark `units`' records stale: the next run measures them again, and until a new record
        replaces one it stays in the report, marked, so a run that does not reach it loses nothing."""
        for unit in units:
            self.units[unit]["stale"] = True
        self.save()

    def record(self, unit: str, value: dict, ok: bool) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.units[unit] = {**value, "ok": ok, "recorded": now}
        self.save()

    def cut(self, what: str) -> None:
        """Note in this run's entry what the clock ended unfinished (report.md lists it)."""
        self.data["runs"][-1].setdefault("cut", []).append(what)
        self.save()

    def save(self) -> None:
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".json")
        with os.fdopen(handle, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(temporary, self.path)


class Clock:
    """Seconds left of `--deadline` (None: no limit), or of a part's share of it (`within`)."""

    def __init__(self, deadline: float | None):
        self.end = None if deadline is None else time.monotonic() + deadline

    def within(self, seconds: float | None) -> "Clock":
        """A clock that ends `seconds` from now, or with this one if that is sooner."""
        part = Clock(seconds)
        if part.end is None or (self.end is not None and self.end < part.end):
            part.end = self.end
        return part

    def left(self) -> float | None:
        return None if self.end is None else self.end - time.monotonic()

    def expired(self, needed: float = 0.0) -> bool:
        return self.end is not None and self.left() <= needed


def run(argv: list[str], clock: Clock, env: dict | None = None, limit: float | None = None,
        progress: str | None = None) -> dict:
    """Run `argv` in the repository (python scripts with this interpreter) until it ends, the clock
    runs out or it is taken as hung -> {"returncode", "seconds", "output" (its tail), "timed_out"
    (ended by the clock: unfinished, to run again), "hung" (ended by `limit`: a failure)}.

    Hung: `limit` seconds have passed; or, with `progress` (a file the command appends to as it
    goes: the suite's log), `limit` seconds have passed without that file changing, so a long run
    that keeps finishing tests is not taken for a hang."""
    if argv[0].endswith(".py"):
        argv = [sys.executable, *argv]
    start = time.monotonic()
    # Its own process group, so that at the deadline its children (pytest-xdist's workers) go too.
    # The output goes to a file: polling a pipe that is not drained would block the command.
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(argv, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, text=True, env=env,
                                   start_new_session=True)
        last_change, last_size, ended_by = start, -1, None
        while process.poll() is None:
            now = time.monotonic()
            size = os.path.getsize(progress) if progress and os.path.exists(progress) else -1
            if size != last_size:
                last_change, last_size = now, size
            left = clock.left()
            if left is not None and left <= 0:
                ended_by = "clock"
            elif limit is not None and now - (last_change if progress else start) > limit:
                ended_by = "limit"
            if ended_by:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended meanwhile; its workers with it
                    pass
                process.wait()
                break
            time.sleep(0.2 if left is None else min(0.2, max(left, 0.01)))
        output.seek(0)
        text = output.read()
    return {"returncode": None if ended_by else process.returncode, "seconds": time.monotonic() - start,
            "output": text[-TAIL:], "timed_out": ended_by == "clock", "hung": ended_by == "limit"}


def child_env(smoke: bool) -> dict:
    """Every part's environment: the repository importable (benchmarks import `jaxspec` and each
    other), JAX allocating on demand (several processes share the GPU in the suite) unless told."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, BENCHMARKS] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# --- the parts -------------------------------------------------------------------------------------


def unit_part(unit: str) -> str:
    """The part that records `unit` ("suite/test_a.py" -> "suite", "kernels_block_n32" -> "tiles")."""
    for part, units in BENCHMARK_UNITS.items():
        if unit in (name for name, _, _ in units):
            return part
    return unit.split("/", 1)[0]


def test_modules() -> list[str]:
    """tests/test_*.py, heaviest first (tests/conftest.py's HEAVIEST_FIRST, then by name)."""
    with open(os.path.join(REPO, "tests", "conftest.py")) as f:
        heavy = re.search(r"HEAVIEST_FIRST = \[(.*?)\]", f.read(), re.S).group(1)
    order = {name: i for i, name in enumerate(re.findall(r'"([^"]+)"', heavy))}
    names = sorted(n for n in os.listdir(os.path.join(REPO, "tests")) if n.startswith("test_") and n.endswith(".py"))
    return sorted(names, key=lambda n: order.get(n, len(order)))


def part_suite(report: Report, clock: Clock, args) -> None:
    """pytest on the GPU. By default one run takes every module not yet recorded, lightest first:
    the run is usually ended by the clock, and light modules first leave the most modules complete
    (xdist keeps every worker busy either way). A module the clock cut is recorded as incomplete
    (its finished tests, failures and slowest tests: the evidence of where GPU time goes) and runs
    again next time; --suite-chunk N runs N modules per pytest run instead."""
    if args.smoke:
        chunks = [["test_config.py"]]
        extra = ["--collect-only"]
    else:
        pending = [m for m in reversed(test_modules()) if not report.has(f"suite/{m}")]
        # Modules of a chunk that hung run one per chunk (under --retry-failed), to find the one.
        alone = [m for m in pending if report.units.get(f"suite/{m}", {}).get("hung")]
        rest = [m for m in pending if m not in alone]
        size = args.suite_chunk or max(len(rest), 1)
        chunks = [[m] for m in alone] + [rest[i:i + size] for i in range(0, len(rest), size)]
        extra = ["-n", str(args.workers)]
    for chunk in chunks:
        if all(report.has(f"suite/{m}") for m in chunk) or clock.expired(30):
            continue
        with tempfile.TemporaryDirectory() as scratch:
            log = os.path.join(scratch, "suite.jsonl")
            # Lightest first: the order of the modules here, and of the tests in the run (conftest.py).
            env = {**child_env(args.smoke), "JAXSPEC_SUITE_LOG": log, "JAXSPEC_TEST_ORDER": "lightest-first"}
            result = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_log", *extra,
                          *[os.path.join("tests", m) for m in chunk]], clock, env, args.unit_timeout, progress=log)
            collected, outcomes = suite_outcomes(log) if os.path.exists(log) else ({}, {})
        note(f"suite: {len(chunk)} modules: exit {result['returncode']} in {result['seconds']:.0f} s"
             + (" (hung: no test finished for --unit-timeout)" if result["hung"] else ""))
        complete = [m for m in chunk if args.smoke and m in collected  # --collect-only runs no test
                    or m in outcomes and outcomes[m]["finished"] == collected.get(m)]
        suspects = []
        if result["hung"]:
            # The tests that were running are the suspects: their modules fail (run again only
            # under --retry-failed, one module a run); the rest runs again next time. Nothing
            # logged at all (a hang before or during collection): the whole chunk is the suspect.
            suspects = ([m for m in chunk if outcomes.get(m, {}).get("running")]
                        or [m for m in chunk if m not in complete])
        unfinished = [m for m in chunk if m not in complete and m not in suspects]
        if unfinished and (result["timed_out"] or result["hung"]):
            # The complete modules are kept; the others run again next time, their progress noted.
            report.cut(f"suite: {len(unfinished)} modules unfinished after {result['seconds']:.0f} s")
            for module in unfinished:
                if outcomes.get(module, {}).get("finished"):
                    found = outcomes[module]
                    report.record(f"suite/{module}", {**found, "collected": collected.get(module), "incomplete": True,
                                                      "chunk_seconds": result["seconds"]}, ok=not found["failed"])
        for module in complete + suspects:
            found = outcomes.get(module, empty_outcome())
            if module in suspects:
                found = {**found, "failed": found["failed"] + 1, "hung": True, "failures": found["failures"] + [
                    f"{', '.join(found['running']) or 'its run'}: no test finished for --unit-timeout "
                    f"{args.unit_timeout:.0f} s; ended"]}
            if args.smoke:  # --collect-only runs no test: count what it collected
                found["collected_only"] = collected.get(module, 0)
            if result["returncode"] not in (0, 5, None) and not found["failed"]:  # a crash (no test failed)
                found["failed"] += 1
                found["failures"].append(f"pytest exit {result['returncode']}: {result['output'][-1500:]}")
            report.record(f"suite/{module}", {**found, "collected": collected.get(module),
                                              "chunk_seconds": result["seconds"]}, ok=not found["failed"])


def run_benchmark(argv: list[str], clock: Clock, args) -> tuple[dict, dict | None]:
    """Run one benchmark command ("{json}" in argv: where it writes its rows) -> (`run`'s result,
    the rows it wrote or None)."""
    with tempfile.TemporaryDirectory() as scratch:
        rows_path = os.path.join(scratch, "rows.json")
        result = run([a.replace("{json}", rows_path) for a in argv], clock, child_env(args.smoke), args.unit_timeout)
        return result, (json.load(open(rows_path)) if os.path.exists(rows_path) else None)


def part_benchmark(name: str, report: Report, clock: Clock, args) -> None:
    """Each unit of part `name` not yet recorded, within the clock. An attention_kernels.py unit that a hung
    Mosaic call ended (`attention_kernels.HUNG_EXIT`) runs again at once without the Mosaic kernels
    (`--no-mosaic`): the stuck device ended it before its later shapes, whose Triton and XLA rows
    the Mosaic rows are read against. Its record keeps the hang (a failure) and the Mosaic rows
    finished before it."""
    for unit, argv, smoke_argv in BENCHMARK_UNITS[name]:
        if report.has(unit) or clock.expired(30) or (args.smoke and smoke_argv is None):
            continue
        command = smoke_argv if args.smoke else argv
        result, rows = run_benchmark(command, clock, args)
        note(f"{unit}: exit {result['returncode']} in {result['seconds']:.0f} s"
             + (" (hung: ended at --unit-timeout)" if result["hung"] else ""))
        if result["returncode"] == HUNG_EXIT and command[0] == KERNELS_SCRIPT and not clock.expired(30):
            note(f"{unit}: a Mosaic call hung; its other kernels run again without the Mosaic ones")
            again, others = run_benchmark([*command, "--no-mosaic"], clock, args)
            note(f"{unit} without Mosaic: exit {again['returncode']} in {again['seconds']:.0f} s")
            if others:
                mosaic = [row for row in (rows or {}).get("rows", []) if row["impl"].startswith("mosaic")]
                rows = {**others, "rows": others["rows"] + mosaic,
                        "failures": (rows or {}).get("failures", []) + others["failures"]}
        if result["timed_out"]:
            report.cut(f"{unit} after {result['seconds']:.0f} s")
            if rows and rows["rows"]:  # keep what it measured; the next run measures the unit again
                report.record(unit, {**result, "json": rows, "incomplete": True}, ok=True)
            continue
        failed = result["returncode"] != 0 or rows is None or bool(rows.get("failures"))
        report.record(unit, {**result, "json": rows}, ok=not failed)


def part_gmm(report: Report, clock: Clock, args) -> None:
    """The step on the Mosaic kernel first (it decides the op's `AUTO_KERNELS` entry), then the
    layers' rows under every tile variant (where the time goes, and which variant moves it), then
    the step under GMM_E2E_TILES (one variant, at the cost of a step's compile a point)."""
    first, *rest = GMM_E2E_VARIANTS
    part_e2e(report, clock, args, first)
    part_benchmark("gmm", report, clock, args)
    for variant in rest:
        part_e2e(report, clock, args, variant)


def part_mainjob(report: Report, clock: Clock, args) -> None:
    for unit, argv, smoke_argv, xla_flags in MAINJOB_UNITS:
        if report.has(f"mainjob/{unit}") or clock.expired(30) or (args.smoke and smoke_argv is None):
            continue
        env = child_env(args.smoke)
        if xla_flags:
            env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS"), xla_flags) if f)
        result = run(smoke_argv if args.smoke else argv, clock, env, args.unit_timeout)
        note(f"mainjob {unit}: exit {result['returncode']} in {result['seconds']:.0f} s")
        found = {key: re.search(pattern, result["output"]) for key, pattern in
                 (("tokens_per_s", r"decode .*?: ([\d,.]+) tokens/s"), ("mean_accepted", r"mean accepted length ([\d.]+)"),
                  ("compile_s", r"compile\s+([\d.]+) s"))}
        parsed = {key: float(m.group(1).replace(",", "")) if m else None for key, m in found.items()}
        if result["timed_out"]:
            report.cut(f"mainjob {unit} after {result['seconds']:.0f} s")
        else:
            report.record(f"mainjob/{unit}", {**result, **parsed}, ok=result["returncode"] == 0)


def part_e2e(report: Report, clock: Clock, args, variant: str | None = None) -> None:
    """The e2e points (units "e2e/B=..,k=.."); with variant "v4" the e2e_v4 part's, V4-Flash's
    (units "e2e_v4/B=..,k=..", under --smoke tiny-v4's at SMOKE_E2E_POINTS); with one of
    GMM_E2E_VARIANTS the gmm part's (units "gmm/e2e-VARIANT/B=..,k=..")."""
    if variant is None:
        prefix, points, flags = "e2e", SMOKE_E2E_POINTS if args.smoke else E2E_POINTS, []
    elif variant == "v4":
        prefix, points, flags = "e2e_v4", SMOKE_E2E_POINTS if args.smoke else V4_E2E_POINTS, ["--v4"]
    else:  # (--smoke: a variant's points are not run; the default's run the same code path)
        prefix, points, flags = f"gmm/e2e-{variant}", [] if args.smoke else GMM_E2E_POINTS, GMM_E2E_VARIANTS[variant]
    # A point measured before the step was profiled is measured again, with its profile.
    missing = [(b, k) for b, k in points
               if not report.has(f"{prefix}/B={b},k={k}") or report.units[f"{prefix}/B={b},k={k}"].get("profile") is None]
    if not missing or clock.expired(60):
        return
    argv = (["benchmarks/e2e_step.py", "--profile", *flags, "--points", *[f"{b},{k}" for b, k in missing]]
            + (["--smoke"] if args.smoke else []))
    with tempfile.TemporaryDirectory() as scratch:
        points_path = os.path.join(scratch, "e2e.json")
        left = clock.left()
        if left is not None:  # leave the point in flight time to finish (on an H200 a point took about 20 s)
            argv += ["--deadline", str(max(left - E2E_POINT_SECONDS, 0))]
        env = child_env(args.smoke)
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # one process: let it have the GPU
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
        result = run([*argv, "--json", points_path], clock, env)
        measured = json.load(open(points_path)) if os.path.exists(points_path) else {}
    note(f"{prefix}: {len(measured)} of {len(missing)} points in {result['seconds']:.0f} s, exit {result['returncode']}")
    for key, point in measured.items():
        report.record(f"{prefix}/B={point['batch']},k={point['drafts']}", point, ok=True)
    if result["returncode"] not in (0, None) or result["timed_out"]:
        report.record(f"{prefix}/failed run {len(report.data['runs'])}", {**result, "missing": missing}, ok=False)


# --- calibration and the markdown report ---------------------------------------------------------


def auto_impl(device: str, op: str, impl: str) -> str:
    """`impl`, or for "auto" the implementation backend="auto" picks for attention_kernels.py's row `op` on
    `device` (nvidia-smi's name, which is JAX's device kind)."""
    if impl != "auto":
        return impl
    prefix = next(name for name in AUTO_OPS if op.startswith(name))
    return AUTO_KERNELS.get(device, {}).get(AUTO_OPS[prefix], "pallas")


def unit_rows(units: dict, unit: str) -> list[dict]:
    """The benchmark rows of `unit` and of its per-op units ("kernels" -> "kernels/mla_attention", ...)."""
    return [row for name, record in units.items() if name == unit or name.startswith(unit + "/")
            for row in (record.get("json") or {}).get("rows", [])]


def row_seconds(row: dict) -> float:
    """A benchmark row's time a call: its kernels' device time where it was measured
    (`device_seconds`, `kernel_profile.device_seconds`), else its wall-clock time (rows from before
    that, and the roofline rows). Calibration and the Mosaic / Triton verdicts use it: a decode
    step pays an op's kernels, not a Python call's dispatch."""
    device = row.get("device_seconds")
    return row["seconds"] if device is None else device


def e2e_lines(points: list[dict], cal: dict | None, layers: str) -> list[str]:
    """report.md's table of e2e points (`e2e_step.py`'s records, one model's), each measured beside
    its projection and calibrated with `cal` (None: no calibration for the device); layers: what the
    model's layers are, for the table's caption ("1 dense + MoE")."""
    if not points:
        return ["not measured"]
    first = points[0]
    lines = [f"{first.get('model', 'deepseek-v3.2')}: {first['layers']} layers ({layers}) + MTP, FP8 random "
             f"weights, context {first['context']}; projection: roofline of the same compiled program on "
             f"{first['target']} peaks; calibrated: {cal['label'] if cal else 'no calibration for this device yet'} "
             "(each op class at its measured fraction of the roofline, and at least its profiled kernels x the "
             "calibration's time a launch where both are known).", "",
             "| B | k | measured ms | projected ms | measured / projected throughput | calibrated ms | TFLOP | GB |",
             "|---|---|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (p["batch"], p["drafts"])):
        calibrated_s = calibrated_seconds(p, cal)
        calibrated = "-" if calibrated_s is None else f"{calibrated_s * 1e3:.2f}"
        lines.append(f"| {p['batch']} | {p['drafts']} | {p['measured_s'] * 1e3:.2f} | {p['projected_s'] * 1e3:.2f} | "
                     f"{p['ratio']:.2f} | {calibrated} | {p['flops'] / 1e12:.3f} | {p['bytes'] / 1e9:.2f} |")
    return lines


def calibrated_seconds(point: dict, cal: dict | None) -> float | None:
    """An e2e point's step projected with the calibration `cal` (report.json's "calibration":
    `projection.step_seconds` of the point's own program's cost by op class, its launches the
    kernels its profile counted where it has them; one GPU: no collectives); None without one."""
    if not cal or not (cal.get("fractions") or cal.get("launch_seconds")):
        return None
    cost = StepCost(flops=point["flops"], bytes_accessed=point["bytes"], compile_seconds=0.0,
                    by_class={name: tuple(value) for name, value in point["by_class"].items()},
                    launches=(point.get("profile") or {}).get("by_class_kernels", {}))
    return step_seconds(cost, target_peaks(point["target"]),
                        Calibration("report", cal.get("fractions", {}), cal.get("launch_seconds")))


def launch_seconds(units: dict) -> tuple[float, str] | None:
    """The device time a launch takes at the least, and the e2e unit it was read from: the mean of
    XLA's kernels (`by_class_ms["xla"]` over `by_class_kernels["xla"]`) in the profile of the e2e
    point with the fewest tokens a step (B x (k + 1)) among those whose profile counted its kernels.
    At one token XLA's kernels (norms, pads, routing, copies) move a few kilobytes each, so their
    mean is what a launch costs inside the step's CUDA graphs; the few that move more (the LM
    head's matmul) make it an upper bound. None without such a profile."""
    counted = [(record["batch"] * (record["drafts"] + 1), name, record["profile"]) for name, record in units.items()
               if name.startswith("e2e/B=") and (record.get("profile") or {}).get("by_class_kernels", {}).get("xla")]
    if not counted:
        return None
    _, name, profile = min(counted)
    return profile["by_class_ms"]["xla"] / 1e3 / profile["by_class_kernels"]["xla"], name


def calibration(report: Report) -> dict | None:
    """Per op class, roofline time / measured time (`row_seconds`) summed over the class's rows (CLASS_ROWS), on
    the target whose peaks match this device; None without any rows."""
    bandwidth, peak = target_peaks(target_of(report.device))
    fractions, counts = {}, {}
    for name, sources in CLASS_ROWS.items():
        roofline = measured = 0.0
        for unit, ops, impl in sources:
            for row in unit_rows(report.units, unit):
                if row["op"].startswith(ops) and row["impl"] == auto_impl(report.device, row["op"], impl):
                    roofline += max(row["bytes"] / bandwidth, row["flops"] / peak)
                    measured += row_seconds(row)
                    counts[name] = counts.get(name, 0) + 1
        if measured:
            fractions[name] = roofline / measured
    launch = launch_seconds(report.units)
    if not fractions and launch is None:
        return None
    return {"label": f"measured on {report.device} ({target_of(report.device)} peaks)", "device": report.device,
            "fractions": fractions, "rows": counts,
            "not_measured": sorted({"attention", "grouped_matmul", "xla", "collectives"} - set(fractions)),
            "launch_seconds": launch and launch[0], "launch_source": launch and launch[1]}


def mosaic_against_triton(units: dict) -> dict[str, dict]:
    """Per op `AUTO_KERNELS` names, from the kernels part's rows: the Mosaic kernel's time over the
    Triton kernel's (default tuning), summed over the shapes both were timed at, each one's largest
    error against the reference, and the verdict: "mosaic" (faster and within ERROR_FACTOR x
    Triton's error + ERROR_SLACK: set `AUTO_KERNELS[device][op] = "mosaic"`), "pallas" (Triton
    stays: not faster), "wrong" (faster or not, the Mosaic error is beyond that) or "unchecked" (no
    reference was computed)."""
    pairs = {}
    for row in unit_rows(units, "kernels"):
        if row["impl"] in ("pallas", "mosaic") and row["op"] in KERNEL_AUTO_OPS:
            key = (row["op"], row["batch"], row["context"], row["queries"], row.get("cache_dtype"))
            pairs.setdefault(key, {})[row["impl"]] = row
    found = {}
    for (op, *_), pair in pairs.items():
        if len(pair) < 2:
            continue
        entry = found.setdefault(KERNEL_AUTO_OPS[op], {"shapes": 0, "pallas_s": 0.0, "mosaic_s": 0.0,
                                                       "pallas_err": 0.0, "mosaic_err": 0.0, "checked": True})
        entry["shapes"] += 1
        for impl in ("pallas", "mosaic"):
            entry[f"{impl}_s"] += row_seconds(pair[impl])
            error = pair[impl].get("max_error")
            entry["checked"] &= error is not None
            entry[f"{impl}_err"] = max(entry[f"{impl}_err"], error or 0.0)
    for entry in found.values():
        entry["ratio"] = entry["mosaic_s"] / entry["pallas_s"]
        close = entry["mosaic_err"] <= ERROR_FACTOR * entry["pallas_err"] + ERROR_SLACK
        entry["verdict"] = ("unchecked" if not entry["checked"] else "wrong" if not close
                            else "mosaic" if entry["ratio"] < 1 else "pallas")
    return found


def grouped_matmul_verdict(units: dict) -> dict | None:
    """The Mosaic grouped matmul against Triton, decided on the step itself: the gmm part's points
    with "auto" on the Mosaic kernel ("gmm/e2e-mosaic/B=..,k=..") beside the e2e part's at the same
    B and k (Triton: no `AUTO_KERNELS` entry). Returns the points both measured, the step time over
    the default's summed over them, and the verdict: "mosaic" (faster at every such point, and the
    suite's `MOSAIC_GMM_TESTS`, which holds the kernel to the reference natively, passed on this
    device: set `AUTO_KERNELS[device]["grouped_matmul"] = "mosaic"`), "pallas" (not faster at
    every point) or "unchecked" (faster, but that module has not passed here yet); None before
    any pair is measured."""
    pairs = [(units[f"e2e/B={p['batch']},k={p['drafts']}"], p) for name, p in units.items()
             if name.startswith("gmm/e2e-mosaic/B=") and p.get("ok", True)
             and f"e2e/B={p['batch']},k={p['drafts']}" in units]
    if not pairs:
        return None
    tests = units.get(f"suite/{MOSAIC_GMM_TESTS}")
    passed = bool(tests) and not tests.get("incomplete") and tests["failed"] == 0 and tests["passed"] > 0
    faster = all(mosaic["measured_s"] < default["measured_s"] for default, mosaic in pairs)
    return {"points": len(pairs),
            "ratio": sum(m["measured_s"] for _, m in pairs) / sum(d["measured_s"] for d, _ in pairs),
            "verdict": "pallas" if not faster else "mosaic" if passed else "unchecked"}


def against_flashmla(units: dict) -> list[str]:
    """report.md's section on FlashMLA: each shape its harness timed (op, B, context, Q, cache dtype),
    its time a call and our kernels' (attention_kernels.py's default tunings: the kernels part's rows and the
    flashmla part's FP8-cache rows) as a multiple of it, each by `row_seconds`."""
    theirs, ours = {}, {}
    for name, record in units.items():
        if not (name.startswith("kernels/") or name == "flashmla" or name.startswith("flashmla/")):
            continue
        for row in (record.get("json") or {}).get("rows", []):
            key = (row["op"], row["batch"], row["context"], row["queries"], row.get("cache_dtype", "bfloat16"))
            if row["impl"] == "flashmla":
                theirs[key] = row
            elif row["impl"] in ("pallas", "mosaic", "xla"):
                ours.setdefault(key, {})[row["impl"]] = row
    lines = ["## FlashMLA beside ours", ""]
    if not theirs:
        return lines + ["not measured", ""]
    lines += ["FlashMLA's time a call (split-KV kernel and combine, CUDA events) and ours as a multiple of it "
              "(device time where measured): under 1 is faster than FlashMLA.", "",
              "| op | B | ctx | Q | cache | FlashMLA ms | FlashMLA GB/s | FlashMLA max err | Triton / FlashMLA | "
              "Mosaic / FlashMLA | XLA / FlashMLA |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in sorted(theirs.items()):
        spent = row_seconds(row)
        ratios = [f"{row_seconds(ours[key][impl]) / spent:.2f}" if impl in ours.get(key, {}) else "-"
                  for impl in ("pallas", "mosaic", "xla")]
        lines.append(f"| {' | '.join(map(str, key))} | {spent * 1e3:.3f} | {row['bytes'] / spent / 1e9:.0f} | "
                     f"{row['max_error']:.2e} | {' | '.join(ratios)} |")
    return lines + [""]


def headline(report: Report) -> dict | None:
    """The e2e point HEADLINE: measured / projected, and per op class its time (with its kernel
    count where the profile has one), share of the step and fraction of its roofline (classes
    under GOAL named). From the point's profile where it has one ("profiled": the kernels' own
    times on the device, and the step's time outside them), else from the calibration
    ("calibrated": each class's roofline time over its benchmarks' fraction, shares of the
    calibrated step)."""
    point = report.units.get(f"e2e/B={HEADLINE[0]},k={HEADLINE[1]}") or (
        report.units.get(f"e2e/B={SMOKE_E2E_POINTS[-1][0]},k={SMOKE_E2E_POINTS[-1][1]}"))
    if point is None:
        return None
    bandwidth, peak = target_peaks(point["target"])
    roofline = {name: max(nbytes / bandwidth, flops / peak) for name, (flops, nbytes) in point["by_class"].items()}
    profile = point.get("profile") or {}
    step = point["measured_s"]
    kernels = {}
    if profile.get("by_class_ms"):
        source, outside = "profiled", step - profile["busy_ms"] / 1e3
        times = {name: ms / 1e3 for name, ms in profile["by_class_ms"].items()}
        kernels = profile.get("by_class_kernels", {})  # none in profiles recorded before the counts
        fractions = {name: roofline.get(name, 0.0) / t if t else None for name, t in times.items()}
        shares = {name: t / step for name, t in times.items()}
    else:
        source, outside = "calibrated", None
        calibrated = (report.data.get("calibration") or {}).get("fractions", {})
        times = {name: t / calibrated.get(name, 1.0) for name, t in roofline.items()}
        fractions = {name: calibrated.get(name) for name in times}
        shares = {name: t / (sum(times.values()) or 1.0) for name, t in times.items()}
    return {"batch": point["batch"], "drafts": point["drafts"], "ratio": point["ratio"], "source": source,
            "measured_ms": step * 1e3, "projected_ms": point["projected_s"] * 1e3,
            "outside_ms": None if outside is None else outside * 1e3,
            "top": profile.get("top", []) if source == "profiled" else [],
            "classes": {name: {"ms": times[name] * 1e3, "share": shares[name], "fraction": fractions[name],
                               "kernels": kernels.get(name)} for name in times},
            "missing_goal": sorted(n for n in times if fractions[n] is not None and fractions[n] < GOAL)}


def tile_variant_lines(units: dict) -> list[str]:
    """report.md's table of the gmm part's e2e points, each beside the default's point."""
    variants = [(k.split("/")[1].removeprefix("e2e-"), v) for k, v in units.items()
                if k.startswith("gmm/e2e-") and "/B=" in k]
    if not variants:
        return []
    lines = ["", "The step with another grouped-matmul tile variant or kernel (the gmm part), against the default's:",
             "", "| variant | B | k | measured ms | default ms | grouped matmul ms (profiled) |",
             "|---|---|---|---|---|---|"]
    for tiles, p in sorted(variants, key=lambda item: (item[0], item[1]["batch"], item[1]["drafts"])):
        default = units.get(f"e2e/B={p['batch']},k={p['drafts']}")
        gmm = ((p.get("profile") or {}).get("by_class_ms") or {}).get("grouped_matmul")
        lines.append(f"| {tiles} | {p['batch']} | {p['drafts']} | {p['measured_s'] * 1e3:.2f} | "
                     f"{'-' if default is None else format(default['measured_s'] * 1e3, '.2f')} | "
                     f"{'-' if gmm is None else format(gmm, '.2f')} |")
    return lines


def markdown(report: Report) -> str:
    units, device = report.units, report.device
    lines = [f"# GPU report: {device}", "", f"Runs: {len(report.data['runs'])}; last "
             f"{report.data['runs'][-1]['started'] if report.data['runs'] else '-'}. Written by "
             "`python benchmarks/gpu_report.py`; figures are measurements on this device unless named projections.", ""]
    cut = report.data["runs"][-1].get("cut") if report.data["runs"] else None
    if cut:
        lines += [f"The last run's clock ended these unfinished (the next run goes on with them): {'; '.join(cut)}.", ""]
    stale = [unit for unit, record in units.items() if record.get("stale")]
    if stale:
        lines += [f"Recorded before a change to what they measure (`--redo`; shown until the next run measures them "
                  f"again): {', '.join(stale)}.", ""]
    suite = {k.split("/", 1)[1]: v for k, v in units.items() if k.startswith("suite/") and not v.get("incomplete")}
    partial = {k.split("/", 1)[1]: v for k, v in units.items() if k.startswith("suite/") and v.get("incomplete")}
    lines += ["## Test suite", ""]
    if suite:
        totals = [sum(v[key] for v in suite.values()) for key in ("passed", "failed", "skipped")]
        lines += [f"{len(suite)} modules: {totals[0]} passed, {totals[1]} failed, {totals[2]} skipped "
                  f"({sum(v['seconds'] for v in suite.values()):.0f} s of test time).", "",
                  "s: the module's test time; compile s: of it, in XLA's compiler (a program from the persistent cache "
                  "included); trace s: tracing and lowering; programs: compiled or fetched (\"-\": recorded before "
                  "these were counted).", "",
                  "| module | passed | failed | skipped | s | compile s | trace s | programs |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {m} | {v['passed']} | {v['failed']} | {v['skipped']} | {v['seconds']:.0f} | "
                  + " | ".join(f"{v[key]:.0f}" if key in v else "-" for key in COMPILE_KEYS) + " |"
                  for m, v in suite.items()]
        problems = [f"- {m}: {f}" for m, v in suite.items() for f in v["failures"]]
        skips = [f"- {m}: {s}" for m, v in suite.items() for s in v["skips"]]
        lines += ([""] + ["Failures:"] + problems if problems else []) + ([""] + ["Skips:"] + skips if skips else [])
    if partial:
        lines += ["", "Cut short (run again next time; what had finished):", ""]
        lines += [f"- {m}: {v['finished']} of {v.get('collected') or '?'} tests in {v['seconds']:.0f} s"
                  + (f", {v['compile_seconds']:.0f} s of it compiling {v['programs']} programs"
                     if "programs" in v else "")
                  + f" ({v['passed']} passed, {v['failed']} failed, {v['skipped']} skipped); slowest: "
                  + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in v.get("slowest", []))
                  for m, v in partial.items()]
        lines += [f"  - failed: {f}" for v in partial.values() for f in v["failures"]]
    pending = [m for m in test_modules() if m not in suite and m not in partial]
    lines += ["", f"Not run yet: {', '.join(pending) or 'none'}.", ""]
    bandwidth, peak = target_peaks(target_of(device))
    for part in ("kernels", "kernels_stages3", "kernels_n32_stages3", "kernels_block_n32", "kernels_sparse_parts16",
                 "kernels_part_slots", "kernels_v4_tunings", "gather", "flashmla", "moe", "matmuls", "gmm"):
        records = {name: record for name, record in units.items() if name == part or name.startswith(part + "/")}
        lines += [f"## {part}", ""]
        problems = [f"- {name}: " + ("incomplete (cut short; measured again next run)" if record.get("incomplete") else
                                     "ended at --unit-timeout (a hang?)" if record.get("hung") else
                                     f"exit {HUNG_EXIT}: a call hung, and its watchdog ended the run"
                                     if record["returncode"] == HUNG_EXIT else f"exit {record['returncode']}")
                    for name, record in records.items() if record.get("incomplete") or not record["ok"]]
        problems += [f"- {f['op']} {f['impl']}" + (f" (B {f['batch']}, ctx {f['context']}, Q {f['queries']})"
                                                  if "batch" in f else "") + f": {f['message'][:300]}"
                     for record in records.values() for f in (record.get("json") or {}).get("failures", [])]
        rows = unit_rows(units, part)
        if not rows:
            lines += ["not measured", ""] + problems + ([""] if problems else [])
            continue
        copy = next(record["json"]["copy_bytes_per_s"] for record in records.values() if record.get("json"))
        lines += [f"copy bandwidth {copy / 1e9:.0f} GB/s; roofline of {target_of(device)}: "
                  f"{bandwidth / 1e12:.2f} TB/s, {peak / 1e12:.0f} TFLOP/s; ms: a call by the wall clock; device ms: "
                  f"its kernels on the device, which GB/s and % roofline use where measured; max err: against the "
                  f"op's reference", "",
                  "| op | impl | shape | ms | device ms | GB/s | % roofline | max err |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in rows:
            shape = ", ".join(f"{k} {row[k]}" for k in ("layer", "batch", "context", "queries", "tokens", "programs",
                                                          "tiles", "keys") if k in row)
            roof = max(row["bytes"] / bandwidth, row["flops"] / peak)
            error = ("wrong rows" if row.get("correct") is False else "-" if row.get("max_error") is None
                     else f"{row['max_error']:.2e}")
            spent = row_seconds(row)
            kernels_ms = "-" if row.get("device_seconds") is None else f"{row['device_seconds'] * 1e3:.3f}"
            lines.append(f"| {row['op']} | {row['impl']} | {shape} | {row['seconds'] * 1e3:.3f} | {kernels_ms} | "
                         f"{row['bytes'] / spent / 1e9:.0f} | {100 * roof / spent:.0f}% | {error} |")
        lines += [""] + (["Not measured or failed:"] + problems + [""] if problems else [])
    lines += against_flashmla(units)
    lines += ["## Exactness", ""]
    record = units.get("exactness")
    if record and record.get("json"):
        lines += ["| backend | window_invariant | draft | identical rows |", "|---|---|---|---|"]
        lines += [f"| {r['backend']} | {r['window_invariant']} | {r['draft']} | {r['identical']} / {r['rows']} |"
                  for r in record["json"]["rows"]]
    else:
        lines.append("not measured" + ("" if record is None else f" (exit {record['returncode']})"))
    lines += ["", "## Main job", ""]
    for unit, *_ in MAINJOB_UNITS:
        record = units.get(f"mainjob/{unit}")
        lines.append(f"- {unit}: " + ("not run" if record is None else
                                      f"{record['tokens_per_s']} tokens/s, mean accepted length "
                                      f"{record['mean_accepted']}, exit {record['returncode']}"))
    cal = report.data.get("calibration")
    cal = cal if cal and cal.get("device") == device else None
    lines += ["", "## End-to-end decode step (measured beside its projection)", ""]
    lines += e2e_lines([v for k, v in units.items() if k.startswith("e2e/B=")], cal, "1 dense + MoE")
    failed = [k for k in units if k.startswith(("e2e/failed", "gmm/e2e-")) and "/failed" in k]
    lines += [f"(e2e runs that failed: {', '.join(failed)}; their output is in report.json)" if failed else ""]
    lines += tile_variant_lines(units)
    lines += ["", "## DeepSeek-V4-Flash's decode step (the e2e_v4 part)", ""]
    lines += e2e_lines([v for k, v in units.items() if k.startswith("e2e_v4/B=")], cal, "MoE")
    failed = [k for k in units if k.startswith("e2e_v4/failed")]
    lines += [f"(runs that failed: {', '.join(failed)}; their output is in report.json)" if failed else ""]
    choice = mosaic_against_triton(units)
    lines += ["", "## Mosaic against Triton (what `AUTO_KERNELS` should say)", ""]
    if choice:
        lines += ["| op | shapes | Mosaic / Triton time | max err Mosaic / Triton | verdict |", "|---|---|---|---|---|"]
        verdicts = {"mosaic": f"Mosaic: set `AUTO_KERNELS[{device!r}][op] = \"mosaic\"`", "pallas": "Triton stays",
                    "wrong": "Mosaic's error is beyond Triton's: fix before timing counts", "unchecked": "no reference row"}
        lines += [f"| {op} | {c['shapes']} | {c['ratio']:.2f} | {c['mosaic_err']:.2e} / {c['pallas_err']:.2e} | "
                  f"{verdicts[c['verdict']]} |" for op, c in choice.items()]
    else:
        lines.append("no shape with both kernels timed yet")
    gmm = grouped_matmul_verdict(units)
    gmm_verdicts = {"mosaic": f"Mosaic: set `AUTO_KERNELS[{device!r}][\"grouped_matmul\"] = \"mosaic\"`",
                    "pallas": "Triton stays", "unchecked": f"faster, but {MOSAIC_GMM_TESTS} has not passed here yet"}
    lines += ["", "grouped_matmul, decided on the step (the gmm part's points with \"auto\" on the Mosaic kernel "
              "against the e2e part's): " + ("not measured yet" if gmm is None else
                                             f"{gmm['points']} points, step time {gmm['ratio']:.2f}x the default's: "
                                             f"{gmm_verdicts[gmm['verdict']]}")]
    lines += ["", "## Calibration (fraction of the roofline per op class)", ""]
    if cal:
        lines += [f"- {name}: {value:.3f} ({cal['rows'][name]} rows)" for name, value in cal["fractions"].items()]
        lines.append(f"- not measured (1.0 in the projection): {', '.join(cal['not_measured'])}")
        lines.append("- a launch: " + ("not measured (no launch floor in the projection)"
                                       if cal.get("launch_seconds") is None else
                                       f"{cal['launch_seconds'] * 1e6:.2f} us (the mean of XLA's kernels in "
                                       f"{cal['launch_source']}'s profile)"))
    else:
        lines.append("none for this device")
    top = headline(report)
    lines += ["", "## The ratio", ""]
    if top:
        lines.append(f"B = {top['batch']}, k = {top['drafts']}: measured {top['measured_ms']:.2f} ms, projected "
                     f"{top['projected_ms']:.2f} ms: measured / projected throughput = {top['ratio']:.2f} (goal >= "
                     f"{GOAL}: {'met' if top['ratio'] >= GOAL else 'missed'}).")
        step = "measured step (profiled)" if top["source"] == "profiled" else "calibrated step"
        unknown = "no kernel of it profiled" if top["source"] == "profiled" else "not measured"
        lines += [f"- {name}: {c['ms']:.2f} ms"
                  + (f" in {c['kernels']} kernels ({1e3 * c['ms'] / c['kernels']:.1f} us each)" if c["kernels"] else "")
                  + f", {100 * c['share']:.0f}% of the {step}, fraction of roofline "
                  f"{unknown if c['fraction'] is None else format(c['fraction'], '.2f')}"
                  for name, c in top["classes"].items()]
        if top["outside_ms"] is not None:
            lines.append(f"- outside any kernel (launch gaps, host round trips): {top['outside_ms']:.2f} ms, "
                         f"{100 * top['outside_ms'] / top['measured_ms']:.0f}% of the measured step")
        lines.append(f"Op classes under {GOAL} of their roofline: {', '.join(top['missing_goal']) or 'none'}.")
        if top["top"]:
            lines += ["", "Its longest kernels (one profiled step):", "", "| kernel | ms | launches |", "|---|---|---|"]
            lines += [f"| `{name}` | {ms:.3f} | {count} |" for name, ms, count in top["top"]]
    else:
        lines.append("no end-to-end point yet")
    return "\n".join(lines) + "\n"


def parse_parts(text: str) -> list[tuple[str, float | None]]:
    """"suite:240,e2e,kernels" -> [("suite", 240.0), ("e2e", None), ("kernels", None)]: the parts in
    the order they run, each with the most seconds it may take (None: until the deadline)."""
    parts = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        name, _, seconds = item.partition(":")
        try:
            limit = float(seconds) if seconds else None
        except ValueError:
            limit = -1.0
        if name not in PARTS or (limit is not None and limit <= 0) or name in (n for n, _ in parts):
            raise argparse.ArgumentTypeError(
                f"--parts {text!r}: distinct names of {','.join(PARTS)}, each optionally with ':SECONDS' > 0")
        parts.append((name, limit))
    if not parts:
        raise argparse.ArgumentTypeError(f"--parts {text!r}: name at least one of {','.join(PARTS)}")
    return parts


def parse_redo(text: str) -> list[str]:
    """"moe,kernels/sparse_mla" -> ["moe", "kernels/sparse_mla"]: parts (every unit of each) and
    benchmark units (`BENCHMARK_UNITS`' names) to measure again, after a change to what they measure."""
    units = {unit for part in BENCHMARK_UNITS.values() for unit, _, _ in part}
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in PARTS and n not in units for n in names):
        raise argparse.ArgumentTypeError(
            f"--redo {text!r}: names of parts ({','.join(PARTS)}) or of benchmark units ({','.join(sorted(units))})")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-report", help="directory of report.json and report.md (kept across runs)")
    parser.add_argument("--parts", type=parse_parts, default=[(part, None) for part in PARTS],
                        help=f"comma-separated parts of {','.join(PARTS)}, run in this order; 'part:SECONDS' gives a "
                             "part at most that long")
    parser.add_argument("--smoke", action="store_true", help="every part at tiny sizes; runs anywhere")
    parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                        help="start no unit after this many seconds (what is left is listed)")
    parser.add_argument("--unit-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="end a suite chunk, benchmark or main-job run that takes longer, and record it as failed "
                             "(default 300)")
    parser.add_argument("--workers", type=int, default=8, help="pytest-xdist workers of the suite part")
    parser.add_argument("--suite-chunk", type=int, default=None,
                        help="test modules per pytest run (default: every module left, in one run)")
    parser.add_argument("--redo", nargs="?", const=",".join(PARTS), default=None, metavar="NAMES",
                        help="measure again what the report holds for this device: of the parts or benchmark units "
                             "named (comma-separated, e.g. kernels,gather/sparse_mla), or of every part when none "
                             "is named")
    parser.add_argument("--retry-failed", action="store_true",
                        help="run again the units that failed (a benchmark's error, a test module's failures)")
    args = parser.parse_args(argv)
    if args.workers < 1 or (args.suite_chunk is not None and args.suite_chunk < 1):
        parser.error("--workers and --suite-chunk must be >= 1")
    try:
        redo = [] if args.redo is None else parse_redo(args.redo)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    if args.unit_timeout <= 0:
        parser.error(f"--unit-timeout must be > 0, got {args.unit_timeout}")
    os.makedirs(args.out, exist_ok=True)
    device = device_name() + (" (smoke)" if args.smoke else "")
    report = Report(args.out, device, args.retry_failed)
    report.redo([u for u in report.units if unit_part(u) in redo or u in redo])
    deadline = Clock(args.deadline)
    started = time.monotonic()
    parts = [part if limit is None else f"{part}:{limit:g}" for part, limit in args.parts]
    report.data["runs"].append({"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                "device": device, "parts": parts, "smoke": args.smoke})
    note(f"device {device}; parts {','.join(parts)}; report {report.path}")
    for part, limit in args.parts:
        clock = deadline.within(limit)
        if part == "suite":
            part_suite(report, clock, args)
        elif part == "mainjob":
            part_mainjob(report, clock, args)
        elif part == "e2e":
            part_e2e(report, clock, args)
        elif part == "e2e_v4":
            part_e2e(report, clock, args, "v4")
        elif part == "gmm":
            part_gmm(report, clock, args)
        else:
            part_benchmark(part, report, clock, args)
        found = calibration(report)
        if found is not None:
            report.data["calibration"] = found
    report.data["runs"][-1]["seconds"] = time.monotonic() - started
    report.save()
    text = markdown(report)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
