"""What a program compiled for a GPU target costs, read from the compiler's own output.

  * `memory`: XLA's buffer assignment per device (arguments, outputs, temporaries, aliased bytes);
  * `program_cost`: XLA's HLO cost analysis of the optimized module (run through the CPU client:
    the GPU path's `cost_analysis()` returns None without a GPU) plus the Pallas kernels' own
    stated costs, which XLA counts as nothing (`jaxspec.pallas_kernels.cost`), with every while
    loop's body counted as many times as it runs where XLA knows its trip count (`hlo_loops`;
    XLA's analysis counts a body once) and once where it does not (`ProgramCost.loops_counted_once`);
  * `kernel_launches`: each Pallas kernel's grid, threads and shared memory from the dumped thunk
    sequence, and its registers and spills from the CUDA toolkit's `ptxas -arch=sm_90a -v` on the
    dumped PTX;
  * `launch_counts`: what one execution launches (kernels, copies, custom calls), from the dumped thunk
    sequence, loops' bodies as often as they run (`op_class_launches`: the same split by op class);
  * `register_spills`: every kernel of the dumped PTX that spills registers (ptxas), for a compile
    that allowed them;
  * `mosaic_launches`: each Mosaic GPU kernel's grid, threads and shared memory, from the launch in
    the Mosaic module its custom call carries (its registers are not in the program: see
    `MosaicLaunch`);
  * `collectives`: every collective of the optimized HLO with the bytes it produces.

All of it parses XLA's text dumps; the formats are XLA's, not a stable API, so each parser is
small and fails loudly (an unreadable dump raises instead of reporting zeros).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import glob
import importlib.util
import math
import os
import re
import shutil
import subprocess
import zlib
from collections import Counter

import jax

from jaxspec.pallas_kernels.cost import KERNEL_ATTRIBUTE, cost_of, read_cost_metadata

from .compile import GpuCompiled
from .hlo_loops import HloModuleText, control_flow, executions, module_with_entry, parse_module

# Custom-call targets of a Pallas kernel lowered through Triton: jaxlib <= 0.10.2 (metadata in
# `serialized_metadata`) and later (metadata inside the zlib-compressed `opaque` kernel proto).
_TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")
# A Mosaic GPU kernel's custom call ("mosaic_gpu", "mosaic_gpu_v2" by jaxlib).
_MOSAIC_PREFIX = "mosaic_gpu"
_MOSAIC_TARGET = f'custom_call_target="{_MOSAIC_PREFIX}'
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                "collective-permute", "collective-broadcast")
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?(\S+) = (.*?) ([a-z][a-z0-9-]*)\(", re.M)
_INSTRUCTION_NAME = re.compile(r"^\s*(?:ROOT )?%?(\S+) = ", re.M)
_REMAT = re.compile(r"\.remat\d*(?:\.\d+)?$")  # HloRematerialization's clones: "fusion.3.remat2", "gte.remat.8"


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in `text` (an HLO shape or tuple: "bf16[2,3]{1,0}")."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        bits = 8 if dtype == "pred" else int(re.match(r"[a-z]+(\d+)", dtype).group(1))
        total += math.ceil(math.prod(int(d) for d in dims.split(",") if d) * bits / 8)
    return total


def _unescape(literal: str) -> bytes:
    """An MLIR string attribute as printed in HLO text (non-printable bytes as \\XX, a backslash as
    two) -> its bytes."""
    return re.sub(rb"\\(\\|[0-9A-Fa-f]{2})", lambda m: b"\\" if m.group(1) == b"\\" else bytes([int(m.group(1), 16)]),
                  literal.encode("latin-1"))


def _attribute(line: str, name: str) -> str | None:
    match = re.search(rf'\b{name} = "((?:[^"\\]|\\.)*)"', line)
    return None if match is None else match.group(1)


def _frontend_attributes(line: str) -> dict[str, str]:
    """An HLO instruction's `frontend_attributes={key="value",...}` (empty when it has none)."""
    match = re.search(r"\bfrontend_attributes=\{([^}]*)\}", line)
    return {} if match is None else dict(re.findall(r'([\w.]+)="([^"]*)"', match.group(1)))


@dataclasses.dataclass(frozen=True)
class PallasCall:
    """One Pallas kernel launch in the optimized HLO: its name, result shape text, stated cost of
    one launch (None when the kernel states none), how many times it runs in one execution of the
    program (`runs`: the product of the known trip counts of the loops around it), and its
    lowering ("triton", or "mosaic" for Mosaic GPU, whose kernels name their op: the Triton
    kernel's name for it)."""

    name: str
    result: str
    flops: int | None
    transcendentals: int | None
    bytes_accessed: int | None
    runs: int = 1
    lowering: str = "triton"


def _optimized_hlo(compiled) -> str:
    return compiled.as_text()


@functools.lru_cache(maxsize=2)
def _parsed(text: str) -> tuple[HloModuleText, dict[str, int]]:
    """The optimized module's computations and how many times each runs (parsed once per program:
    `program_cost`, `pallas_calls` and `collectives` all need them)."""
    module = parse_module(text)
    return module, executions(module)


