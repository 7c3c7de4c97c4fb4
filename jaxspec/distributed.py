"""Several processes (hosts) as one mesh: joining the run, agreeing on its inputs, reading results.

JAX's multi-controller runtime runs one Python process per host; every process runs the same
program on the global mesh, and each holds only its own devices' shards. This module is the thin
layer jaxspec puts over it:

    initialize("10.0.0.1:1234", num_processes=2, process_id=0)   # on host 0 (host 1: process_id=1)
    initialize()                                                  # SLURM, Open MPI, ...: auto-detected
    check_agreement(checkpoint=checkpoint_identity(path), config=...)   # before compiling
    result = gather(run())                                        # every field on every process

`initialize` wraps `jax.distributed.initialize` (run with jax 0.10.2; its keyword arguments used
here, `initialization_timeout`, `coordinator_bind_address`, `heartbeat_timeout_seconds` and
`shutdown_timeout_seconds`, keep their names in later releases) with checked arguments and bounded
timeouts: the coordination service counts a process without a heartbeat for `heartbeat_timeout`
seconds as lost, and the runtime then terminates every other process with a message that gives
the lost process's id ("The following tasks are unhealthy (stopped sending heartbeats): 1"). On the
CPU the processes exchange data through gloo (`jax_cpu_collectives_implementation`), so a
multi-process mesh runs, and is tested, on one host with loopback addresses.

`check_agreement` exists because processes given different checkpoints, configs or decode
settings would otherwise compile different programs and hang in the first collective, or silently
decode garbage: every process hashes what it was given and all hashes are compared before anything
is compiled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
import socket
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

# Bytes hashed from each end of a checkpoint file (see checkpoint_identity).
SAMPLE_BYTES = 1 << 16


def _check_address(coordinator: str) -> tuple[str, int]:
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"coordinator={coordinator!r}: expected HOST:PORT with a port in [1, 65535], "
                         "e.g. 10.0.0.1:1234")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _await_coordinator(host: str, port: int, timeout: int, process_id: int, num_processes: int) -> int:
    """Wait until the coordinator accepts connections; the seconds of `timeout` left (at least 1).

    JAX's own wait for a missing coordinator ends in a process abort that says only "Deadline
    Exceeded ... RegisterTask"; this check turns it into a Python error that names the address."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())).close()
            return max(1, round(deadline - time.monotonic()))
        except OSError as error:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no coordinator answered at {host}:{port} within {timeout} s (this is process "
                                   f"{process_id} of {num_processes}; process 0 serves the coordinator there): "
                                   f"{error}") from None
            time.sleep(0.2)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, initialization_timeout: int = 300, heartbeat_timeout: int = 100,
               shutdown_timeout: int = 300) -> None:
    """Join this process to a multi-process JAX run; call it first, before any other JAX call.

    coordinator "HOST:PORT" (process 0's address; it serves the coordination service there),
    num_processes >= 1, process_id in [0, num_processes): all three, or none to let JAX detect them
    from the cluster's environment (SLURM, Open MPI, `JAX_COORDINATOR_ADDRESS` /
    `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`, ...). A loopback coordinator (127.0.0.1, ::1,
    localhost) is served on that address only, so a one-host run listens on no other interface.

    initialization_timeout: seconds to wait for every process to join; TimeoutError when no
    coordinator answers within it. heartbeat_timeout: seconds without a heartbeat after
    which a process counts as lost and the others are terminated. shutdown_timeout: seconds a
    finishing process waits for the others at exit (a peer that failed with an error is noticed
    here). Raises ValueError naming a bad argument before contacting anyone.
    """
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    missing = [name for name, value in given.items() if value is None]
    if missing and len(missing) < len(given):
        raise ValueError(f"{', '.join(missing)}: give coordinator, num_processes and process_id together, "
                         "or none of them (the cluster's environment is auto-detected)")
    for name, value in {"initialization_timeout": initialization_timeout, "heartbeat_timeout": heartbeat_timeout,
                        "shutdown_timeout": shutdown_timeout}.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a whole number of seconds >= 1")
    bind = None
    if not missing:
        host, port = _check_address(coordinator)
        if not isinstance(num_processes, int) or num_processes < 1:
            raise ValueError(f"num_processes={num_processes!r}: must be an integer >= 1")
        if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id!r}: must be an integer in [0, {num_processes - 1}] "
                             f"(num_processes={num_processes})")
        if _is_loopback(host):
            bind = coordinator
        if process_id != 0:
            initialization_timeout = _await_coordinator(host, port, initialization_timeout, process_id, num_processes)
    if jax.config.jax_cpu_collectives_implementation is None:  # older jax: no CPU collectives unless asked
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=initialization_timeout,
                               coordinator_bind_address=bind, heartbeat_timeout_seconds=heartbeat_timeout,
                               shutdown_timeout_seconds=shutdown_timeout)


