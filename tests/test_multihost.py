"""Several processes as one mesh, on this host: JAX's multi-controller runtime over loopback
addresses, two processes with virtual CPU devices each, gloo for the collectives between them.

All processes start together in one module fixture (starting and compiling is what costs; the
checks only read what they printed or wrote):

  * the main job (`examples/generate.py --coordinator ... --num-processes 2 --process-id I`) on a
    2x2 mesh whose data axis spans the processes, from the trained tiny model's orbax save (greedy
    MTP k = 3) and from a Hugging Face layout of it (a greedy dynamic tree), against the same job
    on one process;
  * `multihost_worker.py`'s pair on a 2x4 mesh (the model's 8 experts one per device) through the
    Python entry points: bytes each process reads, save / restore, sampling, check_agreement; then
    one of them is killed mid-decode;
  * the main job started with different checkpoints, and a process whose coordinator never comes.

Every process gets a free loopback port, output to files, a deadline, and is killed in a finally.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flax import nnx

from test_checkpoint import hf_tensors, released_config, write_checkpoint
from virtual_devices import virtual_devices_env

from jaxspec import distributed, shards
from jaxspec.checkpoint import load_model
from jaxspec.decode_config import DecodeConfig
from jaxspec.generation import generate
from conftest import on_cpu

TESTS = Path(__file__).resolve().parent
GENERATE = TESTS.parent / "examples" / "generate.py"
ORBAX = TESTS / "fixtures" / "tiny"  # trained_v32's save: DeepSeek-V3.2, 2 layers + MTP, 8 experts
PROMPTS = [[116, 104, 101, 32], [97], [116, 104, 101, 32]]
MAX_NEW_TOKENS = 12
SAMPLE_KEY = 3
HEARTBEAT_S = 3    # the lost-peer check's heartbeat timeout
INIT_TIMEOUT_S = 3  # the missing-coordinator check's initialization timeout
DEADLINE_S = 600   # no process outlives this, whatever happens
JOB_FLAGS = [*(f for p in PROMPTS[:2] for f in ("--prompt-ids", ",".join(map(str, p)))), "--batch", "3",
             "--max-new-tokens", str(MAX_NEW_TOKENS), "--backend", "xla"]


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port that is free now and that no other socket is handed meanwhile.

    A coordinator binds its port seconds after this returns (the process imports JAX first). A port
    from the kernel's ephemeral range (what `bind(0)` gives) can be taken in that time as the local end
    of any outgoing connection, the other processes' own included ("Failed to add port to server").
    Below that range only an explicit bind takes a port, so the port is drawn there, at random so that
    two pytest workers rarely draw alike, and checked free."""
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free loopback port below the ephemeral range ({low})")


