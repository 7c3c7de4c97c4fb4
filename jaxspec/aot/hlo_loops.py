"""How many times each computation of an optimized HLO module runs in one execution of it.

XLA's HLO cost analysis counts a while loop's body once, whatever its trip count, so a model whose
layers run as a `lax.scan` would cost one layer. Where XLA knows a loop's trip count it writes it
into the optimized HLO (the `while` instruction's `backend_config={"known_trip_count":{"n":"61"}}`);
`parse_module` reads the computations, what each instruction calls and those trip counts, and
`executions` multiplies them through the call graph: a computation runs as many times as the
computations calling it, times n where it is the body of a loop of n trips (a `lax.map` inside a
`lax.scan`'s body: the product of both). A loop whose trip count XLA does not know (a
`lax.while_loop` on data, the decode loop itself) counts once. A loop's condition counts once as
XLA counts it (it compares the counter). Every branch of a conditional counts as often as the
conditional (XLA's own analysis takes the costliest branch).

`module_with_entry` writes a module whose ENTRY is one computation (a loop's body), so that XLA's
own analysis can cost the body alone: XLA's Python API gives module totals only.

The text is XLA's, not a stable API: the parser is small and raises on anything it cannot read
(instead of counting a body once without saying so).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

_COMPUTATION = re.compile(r"^(ENTRY )?%?([^\s(]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?(\S+) = .*? ([a-z][a-z0-9-]*)\(")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# Attributes naming called computations: `body=%b`, `calls=%f`, `to_apply=%r`, and lists such as
# `branch_computations={%a, %b}`. `control-predecessors={%x}` names instructions, not computations.
_CALLED = re.compile(r"\b([a-z_]+)=(?:%([^\s,{}()]+)|\{(%[^{}]*)\})")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Loop:
    """One `while` instruction: its name, the computation that holds it, its body and condition,
    and XLA's known trip count (None: unknown, the body counts once)."""

    name: str
    computation: str
    body: str
    condition: str
    trip_count: int | None


@dataclasses.dataclass(frozen=True)
class HloModuleText:
    """An optimized HLO module's text split into computations (name -> its lines, header and
    closing brace included, in the module's order), its entry, the calls each computation makes
    ((callee, times per run) pairs), its while loops and the text before the first computation
    (module header and metadata tables)."""

    preamble: str
    computations: dict[str, list[str]]
    entry: str
    calls: dict[str, list[tuple[str, int]]]
    loops: list[Loop]


def parse_module(text: str) -> HloModuleText:
    """Parse `text` (`Compiled.as_text()` of an optimized module). Raises RuntimeError on a module
    without one ENTRY, an instruction naming a computation that is not defined, or a while loop
    whose body or condition cannot be found."""
    computations: dict[str, list[str]] = {}
    entry, current, preamble = None, None, []
    for line in text.splitlines():
        if current is None:
            header = _COMPUTATION.match(line)
            if header is None:
                if not computations:
                    preamble.append(line)
                continue
            current = header.group(2)
            computations[current] = [line]
            if header.group(1):
                if entry is not None:
                    raise RuntimeError(f"HLO module with two ENTRY computations ({entry}, {current})")
                entry = current
        else:
            computations[current].append(line)
            if line == "}":
                current = None
    if entry is None or current is not None:
        raise RuntimeError("HLO module text without an ENTRY computation or with one left open: cannot count loops")
    calls, loops = {}, []
    for name, lines in computations.items():
        calls[name] = []
        for line in lines[1:-1]:
            called = _called_computations(line, computations)
            if not called:
                continue
            instruction = _INSTRUCTION.match(line)
            if instruction is None:
                raise RuntimeError(f"unreadable HLO instruction in {name}: {line[:200]}")
            if instruction.group(2) in ("async-update", "async-done"):
                continue  # the async-start that they finish runs the wrapped computation, once
            if instruction.group(2) != "while":
                calls[name] += [(callee, 1) for callee in called.values()]
                continue
            if "body" not in called or "condition" not in called:
                raise RuntimeError(f"while loop {instruction.group(1)} in {name} without a body or condition: {line[:200]}")
            trips = _TRIP_COUNT.search(line)
            loop = Loop(instruction.group(1), name, called["body"], called["condition"],
                        None if trips is None else int(trips.group(1)))
            loops.append(loop)
            calls[name] += [(loop.body, loop.trip_count or 1), (loop.condition, 1)]
    return HloModuleText("\n".join(preamble), computations, entry, calls, loops)