def checkpoint_identity(directory: str | os.PathLike) -> dict[str, Any]:
    """A cheap fingerprint of a checkpoint directory, for `check_agreement`: every file's relative
    path and size, and a SHA-256 of its first and last `SAMPLE_BYTES` bytes (a whole checkpoint is
    too large to hash on every start; the ends of a safetensors file hold its header and last
    tensor, and a config.json is hashed whole). The directory's own path is not part of it: hosts
    may mount the same checkpoint at different paths. Copies agree; two `jaxspec convert` runs of
    one checkpoint do not (orbax names its data files at random)."""
    directory = os.fspath(directory)
    files = {}
    for root, _, names in os.walk(directory):
        for name in sorted(names):
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                digest.update(f.read(SAMPLE_BYTES))
                if size > SAMPLE_BYTES:
                    f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
                    digest.update(f.read())
            files[os.path.relpath(path, directory)] = [size, digest.hexdigest()]
    return dict(sorted(files.items()))


def _digest(value: Any) -> np.ndarray:
    text = json.dumps(value, sort_keys=True, default=repr)
    return np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)


def check_agreement(**given: Any) -> None:
    """Raise ValueError unless every process was given the same values, before anything compiles.

    given: what this process was given, by name (e.g. checkpoint=checkpoint_identity(dir),
    config=..., decoding=...): JSON-able values (anything else is compared by its repr). Each
    process hashes each value and the hashes are all-gathered; the error names each process whose
    values differ from process 0's and which names differ. Every process must call it with the
    same names. One process: nothing to compare, returns at once.
    """
    if jax.process_count() == 1:
        return
    names = sorted(given)
    mine = np.stack([_digest(given[name]) for name in names] + [_digest(names)])
    everyone = np.asarray(multihost_utils.process_allgather(mine))  # [P, len(names) + 1, 32]
    if (everyone[:, -1] != everyone[0, -1]).any():
        raise ValueError(f"check_agreement: processes passed different names (this one: {names})")
    differ = {p: [name for i, name in enumerate(names) if (everyone[p, i] != everyone[0, i]).any()]
              for p in range(everyone.shape[0])}
    differ = {p: bad for p, bad in differ.items() if bad}
    if differ:
        lines = "; ".join(f"process {p} differs from process 0 in {', '.join(bad)}" for p, bad in differ.items())
        raise ValueError(f"the {everyone.shape[0]} processes were not given the same inputs: {lines} "
                         f"(this is process {jax.process_index()}); start every process with the same "
                         "checkpoint, config and decode settings")


def gather(tree):
    """Every array of `tree` (a pytree, or a dataclass of arrays such as `GenerateResult`) whole on
    every process, as numpy: a global array's shards live on several processes, and only a whole
    array can be read on the host (`process_allgather`)."""
    if dataclasses.is_dataclass(tree):
        fields = {field.name: getattr(tree, field.name) for field in dataclasses.fields(tree)}
        return dataclasses.replace(tree, **gather(fields))
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    return multihost_utils.process_allgather(tree, tiled=True)
