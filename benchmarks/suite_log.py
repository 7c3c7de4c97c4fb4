"""A pytest plugin that writes each test's outcome to a file the moment it is known, so that a run
ended from outside (`gpu_report.py`'s clock) still tells which tests finished and how.

    JAXSPEC_SUITE_LOG=run.jsonl python -m pytest -p suite_log -n 8 tests/...
    python benchmarks/suite_log.py run.jsonl        # per module: time, compiling, programs

(from the repository root, `benchmarks` on PYTHONPATH for the first.)

One JSON object a line: {"collected": [node ids]} once the run knows its tests (with pytest-xdist,
when the first worker has collected them), then {"nodeid", "when" ("setup" / "call" / "teardown"),
"outcome" ("passed" / "failed" / "skipped"), "seconds", "message", "compile_seconds",
"trace_seconds", "programs"} for each phase of each test. Under pytest-xdist the controller writes
every line (the workers' reports reach it); the workers write nothing. A junit file is no
substitute: pytest writes it only when the run ends.

"compile_seconds" is the phase's time in XLA's compiler (or fetching a program from the persistent
compilation cache), "trace_seconds" its time tracing to jaxprs and lowering them, "programs" the
programs it compiled or fetched: JAX's own compile events (`jax.monitoring`), counted in the process
that ran the test, so not a subprocess' compiles. On a GPU they tell compiling from running, which
is what decides how a slow module can be made faster.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

LOG = "JAXSPEC_SUITE_LOG"
# What the log counts of a test phase's compiling (absent from logs written before it did).
COMPILE_KEYS = ("compile_seconds", "trace_seconds", "programs")


def _write(config, entry: dict) -> None:
    path = os.environ.get(LOG)
    if not path or hasattr(config, "workerinput"):  # an xdist worker: its controller writes
        return
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


_config = None  # the run's pytest config: the hooks below that get no config reach it here
# JAX's compile events in this process since the last test phase's report.
_compiles = dict.fromkeys(COMPILE_KEYS, 0)
_EVENTS = {"/jax/core/compile/backend_compile_duration": "compile_seconds",
           "/jax/core/compile/jaxpr_trace_duration": "trace_seconds",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "trace_seconds"}


def _count(event: str, seconds: float, **_) -> None:
    key = _EVENTS.get(event)
    if key:
        _compiles[key] += seconds
        _compiles["programs"] += key == "compile_seconds"


def pytest_configure(config):
    global _config
    _config = config
    if os.environ.get(LOG):
        import jax.monitoring
        jax.monitoring.register_event_duration_secs_listener(_count)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The phase's compile events ride on its report (under xdist, to the controller that logs it):
    a new list, since a report shares its item's user_properties."""
    report = (yield).get_result()
    report.user_properties = [*report.user_properties, ("jax_compiles", dict(_compiles))]
    _compiles.update(dict.fromkeys(COMPILE_KEYS, 0))


def pytest_collection_finish(session):
    if session.items:  # not under xdist's controller, which collects nothing itself
        _write(session.config, {"collected": [item.nodeid for item in session.items]})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    if not getattr(_config, "_suite_log_collected", False):
        _config._suite_log_collected = True
        _write(_config, {"collected": list(ids)})


def _message(report) -> str:
    """A failure's exception line ("AssertionError: boom"), a skip's reason, else ""."""
    if report.passed:
        return ""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        return str(report.longrepr[-1])
    lines = (report.longreprtext or "").strip().splitlines()
    return lines[-1] if lines else ""


def pytest_runtest_logreport(report):
    compiles = dict(map(tuple, report.user_properties)).get("jax_compiles", {})
    _write(_config, {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                     "seconds": report.duration, "message": _message(report)[:300], **compiles})


# --- reading a log back ----------------------------------------------------------------------


def module_of(nodeid: str) -> str:
    """"tests/test_a.py::test_x[1]" -> "test_a.py"."""
    return os.path.basename(nodeid.split("::")[0])


