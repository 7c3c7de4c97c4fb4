"""The instrument's printed report of one compiled program (what `jaxspec aot` prints)."""

from __future__ import annotations

import math
from collections import Counter

from .analysis import (PREDICATE_READS, collectives, is_thunk_kind, kernel_launches, kernel_name, launch_counts,
                       memory, mosaic_launches, pallas_calls, program_cost, register_spills)
from .compile import GpuCompiled

GIB = 2 ** 30


def report(compiled: GpuCompiled, title: str) -> str:
    """Per-device memory, flops and bytes (XLA ops plus the Pallas kernels' own, loops' bodies
    counted as often as they run: `program_cost`), collectives (as often as they run), each Pallas
    kernel's launch resources (identical launch sites counted once, with how many; a site in a
    loop's body launches once per trip, and how many times each kernel runs is listed when loops
    make that differ), the kernels that spill registers (XLA's own included: `register_spills`;
    a compile with `fail_on_spill` has none), what one execution launches (`launch_counts`) and the
    compile time, as text."""
    mem, cost = memory(compiled), program_cost(compiled)
    lines = [title, f"compile time {compiled.compile_seconds:.1f} s",
             f"memory per device: arguments {mem.argument / GIB:.2f} GiB, outputs {mem.output / GIB:.2f} GiB, "
             f"temp {mem.temp / GIB:.3f} GiB, aliased {mem.alias / GIB:.2f} GiB, peak {mem.peak / GIB:.2f} GiB",
             f"flops {cost.flops:.3e} (XLA ops {cost.xla_flops:.3e}, Pallas kernels {cost.kernel_flops:.3e})",
             f"bytes accessed {cost.bytes_accessed:.3e} (XLA ops {cost.xla_bytes:.3e}, "
             f"Pallas kernels {cost.kernel_bytes:.3e})"]
    if cost.loops_counted_once:
        lines.append(f"{cost.loops_counted_once} while loop(s) of a trip count XLA does not know: each body counted "
                     "once (the flops and bytes above are per iteration of them)")
    if cost.rematerialized:
        lines.append(f"rematerialized: {cost.rematerialized} instructions recomputed to fit the device's memory "
                     "(counted above and in the launches below; --device-memory, or gpu_devices(device_memory=), "
                     "compiles the program without them)")
    if cost.uncounted:
        lines.append("not counted (no cost known): " + ", ".join(f"{n} x {t}" for t, n in sorted(cost.uncounted.items())))
    found = collectives(compiled)
    if found:
        totals = Counter()
        counts = Counter()
        for c in found:
            totals[c.op] += c.bytes * c.runs
            counts[c.op] += c.runs
        lines.append("collectives: " + ", ".join(f"{counts[op]} x {op} ({totals[op] / GIB:.3f} GiB)" for op in sorted(counts)))
    else:
        lines.append("collectives: none")
    launches = Counter((kernel_name(k.name), k.grid, k.threads, k.shared_memory, k.registers, k.spill_stores,
                        k.spill_loads)
                       for k in kernel_launches(compiled))
    mosaic = Counter((k.name + " (Mosaic)", k.grid, k.threads, k.shared_memory) for k in mosaic_launches(compiled))
    width = max([24] + [len(key[0]) + 2 for key in (*launches, *mosaic)])  # the name column, names apart
    lines.append(f"{'Pallas kernel':<{width}}{'sites':>9}  {'grid':<16}{'threads':>8}{'smem B':>9}{'regs':>6}"
                 f"{'spills':>8}")
    for (name, grid, threads, smem, registers, stores, loads), n in sorted(launches.items()):
        lines.append(f"{name:<{width}}{n:>9}  {'x'.join(map(str, grid)):<16}{threads[0] * threads[1] * threads[2]:>8}"
                     f"{smem:>9}{registers:>6}{stores + loads:>8}")
    for (name, grid, threads, smem), n in sorted(mosaic.items()):
        lines.append(f"{name:<{width}}{n:>9}  {'x'.join(map(str, grid)):<16}{math.prod(threads):>8}"
                     f"{smem:>9}{'-':>6}{'-':>8}")
    if mosaic:
        lines.append("Mosaic GPU kernels (-): registers and spills in DIR/*.ptxas when run with "
                     "MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR")
    if compiled.fail_on_spill:
        lines.append("register spills: none (the compile refuses a kernel that spills)")
    else:
        spills = register_spills(compiled)
        lines.append("register spills (ptxas, bytes stored + loaded): " + (", ".join(
            f"{name} {stores + loads}" for name, (stores, loads) in sorted(spills.items())) or "none"))
    runs, sites = Counter(), Counter()
    for call in pallas_calls(compiled):
        runs[kernel_name(call.name)] += call.runs
        sites[kernel_name(call.name)] += 1
    if runs != sites:
        lines.append("Pallas kernel runs per execution (loops' bodies as often as they run): "
                     + ", ".join(f"{name} {n}" for name, n in sorted(runs.items())))
    launched = launch_counts(compiled)
    kernels = sum(n for name, n in launched.items() if not is_thunk_kind(name))
    labels = {PREDICATE_READS: "loop predicate read by the host"}  # else the thunk kind without its "k"
    others = ", ".join(f"{n} {labels.get(kind, kind[1:])}" for kind, n in sorted(launched.items())
                       if is_thunk_kind(kind))
    lines.append(f"launches per execution (loops' bodies as often as they run): {sum(launched.values())}, "
                 f"{kernels} kernels{', ' + others if others else ''}")
    return "\n".join(lines)
