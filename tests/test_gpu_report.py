"""`benchmarks/gpu_report.py`, the one command for a lent GPU: its `--smoke` run exercises every
part at tiny sizes on the CPU and records them, a second run skips what is recorded, and the
projection it reports beside each measured step is `benchmarks/projection.py`'s (calibrated per op
class from the benchmark rows)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gather_copies  # noqa: E402
import gpu_report  # noqa: E402
import launch_check  # noqa: E402
import projection  # noqa: E402
import suite_log  # noqa: E402
from projection import Calibration, StepCost, load_calibration, step_seconds, target_peaks  # noqa: E402

from jaxspec.pallas_kernels.grouped_matmul_pallas import DEFAULT_VARIANT  # noqa: E402


def run_report(out, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/gpu_report.py", "--out", str(out), "--smoke", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-report")
    done = run_report(out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out / "report.json") as f:
        return out, json.load(f)


def test_no_benchmark_module_shadows_an_installed_package():
    """The benchmarks import one another as top-level modules (their directory on `sys.path`, as in
    this module and the GPU report's units), so a script named like an installed package hides it:
    `benchmarks/kernels.py` once hid Hugging Face's `kernels`, which transformers imports when it
    builds a model, and the parity tests that ran after a module putting benchmarks on the path
    failed with an ImportError."""
    import importlib.metadata

    installed = set(importlib.metadata.packages_distributions())
    scripts = {name[:-len(".py")] for name in os.listdir(os.path.join(REPO, "benchmarks")) if name.endswith(".py")}
    assert scripts and not scripts & installed, sorted(scripts & installed)


def test_smoke_run_records_every_part(smoke_report):
    out, data = smoke_report
    (device, units), = data["devices"].items()
    assert device.endswith("(smoke)")
    expected = {"suite/test_config.py", "kernels/mla_attention", "kernels_block_n32", "gather", "moe", "matmuls",
                "gmm/expert_matmuls", "gmm/matmuls", "gmm/moe_fp8", "exactness", "mainjob/mtp3", "e2e/B=2,k=1",
                "e2e_v4/B=2,k=1"}
    assert set(units) == expected
    assert units["suite/test_config.py"]["collected_only"] > 0 and not units["suite/test_config.py"]["failed"]
    for name in ("kernels/mla_attention", "kernels_block_n32", "gather", "moe", "matmuls", "gmm/expert_matmuls",
                 "gmm/matmuls", "gmm/moe_fp8", "exactness", "mainjob/mtp3"):
        assert units[name]["returncode"] == 0 and units[name]["ok"], units[name]["output"]
    for name in ("kernels/mla_attention", "kernels_block_n32", "gather", "moe", "matmuls", "gmm/expert_matmuls",
                 "gmm/matmuls", "gmm/moe_fp8"):
        assert units[name]["json"]["rows"] and all(row["seconds"] > 0 for row in units[name]["json"]["rows"])
    # every gather variant staged the rows it was asked for (interpreted: the code path, not the barriers)
    assert ({row["impl"] for row in units["gather"]["json"]["rows"]}
            == {variant for variant in gather_copies.VARIANTS if gather_copies.interpretable(variant)})
    assert all(row["correct"] for row in units["gather"]["json"]["rows"])
    # the tuned rows say their tuning, and are the Triton kernel's only (no Mosaic, no XLA)
    assert {row["impl"] for row in units["kernels_block_n32"]["json"]["rows"]} == {"pallas block_n=32"}
    # the grouped matmul's tile variants: a row each, named by variant, FP8 weights only, on the
    # Triton kernel (default and GMM_E2E_TILES) and the Mosaic one (GMM_E2E_TILES: its default
    # tiles are tests/test_grouped_matmul_mosaic.py's), and beside them XLA's dot of the dequantized weight
    # and the W8A8 Mosaic kernel
    tiles = f":{gpu_report.GMM_E2E_TILES}"
    assert {(row["op"], row["impl"]) for row in units["gmm/matmuls"]["json"]["rows"]} == {
        ("linear_fp8", impl) for impl in ("pallas", f"pallas{tiles}", f"mosaic{tiles}", "xla", "w8a8:k128")}
    assert {(row["op"], row["impl"]) for row in units["gmm/moe_fp8"]["json"]["rows"]} == {("moe_layer_fp8", "pallas:k128")}
    # the experts' matmuls alone: the Triton kernel beside the two that read the weights [out, in]
    assert {row["impl"] for row in units["gmm/expert_matmuls"]["json"]["rows"]} == {
        f"{kernel}:{DEFAULT_VARIANT}" for kernel in ("pallas", "mosaic-swapped")} | {"mosaic-w8a8:k128"}
    # the Mosaic kernel's split-KV parts (the tiles part's --part-slots, here in the kernels part's
    # smoke): its default and 64-slot parts side by side, only the Triton rows calibrating
    kernel_rows = units["kernels/mla_attention"]["json"]["rows"]
    assert {row["impl"] for row in kernel_rows} == {"pallas", "mosaic", "mosaic part_slots=64"}
    assert data["calibration"]["rows"]["attention"] == sum(row["impl"] == "pallas" for row in kernel_rows)
    # window_invariant rows equal plain greedy on the CPU: guaranteed, so the smoke checks it
    assert all(row["identical"] == row["rows"] for row in units["exactness"]["json"]["rows"])
    assert units["mainjob/mtp3"]["tokens_per_s"] > 0 and units["mainjob/mtp3"]["mean_accepted"] >= 1
    text = (out / "report.md").read_text()
    for heading in ("## Test suite", "## kernels", "## kernels_block_n32", "## kernels_part_slots",
                    "## gather", "## moe", "## matmuls", "## gmm", "## Exactness", "## Main job", "## End-to-end decode step",
                    "## DeepSeek-V4-Flash's decode step",
                    "## Calibration", "## The ratio"):
        assert heading in text


def test_smoke_e2e_points_are_projected_from_their_own_program(smoke_report):
    """Each point's projection (V3.2's and V4's) is projection.py's roofline of the flops and bytes
    of the program it timed, and the op classes split those totals exactly."""
    out, data = smoke_report
    (units,) = data["devices"].values()
    for key in [f"{part}/B={b},k={k}" for part in ("e2e", "e2e_v4") for b, k in gpu_report.SMOKE_E2E_POINTS]:
        point = units[key]
        assert point["model"] == ("tiny-v4" if key.startswith("e2e_v4") else "tiny")
        assert point["measured_s"] > 0 and point["flops"] > 0 and point["bytes"] > 0
        cost = StepCost(flops=point["flops"], bytes_accessed=point["bytes"], compile_seconds=0.0,
                        by_class={k: tuple(v) for k, v in point["by_class"].items()})
        assert point["projected_s"] == pytest.approx(step_seconds(cost, target_peaks(point["target"])))
        assert point["ratio"] == pytest.approx(point["projected_s"] / point["measured_s"])
        assert sum(f for f, _ in point["by_class"].values()) == pytest.approx(point["flops"])
        assert sum(b for _, b in point["by_class"].values()) == pytest.approx(point["bytes"])
        # one more step profiled: its kernels' times by class sum to their busy time, within the step
        profile = point["profile"]
        assert profile["kernels"] > 0 and set(profile["by_class_ms"]) == {"attention", "grouped_matmul", "xla"}
        assert sum(profile["by_class_ms"].values()) == pytest.approx(profile["busy_ms"]) and profile["busy_ms"] > 0
        assert sum(profile["by_class_kernels"].values()) == profile["kernels"]
    assert "measured step (profiled)" in (out / "report.md").read_text()
    # the headline's classes with their profiled kernel counts and the time a kernel of each
    ratio_lines = (out / "report.md").read_text().split("## The ratio")[1].splitlines()
    assert any(re.search(r"^- xla: [\d.]+ ms in \d+ kernels \([\d.]+ us each\)", line) for line in ratio_lines)
    # report.md projects each point with the calibration the kernel rows and the profiles gave,
    # whichever part ran first: each class at least its profiled kernels x the time a launch
    found = data["calibration"]
    calibration = Calibration("report", found["fractions"], found["launch_seconds"])
    assert found["launch_seconds"] > 0 and found["launch_source"].startswith("e2e/B=")
    point = units["e2e/B=2,k=1"]
    cost = StepCost(flops=point["flops"], bytes_accessed=point["bytes"], compile_seconds=0.0,
                    by_class={k: tuple(v) for k, v in point["by_class"].items()},
                    launches=point["profile"]["by_class_kernels"])
    calibrated = step_seconds(cost, target_peaks(point["target"]), calibration)
    assert calibrated != pytest.approx(point["projected_s"])
    v32_section = (out / "report.md").read_text().split("## End-to-end decode step")[1].split("## DeepSeek-V4")[0]
    [row] = [line for line in v32_section.splitlines() if line.startswith("| 2 | 1 |")]
    assert row.split(" | ")[5] == f"{calibrated * 1e3:.2f}"


def test_second_run_skips_what_is_recorded(smoke_report):
    out, data = smoke_report
    done = run_report(out, "--parts", "kernels,e2e")
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "report.json") as f:
        again = json.load(f)
    assert len(again["runs"]) == len(data["runs"]) + 1
    (before,), (after,) = data["devices"].values(), again["devices"].values()
    assert {k: v["recorded"] for k, v in after.items()} == {k: v["recorded"] for k, v in before.items()}
    # and the calibration file it wrote is what projection.py --calibration reads
    calibration = load_calibration(str(out / "report.json"))
    assert set(calibration.fractions) == {"attention", "grouped_matmul", "xla"}


def test_calibrated_step_divides_each_class_by_its_fraction():
    bandwidth, peak = 1e12, 1e15
    cost = StepCost(flops=3e12, bytes_accessed=6e9, compile_seconds=0.0, collective_bytes=4.5e8,
                    by_class={"attention": (1e12, 1e9), "grouped_matmul": (0.0, 4e9), "xla": (2e12, 1e9)})
    # roofline of the totals: max(6 ms, 3 ms) + 1 ms of collectives at 450 GB/s
    assert step_seconds(cost, (bandwidth, peak)) == pytest.approx(7e-3)
    every_class = {"attention": 1.0, "grouped_matmul": 1.0, "xla": 1.0}
    # per class: attention max(1, 1) + grouped max(4, 0) + xla max(1, 2) ms, + 1 ms
    assert step_seconds(cost, (bandwidth, peak), Calibration("all", every_class)) == pytest.approx(8e-3)
    halved = Calibration("half", {**every_class, "grouped_matmul": 0.5, "collectives": 0.25})
    assert step_seconds(cost, (bandwidth, peak), halved) == pytest.approx((1 + 8 + 2 + 4) * 1e-3)
    # a launch's time: a class takes at least its launches x 1 us (XLA's 3,000: 3 ms over its 2);
    # without counted launches the term is absent
    launched = dataclasses.replace(cost, launches={"attention": 10, "grouped_matmul": 100, "xla": 3000})
    assert step_seconds(launched, (bandwidth, peak), Calibration("launch", {}, 1e-6)) == pytest.approx(9e-3)
    assert step_seconds(launched, (bandwidth, peak), halved._replace(launch_seconds=1e-6)) == pytest.approx(16e-3)
    assert step_seconds(cost, (bandwidth, peak), Calibration("launch", every_class, 1e-6)) == pytest.approx(8e-3)


def test_a_projected_step_is_the_full_depth_compile_and_refuses_recomputation(monkeypatch):
    """`projection.step_cost` costs the program `compile_model` compiled, launches included, and
    refuses one where XLA recomputed values to fit the device (its costs would count them)."""
    compiled = jax.jit(lambda x: jnp.tanh(x @ x)).lower(jnp.ones((8, 8))).compile()
    seen = {}
    monkeypatch.setattr(projection, "compile_model", lambda config, decode, **point: seen.update(point) or compiled)
    monkeypatch.setattr(projection.aot, "op_class_launches", lambda _: {"attention": 0, "grouped_matmul": 0, "xla": 2})
    cost = projection.step_cost("config", "decode", batch=4, context=64, devices="d", dtype=jnp.bfloat16)
    assert seen == dict(phase="decode", batch=4, context=64, devices="d", dtype=jnp.bfloat16)
    assert cost.flops == projection.aot.program_cost(compiled).flops > 0 and cost.launches["xla"] == 2
    remat = dataclasses.replace(projection.aot.program_cost(compiled), rematerialized=3)
    monkeypatch.setattr(projection.aot, "program_cost", lambda _: remat)
    with pytest.raises(RuntimeError, match="rematerialized 3 instructions"):
        projection.step_cost("config", "decode", batch=4, context=64, devices="d", dtype=jnp.bfloat16)


@pytest.mark.parametrize("content, message", [({"calibration": {"label": "x"}}, "no"),
                                              ({"calibration": {"fractions": {"moe": 0.5}}}, "classes must be"),
                                              ({"calibration": {"fractions": {"xla": 0.0}}}, r"in \(0, 1.5\]"),
                                              ({"calibration": {"fractions": {}, "launch_seconds": 0}},
                                               r"launch_seconds 0: must be in \(0, 0.001\]"),
                                              ({"calibration": {"fractions": {}, "launch_seconds": "2us"}},
                                               "launch_seconds '2us'")])
def test_load_calibration_refuses_what_it_cannot_use(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load_calibration(str(path))


def test_calibration_is_roofline_over_measured_time_per_class():
    report = gpu_report.Report.__new__(gpu_report.Report)
    report.device, report.data = "NVIDIA H100 80GB HBM3", {}
    bandwidth, peak = target_peaks("h100")
    row = lambda op, impl, seconds, nbytes, device=None: dict(op=op, impl=impl, seconds=seconds, bytes=nbytes,
                                                              flops=1.0, device_seconds=device)
    report.units = {  # one unit per op: their rows calibrate together
        "kernels/mla_attention": {"json": {"rows": [row("mla_attention", "pallas", 2e-3, bandwidth * 1e-3),
                                                    row("mla_attention", "xla", 1.0, 1.0)]}},  # a reference: not the kernel's class
        # a call's dispatch (5 ms by the wall clock) is not the kernel's time (2 ms on the device)
        "kernels/indexer_scores": {"json": {"rows": [row("indexer_scores", "pallas", 5e-3, bandwidth * 3e-3, 2e-3)]}},
        "moe": {"json": {"rows": [row("moe_layer", "pallas", 1e-3, bandwidth * 0.9e-3)]}},
    }
    found = gpu_report.calibration(report)
    assert found["fractions"] == pytest.approx({"attention": 1.0, "grouped_matmul": 0.9})
    assert found["not_measured"] == ["collectives", "xla"]


def test_a_launchs_time_comes_from_the_profile_of_the_fewest_tokens_and_floors_each_class(tmp_path):
    """The calibration's time a launch is the mean of XLA's kernels in the e2e profile with the
    fewest tokens a step among those that counted their kernels (B 1, k = 3 here: a B 1, k = 0
    profile recorded before the counts has none), with no benchmark rows needed; it reaches
    `projection.py --calibration`, and a profiled point's calibrated step counts its own kernels."""
    report = gpu_report.Report.__new__(gpu_report.Report)
    report.device, report.data = "NVIDIA H100 80GB HBM3", {}
    profile = lambda xla_ms, xla_kernels: {"by_class_ms": {"attention": 1.0, "grouped_matmul": 2.0, "xla": xla_ms},
                                           "by_class_kernels": {"attention": 5, "grouped_matmul": 20,
                                                                "xla": xla_kernels}}
    point = lambda batch, drafts, found: {"batch": batch, "drafts": drafts, "profile": found, "flops": 0.0,
                                          "bytes": 0.0, "target": "h100",
                                          "by_class": {"attention": [0, 0], "grouped_matmul": [0, 0], "xla": [0, 0]}}
    report.units = {"e2e/B=32,k=3": point(32, 3, profile(10.0, 1000)),
                    "e2e/B=1,k=3": point(1, 3, profile(4.0, 2000)),
                    "e2e/B=1,k=0": point(1, 0, {"by_class_ms": {"xla": 1.0}})}
    found = gpu_report.calibration(report)
    assert found["launch_seconds"] == pytest.approx(2e-6) and found["launch_source"] == "e2e/B=1,k=3"
    assert found["fractions"] == {}
    # a point of no bytes is its launches: (5 + 20 + 1000) x 2 us
    assert gpu_report.calibrated_seconds(report.units["e2e/B=32,k=3"], found) == pytest.approx(1025 * 2e-6)
    assert gpu_report.calibrated_seconds(report.units["e2e/B=1,k=0"], found) == 0.0  # no counts: no floor
    (tmp_path / "report.json").write_text(json.dumps({"calibration": found}))
    assert load_calibration(str(tmp_path / "report.json")).launch_seconds == pytest.approx(2e-6)
    del report.units["e2e/B=1,k=3"], report.units["e2e/B=32,k=3"]
    assert gpu_report.calibration(report) is None


def test_attention_calibrates_from_the_kernels_auto_runs_on_the_device(monkeypatch):
    """Once a measurement moves an op's "auto" to its Mosaic kernel (`backend.AUTO_KERNELS`), the
    attention class is calibrated from that op's Mosaic rows, on that device only: what the e2e
    step, which runs backend="auto", then runs."""
    report = gpu_report.Report.__new__(gpu_report.Report)
    report.data = {}
    bandwidth, _ = target_peaks("h100")
    row = lambda op, impl, seconds: dict(op=op, impl=impl, seconds=seconds, bytes=bandwidth * 1e-3, flops=1.0)
    rows = [row("mla_attention", "pallas", 4e-3), row("mla_attention", "mosaic", 2e-3),
            row("indexer_scores", "pallas", 1e-3), row("indexer_scores", "mosaic", 5e-3)]
    report.units = {"kernels": {"json": {"rows": rows}}}
    monkeypatch.setitem(gpu_report.AUTO_KERNELS, "NVIDIA H100 80GB HBM3", {"mla_attention": "mosaic"})
    report.device = "NVIDIA H100 80GB HBM3"  # Mosaic MLA (2 ms) and Triton indexer (1 ms)
    assert gpu_report.calibration(report)["fractions"]["attention"] == pytest.approx(2e-3 / 3e-3)
    monkeypatch.setitem(gpu_report.AUTO_KERNELS, "NVIDIA H200", {})
    report.device = "NVIDIA H200"  # no entry: Triton for both (4 ms and 1 ms), against the H200's bandwidth
    roofline = 2 * bandwidth * 1e-3 / target_peaks("h200")[0]
    assert gpu_report.calibration(report)["fractions"]["attention"] == pytest.approx(roofline / 5e-3)


def test_suite_log_records_each_test_as_it_finishes(tmp_path):
    """The `suite_log` plugin, in a real pytest run under pytest-xdist as the suite part runs it
    (without xdist, the smoke run's `--collect-only` reads its collected tests): the collected
    tests, then every phase's outcome, read back per module by `suite_outcomes` (a failure with
    its phase and message, a skip with its reason; a module-level fixture error fails its tests),
    and the programs a module's tests compiled, with the seconds that took."""
    (tmp_path / "test_a.py").write_text(
        "import pytest\n"
        "def test_one(): pass\n"
        "def test_jits():\n"
        "    import jax\n"
        "    assert float(jax.jit(lambda x: x * 3 + 1)(2.0)) == 7.0\n"
        "def test_two(): assert 1 == 2, 'boom'\n"
        "@pytest.mark.skip(reason='needs a GPU')\n"
        "def test_three(): pass\n")
    (tmp_path / "test_b.py").write_text(
        "import pytest\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('no device')\n"
        "def test_four(broken): pass\n")
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "JAXSPEC_SUITE_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "benchmarks"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_log",
                           "-n", "2", "test_a.py", "test_b.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    collected, found = suite_log.suite_outcomes(str(log))
    assert collected == {"test_a.py": 4, "test_b.py": 1}
    a, b = found["test_a.py"], found["test_b.py"]
    assert (a["passed"], a["failed"], a["skipped"]) == (2, 1, 1)
    assert a["programs"] >= 1 and a["compile_seconds"] > 0 and a["trace_seconds"] > 0
    assert (b["programs"], b["compile_seconds"]) == (0, 0)
    assert a["failures"][0].startswith("test_two (call): ") and "boom" in a["failures"][0]
    assert "needs a GPU" in a["skips"][0]
    assert b["failed"] == 1 and b["failures"][0].startswith("test_four (setup): ") and "no device" in b["failures"][0]


def suite_log_lines(finished: dict[str, str], running: list[str], collected: list[str]) -> list[dict]:
    """A `suite_log` file's lines: `collected`, then each finished test's phases (its call's
    outcome as given, 3 programs compiled in 0.75 s and traced in 0.25 s), then the setup and call
    of the tests still running."""
    lines = [{"collected": collected}]
    for nodeid, outcome in finished.items():
        lines += [{"nodeid": nodeid, "when": "setup", "outcome": "passed", "seconds": 0.5, "message": ""},
                  {"nodeid": nodeid, "when": "call", "outcome": outcome, "seconds": 1.0,
                   "message": "AssertionError: off" if outcome == "failed" else "", "compile_seconds": 0.75,
                   "trace_seconds": 0.25, "programs": 3},
                  {"nodeid": nodeid, "when": "teardown", "outcome": "passed", "seconds": 0.0, "message": ""}]
    for nodeid in running:
        lines += [{"nodeid": nodeid, "when": "setup", "outcome": "passed", "seconds": 0.5, "message": ""}]
    return lines


def fake_suite_run(lines: list[dict], result: dict, calls: list | None = None):
    """A `gpu_report.run` stand-in that writes `lines` to the suite's log and returns `result`."""
    def fake_run(argv, clock, env=None, limit=None, progress=None):
        assert env["JAXSPEC_TEST_ORDER"] == "lightest-first" and progress == env["JAXSPEC_SUITE_LOG"]
        if calls is not None:
            calls.append([a for a in argv if a.startswith("tests")])
        if lines:
            with open(env["JAXSPEC_SUITE_LOG"], "w") as f:
                f.write("".join(json.dumps(line) + "\n" for line in lines))
        return {"returncode": None, "output": "", **result}
    return fake_run


def test_the_suite_runs_its_modules_in_the_order_asked(monkeypatch):
    """conftest.py orders the tests heaviest module first (CI's balance across workers), or
    lightest first under JAXSPEC_TEST_ORDER=lightest-first (the GPU report's suite part): its hook
    on stand-in items both ways, then a real collection under the variable."""
    import pathlib

    import conftest

    class Item:
        def __init__(self, name):
            self.path, self.keywords = pathlib.Path("tests", name), {}

    heaviest = [conftest.HEAVIEST_FIRST[4], conftest.HEAVIEST_FIRST[-1], "test_config.py"]  # listed 5th, last; unlisted
    assert "test_config.py" not in conftest.HEAVIEST_FIRST
    for lightest, want in ((False, heaviest), (True, heaviest[::-1])):
        monkeypatch.setattr(conftest, "LIGHTEST_FIRST", lightest)
        items = [Item(name) for name in (heaviest[1], heaviest[2], heaviest[0])]  # neither order
        conftest.pytest_collection_modifyitems(None, items)
        assert [item.path.name for item in items] == want
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXSPEC_TEST_ORDER": "lightest-first"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *[f"tests/{name}" for name in heaviest]], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    seen = list(dict.fromkeys(line.split("::")[0] for line in done.stdout.splitlines() if "::" in line))
    assert seen == [f"tests/{name}" for name in heaviest[::-1]]


def test_a_suite_run_the_clock_ends_keeps_the_modules_that_finished_and_notes_the_others(tmp_path, monkeypatch):
    """A run ended by the clock records the modules whose every test finished (from the log its
    pytest wrote as it went) and runs the others again next time; one cut in the middle is noted
    with what had finished (its failures and slowest tests) and shown in report.md."""
    modules = ["test_a.py", "test_b.py", "test_c.py"]
    monkeypatch.setattr(gpu_report, "test_modules", lambda: modules)
    calls = []
    lines = suite_log_lines({"tests/test_a.py::t1": "passed", "tests/test_a.py::t2": "passed",
                             "tests/test_b.py::t4": "failed"}, ["tests/test_b.py::t3"],
                            ["tests/test_a.py::t1", "tests/test_a.py::t2", "tests/test_b.py::t3",
                             "tests/test_b.py::t4", "tests/test_c.py::t5"])
    monkeypatch.setattr(gpu_report, "run", fake_suite_run(lines, {"seconds": 200.0, "timed_out": True, "hung": False},
                                                          calls))
    report = gpu_report.Report(str(tmp_path), "NVIDIA H100 80GB HBM3")
    report.data["runs"].append({"started": "now"})
    gpu_report.part_suite(report, gpu_report.Clock(600.0), benchmark_args(suite_chunk=None))
    assert calls == [["tests/test_c.py", "tests/test_b.py", "tests/test_a.py"]]  # one run, lightest first
    assert report.has("suite/test_a.py") and not report.has("suite/test_b.py") and not report.has("suite/test_c.py")
    assert report.units["suite/test_a.py"]["passed"] == 2 and report.units["suite/test_a.py"]["seconds"] == 3.0
    partial = report.units["suite/test_b.py"]
    assert partial["incomplete"] and (partial["finished"], partial["collected"], partial["failed"]) == (1, 2, 1)
    assert partial["running"] == ["t3"] and partial["slowest"] == [["t4", 1.5]]
    assert "suite/test_c.py" not in report.units
    assert report.data["runs"][-1]["cut"] == ["suite: 2 modules unfinished after 200 s"]
    text = gpu_report.markdown(report)
    assert "| test_a.py | 2 | 0 | 0 | 3 | 2 | 0 | 6 |" in text  # compile 1.5 s, trace 0.5 s, 6 programs
    assert ("- test_b.py: 1 of 2 tests in 2 s, 1 s of it compiling 3 programs (0 passed, 1 failed, 0 skipped); "
            "slowest: t4 2 s") in text
    assert "  - failed: t4 (call): AssertionError: off" in text
    assert re.search(r"Not run yet: [^\n]*test_c\.py", text) and "Not run yet: test_b" not in text


def test_suite_log_prints_where_a_runs_time_went(tmp_path, capsys):
    """`python benchmarks/suite_log.py LOG`: the finished modules slowest first, each with its
    seconds compiling and its programs, under the run's totals; --top keeps the slowest."""
    log = tmp_path / "run.jsonl"
    lines = suite_log_lines({"tests/test_a.py::t1": "passed", "tests/test_b.py::t2": "passed",
                             "tests/test_b.py::t3": "failed"}, [], ["tests/test_a.py::t1", "tests/test_b.py::t2",
                                                                    "tests/test_b.py::t3"])
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert suite_log.main([str(log), "--top", "1"]) == 0
    header, total, *modules = capsys.readouterr().out.splitlines()
    assert total.split() == ["4", "2", "1", "9", "all"]  # 1.5 s a test; 0.75 s compiling, 3 programs
    assert [row.split() for row in modules] == [["3", "2", "0", "6", "test_b.py"]]
    with pytest.raises(SystemExit):
        suite_log.main([str(log), "--top", "-1"])


def test_every_benchmark_units_gpu_command_parses(monkeypatch, tmp_path):
    """The command each benchmark unit runs on a GPU (not its smoke command) is accepted by its
    script's own parser: a misspelt flag would otherwise cost a lent GPU's call. Each script's
    main parses, then asks `gpu_or_smoke`, which here says no, so nothing is measured."""
    import importlib

    asked = []

    def decline(script, smoke):
        asked.append((script, smoke))
        return False

    def no_gpu(binary, *args):  # flashmla.py's gate: its harness's first call, the copy baseline
        asked.append((binary, False))
        raise RuntimeError("no GPU")

    commands = [argv for units in gpu_report.BENCHMARK_UNITS.values() for _, argv, _ in units
                if argv[0] != "benchmarks/exactness.py"]  # exactness runs anywhere: its command is --json only
    for argv in commands:
        module = importlib.import_module(os.path.basename(argv[0])[:-len(".py")])
        if argv[0] == "benchmarks/flashmla.py":
            monkeypatch.setattr(module, "run_binary", no_gpu)
        else:
            monkeypatch.setattr(module, "gpu_or_smoke", decline)
        assert module.main([a.replace("{json}", str(tmp_path / "rows.json")) for a in argv[1:]]) in (1, 2), argv
    assert len(asked) == len(commands) and not any(smoke for _, smoke in asked)
    assert gpu_report.BENCHMARK_UNITS["exactness"][0][1][1:] == ["--json", "{json}"]


def test_the_runbooks_parts_are_parts():
    """Every `--parts` and `--redo` list docs/gpu-testing.md gives (the runbook's calls among
    them) names parts the report has, each at most once: a call that failed on its flags would
    spend a lent GPU's start for nothing."""
    import re

    with open(os.path.join(REPO, "docs", "gpu-testing.md")) as f:
        lists = re.findall(r"--(parts|redo) ([a-z0-9_]+[a-z0-9_:.,/]*)", f.read())
    assert len(lists) >= 4  # the examples, and the runbook's two calls and its --redo
    for flag, text in lists:  # a sentence's full stop is not the list's
        (gpu_report.parse_parts if flag == "parts" else gpu_report.parse_redo)(text.rstrip(".,"))


def test_failed_units_are_kept_and_run_again_only_when_asked(tmp_path):
    report = gpu_report.Report(str(tmp_path), "NVIDIA H100 80GB HBM3")
    report.record("kernels", {"returncode": 0}, ok=True)
    report.record("moe", {"returncode": 1}, ok=False)
    assert report.has("kernels") and report.has("moe") and not report.has("matmuls")
    again = gpu_report.Report(str(tmp_path), "NVIDIA H100 80GB HBM3", retry_failed=True)
    assert again.has("kernels") and not again.has("moe")
    other = gpu_report.Report(str(tmp_path), "NVIDIA H200")  # another device measures everything itself
    assert not other.has("kernels")


def test_kernel_benchmark_reads_fp8_caches(tmp_path):
    """`benchmarks/attention_kernels.py --cache-dtype fp8` (smoke, Triton kernels only): every row says so,
    and the bytes an op must move are its FP8 slots' (sparse MLA at the smoke widths: 128 e4m3
    values, one float32 scale, 64 bfloat16 RoPE values = 260 bytes a slot, beside 384 in bfloat16;
    the indexer: 64 e4m3 values and their scale = 68 bytes a key, beside 128)."""
    import attention_kernels
    path = tmp_path / "rows.json"
    argv = ["--smoke", "--ops", "sparse_mla", "indexer_scores", "v4_hca", "--no-xla", "--no-mosaic",
            "--json", str(path)]
    op_bytes = {}
    for cache_dtype in ("fp8", None):
        assert attention_kernels.main(argv + (["--cache-dtype", cache_dtype] if cache_dtype else [])) == 0
        rows = json.loads(path.read_text())["rows"]
        assert {row["cache_dtype"] for row in rows} == {cache_dtype or "bfloat16"}
        assert {row["op"] for row in rows} == {"sparse_mla", "indexer_scores", "indexer_topk", "v4_hca"}
        op_bytes[cache_dtype] = {row["op"]: row["bytes"] for row in rows if row["impl"] == "pallas"}
    dims, (batch, context, queries) = attention_kernels.SMOKE, (2, 128, 2)
    selected = batch * queries * dims.topk  # every token's top-k slots, each read with its index
    assert op_bytes[None]["sparse_mla"] - op_bytes["fp8"]["sparse_mla"] == selected * (384 - 260)
    assert op_bytes[None]["indexer_scores"] - op_bytes["fp8"]["indexer_scores"] == batch * context * (128 - 68)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_e2e_steps_random_scales_follow_the_configs_scale_fmt(scale_fmt):
    """The e2e step's FP8 model (its scales drawn so a projection keeps unit size): powers of two
    for a "ue8m0" config, as V3.2's (the grouped matmuls' bfloat16 route then runs), the unit-size
    value itself otherwise; either way within a factor of 2^0.5 of it."""
    import e2e_step
    from flax import nnx

    model = e2e_step.random_fp8_model(e2e_step.shallow(e2e_step.preset("tiny", scale_fmt=scale_fmt), 2))
    scales = {jax.tree_util.keystr(path): np.asarray(leaf)
              for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model))
              if "scale_inv" in jax.tree_util.keystr(path)}
    assert len(scales) > 10
    assert all(np.all(np.frexp(scale)[0] == 0.5) for scale in scales.values()) == (scale_fmt == "ue8m0")
    for name, scale in scales.items():
        unit = 1.0 / (e2e_step.FP8_RMS * np.sqrt(scale.shape[-2] * 128))
        assert np.all(np.abs(np.log2(scale / unit)) <= 0.5 + 1e-6), name


