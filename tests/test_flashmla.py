"""`benchmarks/flashmla.py`, FlashMLA's decode kernels beside ours: its driver (the harness calls
it makes, the rows it writes in `attention_kernels.py`'s form, a failing call recorded while the others go
on, what it refuses before building) against a stand-in for the harness binary, which needs a
Hopper GPU to run; and the report's section that sets its rows beside ours."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import flashmla  # noqa: E402
import gpu_report  # noqa: E402

# A stand-in for flashmla_bench: logs its argv, answers as the harness does (V4's op by its rate),
# and fails the sparse call at B 8 the way the harness fails (a message on stderr, exit 2).
FAKE_HARNESS = """#!{python}
import json, sys
with open({log!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
mode = sys.argv[1]
if mode == "copy":
    print(json.dumps({{"op": "copy", "device": "NVIDIA H200", "bytes": 2.0 * 1024 ** 3, "median_us": 500.0,
                      "bytes_per_s": 4.0e12}}))
    sys.exit(0)
batch, context, queries = map(int, sys.argv[2:5])
if mode == "sparse" and batch == 8:
    print("CUDA error an illegal memory access was encountered", file=sys.stderr)
    sys.exit(2)
print("some progress first")
op = {{"dense": "mla_attention", "sparse": "sparse_mla"}}.get(mode) or {{"4": "v4_csa", "128": "v4_hca"}}[sys.argv[6]]
print(json.dumps({{"op": op, "impl": "flashmla", "batch": batch,
                  "context": context, "queries": queries, "heads": 128, "topk": -1, "median_us": 10.0 * batch,
                  "best_us": 9.0 * batch, "metadata_us": 3.0, "bytes": 1e6 * batch, "flops": 1e9,
                  "max_abs_err": 1e-3, "num_sm_parts": 66}}))
"""


@pytest.fixture
def harness(tmp_path):
    """(path of the stand-in harness, path of its call log)."""
    path, log = tmp_path / "flashmla_bench", tmp_path / "calls.log"
    path.write_text(FAKE_HARNESS.format(python=sys.executable, log=str(log)))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "flashmla_bench.source").write_text("9241ae3ef9bac614dd25e45e507e089f888280e0")
    return str(path), log


def test_the_driver_writes_each_shapes_row_and_records_a_failing_call(harness, tmp_path, capsys):
    binary, log = harness
    out = tmp_path / "rows.json"
    code = flashmla.main(["--binary", binary, "--batch", "2", "8", "--context", "128", "256", "--queries", "1",
                          "--topk", "16", "--iters", "3", "--json", str(out)])
    assert code == 1  # one call failed
    calls = log.read_text().splitlines()
    assert calls == ["copy 1024", "dense 2 128 1 3", "dense 2 256 1 3", "dense 8 128 1 3", "dense 8 256 1 3",
                     "sparse 2 4096 1 3 16", "sparse 8 4096 1 3 16", "v4 2 4096 1 3 4 512", "v4 8 4096 1 3 4 512",
                     "v4 2 4096 1 3 128 64", "v4 8 4096 1 3 128 64"]
    data = json.loads(out.read_text())
    assert data["device"] == "NVIDIA H200" and data["copy_bytes_per_s"] == 4.0e12
    assert data["flashmla"].startswith("9241ae3")
    rows = data["rows"]
    assert [(r["op"], r["batch"], r["context"]) for r in rows] == [
        ("mla_attention", 2, 128), ("mla_attention", 2, 256), ("mla_attention", 8, 128), ("mla_attention", 8, 256),
        ("sparse_mla", 2, 4096), ("v4_csa", 2, 4096), ("v4_csa", 8, 4096), ("v4_hca", 2, 4096), ("v4_hca", 8, 4096)]
    dense, sparse = rows[0], rows[4]
    assert dense["impl"] == "flashmla" and dense["cache_dtype"] == "bfloat16"
    assert all(row["cache_dtype"] == "fp8" for row in rows[4:])
    assert dense["seconds"] == dense["device_seconds"] == pytest.approx(20e-6)
    assert dense["max_error"] == 1e-3 and dense["metadata_seconds"] == pytest.approx(3e-6)
    (failure,) = data["failures"]
    assert (failure["op"], failure["batch"], failure["impl"]) == ("sparse_mla", 8, "flashmla")
    assert "illegal memory access" in failure["message"]
    printed = capsys.readouterr().out
    assert "FlashMLA 9241ae3" in printed and "failed:" in printed


def test_ops_pick_the_calls(harness, tmp_path):
    binary, log = harness
    assert flashmla.main(["--binary", binary, "--ops", "v4_hca", "mla_attention", "--batch", "1", "--queries", "4",
                          "--context", "4096"]) == 0
    assert log.read_text().splitlines() == ["copy 1024", "dense 1 4096 4 50", "v4 1 4096 4 50 128 64"]


def test_without_a_harness_or_a_gpu_it_says_so(tmp_path, capsys):
    assert flashmla.main(["--binary", str(tmp_path / "absent")]) == 2
    assert "no harness at" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch"),
    (["--topk", "4096", "--queries", "4"], "--topk"),
    (["--build"], "--build needs --src"),
])
def test_bad_flags_are_refused(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("FLASHMLA_SRC", raising=False)
    with pytest.raises(SystemExit):
        flashmla.main(argv)
    assert message in capsys.readouterr().err


def test_a_build_refuses_a_checkout_without_the_kernels_or_cutlass(tmp_path):
    with pytest.raises(SystemExit, match="missing csrc/sm90/decode/dense"):
        flashmla.check_source(str(tmp_path))
    for source in flashmla.SOURCES + ("params.h",):
        (tmp_path / "csrc" / source).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "csrc" / source).write_text("")
    with pytest.raises(SystemExit, match="submodule update --init csrc/cutlass"):
        flashmla.check_source(str(tmp_path))
    (tmp_path / "csrc" / "cutlass" / "include" / "cute").mkdir(parents=True)
    assert flashmla.check_source(str(tmp_path)) == str(tmp_path / "csrc")


def test_the_report_sets_flashmla_beside_our_rows_of_the_same_shape():
    def row(op, impl, batch, ms, cache="bfloat16", device_ms=None):
        return dict(op=op, impl=impl, batch=batch, context=4096, queries=1, seconds=ms / 1e3,
                    device_seconds=None if device_ms is None else device_ms / 1e3, bytes=1e8, flops=1e9,
                    cache_dtype=cache, max_error=1e-3)

    units = {
        "flashmla": {"json": {"rows": [row("mla_attention", "flashmla", 32, 0.05),
                                       row("sparse_mla", "flashmla", 32, 0.1, "fp8")]}},
        "kernels/mla_attention": {"json": {"rows": [row("mla_attention", "pallas", 32, 9.0, device_ms=0.2),
                                                    row("mla_attention", "mosaic", 32, 9.0, device_ms=0.075),
                                                    row("mla_attention", "roofline", 32, 0.03),
                                                    row("mla_attention", "mosaic", 8, 0.01)]}},
        "flashmla/fp8_caches": {"json": {"rows": [row("sparse_mla", "pallas", 32, 0.3, "fp8")]}},
        "kernels/sparse_mla": {"json": {"rows": [row("sparse_mla", "pallas", 32, 0.2)]}},  # bf16: no FlashMLA row
    }
    lines = gpu_report.against_flashmla(units)
    dense = next(line for line in lines if line.startswith("| mla_attention | 32"))
    sparse = next(line for line in lines if line.startswith("| sparse_mla | 32"))
    # ours over FlashMLA by device time: Triton 0.2 / 0.05, Mosaic 0.075 / 0.05, no XLA row
    assert dense.endswith("| 4.00 | 1.50 | - |") and "| 0.050 | 2000 |" in dense
    assert sparse.endswith("| 3.00 | - | - |") and "| fp8 |" in sparse
    assert len([line for line in lines if line.startswith("| ") and "---" not in line]) == 3  # header + 2
    assert gpu_report.against_flashmla({})[-2] == "not measured"