class Runs:
    """The processes of this module, by name, each with its stdout / stderr files."""

    def __init__(self, directory: Path):
        self.directory, self.procs = directory, {}

    def start(self, name: str, argv: list, devices: int):
        env = virtual_devices_env(devices)
        with open(self.directory / f"{name}.out", "w") as out, open(self.directory / f"{name}.err", "w") as err:
            self.procs[name] = subprocess.Popen([sys.executable, *map(str, argv)], stdout=out, stderr=err, env=env,
                                                cwd=self.directory)

    def pair(self, name: str, argv: list, devices: int = 2, per_process=lambda i: []):
        port = free_port()
        for i in range(2):
            self.start(f"{name}.{i}", [*argv, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                       "--process-id", i, *per_process(i)], devices)

    def wait(self, name: str, deadline: float) -> int:
        return self.procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))

    def out(self, name: str) -> str:
        return (self.directory / f"{name}.out").read_text()

    def err(self, name: str) -> str:
        return (self.directory / f"{name}.err").read_text()

    def kill_all(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()  # SIGKILL: JAX's preemption notifier catches SIGTERM and carries on
                proc.wait(timeout=30)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, trained_v32):
    root = tmp_path_factory.mktemp("multihost")
    write_checkpoint(root / "hf", released_config(trained_v32.config), hf_tensors(trained_v32))
    (root / "case.json").write_text(json.dumps({
        "prompts": PROMPTS, "mesh": [2, 4], "decode": {"max_new_tokens": MAX_NEW_TOKENS, "page_size": 64},
        "sample_key": SAMPLE_KEY, "heartbeat_timeout": HEARTBEAT_S}))
    runs = Runs(root)
    deadline = time.monotonic() + DEADLINE_S
    try:
        worker_port = free_port()
        for i in range(2):
            runs.start(f"worker.{i}", [TESTS / "multihost_worker.py", root, worker_port, i], devices=4)
        job = [GENERATE, *JOB_FLAGS, "--print-ids"]
        runs.pair("orbax k=3", [*job, "--checkpoint", ORBAX, "--mesh", "2x2", "--mtp", "3"])
        runs.pair("hf tree", [*job, "--checkpoint", root / "hf", "--mesh", "2x2", "--tree", "2,2,3"])
        runs.start("one process", [*job, "--checkpoint", ORBAX, "--mtp", "3"], devices=1)
        runs.pair("disagree", [*job, "--mesh", "2x2"],
                  per_process=lambda i: ["--checkpoint", ORBAX if i == 0 else root / "hf"])
        runs.start("no coordinator", [*job, "--checkpoint", ORBAX, "--mesh", "2x2", "--coordinator",
                                      f"127.0.0.1:{free_port()}", "--num-processes", "2", "--process-id", "1",
                                      "--init-timeout", INIT_TIMEOUT_S], devices=2)

        # One-process references, computed here while the processes start and compile.
        reads = []
        read = shards.read
        shards.read = lambda info: (reads.append((Path(info.file).name, info.start)), read(info))[1]
        try:
            load_model(root / "hf", log=lambda line: None)
        finally:
            shards.read = read
        name_at = {(Path(info.file).name, info.start): name for name, info in shards.read_headers(root / "hf").items()}
        # The workers run the references on (virtual) CPU devices: so does this one, on a GPU host too,
        # where "auto" would pick the kernels and another device's rounding could move a sampled token.
        config = DecodeConfig(num_draft=3, eos_token_id=trained_v32.config.eos_token_id, temperature=1.0, top_k=5,
                              max_new_tokens=MAX_NEW_TOKENS, page_size=64, backend="xla")
        graphdef, state = nnx.split(trained_v32)
        sampled = generate(nnx.merge(graphdef, on_cpu(state)), PROMPTS, config, key=SAMPLE_KEY)

        # The worker pair writes its results, then decodes until one of them is killed.
        results = [root / f"result-{i}.json" for i in range(2)]
        while not all(r.exists() for r in results):
            assert all(runs.procs[f"worker.{i}"].poll() is None for i in range(2)), runs.err("worker.0")[-3000:]
            assert time.monotonic() < deadline, "the worker pair wrote no results in time"
            time.sleep(0.5)
        worker = [json.loads(r.read_text()) for r in results]
        time.sleep(1)  # both are in the decode loop now
        runs.procs["worker.1"].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        lost = {"returncode": runs.wait("worker.0", deadline), "seconds": time.monotonic() - killed,
                "stderr": runs.err("worker.0")}

        codes = {name: runs.wait(name, deadline) for name in runs.procs if not name.startswith("worker")}
        yield {"root": root, "worker": worker, "lost": lost, "codes": codes, "out": runs.out, "err": runs.err,
               "one device reads": [name_at[at] for at in reads],
               "one device sampled": [sampled.row_tokens(row) for row in range(len(PROMPTS))]}
    finally:
        runs.kill_all()


def _rows(output: str) -> list[str]:
    """The main job's per-row lines `[b] [prompt ids] -> [ids]`."""
    return [line for line in output.splitlines() if re.match(r"\[\d+\] ", line)]


def _ids(output: str) -> list[list[int]]:
    return [json.loads(row.split(" -> ")[1]) for row in _rows(output)]


@pytest.mark.slow
def test_main_job_on_two_processes_prints_the_one_process_tokens(runs):
    """Greedy MTP k = 3 from an orbax save and a greedy dynamic tree from a Hugging Face layout,
    each on a 2x2 mesh over two processes, print the one-process run's tokens; only process 0 prints."""
    for name in ("orbax k=3", "hf tree"):
        assert runs["codes"][f"{name}.0"] == 0 and runs["codes"][f"{name}.1"] == 0, runs["err"](f"{name}.0")[-3000:]
    assert runs["codes"]["one process"] == 0, runs["err"]("one process")[-3000:]
    reference = _rows(runs["out"]("one process"))
    assert len(reference) == 3 and all(len(ids) == MAX_NEW_TOKENS for ids in _ids(runs["out"]("one process")))
    assert _rows(runs["out"]("orbax k=3.0")) == reference
    assert _rows(runs["out"]("hf tree.0")) == reference
    assert "per device of 4 planned" in runs["out"]("hf tree.0")
    assert runs["out"]("orbax k=3.1") == runs["out"]("hf tree.1") == ""  # not even the runtime's lines