def _called_computations(line: str, computations: dict) -> dict[str, str]:
    """attribute -> computation for every computation `line` calls (a list's members as
    "attribute[i]"). Raises RuntimeError for a name the module does not define."""
    found = {}
    for attribute, single, listed in _CALLED.findall(_STRING.sub('""', line)):
        if attribute == "predecessors":  # control-predecessors={%x}: instructions
            continue
        names = [single] if single else [name.strip().lstrip("%") for name in listed.split(",")]
        for i, callee in enumerate(names):
            if callee not in computations:
                raise RuntimeError(f"HLO instruction calls {callee!r}, which the module does not define: {line[:200]}")
            found[attribute if single else f"{attribute}[{i}]"] = callee
    return found


def control_flow(module: HloModuleText) -> dict[str, list[tuple[str, dict[str, str]]]]:
    """Computation -> its while loops and conditionals in the order of its text (an optimized
    module is printed in its schedule's order), each as (opcode, {attribute: computation}): a
    while's "condition" and "body", a conditional's "true_computation" and "false_computation" or
    "branch_computations[i]"."""
    found = {}
    for name, lines in module.computations.items():
        found[name] = []
        for line in lines[1:-1]:
            instruction = _INSTRUCTION.match(line)
            if instruction is not None and instruction.group(2) in ("while", "conditional"):
                found[name].append((instruction.group(2), _called_computations(line, module.computations)))
    return found


def executions(module: HloModuleText) -> dict[str, int]:
    """Computation -> how many times it runs in one execution of the module (0 where the entry
    never calls it), through every call chain from the entry: a loop's body n times its caller
    where XLA knows n, once otherwise."""
    callers = defaultdict(int)
    for name in module.computations:
        for callee, _ in module.calls[name]:
            callers[callee] += 1
    # The call graph is acyclic (HLO has no recursion): visit it in topological order from the entry.
    runs = dict.fromkeys(module.computations, 0)
    runs[module.entry] = 1
    ready = [name for name in module.computations if callers[name] == 0]
    while ready:
        name = ready.pop()
        for callee, times in module.calls[name]:
            runs[callee] += runs[name] * times
            callers[callee] -= 1
            if callers[callee] == 0:
                ready.append(callee)
    if any(callers.values()):
        raise RuntimeError("HLO module with a cycle of computation calls: cannot count loops")
    return runs


def module_with_entry(module: HloModuleText, name: str) -> str:
    """HLO text of a module whose ENTRY is computation `name`, holding it and every computation it
    calls (transitively, in the module's order, so each is defined before its callers) and the
    module's metadata tables. Its cost is one run of `name`."""
    reachable, stack = {name}, [name]
    while stack:
        for callee, _ in module.calls[stack.pop()]:
            if callee not in reachable:
                reachable.add(callee)
                stack.append(callee)
    # The header's entry layout and schedule describe the original entry: keep its name only.
    preamble = re.sub(r"^HloModule ([^\s,]+).*$", r"HloModule \1", module.preamble, count=1, flags=re.M)
    blocks = []
    for computation, lines in module.computations.items():
        if computation in reachable:
            header = lines[0].removeprefix("ENTRY ")
            blocks.append("\n".join([("ENTRY " + header) if computation == name else header, *lines[1:]]))
    return preamble + "\n\n" + "\n\n".join(blocks) + "\n"