def test_e2e_step_runs_a_chosen_backend_on_fp8_caches_filled_at_random(tmp_path, monkeypatch):
    """`benchmarks/e2e_step.py --backend pallas --cache-dtype fp8 --unroll-layers` (smoke): the
    caches it times are FP8 pools holding random quantized entries (every page, both caches), the
    step it compiles has its layers unrolled, its point records the backend, cache dtype and
    unrolling, and a point of other settings already in the JSON file is kept."""
    import e2e_step

    from jaxspec.pallas_kernels.fp8_cache import Fp8Pool, entries

    random_caches, draws = e2e_step._random_caches, []

    def inspected(state, key):  # the point's own caches, read before the step donates them
        state = random_caches(state, key)
        pools = [pool for cache in (state.target_cache, state.mtp_cache) for pool in (cache.latent, cache.index_keys)]
        assert len(pools) == 4 and all(isinstance(pool, Fp8Pool) for pool in pools)
        for pool in pools:
            values = np.asarray(entries(pool), np.float32)  # [L, P, page, width]: dequantized by the pool's scales
            assert (values.std(axis=(-2, -1)) > 0.5).all()  # every page of every layer drawn, at unit scale
            assert (np.asarray(pool.scales) > 0).all()
        draws.append(key)
        return state

    monkeypatch.setattr(e2e_step, "_random_caches", inspected)
    compiled_configs = []
    step = e2e_step._step

    def traced_step(graphdef, params, state, *, config):  # the step as compiled: its DecodeConfig
        compiled_configs.append(config)
        return step(graphdef, params, state, config=config)

    monkeypatch.setattr(e2e_step, "_step", traced_step)
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"earlier": {"batch": 1}}))
    argv = ["--smoke", "--points", "2,1", "--iters", "1", "--backend", "pallas", "--cache-dtype", "fp8",
            "--tiles", "k64-split", "--auto", "grouped_matmul=mosaic", "--unroll-layers", "--json", str(path)]
    assert e2e_step.main(argv) == 0
    assert len(draws) == 1  # the one point's caches were drawn, and checked
    assert compiled_configs and all(config.unroll_layers for config in compiled_configs)
    points = json.loads(path.read_text())
    assert points["earlier"] == {"batch": 1}
    [(key, point)] = [(k, v) for k, v in points.items() if k != "earlier"]
    assert (point["backend"], point["cache_dtype"], point["tiles"], point["batch"], point["drafts"]) == (
        "pallas", "fp8", "k64-split", 2, 1)
    assert point["auto"] == {"grouped_matmul": "mosaic"} and point["unrolled"] is True
    assert key.endswith(",tiles=k64-split,auto=grouped_matmul=mosaic,unrolled")
    assert point["measured_s"] > 0 and point["bytes"] > 0 and point["model"] == "tiny"