def suite_outcomes(path: str) -> tuple[dict[str, int], dict[str, dict]]:
    """A `suite_log` file -> (tests collected per module, and per module with a test that started:
    {"passed", "failed", "skipped", "finished", "seconds", "failures": [...], "skips": [...],
    "slowest": [[test, seconds], ...] (its three longest), "running": [tests started, unfinished],
    and its finished tests' "compile_seconds", "trace_seconds" and "programs" where the log has
    them: what of "seconds" went to compiling}).

    A test is finished once its teardown is logged; it failed if any of its phases failed, was
    skipped if one was skipped (and none failed), and passed otherwise. A module is complete when
    "finished" equals its collected count; a run ended from outside leaves the others partial, and
    the tests it ended in the middle "running"."""
    collected, phases = {}, {}
    with open(path) as f:
        for line in f:
            entry = json.loads(line)
            if "collected" in entry:
                collected = {}
                for nodeid in entry["collected"]:
                    collected.setdefault(module_of(nodeid), []).append(nodeid)
            else:
                phases.setdefault(entry["nodeid"], []).append(entry)
    modules = {}
    for module, nodeids in collected.items():
        finished = [n for n in nodeids if any(p["when"] == "teardown" for p in phases.get(n, []))]
        running = [n.split("::", 1)[-1] for n in nodeids if n in phases and n not in finished]
        if not finished and not running:
            continue
        entry = {"passed": 0, "failed": 0, "skipped": 0, "finished": len(finished), "seconds": 0.0, "failures": [],
                 "skips": []}
        durations = []
        for nodeid in finished:
            test = phases[nodeid]
            name = nodeid.split("::", 1)[-1]
            durations.append([name, round(sum(p["seconds"] for p in test), 1)])
            entry["seconds"] += durations[-1][1]
            for key in COMPILE_KEYS:
                if any(key in p for p in test):
                    entry[key] = entry.get(key, 0) + sum(p.get(key, 0) for p in test)
            failed = [p for p in test if p["outcome"] == "failed"]
            skipped = [p for p in test if p["outcome"] == "skipped"]
            if failed:
                entry["failed"] += 1
                entry["failures"].append(f"{name} ({failed[0]['when']}): {failed[0]['message']}")
            elif skipped:
                entry["skipped"] += 1
                entry["skips"].append(f"{name}: {skipped[0]['message'][:200]}")
            else:
                entry["passed"] += 1
        entry["slowest"] = sorted(durations, key=lambda d: -d[1])[:3]
        entry["running"] = running
        modules[module] = entry
    return {module: len(nodeids) for module, nodeids in collected.items()}, modules


def empty_outcome() -> dict:
    """`suite_outcomes`' entry of a module none of whose tests started."""
    return {"passed": 0, "failed": 0, "skipped": 0, "finished": 0, "seconds": 0.0, "failures": [], "skips": [],
            "slowest": [], "running": []}


def main(argv: list[str] | None = None) -> int:
    """Print a log's modules, slowest first: test seconds, and of them compiling, tracing and the
    programs compiled (the table that says where a suite's time goes, and which modules would
    gain from fewer programs)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("log", help="a JAXSPEC_SUITE_LOG file")
    parser.add_argument("--top", type=int, default=0, help="print only the N slowest modules (0: all)")
    args = parser.parse_args(argv)
    if args.top < 0:
        parser.error(f"--top {args.top}: must be 0 (all) or more")
    _, modules = suite_outcomes(args.log)
    rows = sorted(modules.items(), key=lambda item: -item[1]["seconds"])
    total = {key: sum(v.get(key, 0) for v in modules.values()) for key in ("seconds", *COMPILE_KEYS)
             if any(key in v for v in modules.values()) or key == "seconds"}
    print(f"{'seconds':>8} {'compile':>8} {'trace':>8} {'programs':>8}  module")
    for name, v in [("all", total)] + rows[:args.top or None]:
        print(f"{v['seconds']:8.0f} " + " ".join(f"{v[key]:8.0f}" if key in v else f"{'-':>8}" for key in COMPILE_KEYS)
              + f"  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