def _instructions(text: str):
    """(line, runs) for each instruction of an optimized HLO module's text, in module order: runs
    is how many times the computation holding it runs in one execution of the program."""
    module, runs = _parsed(text)
    for name, lines in module.computations.items():
        for line in lines[1:-1]:
            yield line, runs[name]


def pallas_calls(compiled) -> list[PallasCall]:
    """The Pallas kernel launches (Triton and Mosaic GPU) of a compiled program, in HLO order."""
    return _pallas_calls(_optimized_hlo(compiled))


def _pallas_calls(text: str) -> list[PallasCall]:
    calls = []
    for line, runs in _instructions(text):
        if "custom-call(" not in line:
            continue
        if _MOSAIC_TARGET in line:
            line = re.sub(r'\bmodule = "(?:[^"\\]|\\.)*"', "", line)  # the kernel's MLIR bytecode
            attributes = _frontend_attributes(line)
            # `cost.stating`: Mosaic GPU drops a kernel's metadata, so it rides as frontend attributes
            name, cost, lowering = attributes.get(KERNEL_ATTRIBUTE, _MOSAIC_PREFIX), cost_of(attributes), "mosaic"
        elif any(f'custom_call_target="{t}"' in line for t in _TRITON_TARGETS):
            line = re.sub(r'\bir = "(?:[^"\\]|\\.)*"', "", line)  # the kernel's MLIR bytecode
            name, cost, lowering = _attribute(line, "name") or "?", _triton_cost(line), "triton"
        else:
            continue
        match = _INSTRUCTION.match(line)
        calls.append(PallasCall(name=name, result=match.group(2) if match else "", flops=cost and cost.flops,
                                transcendentals=cost and cost.transcendentals,
                                bytes_accessed=cost and cost.bytes_accessed, runs=runs, lowering=lowering))
    return calls


def _triton_cost(line: str):
    """The cost a Triton custom call's metadata carries (`cost.cost_metadata`), or None."""
    metadata = _attribute(line, "serialized_metadata")
    if metadata is not None:
        metadata = _unescape(metadata).decode()
    elif (opaque := _attribute(line, "opaque")) is not None:
        proto = zlib.decompress(_unescape(opaque))
        found = re.search(rb'\{"jaxspec_[^{}]*\}', proto)
        metadata = found.group(0).decode() if found else None
    return None if metadata is None else read_cost_metadata(metadata)


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """Flops and bytes of one execution of a compiled program, every while loop's body counted as
    many times as it runs where XLA knows the loop's trip count (a `lax.scan` over layers: every
    layer). `loops_counted_once`: while loops whose trip count XLA does not know (a
    `lax.while_loop` on data), whose bodies are counted once: the totals are then per iteration
    of those loops. `xla_*`: XLA's HLO cost analysis; `kernel_*`: the Pallas kernels' stated
    costs; `uncounted`: custom calls nobody states a cost for (target -> runs);
    `rematerialized`: instructions XLA recomputed to fit the device's memory (named `*.remat*`),
    whose flops and bytes are in the totals (see `gpu_devices(device_memory=)`)."""

    flops: float
    transcendentals: float
    bytes_accessed: float
    xla_flops: float
    xla_bytes: float
    kernel_flops: float
    kernel_bytes: float
    uncounted: dict[str, int]
    rematerialized: int
    loops_counted_once: int = 0


_COSTS = ("flops", "transcendentals", "bytes accessed")


def _cost_analysis(hlo_module) -> dict[str, float]:
    """XLA's HLO cost analysis of `hlo_module` (an optimized module: a loop's body counted once)."""
    # Private but the only route: the public `cost_analysis()` of a deviceless GPU compile is None.
    from jax._src.lib import _jax

    analysis = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, hlo_module)
    return {key: analysis.get(key, 0.0) for key in _COSTS}


def _module_from_text(text: str):
    """An HloModule parsed by XLA's own HLO parser (`jaxlib._hlo`, which `xla_client.hlo` names)."""
    from jax._src.lib import xla_client

    parse = getattr(getattr(xla_client, "hlo", None), "hlo_module_from_text", None)
    if parse is None:
        raise RuntimeError(f"jaxlib {jax.__version__}: xla_client.hlo.hlo_module_from_text is gone, so program_cost "
                           "cannot cost a loop's body; jaxspec.aot.analysis needs another route to it")
    return parse(text)


_SCATTER = re.compile(r"^\s*(?:ROOT )?%?(\S+) = (\S+) scatter\(%?([^\s,]+), %?([^\s,]+), %?([^\s,)]+)")