def test_e2e_step_times_a_v4_step_on_caches_filled_at_random(tmp_path, monkeypatch):
    """`benchmarks/e2e_step.py --v4` (smoke: tiny-v4, one draft): every cache array of both V4
    caches that holds values (the window rings, the CSA and HCA entries and the compressors' states) is drawn
    at random, every layer of it, and the point names its model in its record and its key."""
    import e2e_step

    random_caches, drawn = e2e_step._random_caches, []

    def inspected(state, key):  # the point's own caches, read before the step donates them
        state = random_caches(state, key)
        # the target's layers have every kind (window, CSA and HCA entries and states), the MTP block a window
        for cache, kinds in ((state.target_cache, 5), (state.mtp_cache, 1)):
            arrays = [leaf for leaf in jax.tree.leaves(cache) if jnp.issubdtype(leaf.dtype, jnp.floating)]
            assert len(arrays) >= kinds
            for array in arrays:  # [L, ...]: each layer's slice at unit scale
                assert (np.asarray(array, np.float32).reshape(array.shape[0], -1).std(axis=1) > 0.5).all()
        drawn.append(key)
        return state

    monkeypatch.setattr(e2e_step, "_random_caches", inspected)
    path = tmp_path / "e2e.json"
    # the smoke report's e2e_v4 point: one program for both (the persistent compilation cache's)
    assert e2e_step.main(["--smoke", "--v4", "--points", "2,1", "--iters", "1", "--json", str(path)]) == 0
    assert len(drawn) == 1
    [(key, point)] = json.loads(path.read_text()).items()
    assert key.endswith(",model=tiny-v4") and point["model"] == "tiny-v4" and point["layers"] == 4
    assert point["measured_s"] > 0 and point["bytes"] > 0


