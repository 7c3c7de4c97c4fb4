"""Where a compiled step's time goes: the device's own kernel timings from JAX's profiler, summed
per op class (`jaxspec.aot.OP_CLASSES`), beside the time between kernels.

    profile = profile_call(lambda: compiled(params, state))   # runs it once, traced
    profile["by_class_ms"], profile["busy_ms"], profile["span_ms"], profile["top"]
    device_seconds({"pallas": lambda: f(x), "xla": lambda: g(x)}, iters=10)   # kernel s per call

`device_seconds` is what the kernel benchmarks time with beside their wall clock: a call of a
small op from Python costs tens of microseconds of dispatch, which calls issued back to back hide
only when the device work is longer (on the lent H200, jax 0.11.2, the kernel benchmark's
smallest ops took 52 to 75 us a call whatever their bytes: `lax.top_k` over 8 x 4096 scores 55 us,
XLA's MLA decode of one row over 4096 slots 64 us). Inside
a decode step the kernels run back to back in one program, so what the step pays for an op is its
kernels' device time.

`jax.profiler.trace` writes an XSpace protobuf, which `jax.profiler.ProfileData` (part of jaxlib)
reads, so no profiler UI or TensorFlow is needed. On a GPU the kernels are the events of the
device plane's stream lines ("/device:GPU:0", "Stream #..."), named after the kernel: XLA's
fusions and library GEMMs by their own names, the Pallas kernels by their `pallas_call` names
(Triton: "mla_attention", "grouped_matmul", ...; Mosaic GPU: "_mla_attention_mosaic", "_sparse_mla",
...). They are read from the kernels, not from XLA's per-HLO annotations, because those are lost
for kernels that run inside XLA's command buffers (CUDA graphs), which XLA uses by default. On a
CPU (the smoke runs) the events are the host's XLA ops (the events with an `hlo_op` statistic).

A class's time is the sum of its kernels' durations; `busy_ms` the sum over all kernels, `span_ms`
from the first kernel's start to the last one's end. span - busy is time the device spent between
kernels (launch gaps, host round trips, waits), which no op class owns.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import glob
import os
import re
import sys
import tempfile
import time
from typing import Callable

import jax
from jax.profiler import ProfileData

from jaxspec.aot import OP_CLASSES

# Kernel name -> op class: the Pallas kernels' names (Triton and Mosaic GPU) by op; every other
# kernel (XLA's fusions, cuBLAS / cuDNN GEMMs, copies) is XLA's own.
CLASS_PATTERNS = (("attention", re.compile(r"mla_attention|sparse_mla|indexer_scores|flash_decoding|"
                                           r"sliding_compressed")),
                  ("grouped_matmul", re.compile(r"grouped_matmul")))
TOP_KERNELS = 12
# `device_seconds`: the host annotation that names a call's window, the pause between windows, and
# how far before its window a kernel may seem to start (the device's clock as the profiler maps it
# onto the host's) and still be the window's.
WINDOW_PREFIX = "device_seconds:"
WINDOW_GAP_S = 0.02
CLOCK_SKEW_NS = 5_000_000
# Lines of a device plane that XLA's profiler derives from the kernels (they would count them twice).
DERIVED_LINES = frozenset({"XLA Modules", "XLA Ops", "Steps", "Framework Name Scope", "Framework Ops",
                           "Source code", "XLA TraceMe", "Launch Stats"})


def op_class(kernel: str) -> str:
    """The op class (`OP_CLASSES`) a kernel of this name belongs to."""
    return next((name for name, pattern in CLASS_PATTERNS if pattern.search(kernel)), "xla")


def kernel_events(xspace_path: str) -> list[tuple[str, int, int]]:
    """(kernel name, start ns, duration ns) of every kernel an XSpace file records: the GPU planes'
    stream lines where there are GPU planes, else the host's XLA ops (events with an `hlo_op`)."""
    data = ProfileData.from_file(xspace_path)
    planes = list(data.planes)
    gpus = [plane for plane in planes if plane.name.startswith("/device:GPU:")]
    events = []
    if gpus:
        lines = [line for plane in gpus for line in plane.lines]
        streams = [line for line in lines if line.name.startswith("Stream")]
        # Should a profiler name its stream lines otherwise: every line but the ones it derives.
        for line in streams or [line for line in lines if line.name not in DERIVED_LINES]:
            events += [(event.name, int(event.start_ns), int(event.duration_ns)) for event in line.events]
        return events
    for plane in planes:
        for line in plane.lines:
            for event in line.events:
                if any(key == "hlo_op" for key, _ in event.stats):
                    events.append((event.name, int(event.start_ns), int(event.duration_ns)))
    return events


def windows(xspace_path: str, prefix: str = WINDOW_PREFIX) -> list[tuple[str, int, int]]:
    """(name without `prefix`, start ns, end ns) of the host annotations (`jax.profiler.TraceAnnotation`)
    an XSpace file records whose names start with `prefix`."""
    found = []
    for plane in ProfileData.from_file(xspace_path).planes:
        if plane.name.startswith("/host:"):
            for line in plane.lines:
                found += [(event.name[len(prefix):], int(event.start_ns), int(event.start_ns + event.duration_ns))
                          for event in line.events if event.name.startswith(prefix)]
    return found


