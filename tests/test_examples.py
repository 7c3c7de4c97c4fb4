"""The main job (`examples/generate.py`) and the speculative benchmark run end to end.

The scripts run as subprocesses on the CPU, all started together (compilation dominates their
time and is mostly single-threaded), then each test reads its own one's output.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxspec.platforms import cuda_plugin_installed
from virtual_devices import virtual_devices_env

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ROOT / "examples" / "generate.py"
BENCHMARK = ROOT / "benchmarks" / "speculative.py"
EXAMPLE_FLAGS = ["--max-new-tokens", "12", "--prompt", "hello", "--prompt", "ab", "--batch", "3", "--backend", "xla"]
V4_MODEL = ROOT / "tests" / "fixtures" / "tiny-v4"  # the suite's trained DeepSeek-V4 (trained_models)
RUNS = {
    "mtp3": [GENERATE, "--mtp", "3", *EXAMPLE_FLAGS],
    # Plain decoding on a 2 x 2 mesh of virtual CPU devices (the shipped model has 4 experts): its
    # text must equal mtp3's on one device, which checks both at once.
    "mtp0 on a mesh": [GENERATE, "--mtp", "0", *EXAMPLE_FLAGS, "--mesh", "2x2"],
    "sampled": [GENERATE, "--checkpoint", V4_MODEL, "--prompt-ids", "116,104,101,32", "--prompt-ids", "97",
                "--tree", "2,2,3", "--temperature", "1.0", "--top-k", "5", "--sample-seed", "3",
                *EXAMPLE_FLAGS[:2], "--batch", "3", "--backend", "xla"],
    "benchmark": [BENCHMARK, "--random", "--k", "1", "--tree", "small", "--batch", "2", "--prompt-len", "8",
                  "--max-new-tokens", "8", "--repeats", "1", "--backend", "xla"],
}


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> Path:
    """The mtp3 run's --compile-cache directory."""
    return tmp_path_factory.mktemp("compile-cache")


# A user's host with JAX's CUDA plugin (the test command installs it) and no NVIDIA driver: no
# platform named, and no device visible even where a GPU is (so the run stays on the CPU everywhere).
NO_DRIVER_ENV = {**{k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}, "CUDA_VISIBLE_DEVICES": ""}
# The control: plain JAX in that environment, to show that it has the plugin and no driver.
JAX_ALONE = ["-c", "import jax; print(jax.devices())"]


@pytest.fixture(scope="module")
def runs(compile_cache) -> dict[str, subprocess.CompletedProcess]:
    """Each run's result, by name; a failed run fails the tests with its stderr. The main job (mtp3)
    and the control run in NO_DRIVER_ENV."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argvs = {**RUNS, "mtp3": [*RUNS["mtp3"], "--compile-cache", compile_cache], "jax alone": JAX_ALONE}
    envs = {"mtp3": NO_DRIVER_ENV, "jax alone": NO_DRIVER_ENV, "mtp0 on a mesh": virtual_devices_env(4)}
    procs = {name: subprocess.Popen([sys.executable, *map(str, argv)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=envs.get(name, env))
             for name, argv in argvs.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} failed:\n{err}"
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


@pytest.fixture(scope="module")
def outputs(runs) -> dict[str, str]:
    """Each run's stdout, by name."""
    return {name: run.stdout for name, run in runs.items()}


def _rows(output: str) -> list[str]:
    """The per-row lines `[b] 'prompt' -> 'text'`."""
    return [line for line in output.splitlines() if line.startswith("[")]