def test_the_gmm_part_times_the_step_with_its_variants_beside_the_default(tmp_path, monkeypatch):
    """The gmm part's e2e points run e2e_step.py once per GMM_E2E_VARIANTS entry (--auto
    grouped_matmul=mosaic, then --tiles k64-int and GMM_E2E_TILES), are recorded under the gmm
    part (so --redo gmm measures them again, and the e2e part's points stay the default's), and
    report.md sets each beside the default's point."""
    calls = []

    def fake_run(argv, clock, env=None, limit=None):
        calls.append(argv)
        path = argv[argv.index("--json") + 1]
        rest = argv[argv.index("--points") + 1:]
        asked = rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]
        points = {f"B={b},k={k}": dict(batch=int(b), drafts=int(k), measured_s=0.05,
                                      profile={"by_class_ms": {"grouped_matmul": 30.0}})
                  for b, k in (point.split(",") for point in asked)}
        with open(path, "w") as f:
            json.dump(points, f)
        return {"returncode": 0, "timed_out": False, "seconds": 1.0}

    monkeypatch.setattr(gpu_report, "run", fake_run)
    report = gpu_report.Report(str(tmp_path), "NVIDIA H200")
    report.data["runs"].append({"started": "now"})
    for variant in gpu_report.GMM_E2E_VARIANTS:
        gpu_report.part_e2e(report, gpu_report.Clock(None), benchmark_args(), variant)
    mosaic_argv, *tiles_argvs = calls  # the Mosaic step first: it decides the op's AUTO_KERNELS entry
    assert [argv[argv.index("--tiles") + 1] for argv in tiles_argvs] == ["k64-int", gpu_report.GMM_E2E_TILES]
    assert not any("--auto" in argv for argv in tiles_argvs)
    assert mosaic_argv[mosaic_argv.index("--auto") + 1] == "grouped_matmul=mosaic" and "--tiles" not in mosaic_argv
    for variant in gpu_report.GMM_E2E_VARIANTS:
        units = [f"gmm/e2e-{variant}/B={b},k={k}" for b, k in gpu_report.GMM_E2E_POINTS]
        assert all(report.has(unit) and gpu_report.unit_part(unit) == "gmm" for unit in units)
    assert not [unit for unit in report.units if unit.startswith("e2e/")]
    report.units["e2e/B=32,k=3"] = {"batch": 32, "drafts": 3, "measured_s": 0.0968, "ok": True}
    lines = gpu_report.tile_variant_lines(report.units)
    for variant in gpu_report.GMM_E2E_VARIANTS:
        assert f"| {variant} | 32 | 3 | 50.00 | 96.80 | 30.00 |" in lines
        assert f"| {variant} | 1 | 0 | 50.00 | - | 30.00 |" in lines
    for variant in gpu_report.GMM_E2E_VARIANTS:
        gpu_report.part_e2e(report, gpu_report.Clock(None), benchmark_args(), variant)
    assert len(calls) == len(gpu_report.GMM_E2E_VARIANTS)  # recorded with profiles: not run again