@pytest.mark.slow
def test_each_process_reads_only_its_experts_and_the_replicated_tensors(runs):
    """On the 2x4 mesh each device holds one of the 8 experts of every MoE layer, process 0 the
    first four: a process reads each tensor a one-device load reads, once, except the other
    process's experts (counted at jaxspec.shards.read, the loader's only path to tensor data)."""
    tensors = shards.read_headers(runs["root"] / "hf")
    name_at = {(Path(info.file).name, info.start): name for name, info in tensors.items()}
    expert = lambda name: int(m.group(1)) if (m := re.search(r"\.mlp\.experts\.(\d+)\.", name)) else None
    one_device = runs["one device reads"]
    assert sorted(set(map(expert, one_device)) - {None}) == list(range(8))
    for result in runs["worker"]:
        mine = range(4) if result["process"] == 0 else range(4, 8)
        expected = collections.Counter(name for name in one_device if expert(name) is None or expert(name) in mine)
        read = collections.Counter(name_at[tuple(at)] for at in result["reads"])
        assert read == expected, (result["process"], read - expected, expected - read)
        share = sum(tensors[name].nbytes for name in read.elements())
        assert share < 0.9 * sum(tensors[name].nbytes for name in one_device)


@pytest.mark.slow
def test_save_and_restore_across_processes(runs):
    """Both processes save the loaded model (save_model) and restore it onto the mesh (restore_model):
    every parameter comes back bit for bit (the restored model's sampled tokens are checked against
    one device below); the loaded model decodes the one-process run's greedy tokens."""
    for result in runs["worker"]:
        assert result["greedy"] == _ids(runs["out"]("one process"))
        assert result["restored_params"] > 0 and result["restored_differ"] == []


@pytest.mark.slow
def test_sampled_decoding_with_a_fixed_key_equals_one_process(runs):
    """MTP k = 3 sampling (temperature 1, top-k 5) with key 3 by the restored model on the 2x4 mesh
    over two processes draws the stored model's tokens on one device."""
    expected = runs["one device sampled"]
    for result in runs["worker"]:
        assert result["sampled"] == expected
        assert result["sampled"] != result["greedy"]  # it did sample
    assert expected[0] != expected[2]  # the same prompt, another row's stream


@pytest.mark.slow
def test_processes_given_different_inputs_are_refused_before_compiling(runs):
    for i in range(2):
        assert runs["codes"][f"disagree.{i}"] != 0
        assert "process 1 differs from process 0 in checkpoint" in runs["err"](f"disagree.{i}")
        assert "compile" not in runs["out"](f"disagree.{i}")
    for result in runs["worker"]:
        assert "process 1 differs from process 0 in decoding" in result["disagreement"]


@pytest.mark.slow
def test_a_lost_peer_ends_the_other_process_with_an_error_naming_it(runs):
    """Process 1 killed mid-decode: process 0 exits non-zero once the heartbeat timeout (3 s here)
    has passed, its runtime naming task 1 as the one that stopped sending heartbeats."""
    lost = runs["lost"]
    assert lost["returncode"] != 0
    assert lost["seconds"] < HEARTBEAT_S + 30, lost["seconds"]
    assert re.search(r"stopped sending heartbeats\):\s*1\b", lost["stderr"]), lost["stderr"][-3000:]


@pytest.mark.slow
def test_a_missing_coordinator_is_a_clear_error(runs):
    assert runs["codes"]["no coordinator"] != 0
    assert re.search(rf"no coordinator answered at 127\.0\.0\.1:\d+ within {INIT_TIMEOUT_S} s \(this is process 1 "
                     "of 2", runs["err"]("no coordinator")), runs["err"]("no coordinator")[-3000:]


@pytest.mark.parametrize("args, message", [
    (dict(coordinator="10.0.0.1:1234"), "give coordinator, num_processes and process_id together"),
    (dict(coordinator="10.0.0.1", num_processes=2, process_id=0), "coordinator='10.0.0.1': expected HOST:PORT"),
    (dict(coordinator="10.0.0.1:70000", num_processes=2, process_id=0), "port in"),
    (dict(coordinator="10.0.0.1:1234", num_processes=0, process_id=0), "num_processes=0"),
    (dict(coordinator="10.0.0.1:1234", num_processes=2, process_id=2), r"process_id=2: must be an integer in \[0, 1\]"),
    (dict(heartbeat_timeout=0), "heartbeat_timeout=0"),
])
def test_initialize_refuses_bad_arguments_before_contacting_anyone(args, message):
    with pytest.raises(ValueError, match=message):
        distributed.initialize(**args)


def test_checkpoint_identity_follows_the_contents_not_the_path(tmp_path):
    shutil.copytree(ORBAX, tmp_path / "copy")
    assert distributed.checkpoint_identity(tmp_path / "copy") == distributed.checkpoint_identity(ORBAX)
    assert distributed.checkpoint_identity(TESTS / "fixtures" / "tiny-v3") != distributed.checkpoint_identity(ORBAX)


@pytest.mark.parametrize("argv, message", [
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2"], "give all three"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0", "--distributed"],
     "give all three"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
     r"--process-id 2: must be in \[0, 1\]"),
])
def test_main_job_refuses_incomplete_process_flags(argv, message, capsys):
    spec = importlib.util.spec_from_file_location("generate_example", GENERATE)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    with pytest.raises(SystemExit):
        job.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)