def _scatter_overcount(module, runs: dict[str, int]) -> float:
    """Bytes XLA's cost analysis counts for scatters beyond what they touch, in one execution.

    XLA's HLO cost analysis counts a scatter (alone, or as the root of its fusion) as reading its
    whole operand and writing its whole result. The GPU runs a scatter in place: it reads and
    writes the updated rows only (XLA copies the operand first, as an instruction counted on its
    own, where it cannot share the buffer). A paged cache's write is such a scatter into a cache a
    thousand times larger than one step's entries (into every layer's pages at once when the layers
    are a scan over stacked caches), so each scatter is counted here as its indices plus its
    updates read and written. The correction is (operand + result - 2 x updates) bytes per run,
    summed over every scatter and the runs of the computation holding it.
    """
    over = 0.0
    for name, lines in module.computations.items():
        shapes = {m.group(1): m.group(2) for line in lines if (m := _INSTRUCTION.match(line))}
        for line in lines:
            if (m := _SCATTER.match(line)) is not None:
                operand, updates = shapes.get(m.group(3)), shapes.get(m.group(5))
                if operand is None or updates is None:
                    raise RuntimeError(f"unreadable scatter in {name}: {line.strip()[:200]}")
                over += runs[name] * (
                    shape_bytes(operand) + shape_bytes(m.group(2)) - 2 * shape_bytes(updates))
    return over


_FUSION_CALL = re.compile(r"^\s*(?:ROOT )?%?\S+ = .*? fusion\(.*\bkind=(k\w+).*\bcalls=%?([^\s,}]+)")
_OPERANDS = re.compile(r"%([\w.\-]+)")


def _fused_instructions(lines: list[str]) -> tuple[dict[str, str], list[tuple[str, str, str, list[str]]], str]:
    """A fused computation's parameters (name -> shape), its instructions (name, shape, opcode,
    operand names) and its root's name."""
    header = re.match(r"^%?\S+ \((.*)\) -> .* \{$", lines[0].strip())
    params = dict(re.findall(r"%?([\w.\-]+): ([^:]+?)(?:, (?=%?[\w.\-]+: )|$)", header.group(1))) if header else {}
    instructions, root = [], ""
    for line in lines[1:]:
        if (m := _INSTRUCTION.match(line)) is None:
            continue
        operands = line[m.end():].split("), ", 1)[0]
        instructions.append((m.group(1), m.group(2), m.group(3), _OPERANDS.findall(operands)))
        if line.lstrip().startswith("ROOT "):
            root = m.group(1)
    return params, instructions, root


def _touched_bytes(lines: list[str]) -> float | None:
    """The bytes a fusion that dynamic-slices a parameter or updates one in place touches on a
    GPU: such a parameter read as its slices (nothing, when it is updated in place by the root),
    every other parameter whole, and the output written whole or, for an in-place update, as the
    update. None when the fusion does neither."""
    params, instructions, root = _fused_instructions(lines)
    # A bitcast moves no data: its uses are its parameter's (the stacked cache is sliced as
    # [layers * pages, page, width], a bitcast of the parameter).
    origin = {name: name for name in params}
    uses = {name: [] for name in params}
    for name, shape, opcode, operands in instructions:
        if opcode == "bitcast" and operands and operands[0] in origin:
            origin[name] = origin[operands[0]]
            continue
        for position, operand in enumerate(operands):
            if operand in origin:
                uses[origin[operand]].append((name, shape, opcode, position))
    shapes = {name: shape for name, shape, _, _ in instructions}
    root_op = next(((opcode, operands) for name, _, opcode, operands in instructions if name == root), None)
    in_place = root_op is not None and root_op[0] == "dynamic-update-slice" and root_op[1][:1] != [] \
        and root_op[1][0] in origin
    if in_place:
        root_op = (root_op[0], [origin[root_op[1][0]], *root_op[1][1:]])
    if not in_place and not any(use[2] == "dynamic-slice" and use[3] == 0 for u in uses.values() for use in u):
        return None
    read = 0.0
    for name, shape in params.items():
        param_uses = uses[name]
        if in_place and name == root_op[1][0]:
            # The update moves only its entries (written, below); the parameter's other uses may
            # slice it (a one-token write keeps the old entry where its slot is invalid).
            param_uses = [use for use in param_uses if use[0] != root or use[3] != 0]
            if not param_uses:
                continue
        if param_uses and all(opcode == "dynamic-slice" and position == 0 for _, _, opcode, position in param_uses):
            read += sum(shape_bytes(use_shape) for _, use_shape, _, _ in param_uses)
        else:
            read += shape_bytes(shape)
    written = shape_bytes(shapes.get(root_op[1][1], "")) if in_place else shape_bytes(shapes.get(root, ""))
    return read + written


def _fusion_module(module, fused: str, kind: str) -> str:
    """HLO text of a module whose ENTRY runs one fusion instruction calling `fused`: its cost is
    what XLA's analysis counts for that instruction inside the program."""
    params, _, _ = _fused_instructions(module.computations[fused])
    header = module.computations[fused][0].strip()
    output = re.match(r"^.*\) -> (.*) \{$", header).group(1)
    # `fused` and what it calls, `fused` demoted from the ENTRY module_with_entry makes it.
    text = module_with_entry(module, fused).replace(f"ENTRY {header}", header, 1)
    names = [f"p{i}" for i in range(len(params))]
    signature = ", ".join(f"{name}: {shape}" for name, shape in zip(names, params.values()))
    entry = [f"ENTRY %fusion_only ({signature}) -> {output} {{"]
    entry += [f"  %{name} = {shape} parameter({i})" for i, (name, shape) in enumerate(zip(names, params.values()))]
    entry += [f"  ROOT %f = {output} fusion({', '.join('%' + name for name in names)}), kind={kind}, calls=%{fused}",
              "}"]
    return text + "\n" + "\n".join(entry) + "\n"