def test_the_gmm_part_runs_the_mosaic_step_then_the_layers_then_the_tile_variants_step(monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_report, "part_e2e", lambda report, clock, args, variant: calls.append(variant))
    monkeypatch.setattr(gpu_report, "part_benchmark", lambda name, report, clock, args: calls.append(name))
    gpu_report.part_gmm(None, gpu_report.Clock(None), benchmark_args())
    assert calls == ["mosaic", "gmm", "k64-int", gpu_report.GMM_E2E_TILES]


def test_parts_run_in_the_order_given_each_within_its_seconds():
    assert gpu_report.parse_parts("e2e:200, suite,kernels:90.5") == [("e2e", 200.0), ("suite", None), ("kernels", 90.5)]
    for bad in ("e2e,gpu", "e2e:0", "e2e:soon", "e2e,e2e:5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--parts"):
            gpu_report.parse_parts(bad)
    deadline = gpu_report.Clock(100.0)
    assert 9.0 < deadline.within(10.0).left() <= 10.0  # the part's share ends first
    assert 99.0 < deadline.within(1000.0).left() <= 100.0  # the deadline ends first
    assert 99.0 < deadline.within(None).left() <= 100.0
    assert gpu_report.Clock(None).within(None).left() is None


SLEEPER = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]


def test_a_run_ended_by_the_clock_is_unfinished_and_one_ended_by_its_limit_hung():
    cut = gpu_report.run(SLEEPER, gpu_report.Clock(1.0), limit=60.0)
    assert (cut["timed_out"], cut["hung"], cut["returncode"]) == (True, False, None) and cut["seconds"] < 30
    hung = gpu_report.run(SLEEPER, gpu_report.Clock(60.0), limit=1.0)
    assert (hung["timed_out"], hung["hung"]) == (False, True) and "started" in hung["output"]
    done = gpu_report.run([sys.executable, "-c", "print('hi')"], gpu_report.Clock(60.0), limit=60.0)
    assert (done["timed_out"], done["hung"], done["returncode"]) == (False, False, 0)


def test_a_run_with_a_progress_file_is_hung_only_when_the_file_stops_changing(tmp_path):
    """With `progress` the limit is on silence: a command that keeps appending to the file runs
    past the limit to its end; one that stops appending is ended as hung."""
    log = tmp_path / "progress"
    writer = ("import sys, time\nfor i in range({n}):\n    open(sys.argv[1], 'a').write('x')\n    time.sleep(0.15)\n"
              "time.sleep({rest})")
    busy = gpu_report.run([sys.executable, "-c", writer.format(n=12, rest=0), str(log)], gpu_report.Clock(60.0),
                          limit=0.7, progress=str(log))
    assert (busy["timed_out"], busy["hung"], busy["returncode"]) == (False, False, 0) and busy["seconds"] > 1.5
    log.unlink()
    stalled = gpu_report.run([sys.executable, "-c", writer.format(n=2, rest=60), str(log)], gpu_report.Clock(60.0),
                             limit=0.7, progress=str(log))
    assert (stalled["timed_out"], stalled["hung"], stalled["returncode"]) == (False, True, None)
    assert stalled["seconds"] < 10


def benchmark_args(**kwargs):
    return type("Args", (), {"smoke": False, "unit_timeout": 60.0, "workers": 2, "suite_chunk": 2, **kwargs})()


def test_a_benchmark_cut_short_keeps_its_rows_and_runs_again_and_one_that_hangs_is_a_failure(tmp_path, monkeypatch):
    """A benchmark writes its rows as it goes: the clock ending it keeps them (incomplete: the next
    run measures the unit again); a benchmark past --unit-timeout is recorded failed and not run
    again unless asked, so a kernel that hangs on the device cannot take every later run's time."""
    rows = {"device": "x", "copy_bytes_per_s": 1e12, "failures": [],
            "rows": [dict(op="mla_attention", impl="pallas", batch=32, context=4096, queries=1, seconds=1e-3, bytes=1e9,
                          flops=1.0, max_error=4e-3)]}
    writer = ("import json, sys, time; json.dump(%r, open(sys.argv[1], 'w')); print('wrote', flush=True); "
              "time.sleep(60)" % rows)
    monkeypatch.setitem(gpu_report.BENCHMARK_UNITS, "kernels",
                        [("kernels/mla_attention", [sys.executable, "-c", writer, "{json}"], None)])
    report = gpu_report.Report(str(tmp_path), "NVIDIA H100 80GB HBM3")
    report.data["runs"].append({"started": "now"})
    clock = gpu_report.Clock(2.0)  # the writer starts and writes in a few tenths of a second
    clock.expired = lambda needed=0.0: False  # start the unit although under 30 s are left
    gpu_report.part_benchmark("kernels", report, clock, benchmark_args())
    record = report.units["kernels/mla_attention"]
    assert record["incomplete"] and record["json"]["rows"] == rows["rows"] and not record.get("hung")
    assert not report.has("kernels/mla_attention") and report.data["runs"][-1]["cut"]
    assert gpu_report.unit_rows(report.units, "kernels") == rows["rows"]  # measured rows already count
    gpu_report.part_benchmark("kernels", report, gpu_report.Clock(600.0), benchmark_args(unit_timeout=1.0))
    record = report.units["kernels/mla_attention"]
    assert record["hung"] and not record["ok"] and not record.get("incomplete")
    assert report.has("kernels/mla_attention")  # recorded: the next run goes past it
    assert not gpu_report.Report(str(tmp_path), report.device, retry_failed=True).has("kernels/mla_attention")
    text = gpu_report.markdown(report)
    assert "kernels/mla_attention: ended at --unit-timeout (a hang?)" in text