def _stat(output: str, prefix: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"no single line starting with {prefix!r} in:\n{output}"
    return lines[0]


@pytest.mark.slow
def test_generate_prints_the_same_text_with_and_without_mtp_on_a_mesh(outputs):
    """The main job on the shipped model: MTP k = 3 on one device and plain decoding on a 2x2 mesh
    (experts split over 4 devices, rows over 4: 3 rows and one padding row) print the same text,
    and that text is Python-flavoured printable ASCII."""
    with_mtp, plain = outputs["mtp3"], outputs["mtp0 on a mesh"]
    rows = _rows(with_mtp)
    assert [row[:4] for row in rows] == ["[0] ", "[1] ", "[2] "]
    assert rows[0].startswith("[0] 'hello' -> ") and rows[2].startswith("[2] 'hello' -> ")
    assert rows == _rows(plain)
    for row in rows:
        text = ast.literal_eval(row.split(" -> ", 1)[1])
        assert len(text) == 12 and all(" " <= c <= "~" or c in "\n\t" for c in text), row
    assert "per device of 4 planned" in _stat(plain, "memory")


@pytest.mark.slow
def test_generate_samples_one_stream_per_row(outputs):
    """A saved DeepSeek-V4 checkpoint without a tokenizer (the suite's trained tiny V4: --prompt-ids),
    a dynamic tree, sampling: rows with the same prompt get their own streams."""
    sampled = outputs["sampled"]
    assert "deepseek_v4" in _stat(sampled, "model")
    assert "sampling (temperature 1.0, top-k 5, top-p 1.0, seed 3)" in _stat(sampled, "decoding")
    rows = _rows(sampled)
    assert rows[0].startswith("[0] [116, 104, 101, 32] -> [") and rows[2].startswith("[2] [116, 104, 101, 32] -> [")
    assert rows[0].split(" -> ")[1] != rows[2].split(" -> ")[1]  # the same prompt, another stream


@pytest.mark.slow
def test_generate_reports_speed_and_acceptance_apart_from_compilation(outputs):
    with_mtp, plain = outputs["mtp3"], outputs["mtp0 on a mesh"]
    for output in (with_mtp, plain):
        assert "tokens/s" in _stat(output, "decode")
        assert "s ahead of time" in _stat(output, "compile")
        float(_stat(output, "mean accepted length").split()[3])
    assert len(_stat(with_mtp, "acceptance per position").split()[3:]) == 3
    assert "no drafts" in _stat(plain, "acceptance per position")


@pytest.mark.slow
def test_generate_keeps_its_compiled_programs_in_the_compile_cache(outputs, compile_cache):
    assert any(compile_cache.iterdir()), "--compile-cache wrote nothing"


@pytest.mark.slow
def test_generate_on_a_host_without_a_driver_prints_no_cuda_traceback(runs):
    """With JAX's CUDA plugin installed and no NVIDIA driver, plain JAX logs the plugin's failed
    `cuInit` as a traceback on every run; the main job picks the CPU first and prints none."""
    if not cuda_plugin_installed():
        pytest.skip("JAX's CUDA plugin is not installed (the README's test command installs it)")
    assert "Jax plugin configuration error" in runs["jax alone"].stderr, runs["jax alone"].stderr
    stderr = runs["mtp3"].stderr
    assert "Traceback" not in stderr and "Jax plugin configuration error" not in stderr, stderr
    assert "CpuDevice" in runs["jax alone"].stdout


@pytest.mark.slow
def test_benchmark_has_a_lossless_row_per_draft_length(outputs):
    table = [line.split() for line in outputs["benchmark"].splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [row[0] for row in table] == ["0", "1"], outputs["benchmark"]
    assert all("yes" in row for row in table)  # the "= plain" column
    assert table[0][3] == "1.00x"
    tree_rows = [line.split() for line in outputs["benchmark"].splitlines() if line.split()[:1] == ["small"]]
    assert len(tree_rows) == 1 and "yes" in tree_rows[0]


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script, flags, message", [
    (GENERATE, ["--mtp", "8"], "--mtp 8: must be in [0, 7]"),
    (GENERATE, ["--mtp", "-1"], "--mtp -1: must be in [0, 7]"),
    (GENERATE, ["--prompt", "a", "--prompt", "b", "--batch", "1"], "--batch 1: smaller than the number of prompts"),
    (GENERATE, ["--prompt", ""], "--prompt: prompts must not be empty"),
    (GENERATE, ["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    (GENERATE, ["--preset", "deepseek-v3"], "--preset: invalid choice"),
    (GENERATE, ["--preset", "tiny-v4"], "--preset: the random model's shape and weights; add --random"),
    (GENERATE, ["--seed", "2", "--preset", "tiny"], "--preset and --seed: the random model's"),
    (GENERATE, ["--dtype", "bfloat16"], "--dtype: the dtype --checkpoint's weights are loaded in"),
    (GENERATE, ["--prefill", "loop", "--prefill-chunk", "4"], "--prefill loop feeds the prompts through"),
    (GENERATE, ["--tree", "bushy"], "argument --tree: tree 'bushy'"),
    (GENERATE, ["--tree", "small", "--mtp", "0"], "num_draft=0 means plain decoding"),
    (GENERATE, ["--top-p", "0.5"], "top_p=0.5 filters sampling, but temperature=0 is greedy"),
    (GENERATE, ["--temperature", "-1"], "temperature=-1.0: must be"),
    (GENERATE, ["--relaxed", "3"], "argument --relaxed: expected top_k,delta"),
    (GENERATE, ["--mesh", "8"], "argument --mesh: expected DATAxMODEL like 1x8, got '8'"),
    (GENERATE, ["--mesh", "0x8"], "argument --mesh: both mesh sizes must be >= 1"),
    (GENERATE, ["--plan", "fsdp"], "argument --plan: invalid choice"),
    # out-of-vocabulary ids, refused from the config alone: the shipped model, a random one, a V4 save
    (GENERATE, ["--prompt-ids", "1,258"],
     "--prompt-ids: token ids must be in [0, 258), the model's vocabulary; got [258]"),
    (GENERATE, ["--random", "--preset", "tiny-v4", "--prompt-ids", "7", "--prompt-ids", "300,259"], "got [259, 300]"),
    (GENERATE, ["--checkpoint", str(V4_MODEL), "--prompt-ids", "1000"], "must be in [0, 258)"),
    (BENCHMARK, ["--tree", "1,2"], "argument --tree: tree '1,2'"),
    (BENCHMARK, ["--k", "0", "1"], "--k [0]: each must be in [1, 7]"),
    (BENCHMARK, ["--k", "8"], "--k [8]: each must be in [1, 7]"),
    (BENCHMARK, ["--batch", "0"], "--batch: must be >= 1"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_scripts_reject_bad_flags(script, flags, message, capsys):
    with pytest.raises(SystemExit):
        _load_script(script).parse_args(flags)
    assert message in capsys.readouterr().err