def _sliced_fusion_overcount(module, runs: dict[str, int]) -> float:
    """Bytes XLA's cost analysis counts, in one execution, for fusions that dynamic-slice a large
    operand or update it in place, beyond what they touch.

    A decode step at one row reads and writes single cache slots by dynamic slices and in-place
    dynamic updates of the whole stacked cache (every layer's pages at once when the layers are a
    scan), and XLA's analysis counts some such fusions as reading or writing the whole operand: at
    full depth, B 1, four fusions a layer each counted as the 292 MB latent cache, 79 GB a step
    that no kernel moves. Each fusion that slices or updates a parameter is costed again alone
    (XLA's figure, `_fusion_module`) and counted instead as what it touches (`_touched_bytes`);
    the difference, where positive, is the overcount, times the runs of the computation holding it.
    """
    over, costed = 0.0, {}
    for name, lines in module.computations.items():
        for line in lines:
            if (m := _FUSION_CALL.match(line)) is None or runs.get(name, 0) == 0:
                continue
            kind, fused = m.groups()
            if (kind, fused) not in costed:
                touched = _touched_bytes(module.computations[fused])
                if touched is None:
                    costed[kind, fused] = 0.0
                else:
                    counted = _cost_analysis(_module_from_text(_fusion_module(module, fused, kind)))["bytes accessed"]
                    costed[kind, fused] = max(0.0, counted - touched)
            over += runs[name] * costed[kind, fused]
    return over


def _xla_cost(compiled, text: str) -> dict[str, float]:
    """XLA's cost of the optimized module with each loop of known trip count n counted n times.

    XLA's analysis of the module counts each body once, nested loops' bodies included, and gives
    module totals only. So each such body is costed alone, as the ENTRY of a module holding it and
    what it calls, and added n - 1 more times per run of the computation holding the loop. Nested
    loops come out right: an inner body's runs already include the outer trip count, and the outer
    body's own cost holds the inner body once, as the module's does. (Costing the module once more
    with each body removed and taking differences would need a rewritten module per loop as well.)
    """
    module, runs = _parsed(text)
    totals = _cost_analysis(compiled.runtime_executable().hlo_modules()[0])
    totals["bytes accessed"] -= _scatter_overcount(module, runs) + _sliced_fusion_overcount(module, runs)
    bodies = {}
    for loop in module.loops:
        if loop.trip_count is None or loop.trip_count == 1:
            continue
        if loop.body not in bodies:
            bodies[loop.body] = _cost_analysis(_module_from_text(module_with_entry(module, loop.body)))
        for key in _COSTS:
            totals[key] += (loop.trip_count - 1) * runs[loop.computation] * bodies[loop.body][key]
    return totals


def program_cost(compiled) -> ProgramCost:
    """XLA's HLO cost analysis of the optimized module plus the Pallas kernels' own costs, each
    loop's body counted as many times as it runs where XLA knows its trip count."""
    text = _optimized_hlo(compiled)
    analysis = _xla_cost(compiled, text)
    targets = Counter()
    for line, runs in _instructions(text):
        if (target := re.search(r'custom-call\(.*?custom_call_target="([^"]+)"', line)) is not None:
            targets[target.group(1)] += runs
    # XLA marks each custom call's flops and bytes "unknown" by adding -1 (per run, once loops are
    # counted): take those back out.
    unknown = sum(targets.values())
    calls = _pallas_calls(text)
    stated = [c for c in calls if c.flops is not None]
    uncounted = {t: n for t, n in targets.items() if t not in _TRITON_TARGETS and not t.startswith(_MOSAIC_PREFIX)}
    if len(stated) < len(calls):
        uncounted["pallas kernels without a stated cost"] = sum(c.runs for c in calls if c.flops is None)
    kernel_flops = sum(c.flops * c.runs for c in stated)
    kernel_bytes = sum(c.bytes_accessed * c.runs for c in stated)
    xla_flops = analysis["flops"] + unknown
    xla_bytes = analysis["bytes accessed"] + unknown
    module, _ = _parsed(text)
    return ProgramCost(flops=xla_flops + kernel_flops,
                       transcendentals=analysis["transcendentals"] + sum(c.transcendentals * c.runs for c in stated),
                       bytes_accessed=xla_bytes + kernel_bytes, xla_flops=xla_flops, xla_bytes=xla_bytes,
                       kernel_flops=kernel_flops, kernel_bytes=kernel_bytes, uncounted=uncounted,
                       rematerialized=sum(1 for name in _INSTRUCTION_NAME.findall(text) if _REMAT.search(name)),
                       loops_counted_once=sum(1 for loop in module.loops if loop.trip_count is None))


