"""One engine across processes (jaxspec.distributed): two processes of 2 CPU devices each (gloo collectives), the
model split over all 4, process 0 scheduling and the other following its device operations, emit the tokens of
one process over 4 devices (tensor_parallel_size=4), with chunked prefill, n-gram drafts, a prefix-cache hit, a
seeded sampled request and a logit bias; and the follower ends holding the leader's replicated state (the device
history, token counts and logit-bias table: every device operation mirrored, in order)."""
import json
import os
import socket
import subprocess
import sys

import pytest

from distributed_case import ENGINE, model, run
from jaxspec import LLM

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_worker.py")


def two_free_ports() -> int:
    """A port p with p and p + 1 free (jax.distributed's coordinator and the engine's connection)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("localhost", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


def test_two_processes_emit_the_tokens_of_one(tmp_path):
    single = LLM(model(), **ENGINE, tensor_parallel_size=4)
    want = run(single)
    port, out = two_free_ports(), tmp_path / "tokens.json"
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=4",
                                                    "--xla_force_host_platform_device_count=2")
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, WORKER, str(rank), str(port), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a process of the engine across processes hung")
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    got, follower = (json.loads(open(f"{out}.{rank}").read()) for rank in (0, 1))
    assert got["tokens"] == want
    assert "structured_outputs: not supported by an engine across processes" in got["refused"]
    assert follower["held"] == got["held"]   # the follower's copy of the replicated state is the leader's
    assert got["hit_tokens"] > 0 and got["stats"]["accepted_tokens"] > 0   # the paths ran: a cache hit, drafts
    assert got["stats"] == single.stats()["spec"]
