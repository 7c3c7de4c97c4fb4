"""A pytest plugin that writes each test's outcome to a file the moment it is known, so that a run
ended from outside (`gpu_report.py`'s clock) still tells which tests finished and how.

    JAXSPEC_SUITE_LOG=run.jsonl python -m pytest -p suite_log -n 8 tests/...

One JSON object a line: {"collected": [node ids]} once the run knows its tests (with pytest-xdist,
when the first worker has collected them), then {"nodeid", "when" ("setup" / "call" / "teardown"),
"outcome" ("passed" / "failed" / "skipped"), "seconds", "message"} for each phase of each test.
Under pytest-xdist the controller writes every line (the workers' reports reach it); the workers
write nothing. A junit file is no substitute: pytest writes it only when the run ends.
"""

from __future__ import annotations

import json
import os

import pytest

LOG = "JAXSPEC_SUITE_LOG"


def _write(config, entry: dict) -> None:
    path = os.environ.get(LOG)
    if not path or hasattr(config, "workerinput"):  # an xdist worker: its controller writes
        return
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


_config = None  # the run's pytest config: the hooks below that get no config reach it here


def pytest_configure(config):
    global _config
    _config = config


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
    _write(_config, {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                     "seconds": report.duration, "message": _message(report)[:300]})