# The op classes a program's cost splits into (`op_class_costs`), by the Pallas kernel that runs
# them: the attention kernels; the grouped matmul, which runs the MoE's experts and, on the pallas
# backend, every FP8 linear layer (`models.layers.Linear`); and everything XLA emits itself as
# "xla" (bfloat16 matmuls, norms, routing, top-k, sampling).
KERNEL_CLASSES = {"mla_attention": "attention", "sparse_mla_attention": "attention", "indexer_scores": "attention",
                  "flash_decoding": "attention", "sliding_compressed_attention": "attention",
                  "grouped_matmul": "grouped_matmul"}
OP_CLASSES = ("attention", "grouped_matmul", "xla")


def op_class_costs(compiled) -> dict[str, tuple[float, float]]:
    """`program_cost` split by op class -> {class: (flops, bytes accessed)} over `OP_CLASSES`: the
    Pallas kernels' stated costs by `KERNEL_CLASSES` (a kernel it does not name counts as "xla"),
    XLA's own ops as "xla". The classes sum to `program_cost`'s totals."""
    cost = program_cost(compiled)
    split = {name: [0.0, 0.0] for name in OP_CLASSES}
    split["xla"] = [cost.xla_flops, cost.xla_bytes]
    for call in pallas_calls(compiled):
        if call.flops is not None:
            part = split[KERNEL_CLASSES.get(kernel_name(call.name), "xla")]
            part[0] += call.flops * call.runs
            part[1] += call.bytes_accessed * call.runs
    return {name: (flops, nbytes) for name, (flops, nbytes) in split.items()}


def op_class_launches(compiled: GpuCompiled) -> dict[str, int]:
    """What one execution launches, split as `op_class_costs` splits the cost -> {class: launches}
    over `OP_CLASSES`: each Pallas kernel's launches (its `runs`) under `KERNEL_CLASSES`, and every
    other launch `launch_counts` counts (XLA's kernels, device copies, library GEMMs, memsets) as
    "xla". The classes sum to `launch_counts`' total. What a launch-bound step (B 1) pays per class
    beside its bytes: `benchmarks/projection.py`'s launch term."""
    split = dict.fromkeys(OP_CLASSES, 0)
    split["xla"] = sum(launch_counts(compiled).values())
    for call in pallas_calls(compiled):
        named = KERNEL_CLASSES.get(kernel_name(call.name), "xla")
        split[named] += call.runs
        split["xla"] -= call.runs
    return split


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes of XLA's buffer assignment. `alias`: output bytes that reuse a donated
    argument's buffer (counted in `argument`, not again in `output`'s peak); `peak` = argument +
    output - alias + temp, the device memory the program needs while it runs."""

    argument: int
    output: int
    temp: int
    alias: int
    generated_code: int

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp


def memory(compiled) -> Memory:
    """Per-device argument / output / temp / alias bytes of a compiled program."""
    stats = compiled.memory_analysis()
    return Memory(argument=stats.argument_size_in_bytes, output=stats.output_size_in_bytes,
                  temp=stats.temp_size_in_bytes, alias=stats.alias_size_in_bytes,
                  generated_code=stats.generated_code_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the optimized HLO: op (e.g. "all-reduce"), bytes of its result, HLO name,
    and how many times it runs in one execution of the program (as `PallasCall.runs`)."""

    op: str
    bytes: int
    name: str
    runs: int = 1


def _largest_array(shape_text: str) -> int:
    """Bytes of the largest array shape written in `shape_text` (0 when there is none)."""
    return max((shape_bytes(part) for part in re.findall(r"[a-z0-9]+\[[0-9,]*\]", shape_text)), default=0)


def collectives(compiled) -> list[Collective]:
    """Every collective in the optimized HLO (async `-start` halves; `-done` halves skipped), with
    the bytes of the largest array it reads or writes (a reduce-scatter's input, an all-gather's
    output), whichever form XLA chose: an async start returns (operands, results[, scratch]); a
    synchronous op's operands are looked up by name, since XLA (jax 0.11) prints them without
    their shapes."""
    hlo = _optimized_hlo(compiled)
    results = {m.group(1): m.group(2) for m in _INSTRUCTION.finditer(hlo)}
    found = []
    for line, runs in _instructions(hlo):
        instruction = _INSTRUCTION.match(line)
        if instruction is None:
            continue
        name, result, op = instruction.groups()
        base = op.removesuffix("-start")
        if base in _COLLECTIVES:
            size = _largest_array(result)
            if not op.endswith("-start"):
                operands = line[instruction.end():].split(")", 1)[0]
                size = max(size, _largest_array(operands),
                           *(_largest_array(results.get(operand, "")) for operand in re.findall(r"%([^\s,()]+)", operands)))
            found.append(Collective(base, size, name, runs))
    return found


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """A Pallas kernel's launch resources: grid and threads per block from the thunk sequence,
    shared memory (bytes per block), registers per thread and spill bytes from ptxas."""

    name: str
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    shared_memory: int
    registers: int
    spill_stores: int
    spill_loads: int


