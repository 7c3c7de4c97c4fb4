"""Where a compiled step's time goes: the device's own kernel timings from JAX's profiler, summed
per op class (`jaxspec.aot.OP_CLASSES`), beside the time between kernels.

    profile = profile_call(lambda: compiled(params, state))   # runs it once, traced
    profile["by_class_ms"], profile["busy_ms"], profile["span_ms"], profile["top"]

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

import collections
import glob
import os
import re
import tempfile
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


def summarize(events: list[tuple[str, int, int]]) -> dict:
    """events (name, start ns, duration ns) -> {"kernels": count, "busy_ms", "span_ms",
    "by_class_ms": {class: ms} over `OP_CLASSES`, "top": [[name, ms, count], ...] (the
    TOP_KERNELS longest in total, XLA's numbered repeats of a name counted as one)}."""
    by_class = dict.fromkeys(OP_CLASSES, 0.0)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for name, _, duration in events:
        by_class[op_class(name)] += duration / 1e6
        entry = by_name[re.sub(r"(_|\.)\d+$", "", name)]
        entry[0] += duration / 1e6
        entry[1] += 1
    span = (max(start + duration for _, start, duration in events) - min(start for _, start, _ in events)) / 1e6 \
        if events else 0.0
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return {"kernels": len(events), "busy_ms": sum(by_class.values()), "span_ms": span, "by_class_ms": by_class,
            "top": [[name, ms, count] for name, (ms, count) in top]}


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