def test_a_suite_chunk_that_hangs_fails_its_modules_and_a_retry_runs_them_one_by_one(tmp_path, monkeypatch):
    modules = ["test_a.py", "test_b.py", "test_c.py"]
    monkeypatch.setattr(gpu_report, "test_modules", lambda: modules)
    calls = []
    # Nothing logged (a hang in collection): every module of the chunk is a suspect.
    monkeypatch.setattr(gpu_report, "run", fake_suite_run([], {"seconds": 60.0, "timed_out": False, "hung": True},
                                                          calls))
    report = gpu_report.Report(str(tmp_path), "NVIDIA H100 80GB HBM3")
    report.data["runs"].append({"started": "now"})
    gpu_report.part_suite(report, gpu_report.Clock(600.0), benchmark_args())
    assert calls == [["tests/test_c.py", "tests/test_b.py"], ["tests/test_a.py"]]
    assert all(report.units[f"suite/{m}"]["hung"] and report.units[f"suite/{m}"]["failed"] for m in modules)
    assert all(report.has(f"suite/{m}") for m in modules)  # not run again unless asked
    calls.clear()
    retry = gpu_report.Report(str(tmp_path), report.device, retry_failed=True)
    retry.data["runs"].append({})
    gpu_report.part_suite(retry, gpu_report.Clock(600.0), benchmark_args())
    assert calls == [["tests/test_c.py"], ["tests/test_b.py"], ["tests/test_a.py"]]


def test_a_suite_run_that_hangs_fails_the_modules_of_the_tests_it_was_running(tmp_path, monkeypatch):
    """No test finished for --unit-timeout: the modules of the tests that had started and not
    finished are failed as hung; a module that finished is kept, one not reached runs next time."""
    modules = ["test_a.py", "test_b.py", "test_c.py"]
    monkeypatch.setattr(gpu_report, "test_modules", lambda: modules)
    lines = suite_log_lines({"tests/test_c.py::t5": "passed"}, ["tests/test_b.py::t3"],
                            ["tests/test_a.py::t1", "tests/test_b.py::t3", "tests/test_c.py::t5"])
    monkeypatch.setattr(gpu_report, "run", fake_suite_run(lines, {"seconds": 90.0, "timed_out": False, "hung": True}))
    report = gpu_report.Report(str(tmp_path), "NVIDIA H100 80GB HBM3")
    report.data["runs"].append({"started": "now"})
    gpu_report.part_suite(report, gpu_report.Clock(600.0), benchmark_args(suite_chunk=None))
    hung = report.units["suite/test_b.py"]
    assert hung["hung"] and not hung["ok"] and "t3: no test finished for --unit-timeout 60 s" in hung["failures"][0]
    assert report.units["suite/test_c.py"]["passed"] == 1 and report.units["suite/test_c.py"]["ok"]
    assert not report.has("suite/test_a.py") and "suite/test_a.py" not in report.units


def test_redo_measures_the_named_parts_again_and_keeps_their_records_until_then(tmp_path):
    """`--redo moe,tiles,gather/sparse_mla` marks those parts' units (`unit_part` maps each unit to
    its part) and that unit stale: the next run measures them, and a run that does not reach them
    (here the clock ends at once) keeps their records, marked in report.md; the other units stay."""
    device = gpu_report.device_name()
    report = gpu_report.Report(str(tmp_path), device)
    for unit in ("moe", "kernels_block_n32", "kernels/mla_attention", "gather/sparse_mla"):
        report.record(unit, {"returncode": 0}, ok=True)
    report.record("suite/test_a.py", suite_log.empty_outcome(), ok=True)
    assert [gpu_report.unit_part(u) for u in [*report.units, "e2e/B=1,k=0", "mainjob/mtp3"]] == [
        "moe", "tiles", "kernels", "gather", "suite", "e2e", "mainjob"]
    assert gpu_report.main(["--out", str(tmp_path), "--redo", "moe,tiles,gather/sparse_mla", "--parts", "suite",
                            "--deadline", "0"]) == 0
    report = gpu_report.Report(str(tmp_path), device)
    assert set(report.units) == {"moe", "kernels_block_n32", "kernels/mla_attention", "gather/sparse_mla",
                                 "suite/test_a.py"}
    stale = {"moe", "kernels_block_n32", "gather/sparse_mla"}
    assert {u for u in report.units if not report.has(u)} == stale
    with open(tmp_path / "report.md") as f:
        assert "(`--redo`; shown until the next run measures them again): moe, kernels_block_n32, gather/sparse_mla." in f.read()
    report.record("moe", {"returncode": 0}, ok=True)
    assert report.has("moe") and not report.has("gather/sparse_mla")
    for names in ("moe,gpu", "kernels/nothing"):
        with pytest.raises(SystemExit):
            gpu_report.main(["--out", str(tmp_path), "--redo", names])