def ptxas_path() -> str:
    """The CUDA toolkit's ptxas that comes with the CUDA plugin (nvidia-cuda-nvcc), else PATH's."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        # CUDA 12's wheel (nvidia-cuda-nvcc-cu12) and CUDA 13's (nvidia/cu13/bin)
        candidates = [os.path.join(root, "cuda_nvcc", "bin", "ptxas"), *glob.glob(os.path.join(root, "cu*", "bin", "ptxas"))]
        for candidate in candidates:
            if os.path.isfile(candidate):
                return candidate
    found = shutil.which("ptxas")
    if found is None:
        raise RuntimeError(f"ptxas not found: pip install 'jax[cuda12]=={jax.__version__}' brings it")
    return found


def _dump_files(compiled: GpuCompiled, suffix: str) -> list[str]:
    module = compiled.runtime_executable().hlo_modules()[0].name
    files = sorted(glob.glob(os.path.join(compiled.dump_dir, f"module_*.{module}.*{suffix}")))
    if not files:
        raise RuntimeError(f"no *{suffix} for module {module} in {compiled.dump_dir}: compile with compile_gpu")
    # Several compilations of one module name in one directory: the latest (highest module number).
    latest = max(os.path.basename(f).split(".")[0] for f in files)
    return [f for f in files if os.path.basename(f).startswith(latest + ".")]


_THUNK = re.compile(r"kCustomKernel\s+\[[^\]]*\]\s+(\S+) grid: \[(\d+), (\d+), (\d+)\] "
                    r"threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes")
_PTXAS_ENTRY = re.compile(r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads\n.*?Used (\d+) registers")


def ptxas_resources(ptx_files: list[str], arch: str = "sm_90a") -> dict[str, tuple[int, int, int]]:
    """Entry name -> (registers, spill store bytes, spill load bytes), from `ptxas -arch -v`, one
    process per file, as many at once as this host has cores (a full model's XLA dumps hundreds)."""
    ptxas = ptxas_path()

    def entries(path: str) -> list[tuple[str, ...]]:
        run = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
        return _PTXAS_ENTRY.findall(run.stdout + run.stderr)

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        found = list(pool.map(entries, ptx_files))
    return {name: (int(registers), int(stores), int(loads))
            for file_entries in found for name, _, stores, loads, registers in file_entries}


def register_spills(compiled: GpuCompiled) -> dict[str, tuple[int, int]]:
    """Every kernel of a `compile_gpu` result's PTX (XLA's own kernels and the Triton ones) that
    spills registers: name -> (spill store bytes, spill load bytes), from ptxas over each dumped
    PTX file. Empty without running ptxas when the compile refused spills (`fail_on_spill`). The
    Mosaic GPU kernels are not in XLA's PTX (`MosaicLaunch`)."""
    if compiled.fail_on_spill:
        return {}
    files = [path for path in _dump_files(compiled, ".ptx") if os.path.getsize(path)]  # a part without kernels: empty
    return {name: (stores, loads) for name, (_, stores, loads) in ptxas_resources(files).items() if stores or loads}


def _ptx_files(compiled: GpuCompiled, entries: set[str]) -> dict[str, str]:
    """The dumped PTX files of `compiled` that define any of `entries` -> their text."""
    found = {}
    for path in _dump_files(compiled, ".ptx"):
        with open(path) as f:
            text = f.read()
        if set(re.findall(r"\.entry (\S+)\(", text)) & entries:
            found[path] = text
    return found


def kernel_ptx(compiled: GpuCompiled, name: str) -> str:
    """The PTX that XLA generated for the Pallas (Triton) kernel launched as `name` (a
    `KernelLaunch.name`) in a `compile_gpu` result: what its loops issue can be read there."""
    found = list(_ptx_files(compiled, {name}).values())
    if len(found) != 1:
        raise ValueError(f"name: {len(found)} PTX files define kernel {name!r}; expected one")
    return found[0]


def kernel_launches(compiled: GpuCompiled) -> list[KernelLaunch]:
    """Launch resources of each Pallas kernel launch of a `compile_gpu` result, in thunk order.

    Only the PTX files that define a Pallas kernel go through ptxas (a full model has thousands
    of XLA fusions).
    """
    kernel_names = {call.name for call in pallas_calls(compiled) if call.lowering == "triton"}
    thunks = []
    for path in _dump_files(compiled, "thunk_sequence.txt"):
        with open(path) as f:
            thunks += [m for m in _THUNK.findall(f.read()) if {m[0], kernel_name(m[0])} & kernel_names]
    resources = ptxas_resources(list(_ptx_files(compiled, {m[0] for m in thunks})))
    launches = []
    for name, gx, gy, gz, tx, ty, tz, smem in thunks:
        registers, stores, loads = resources[name]
        launches.append(KernelLaunch(name, (int(gx), int(gy), int(gz)), (int(tx), int(ty), int(tz)), int(smem),
                                     registers, stores, loads))
    return launches


_THUNK_LINE = re.compile(r"^( *)\d+: (k\w+)\s+\[[^\]]*\]\s*(\S*)")
_THUNK_HEADER = re.compile(r"^\s*([\w ]+):\s*$")  # condition:, body:, true_branch:, ...
# Thunks that only hold or order others: their inner thunks are the launches. jax 0.11's XLA wraps
# some thunks (a dynamic slice's copy) in an async start, on another stream, and an async done,
# which waits for it.
_STRUCTURAL_THUNKS = frozenset({"kWhile", "kConditional", "kDynamicSliceFusion", "kSequential", "kCommandBuffer",
                                "kAsyncStart", "kAsyncDone"})
# `launch_counts`' key for a loop's predicate copied to the host (the while thunk's own copy).
PREDICATE_READS = "kWhile"


@dataclasses.dataclass
class _Block:
    """A run of thunks in XLA's thunk sequence: the entry's, or one under a header ("body:") of a
    loop or conditional thunk, the `owner`-th of those in its `parent` block's `thunks`."""

    indent: int
    header: str | None = None
    parent: int | None = None
    owner: int | None = None
    thunks: list = dataclasses.field(default_factory=list)  # (kind, name)
    computation: str | None = None


def _thunk_blocks(paths: list[str]) -> list[_Block]:
    """The thunk sequence's blocks, the entry's first. A header's thunks are indented past their
    owner's; a thunk indented deeper without a header belongs to a wrapper (a dynamic slice's
    copy) and is launched in its block. RuntimeError where a header's block would not belong to
    the loop or conditional printed last (an empty block: its thunks would be counted elsewhere)."""
    blocks, stack, header, last_owner = [_Block(0)], [0], None, None
    for path in paths:
        with open(path) as f:
            for line in f:
                heading = _THUNK_HEADER.match(line)
                if heading:
                    header = heading.group(1).strip()
                    continue
                thunk = _THUNK_LINE.match(line)
                if thunk is None:
                    continue
                indent = len(thunk.group(1))
                if header is not None:
                    while blocks[stack[-1]].indent >= indent and len(stack) > 1:
                        stack.pop()
                    if last_owner is None or last_owner[0] != stack[-1] or indent <= blocks[stack[-1]].indent:
                        raise RuntimeError(f"thunk sequence {path}: block {header!r} at {line.strip()[:80]!r} does not "
                                           "follow the loop or conditional before it")
                    blocks.append(_Block(indent, header, *last_owner))
                    stack.append(len(blocks) - 1)
                    header = None
                else:
                    while blocks[stack[-1]].indent > indent and len(stack) > 1:
                        stack.pop()
                blocks[stack[-1]].thunks.append((thunk.group(2), thunk.group(3)))
                if thunk.group(2) in ("kWhile", "kConditional"):
                    last_owner = (stack[-1], len(blocks[stack[-1]].thunks) - 1)
    return blocks


def launch_counts(compiled: GpuCompiled) -> Counter:
    """What one execution of a `compile_gpu` result launches, from XLA's thunk sequence: name ->
    count, each kernel under its kernel name (an XLA fusion's, or the Pallas kernel's) and every
    other launch (a device copy, a custom call such as a Mosaic GPU kernel, a memset) under its
    thunk kind ("kCopy", "kCustomCall", ...). A while loop's body counts as often as it runs
    where XLA knows its trip count (`hlo_loops.executions`; once where it does not); each branch
    of a conditional as often as the conditional (an upper bound, as `program_cost` counts them).
    A thunk that only holds others (a loop, a conditional, a dynamic slice's wrapper) is not a
    launch; the thunks it holds are.

    A loop's condition runs only where XLA does not know the trip count: XLA's `WhileThunk` runs
    a known count's body that many times and never evaluates the condition (a `lax.scan` over
    layers). An unknown count's loop (a `lax.while_loop` on data) evaluates it once a trip and
    once to end, and each time copies the predicate to the host and waits for it (a host
    synchronization, counted as `PREDICATE_READS`): both counted as often as the body plus once.

    Why its own parser: a launch costs microseconds whatever its kernel does, launch-bound steps
    (B 1) are decided by this count, and no XLA API reports it. A block of the sequence is matched
    to its HLO computation by position: the k-th loop thunk of a block is the k-th while of the
    block's computation (the optimized module prints each computation in its schedule's order,
    which the thunks follow), its "condition" and "body" that while's; a conditional's branches
    by name. RuntimeError when the two disagree."""
    module = parse_module(compiled.as_text())
    runs = executions(module)
    flow = control_flow(module)
    blocks = _thunk_blocks(_dump_files(compiled, "thunk_sequence.txt"))
    blocks[0].computation = module.entry
    for block in blocks[1:]:
        parent = blocks[block.parent]
        kind = parent.thunks[block.owner][0]
        opcode = "while" if kind == "kWhile" else "conditional"
        position = sum(k == kind for k, _ in parent.thunks[:block.owner])
        held = [called for op, called in flow[parent.computation] if op == opcode]
        if position >= len(held):
            raise RuntimeError(f"thunk sequence: {kind} #{position} of {parent.computation}, which holds "
                               f"{len(held)} {opcode}(s) in the HLO")
        attribute = {"true_branch": "true_computation", "false_branch": "false_computation"}.get(
            block.header, re.sub(r"^branch[ _](\d+)$", r"branch_computations[\1]", block.header))
        if attribute not in held[position]:
            raise RuntimeError(f"thunk sequence: block {block.header!r} of a {opcode} in {parent.computation} "
                               f"names none of its computations ({sorted(held[position])})")
        block.computation = held[position][attribute]
    trip_counts = {loop.condition: loop.trip_count for loop in module.loops}
    counted = Counter()
    for block in blocks:
        n = runs[block.computation]
        if block.header == "condition":
            if trip_counts[block.computation] is not None:
                continue  # never evaluated
            n = runs[_loop_body(block, blocks)] + runs[blocks[block.parent].computation]
            counted[PREDICATE_READS] += n  # the predicate's copy to the host, each time it is evaluated
        for kind, name in block.thunks:
            if kind not in _STRUCTURAL_THUNKS:
                counted[kernel_name(name) if kind in ("kCustomKernel", "kKernel") and name else kind] += n
    return counted


def is_thunk_kind(name: str) -> bool:
    """Whether a `launch_counts` key is a thunk kind ("kCopy") rather than a kernel's name."""
    return re.match(r"k[A-Z]", name) is not None


def _loop_body(condition: _Block, blocks: list[_Block]) -> str:
    """The body computation of the loop whose condition block is `condition`."""
    return next(block.computation for block in blocks
                if block.parent == condition.parent and block.owner == condition.owner and block.header == "body")


@dataclasses.dataclass(frozen=True)
class MosaicLaunch:
    """A Mosaic GPU kernel launch of the optimized HLO: the op it runs (the name the kernel states,
    `cost.stating`; else the jitted function around it), grid, threads per block, shared memory
    (bytes a block claims, Mosaic GPU's count) and `kernel`, the device function's name as the
    profiler shows it: the `kernel_name` given to `plgpu.kernel` (else the body's function name,
    "anonymous" for a `functools.partial`) and "_mosaic_gpu_kernel", which is what
    `benchmarks/kernel_profile.py` classifies a kernel's time by. Registers
    and spills are not in the program: Mosaic GPU's ptxas report is written only by a process
    started with `MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR` (docs/kernels.md)."""

    name: str
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    shared_memory: int
    kernel: str


_LAUNCH = "gpu.launch"


def mosaic_launches(compiled: GpuCompiled) -> list[MosaicLaunch]:
    """The Mosaic GPU kernel launches of a `compile_gpu` result, in HLO order. Each custom call
    carries its kernel's MLIR module (bytecode, ops under Mosaic's serialization prefix); its one
    `gpu.launch` takes the grid, the block and the dynamic shared memory as constants."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic.gpu import dialect

    context = mlir.make_ir_context()
    dialect.register_dialect(context)
    context.allow_unregistered_dialects = True  # the serialized ops keep their prefixed names
    launches = []
    for line in _optimized_hlo(compiled).splitlines():
        if _MOSAIC_TARGET not in line:
            continue
        module, op_name = _attribute(line, "module"), re.search(r'op_name="([^"]*)"', line)
        if module is None:
            raise RuntimeError(f"a Mosaic GPU custom call without its module: {line[:200]}")
        with context:
            parsed = ir.Module.parse(_unescape(module))  # kept alive while its operations are read
            found = _find_ops(parsed.operation, _LAUNCH)
            if len(found) != 1:
                raise RuntimeError(f"expected one {_LAUNCH} in a Mosaic GPU module, found {len(found)}")
            # operands: async token, grid x y z, block x y z, dynamic shared memory (operandSegmentSizes)
            sizes = [int(ir.IntegerAttr(operand.owner.attributes["value"]).value)
                     for operand in found[0].operands[1:8]]
            kernel = ir.StringAttr(parsed.operation.attributes["sym_name"]).value + "_mosaic_gpu_kernel"
        names = re.findall(r"jit\(([^)]*)\)", op_name.group(1)) if op_name else []
        name = _frontend_attributes(line).get(KERNEL_ATTRIBUTE, names[-1] if names else _MOSAIC_PREFIX)
        launches.append(MosaicLaunch(name, tuple(sizes[:3]), tuple(sizes[3:6]), sizes[6], kernel))
    return launches


def _find_ops(operation, suffix: str) -> list:
    """Every operation nested in `operation` whose name ends with `suffix`. `walk` hands over bare
    operations: iterating `block.operations` builds each one's Python op class, which for the
    serialized Mosaic ops' unregistered dialects means failed imports of their generated modules,
    several per op (22 s of a 29 s compile test at V4-Flash shapes)."""
    from jax._src.lib.mlir import ir

    found = []

    def visit(op):
        if op.name.endswith(suffix):
            found.append(op)
        return ir.WalkResult.ADVANCE

    operation.walk(visit)
    return found


def kernel_name(thunk_name: str) -> str:
    """A launch's kernel: XLA numbers repeated kernel names ("mla_attention__3" -> "mla_attention")."""
    return re.sub(r"__\d+$", "", thunk_name)