def per_window(events: list[tuple[str, int, int]], spans: list[tuple[str, int, int]], iters: int) -> dict:
    """Each window's kernel time per call: events (kernel, start ns, duration ns) go to the window
    (name, start ns, end ns) that started last before them (`CLOCK_SKEW_NS` allowed), the windows
    being apart by more than that; name -> seconds per call (durations summed over `iters`), or
    None where the window got fewer than `iters` kernels (a call launches at least one)."""
    spans = sorted(spans, key=lambda span: span[1])
    starts = [start for _, start, _ in spans]
    total, count = collections.Counter(), collections.Counter()
    for _, start, duration in events:
        at = bisect.bisect_right(starts, start + CLOCK_SKEW_NS) - 1
        if at >= 0 and start <= spans[at][2] + CLOCK_SKEW_NS:
            total[spans[at][0]] += duration
            count[spans[at][0]] += 1
    return {name: total[name] / iters / 1e9 if count[name] >= iters else None for name, _, _ in spans}


def device_seconds(calls: dict[str, Callable[[], object]], iters: int) -> dict[str, float | None]:
    """Device time per call of each of `calls` (name, anything whose str() is distinct -> a
    function of no arguments that dispatches one call; compiled and warmed up before): one
    profiler trace in which each runs `iters` times
    back to back in a window of its own (a host annotation, `WINDOW_GAP_S` apart, synchronised at
    its end), its kernels' durations summed (`per_window`). That excludes dispatch and the gaps
    between a call's kernels, which a call from Python pays and a compiled decode step mostly does
    not. None for a call whose kernels were not found (said on stderr), and for every call when
    the profiler fails: the device time is a column beside the wall clock's, so a profiler that
    cannot trace (CUPTI taken, an unreadable trace) costs that column, said on stderr, and not the
    benchmark's rows on a GPU lent for minutes; a call that fails still raises. On a CPU the
    kernels are the host's XLA ops, nested ones included: the figure there only shows that the
    path runs."""
    with tempfile.TemporaryDirectory() as scratch:
        # Broad catches around the profiler's own steps only (jaxlib's profiler raises several
        # types); a call that fails still raises, after the trace is stopped.
        try:
            jax.profiler.start_trace(scratch)
        except Exception as failure:  # noqa: BLE001
            return _no_device_times(calls, failure)
        try:
            for name, call in calls.items():
                with jax.profiler.TraceAnnotation(WINDOW_PREFIX + str(name)):
                    for _ in range(iters):
                        out = call()
                    jax.block_until_ready(out)
                time.sleep(WINDOW_GAP_S)
        except BaseException:
            with contextlib.suppress(Exception):
                jax.profiler.stop_trace()
            raise
        try:
            jax.profiler.stop_trace()
            paths = glob.glob(os.path.join(scratch, "**", "*.xplane.pb"), recursive=True)
            found = per_window([event for path in paths for event in kernel_events(path)],
                               [span for path in paths for span in windows(path)], iters)
        except Exception as failure:  # noqa: BLE001
            return _no_device_times(calls, failure)
    missing = [str(name) for name in calls if found.get(str(name)) is None]
    if missing:
        print(f"device_seconds: no kernels found for {', '.join(missing)} in the profiler's trace", file=sys.stderr)
    return {name: found.get(str(name)) for name in calls}


def _no_device_times(calls: dict, failure: Exception) -> dict:
    """`device_seconds`' answer when the profiler fails: None for every call, said on stderr."""
    print(f"device_seconds: the profiler failed ({type(failure).__name__}: {str(failure)[:200]}); no device times",
          file=sys.stderr)
    return {name: None for name in calls}


def summarize(events: list[tuple[str, int, int]]) -> dict:
    """events (name, start ns, duration ns) -> {"kernels": count, "busy_ms", "span_ms",
    "by_class_ms": {class: ms} over `OP_CLASSES`, "by_class_kernels": {class: count} (a class's
    ms over its count is what a launch of it takes on average: the launch-bound share of a small
    step, beside `jaxspec aot`'s deviceless launch count), "top": [[name, ms, count], ...] (the
    TOP_KERNELS longest in total, XLA's numbered repeats of a name counted as one)}."""
    by_class = dict.fromkeys(OP_CLASSES, 0.0)
    by_class_kernels = dict.fromkeys(OP_CLASSES, 0)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for name, _, duration in events:
        by_class[op_class(name)] += duration / 1e6
        by_class_kernels[op_class(name)] += 1
        entry = by_name[re.sub(r"(_|\.)\d+$", "", name)]
        entry[0] += duration / 1e6
        entry[1] += 1
    span = (max(start + duration for _, start, duration in events) - min(start for _, start, _ in events)) / 1e6 \
        if events else 0.0
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return {"kernels": len(events), "busy_ms": sum(by_class.values()), "span_ms": span, "by_class_ms": by_class,
            "by_class_kernels": by_class_kernels, "top": [[name, ms, count] for name, (ms, count) in top]}


def profile_call(fn: Callable[[], object]) -> dict:
    """Run `fn` once (it should block until its results are ready) under JAX's profiler and
    summarize its kernels (`summarize`). Compile and warm `fn` up first: what the trace holds is
    everything the process ran while it was open."""
    with tempfile.TemporaryDirectory() as scratch:
        with jax.profiler.trace(scratch):
            jax.block_until_ready(fn())
        paths = glob.glob(os.path.join(scratch, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {scratch}")
        return summarize([event for path in paths for event in kernel_events(path)])
