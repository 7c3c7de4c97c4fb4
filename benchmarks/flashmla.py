"""FlashMLA's Hopper decode kernels timed at `attention_kernels.py`'s shapes: the ground truth beside
jaxspec's MLA kernels (GPU; a Hopper GPU for the run, only nvcc for the build).

FlashMLA (github.com/deepseek-ai/FlashMLA) is DeepSeek's CUDA MLA decode library, what SGLang and
vLLM serve V3, V3.2 and V4 with. Its Python package is a PyTorch extension; this script instead builds
`flashmla_bench.cu` (beside it) against a FlashMLA checkout: a harness that calls the package's
own host entry points with cudaMalloc'd buffers, so it needs nvcc and FlashMLA's sources (with
its `csrc/cutlass` submodule), not a PyTorch of matching CUDA, and compiles five of FlashMLA's
translation units (under two minutes on two cores). The binary runs on any Hopper host whose
driver takes its CUDA version: build it where nvcc is, carry it to the GPU.

    python benchmarks/flashmla.py --build --src ~/FlashMLA     # -> .flashmla/flashmla_bench
    python benchmarks/flashmla.py                              # every shape below, on a GPU
    python benchmarks/flashmla.py --batch 32 --queries 1 --json rows.json

Shapes (`attention_kernels.py`'s): dense MLA (`flash_mla_with_kvcache` on a bfloat16 latent cache, pages of 64
in a random order, a window of Q > 1 tokens causal) at B x context x Q; sparse MLA (its FP8 sparse
decode on V3.2's 656-byte cache, each query token's top-k distinct random slots) at B x Q over a
context of 4096; DeepSeek-V4-Flash's attention (the same kernel on FlashMLA's MODEL1 FP8 token, 64
heads of 512, per-head sinks: each token's 128-token window as its extra cache, and CSA's top-512
of the entries closed every 4 tokens, or HCA's every entry closed every 128) at B x Q, context
4096. Each row is the median of --iters calls timed by CUDA events (split-KV kernel and
combine; the scheduler metadata, computed once a step for every layer, is printed apart), with the
bytes the op must move at least as `attention_kernels.py` counts them (cache, queries, outputs; V4: every
token's keys once, where attention_kernels.py counts a row's distinct entries once), and the
largest error of three output rows against a float64 reference the harness computes from the same
data. `--json` writes the rows as `attention_kernels.py --json` does, so `gpu_report.py`'s `flashmla` part
puts them beside jaxspec's rows of the same shape.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
HARNESS = os.path.join(HERE, "flashmla_bench.cu")
DEFAULT_BINARY = os.path.join(REPO, ".flashmla", "flashmla_bench")
# FlashMLA's translation units the harness calls into (paths under its csrc/): the dense bf16 decode
# kernel, the FP8 sparse decode kernel for V3.2 at 128 heads and for V4 (MODEL1) at V4-Flash's 64,
# the scheduler metadata and the combine.
SOURCES = ("sm90/decode/dense/instantiations/bf16.cu", "sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu",
           "sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu",
           "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu", "smxx/decode/combine/combine.cu")
# FlashMLA's own nvcc flags (its setup.py), for sm_90a only.
NVCC_FLAGS = ("-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
              "--use_fast_math", "-gencode=arch=compute_90a,code=sm_90a")
INCLUDES = ("", "kerutils/include", "sm90", "cutlass/include", "cutlass/tools/util/include")  # under csrc/
TOPK = 2048  # DeepSeek-V3.2's index_topk
SPARSE_CONTEXT = 4096  # the sparse and V4 rows' context (attention_kernels.py's V4 rows have it too)
# V4-Flash's compressed layer kinds as attention_kernels.py times them: (entries closed every RATE tokens, the
# entries a token attends to at most: CSA's index_topk; HCA's every one, at most 64 at 4096).
V4_KINDS = {"v4_csa": (4, 512), "v4_hca": (128, 64)}
OPS = ("mla_attention", "sparse_mla", *V4_KINDS)
COPY_MIB = 1024


def find_nvcc(given: str | None) -> str:
    """The nvcc to build with: --nvcc, else $CUDA_HOME/bin/nvcc, else the one on PATH."""
    candidates = [given] if given else [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
                                        shutil.which("nvcc")]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise SystemExit(f"--nvcc: no nvcc at {given!r}" if given else
                     "no nvcc: set CUDA_HOME, put nvcc on PATH or pass --nvcc")


def check_source(src: str) -> str:
    """FlashMLA checkout -> its csrc/ folder, after checking it holds what the build reads."""
    csrc = os.path.join(src, "csrc")
    missing = [s for s in SOURCES + ("params.h",) if not os.path.exists(os.path.join(csrc, s))]
    if missing:
        raise SystemExit(f"--src {src}: not a FlashMLA checkout with the sm90 decode kernels (missing csrc/{missing[0]})")
    if not os.path.exists(os.path.join(csrc, "cutlass", "include", "cute")):
        raise SystemExit(f"--src {src}: its CUTLASS submodule is empty (in the checkout: "
                         "git submodule update --init csrc/cutlass)")
    return csrc


def build(src: str, binary: str, nvcc: str, jobs: int) -> None:
    """Compile the harness and FlashMLA's four translation units (in parallel) and link them into
    `binary`. The CUDA runtime links statically (nvcc's default); the driver is found at run time."""
    csrc = check_source(src)
    objects = os.path.join(os.path.dirname(os.path.abspath(binary)), "objects")
    os.makedirs(objects, exist_ok=True)
    includes = [f"-I{os.path.join(csrc, d)}" for d in INCLUDES]
    units = [HARNESS] + [os.path.join(csrc, s) for s in SOURCES]

    def compile_unit(path: str) -> str:
        out = os.path.join(objects, os.path.basename(path).replace(".cu", ".o"))
        done = subprocess.run([nvcc, *NVCC_FLAGS, *includes, "-c", path, "-o", out], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"nvcc failed on {path}:\n{done.stderr[-4000:]}")
        print(f"  compiled {os.path.relpath(path, REPO) if path == HARNESS else path}", file=sys.stderr)
        return out

    print(f"building {binary} with {nvcc} ({len(units)} units, {jobs} at a time)", file=sys.stderr)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        linked = list(pool.map(compile_unit, units))
    done = subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", *linked, "-o", binary],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"linking {binary} failed:\n{done.stderr[-4000:]}")
    commit = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(binary + ".source", "w") as f:  # which FlashMLA the rows measured
        f.write(commit or f"{os.path.abspath(src)} (not a git checkout)")


def run_binary(binary: str, *args) -> dict:
    """One harness call -> its JSON object; a failure (no harness built, no Hopper GPU, a kernel's
    error) raises RuntimeError with its reason."""
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"no harness at {binary}: build it with --build --src FLASHMLA_CHECKOUT")
    done = subprocess.run([binary, *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{os.path.basename(binary)} {' '.join(map(str, args))}: exit {done.returncode}: "
                           f"{done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def row_of(result: dict) -> dict:
    """The harness's JSON object -> a row as `attention_kernels.py --json` writes it (impl "flashmla"; device
    seconds = the event-timed median, which is device time)."""
    seconds = result["median_us"] * 1e-6
    return dict(op=result["op"], impl="flashmla", batch=result["batch"], context=result["context"],
                queries=result["queries"], seconds=seconds, device_seconds=seconds, bytes=result["bytes"],
                flops=result["flops"], cache_dtype="bfloat16" if result["op"] == "mla_attention" else "fp8",
                max_error=result["max_abs_err"], metadata_seconds=result["metadata_us"] * 1e-6,
                num_sm_parts=result["num_sm_parts"])


def cases(args) -> list[tuple]:
    """The harness calls of --ops, in OPS' order: ("dense", B, ctx, Q, iters), ("sparse", B, ctx, Q,
    iters, topk), ("v4", B, ctx, Q, iters, rate, topk)."""
    calls = []
    for op in (op for op in OPS if op in args.ops):
        if op == "mla_attention":
            calls += [("dense", b, c, q, args.iters) for b, c, q in itertools.product(args.batch, args.context,
                                                                                    args.queries)]
        elif op == "sparse_mla":
            calls += [("sparse", b, SPARSE_CONTEXT, q, args.iters, args.topk)
                      for b, q in itertools.product(args.batch, args.queries)]
        else:
            calls += [("v4", b, SPARSE_CONTEXT, q, args.iters, *V4_KINDS[op])
                      for b, q in itertools.product(args.batch, args.queries)]
    return calls


def op_of(case: tuple) -> str:
    """The op a harness call (`cases`) times, as attention_kernels.py names it."""
    if case[0] == "v4":
        return next(op for op, kind in V4_KINDS.items() if kind == case[5:])
    return "mla_attention" if case[0] == "dense" else "sparse_mla"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="store_true", help="compile the harness against --src, and only that")
    parser.add_argument("--src", default=os.environ.get("FLASHMLA_SRC"),
                        help="a FlashMLA checkout with its csrc/cutlass submodule (default $FLASHMLA_SRC)")
    parser.add_argument("--binary", default=DEFAULT_BINARY, help="the harness binary (default %(default)s)")
    parser.add_argument("--nvcc", help="nvcc to build with (default $CUDA_HOME/bin/nvcc, else PATH)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="nvcc processes at once")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 8, 1])
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 32768], help="dense rows' contexts")
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--topk", type=int, default=TOPK)
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", metavar="PATH", help="also write the rows (and the copy bandwidth) here")
    args = parser.parse_args(argv)
    for name in ("batch", "context", "queries"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name}: every value must be >= 1")
    if args.iters < 1 or args.jobs < 1 or not 1 <= args.topk <= SPARSE_CONTEXT - max(args.queries) + 1:
        parser.error(f"--iters and --jobs must be >= 1, --topk in [1, {SPARSE_CONTEXT - max(args.queries) + 1}]")
    if args.build:  # build only: the machine with nvcc is often not the one with the GPU
        if not args.src:
            parser.error("--build needs --src (or $FLASHMLA_SRC): a FlashMLA checkout")
        build(args.src, args.binary, find_nvcc(args.nvcc), args.jobs)
        print(f"built {args.binary}", file=sys.stderr)
        return 0

    try:
        baseline = run_binary(args.binary, "copy", COPY_MIB)
    except RuntimeError as error:  # no harness or no usable GPU: nothing else can run either
        print(error, file=sys.stderr)
        return 2
    copy = baseline["bytes_per_s"]
    source = open(args.binary + ".source").read().strip() if os.path.exists(args.binary + ".source") else "unknown"
    print(f"FlashMLA {source}")
    print(f"device: {baseline['device']}; copy bandwidth {copy / 1e9:.0f} GB/s (read + write of {COPY_MIB} MiB)\n"
          f"V3.2: 128 heads, latent 512+64, pages of 64; sparse on an FP8 cache, top-{args.topk} of {SPARSE_CONTEXT}\n"
          f"V4-Flash: 64 heads of 512, MODEL1 FP8 pools, window 128; CSA top-512 of every 4th token's entry, HCA "
          f"every 128th's")
    header = f"{'op':<15}{'B':>4}{'ctx':>7}{'Q':>3}{'us':>10}{'GB/s':>8}{'TFLOP/s':>9}{'%copy':>7}{'meta us':>9}{'max err':>10}"
    print(header + "\n" + "-" * len(header))
    rows, failures = [], []
    for case in cases(args):
        try:
            row = row_of(run_binary(args.binary, *case))
        except RuntimeError as error:
            print(f"{op_of(case):<15}{case[1]:>4}{case[2]:>7}{case[3]:>3}  failed: {error}")
            failures.append(dict(op=op_of(case), impl="flashmla", batch=case[1], context=case[2], queries=case[3],
                                 message=str(error)))
        else:
            rows.append(row)
            rate = row["bytes"] / row["seconds"]
            print(f"{row['op']:<15}{row['batch']:>4}{row['context']:>7}{row['queries']:>3}{row['seconds'] * 1e6:>10.1f}"
                  f"{rate / 1e9:>8.0f}{row['flops'] / row['seconds'] / 1e12:>9.1f}{100 * rate / copy:>6.0f}%"
                  f"{row['metadata_seconds'] * 1e6:>9.1f}{row['max_error']:>10.2e}")
        if args.json:  # written whole after every row: a run cut short keeps what it finished
            with open(args.json, "w") as f:
                json.dump({"device": baseline["device"], "flashmla": source, "copy_bytes_per_s": copy, "rows": rows,
                           "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
