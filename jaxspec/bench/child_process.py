"""A timed child process of `jaxspec-bench startup`: jaxspec's start-up runs (jaxspec/bench/startup.py) and vLLM's
(jaxspec/bench/baselines/vllm.py) alike. The parent notes the wall clock just before it starts the child
($JAXSPEC_STARTUP_T0), so that the child can report its phases in seconds since then; the child prints its result
as one JSON line on stdout, and everything else it prints is passed on."""
from __future__ import annotations

import json
import subprocess
import time

T0_ENV = "JAXSPEC_STARTUP_T0"


def run_timed_child(cmd: list[str], env: dict, what: str) -> dict:
    """Runs `cmd` with `env` and $JAXSPEC_STARTUP_T0 set to now; its result (child_result). The child's stderr
    (progress bars, an engine's log) passes through."""
    env = dict(env)
    env[T0_ENV] = repr(time.time())
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    return child_result(proc, what)


def child_result(proc: subprocess.CompletedProcess, what: str) -> dict:
    """The JSON object of a child's last stdout line that is one; its other lines are passed on."""
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            try:
                result = json.loads(line)
                continue
            except ValueError:
                pass
        print(line)
    if proc.returncode != 0 or result is None:
        raise SystemExit(f"jaxspec-bench startup: error: {what} failed (exit code {proc.returncode}); its output "
                         "is above")
    return result