def test_kernel_benchmark_records_a_kernel_that_fails_on_the_device_and_goes_on(tmp_path, monkeypatch):
    """A Mosaic kernel that fails for any reason but refusing the shape (a compile or launch error
    on a GPU) is a failure in the JSON, beside the rows the other kernels measured; every row
    carries its error against the reference."""
    import attention_kernels

    def broken(*args, **kwargs):
        raise RuntimeError("mosaic launch failed")

    monkeypatch.setattr(attention_kernels, "mla_attention_mosaic", broken)
    path = tmp_path / "rows.json"
    assert attention_kernels.main(["--smoke", "--ops", "mla_attention", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    [failure] = data["failures"]
    assert (failure["op"], failure["impl"]) == ("mla_attention", "mosaic")
    assert failure["message"] == "RuntimeError: mosaic launch failed"
    impls = {row["impl"]: row for row in data["rows"]}
    assert set(impls) == {"pallas", "xla"}
    assert all(row["device_seconds"] > 0 for row in data["rows"])  # the profiler found each call's kernels
    assert 0 <= impls["pallas"]["max_error"] < 5e-2 and impls["xla"]["max_error"] is None


# A benchmark run whose Mosaic kernel never returns: a host callback that sleeps stands in for a
# kernel waiting on the device, the Triton kernel is the reference (fast to interpret), and the
# watchdog's limit is 1 s, as on a GPU (elsewhere it sets none).
HANGING_RUN = """
import sys, time
import jax, jax.numpy as jnp
import attention_kernels

def never_returns(q_nope, q_rope, latent_cache, page_table, vis, **options):
    wait = lambda x: (time.sleep(600), x)[1]
    out = jax.pure_callback(wait, jax.ShapeDtypeStruct(q_nope.shape, q_nope.dtype), q_nope)
    return out, jnp.zeros(q_nope.shape[:-1], jnp.float32)

attention_kernels.mla_attention_mosaic = never_returns
attention_kernels.mla_attention_pallas = attention_kernels.mla_attention_reference
attention_kernels.call_limit = lambda: 1.0
sys.exit(attention_kernels.main(["--smoke", "--ops", "mla_attention", "--json", sys.argv[1]]))
"""


def test_a_kernel_that_hangs_ends_its_benchmark_at_once_and_the_report_says_which(tmp_path):
    """On a GPU a Mosaic kernel's call gets `attention_kernels.CALL_SECONDS` once compiled
    (`attention_kernels.first_call`). One that never returns ends the run then, with status HUNG_EXIT and the
    hang in its JSON, not at the report's --unit-timeout minutes later (the subprocess' timeout is
    shorter than the sleep); report.md names the unit and the call."""
    path = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-c", HANGING_RUN, str(path)], cwd=os.path.join(REPO, "benchmarks"),
                          capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == gpu_report.HUNG_EXIT, done.stdout[-2000:] + done.stderr[-2000:]
    message = "hung: mla_attention mosaic at B 2, ctx 128, Q 2 did not return within 1 s"
    assert message in done.stdout.splitlines()
    data = json.loads(path.read_text())
    assert data["rows"] == [] and data["failures"] == [
        dict(op="mla_attention", impl="mosaic", batch=2, context=128, queries=2, message=message)]
    report = gpu_report.Report(str(tmp_path), "cpu")
    report.record("kernels/mla_attention", {"returncode": done.returncode, "hung": False, "json": data}, ok=False)
    text = gpu_report.markdown(report)
    assert "- kernels/mla_attention: exit 3: a call hung, and its watchdog ended the run" in text
    assert f"- mla_attention mosaic (B 2, ctx 128, Q 2): {message}" in text


def test_a_kernels_unit_a_mosaic_hang_ended_measures_its_other_kernels_again_at_once(tmp_path, monkeypatch):
    """An attention_kernels.py unit ended by a hung Mosaic call (exit HUNG_EXIT) runs again at once with
    --no-mosaic: its record has that run's rows, the Mosaic rows finished before the hang, and the
    hang, a failure (--retry-failed runs the whole unit again); other exits run nothing more."""
    def row(impl, batch):
        return dict(op="mla_attention", impl=impl, batch=batch, context=4096, queries=1, seconds=1e-3, bytes=1e9,
                    flops=1.0, max_error=None)

    hang = dict(op="mla_attention", impl="mosaic", batch=8, context=4096, queries=1, message="hung: ...")
    outputs = [(gpu_report.HUNG_EXIT, dict(rows=[row("pallas", 32), row("mosaic", 32)], failures=[hang])),
               (0, dict(rows=[row("pallas", 32), row("pallas", 8), row("xla", 8)], failures=[]))]
    commands = []

    def fake_run(argv, clock, env=None, limit=None, progress=None):
        commands.append(argv)
        returncode, rows = outputs[len(commands) - 1]
        json.dump({"device": "x", "copy_bytes_per_s": 1e12, **rows}, open(argv[argv.index("--json") + 1], "w"))
        return {"returncode": returncode, "seconds": 1.0, "output": "", "timed_out": False, "hung": False}

    monkeypatch.setattr(gpu_report, "run", fake_run)
    unit = ["benchmarks/attention_kernels.py", "--ops", "mla_attention", "--json", "{json}"]
    monkeypatch.setitem(gpu_report.BENCHMARK_UNITS, "kernels", [("kernels/mla_attention", unit, None)])
    report = gpu_report.Report(str(tmp_path), "NVIDIA H200")
    gpu_report.part_benchmark("kernels", report, gpu_report.Clock(600.0), benchmark_args())
    def without_json(argv):
        return [a for a in argv if not a.endswith("rows.json")]

    assert without_json(commands[1]) == without_json(commands[0]) + ["--no-mosaic"]
    record = report.units["kernels/mla_attention"]
    assert not record["ok"] and record["returncode"] == gpu_report.HUNG_EXIT
    assert record["json"]["rows"] == [row("pallas", 32), row("pallas", 8), row("xla", 8), row("mosaic", 32)]
    assert record["json"]["failures"] == [hang]
    del outputs[0]  # a unit that ends otherwise (here: exit 0) runs once
    commands.clear()
    (tmp_path / "other").mkdir()
    gpu_report.part_benchmark("kernels", gpu_report.Report(str(tmp_path / "other"), "NVIDIA H200"),
                              gpu_report.Clock(600.0), benchmark_args())
    assert len(commands) == 1


def test_mosaic_against_triton_says_which_kernel_auto_should_run():
    """Per op, summed over the shapes both kernels were timed at: a Mosaic kernel faster and as
    close to the reference as Triton's is the one to name in AUTO_KERNELS; a slower one leaves
    Triton; one whose error is far beyond Triton's is wrong whatever its speed; V4's two layer
    kinds decide one op together."""
    row = lambda op, impl, seconds, error, batch=32: dict(op=op, impl=impl, seconds=seconds, max_error=error,
                                                          batch=batch, context=4096, queries=1, bytes=1.0, flops=1.0)
    units = {
        "kernels/mla_attention": {"json": {"rows": [
            row("mla_attention", "pallas", 3e-4, 4e-3), row("mla_attention", "mosaic", 1e-4, 5e-3),
            row("mla_attention", "pallas", 2e-4, 4e-3, batch=8), row("mla_attention", "mosaic", 1e-4, 4e-3, batch=8),
            row("mla_attention", "pallas", 1e-4, 4e-3, batch=1),  # no Mosaic row: not compared
            row("mla_attention", "xla", 1e-2, None)]}},
        "kernels/indexer_scores": {"json": {"rows": [row("indexer_scores", "pallas", 1e-4, 0.0),
                                                     row("indexer_scores", "mosaic", 2e-4, 0.0)]}},
        "kernels/sparse_mla": {"json": {"rows": [row("sparse_mla", "pallas", 2e-4, 4e-3),
                                                 row("sparse_mla", "mosaic", 1e-4, 0.5)]}},
        "kernels/v4_csa": {"json": {"rows": [row("v4_csa", "pallas", 1e-4, 4e-3), row("v4_csa", "mosaic", 3e-4, 4e-3)]}},
        "kernels/v4_hca": {"json": {"rows": [row("v4_hca", "pallas", 3e-4, 4e-3), row("v4_hca", "mosaic", 0.5e-4, 4e-3)]}},
    }
    units = {name: {"ok": True, "json": {"copy_bytes_per_s": 2e12, **record["json"]}} for name, record in units.items()}
    found = gpu_report.mosaic_against_triton(units)
    assert {op: c["verdict"] for op, c in found.items()} == {
        "mla_attention": "mosaic", "indexer_topk": "pallas", "sparse_mla_attention": "wrong",
        "sliding_compressed_attention": "mosaic"}
    assert found["mla_attention"]["shapes"] == 2 and found["mla_attention"]["ratio"] == pytest.approx(2e-4 / 5e-4)
    assert found["sliding_compressed_attention"]["ratio"] == pytest.approx(3.5e-4 / 4e-4)
    report = gpu_report.Report.__new__(gpu_report.Report)
    report.device, report.units, report.data = "NVIDIA H100 80GB HBM3", units, {"runs": []}
    text = gpu_report.markdown(report)
    assert "| mla_attention | 2 | 0.40 |" in text and "AUTO_KERNELS['NVIDIA H100 80GB HBM3'][op] = \"mosaic\"" in text


def test_the_grouped_matmul_is_decided_on_the_step():
    """The Mosaic grouped matmul's verdict compares the gmm part's step with "auto" on it to the e2e
    part's at the same points: faster at every point and its suite module passed on the device ->
    "mosaic"; faster but that module not run (or failing) -> "unchecked"; slower at one point ->
    Triton stays; no pair -> no verdict. report.md says which."""
    def point(batch, drafts, seconds):
        return {"batch": batch, "drafts": drafts, "measured_s": seconds, "ok": True, "layers": 10, "context": 4096,
                "target": "h200", "projected_s": 0.03, "ratio": 0.03 / seconds, "flops": 1e12, "bytes": 1e11,
                "by_class": {"grouped_matmul": (5e11, 8e10), "attention": (3e11, 1e10), "xla": (2e11, 1e10)},
                "profile": {"by_class_ms": {"grouped_matmul": 0.8e3 * seconds, "attention": 0.1e3 * seconds,
                                            "xla": 0.05e3 * seconds}, "busy_ms": 0.95e3 * seconds}}

    units = {"e2e/B=32,k=3": point(32, 3, 0.0968), "e2e/B=1,k=0": point(1, 0, 0.0221),
             "e2e/B=8,k=3": point(8, 3, 0.0621),  # no Mosaic point: not compared
             "gmm/e2e-mosaic/B=32,k=3": point(32, 3, 0.0600), "gmm/e2e-mosaic/B=1,k=0": point(1, 0, 0.0150)}
    assert gpu_report.grouped_matmul_verdict({}) is None
    unchecked = gpu_report.grouped_matmul_verdict(units)
    assert (unchecked["points"], unchecked["verdict"]) == (2, "unchecked")
    assert unchecked["ratio"] == pytest.approx(0.075 / 0.1189)
    suite = {"passed": 12, "failed": 0, "skipped": 0, "seconds": 20.0, "failures": [], "skips": []}
    units[f"suite/{gpu_report.MOSAIC_GMM_TESTS}"] = suite
    assert gpu_report.grouped_matmul_verdict(units)["verdict"] == "mosaic"
    report = gpu_report.Report.__new__(gpu_report.Report)
    report.device, report.units, report.data = "NVIDIA H200", units, {"runs": []}
    assert ("2 points, step time 0.63x the default's: Mosaic: set `AUTO_KERNELS['NVIDIA H200'][\"grouped_matmul\"]"
            in gpu_report.markdown(report))
    units[f"suite/{gpu_report.MOSAIC_GMM_TESTS}"] = {**suite, "failed": 1}
    assert gpu_report.grouped_matmul_verdict(units)["verdict"] == "unchecked"
    units["gmm/e2e-mosaic/B=1,k=0"] = point(1, 0, 0.0230)
    assert gpu_report.grouped_matmul_verdict(units)["verdict"] == "pallas"


def test_device_seconds_gives_each_window_its_kernels():
    """A kernel belongs to the window that started last before it, allowing for the device's clock
    as the profiler maps it (`CLOCK_SKEW_NS`); a kernel outside every window is nobody's; a window
    with fewer kernels than calls has no device time, rather than a wrong one."""
    from kernel_profile import CLOCK_SKEW_NS, per_window
    ms = 1_000_000
    spans = [("b", 100 * ms, 130 * ms), ("a", 0, 50 * ms), ("c", 200 * ms, 210 * ms)]
    events = [("k", 1 * ms, 2 * ms), ("k", 10 * ms, 2 * ms), ("fusion", 20 * ms, 1 * ms),
              ("k", 100 * ms - CLOCK_SKEW_NS // 2, 4 * ms), ("k", 110 * ms, 4 * ms),  # b's first seems early
              ("late", 130 * ms + 2 * CLOCK_SKEW_NS, 9 * ms),  # after b ended and before c: no window's
              ("k", 201 * ms, 1 * ms)]
    found = per_window(events, spans, iters=2)
    assert found == {"a": pytest.approx(5e-3 / 2), "b": pytest.approx(8e-3 / 2), "c": None}


def test_device_seconds_without_a_profiler_leaves_the_column_empty_and_a_failing_call_raises(monkeypatch, capsys):
    """A profiler that cannot start (another trace running) gives no device times, said on stderr,
    instead of failing the benchmark; a call that fails inside the trace still raises, and the
    trace is stopped, so the next measurement can start one."""
    import kernel_profile
    add = jax.jit(lambda x: x + 1)
    x = jnp.ones(4)
    jax.block_until_ready(add(x))
    real_start = jax.profiler.start_trace

    def taken(path):
        raise RuntimeError("Only one profile may be run at a time.")

    monkeypatch.setattr(jax.profiler, "start_trace", taken)
    assert kernel_profile.device_seconds({"add": lambda: add(x)}, iters=2) == {"add": None}
    assert "the profiler failed (RuntimeError: Only one profile" in capsys.readouterr().err
    monkeypatch.setattr(jax.profiler, "start_trace", real_start)

    def broken():
        raise ValueError("the call's own error")

    with pytest.raises(ValueError, match="the call's own error"):
        kernel_profile.device_seconds({"broken": broken}, iters=1)
    assert kernel_profile.device_seconds({"add": lambda: add(x)}, iters=2)["add"] > 0


def test_kernel_profile_sums_kernels_by_op_class():
    """The profile of one step: each kernel's time goes to its op class by name (the Pallas
    kernels' Triton and Mosaic names; everything else XLA's), XLA's numbered repeats of a kernel
    count as one in the longest-kernel list, and the span runs from the first start to the last end."""
    import kernel_profile
    summarize = kernel_profile.summarize
    events = [("grouped_matmul", 0, 4_000_000), ("_sparse_mla", 5_000_000, 1_000_000),
              ("mla_attention", 6_000_000, 500_000), ("loop_add_fusion_3", 7_000_000, 250_000),
              ("loop_add_fusion_4", 8_000_000, 250_000), ("nvjet_tst_128x64", 9_000_000, 1_000_000)]
    found = summarize(events)
    assert found["by_class_ms"] == {"attention": 1.5, "grouped_matmul": 4.0, "xla": 1.5}
    assert found["busy_ms"] == 7.0 and found["span_ms"] == 10.0 and found["kernels"] == 6
    assert found["by_class_kernels"] == {"attention": 2, "grouped_matmul": 1, "xla": 3}
    assert found["top"][0] == ["grouped_matmul", 4.0, 1]
    assert ["loop_add_fusion", 0.5, 2] in found["top"]
    assert summarize([])["busy_ms"] == 0.0
    # The Mosaic GPU kernels by the names they are launched under (`aot.MosaicLaunch.kernel`); an
    # unnamed one ("anonymous", which the grouped matmul's was on the H200) is XLA's to the profile.
    for kernel, op in [("grouped_matmul_mosaic", "grouped_matmul"), ("mla_attention_mosaic", "attention"),
                       ("sparse_mla_attention_mosaic", "attention"), ("indexer_scores_mosaic", "attention"),
                       ("sliding_compressed_attention_mosaic", "attention"), ("anonymous", "xla")]:
        assert kernel_profile.op_class(f"{kernel}_mosaic_gpu_kernel") == op


def test_the_main_job_runs_once_more_with_the_loop_as_a_cuda_graph(tmp_path, monkeypatch):
    """The mainjob part runs k = 0 and k = 3, then k = 3 again with XLA's command buffers for loops
    added to the XLA flags the environment already holds (the others run without them), and
    records each run's tokens/s; report.md lists the three."""
    seen = {}

    def fake_run(argv, clock, env=None, limit=None, progress=None):
        unit = f"k{argv[argv.index('--mtp') + 1]}" + ("-graph" if "+WHILE" in env.get("XLA_FLAGS", "") else "")
        seen[unit] = env.get("XLA_FLAGS")
        rate = {"k0": 100.0, "k3": 250.0, "k3-graph": 260.0}[unit]
        return {"returncode": 0, "timed_out": False, "hung": False, "seconds": 1.0,
                "output": f"decode (96 tokens): {rate:,.1f} tokens/s\nmean accepted length 2.50\n"}

    monkeypatch.setattr(gpu_report, "run", fake_run)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    report = gpu_report.Report(str(tmp_path), "NVIDIA H100 80GB HBM3")
    gpu_report.part_mainjob(report, gpu_report.Clock(None), benchmark_args())
    assert seen == {"k0": "--xla_dump_to=/tmp/x", "k3": "--xla_dump_to=/tmp/x",
                    "k3-graph": f"--xla_dump_to=/tmp/x {gpu_report.LOOP_GRAPH_FLAGS}"}
    rates = {unit: report.units[f"mainjob/{unit}"]["tokens_per_s"] for unit in ("mtp0", "mtp3", "mtp3-loop-graph")}
    assert rates == {"mtp0": 100.0, "mtp3": 250.0, "mtp3-loop-graph": 260.0}
    markdown = gpu_report.markdown(report)
    assert "- mtp3-loop-graph: 260.0 tokens/s" in markdown and "- mtp0: 100.0 tokens/s" in markdown


def test_launch_check_compiles_each_profiled_point_as_its_step_was_built(tmp_path, monkeypatch, capsys):
    """benchmarks/launch_check.py: each e2e point whose profile counted its device events (the e2e,
    e2e_v4 and gmm parts' units; one without a profile or with a count of 0, and other units, are left
    out) is compiled here with the point's model, layers, drafts, backend, cache dtype, tiles,
    --auto choices and unrolling, for its GPU, and printed beside the profile's count, per class
    where the profile has them. A point recorded before the model and unrolling were is V3.2's,
    as scans; a report without such a point, or not JSON, is said so."""
    from collections import Counter

    from jaxspec.pallas_kernels import backend, grouped_matmul_pallas
    built = []

    def fake_compile(config, decode, *, phase, batch, context, devices, dtype):
        built.append(dict(model=config.model_type, layers=config.num_hidden_layers, drafts=decode.num_draft,
                          backend=decode.backend, cache=decode.cache_dtype, unrolled=decode.unroll_layers, phase=phase,
                          batch=batch, context=context, gpu=devices[0].device_kind, dtype=dtype,
                          tiles=grouped_matmul_pallas.current_tiles(), auto=dict(backend._auto_choices)))
        return len(built)

    monkeypatch.setattr(launch_check, "compile_model", fake_compile)
    monkeypatch.setattr(launch_check.aot, "launch_counts", lambda n: Counter({"kCopy": 10 * n, "fusion": 100}))
    monkeypatch.setattr(launch_check.aot, "op_class_launches",
                        lambda n: {"attention": n, "grouped_matmul": 2 * n, "xla": 100 + 7 * n})
    old = dict(batch=1, drafts=0, context=4096, layers=10, backend="auto", cache_dtype="bfloat16", tiles="k64",
               auto={"grouped_matmul": "mosaic"}, target="h200", profile={"kernels": 112})
    new = dict(model="deepseek-v4-flash", batch=32, drafts=3, context=4096, layers=4, backend="mosaic",
               cache_dtype="fp8", tiles="k64-int", auto={}, unrolled=True, target="h100",
               profile={"kernels": 125, "by_class_kernels": {"attention": 2, "grouped_matmul": 4, "xla": 119}})
    report = {"devices": {"NVIDIA H200": {"gmm/e2e-mosaic/B=1,k=0": old, "e2e/B=8,k=1": {**old, "profile": None},
                                          "e2e/B=8,k=0": {**old, "profile": {"kernels": 0}},
                                          "moe": {"profile": {"kernels": 3}}},
                          "NVIDIA H100 80GB HBM3": {"e2e_v4/B=32,k=3": new}}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert launch_check.main([str(path)]) == 0
    assert [(b["model"], b["layers"], b["drafts"], b["backend"], b["cache"], b["unrolled"], b["batch"], b["tiles"],
             b["auto"], "H200" in b["gpu"], "H100" in b["gpu"]) for b in built] == [
        ("deepseek_v32", 10, 0, "auto", None, False, 1, grouped_matmul_pallas.VARIANTS["k64"],
         {"grouped_matmul": "mosaic"}, True, False),
        ("deepseek_v4", 4, 3, "mosaic", "fp8", True, 32, grouped_matmul_pallas.VARIANTS["k64-int"], {}, False, True)]
    assert all(b["phase"] == "decode" and b["context"] == 4096 and b["dtype"] == jnp.float8_e4m3fn for b in built)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[1].split()[-5:] == ["gmm/e2e-mosaic/B=1,k=0", "112", "110", "0.982", "-"]
    assert lines[2].split()[-16:-12] == ["e2e_v4/B=32,k=3", "125", "120", "0.960"]
    assert lines[2].endswith(" attention 2 / 2, grouped_matmul 4 / 4, xla 114 / 119")
    path.write_text(json.dumps({"devices": {"NVIDIA H200": {"e2e/B=8,k=1": {**old, "profile": None}}}}))
    assert launch_check.main([str(path)]) == 1
    assert "no e2e point with a profiled kernel count" in capsys.readouterr().out
    path.write_text("{not json")
    with pytest.raises(SystemExit):
        launch_check.main([str(path)])
    assert f"{path}: " in capsys.readouterr().err
