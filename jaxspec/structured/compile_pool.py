"""Worker processes that compile structured-outputs constraints, each one killable: a compile that runs past its
time budget is stopped by killing its process, and each process's address space is capped at the memory budget
(jaxspec/structured/worker.py runs in it), so no constraint can keep a CPU busy or grow the server's memory after
its request was refused.

The pool holds at most `size` processes, started on first use (an LLM that never compiles a constraint starts
none). Each receives the model's vocabulary once, when it starts. A compile waits for a free process at most
`wait` seconds; when every process stays busy with other requests' compiles that long, it gets
`CompileUnavailable` (the server is busy; the constraint is not at fault).

Processes are started with `subprocess` (fork + exec of a fresh interpreter running worker.py as a script), not
`multiprocessing`: forking the parent's JAX threads is unsafe, and a spawned multiprocessing child imports the
parent's `__main__` again (a user's script without a main guard would build its LLM once more).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
START_TIMEOUT = 60.0     # seconds a new process may take to start and load the vocabulary
# A process that holds more memory than this after a compile is ended (a new one starts when needed): memory a
# large compile freed often stays with the process, and idle workers should not keep the server big.
RECYCLE_ABOVE_BYTES = 512 * 2**20
KILL_WAIT = 5.0          # seconds to wait for a killed process to be reaped


class CompileUnavailable(RuntimeError):
    """No compile process could take the constraint: all were busy with other requests' compiles for the whole
    wait, the pool was closed (shutdown), or a process could not start. Not the constraint's fault."""


class _Worker:
    """One compile process and the two pipes to it."""

    def __init__(self, setup: dict, max_bytes: int):
        to_child, from_parent = _pipe()
        to_parent, from_child = _pipe()
        self.jobs, self.results = Connection(to_child, readable=False), Connection(from_child, writable=False)
        self.process = None
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_outlines_core_dir(),
                                                                          os.environ.get("PYTHONPATH")]))}
        try:
            try:
                self.process = subprocess.Popen(
                    [sys.executable, WORKER_SCRIPT, str(from_parent), str(to_parent), str(max_bytes)],
                    pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL, env=env)
            finally:   # the child's ends: it has its own copies
                os.close(from_parent)
                os.close(to_parent)
            self.jobs.send(setup)
            if not self.results.poll(START_TIMEOUT):
                raise TimeoutError(f"no answer in {START_TIMEOUT:g} s")
            self.results.recv()
        except (OSError, EOFError, TimeoutError) as e:
            status = self.process.poll() if self.process is not None else None
            self.kill()
            raise CompileUnavailable(f"the structured-outputs compile process could not start ({e!r}, exit status "
                                     f"{status}); see the server's log") from None

    @property
    def pid(self) -> int:
        return self.process.pid

    def run(self, kind: str, regex: str, timeout: float) -> tuple[str, object] | None:
        """The worker's answer to one job, or None when it did not answer within `timeout` seconds. An EOFError
        when the process ended while compiling (see `ended_by`)."""
        self.jobs.send((kind, regex))
        if not self.results.poll(timeout):
            return None
        return self.results.recv()

    def resident_bytes(self) -> int:
        """The process's resident memory (0 where /proc cannot tell)."""
        try:
            with open(f"/proc/{self.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ended_by(self) -> str:
        """How the process that closed its pipe ended: a signal's name or an exit status."""
        try:
            code = self.process.wait(KILL_WAIT)
        except subprocess.TimeoutExpired:   # alive with its pipe closed: no use any more
            self.end_process()
            return "closing its pipe"
        return signal.Signals(-code).name if code < 0 else f"exit status {code}"

    def end_process(self):
        """Kills the process (a compile it runs stops; whoever waits for its answer sees the pipe close)."""
        if self.alive:
            self.process.kill()
            try:
                self.process.wait(KILL_WAIT)
            except subprocess.TimeoutExpired:   # not reaped yet: the OS finishes it; nothing else holds it
                pass

    def kill(self):
        """Kills the process and closes the pipes (only the thread that holds the worker, or none, may)."""
        self.end_process()
        for conn in (self.jobs, self.results):
            conn.close()


class CompilePool:
    """At most `size` compile processes, each capped at `max_bytes` of address space (0: no cap)."""

    def __init__(self, make_setup, size: int, max_bytes: int):
        self._make_setup = make_setup    # () -> the setup dict each process receives (the vocabulary): built once
        self._setup: dict | None = None
        self.size, self.max_bytes = size, max_bytes
        self._cond = threading.Condition()
        self._free = size                # processes a compile may take (started or still to start)
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set() # every started process (close() kills them)
        self.closed = False

    @property
    def pids(self) -> list[int]:
        """The running compile processes' ids."""
        with self._cond:
            return [w.pid for w in self._live]

    def compile(self, kind: str, regex: str, timeout: float, wait: float) -> tuple[str, object]:
        """A worker's answer ("ok", arrays) / ("refused", why) / ("memory", why), ("timeout", None) when the compile
        took longer than `timeout` seconds (its process killed), or ("ended", how) when its process died (out
        of memory). CompileUnavailable when no process was free within `wait` seconds."""
        worker = self._acquire(wait)
        try:
            if worker is not None and not worker.alive:   # ended while idle (killed from outside): not this job's
                self._forget(worker)
                worker = None
            if worker is None:
                worker = self._start()
            try:
                outcome = worker.run(kind, regex, timeout)
            except (EOFError, OSError):
                if self.closed:
                    raise CompileUnavailable("the structured-outputs compile was stopped: the server is shutting "
                                             "down") from None
                return "ended", worker.ended_by()
            if outcome is None:
                worker.kill()
                return "timeout", None
            if outcome[0] == "memory" or worker.resident_bytes() > RECYCLE_ABOVE_BYTES:
                worker.kill()
            return outcome
        finally:
            self._release(worker)

    def close(self):
        """Kills every process (compiles under way end with CompileUnavailable); later compiles are refused. The
        pipes of a process a compile holds are closed by that compile's thread, which may be reading them."""
        with self._cond:
            self.closed = True
            idle, busy = list(self._idle), [w for w in self._live if w not in self._idle]
            self._idle.clear()
            self._live.difference_update(idle)
            self._cond.notify_all()
        for w in idle:
            w.kill()
        for w in busy:
            w.end_process()

    def _acquire(self, wait: float) -> _Worker | None:
        """An idle process, or None: a place to start one. Waits `wait` seconds at most for a place."""
        deadline = time.monotonic() + wait
        with self._cond:
            while self._free == 0 and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CompileUnavailable(
                        f"the server is busy: its {self.size} structured-outputs compile processes stayed busy with "
                        f"other requests' constraints for {wait:g} s; retry later")
                self._cond.wait(left)
            if self.closed:
                raise CompileUnavailable("structured outputs are not compiled any more: the server is shutting down")
            self._free -= 1
            return self._idle.pop() if self._idle else None

    def _release(self, worker: _Worker | None):
        with self._cond:
            self._free += 1
            if worker is not None and worker.alive and not self.closed:
                self._idle.append(worker)
            elif worker is not None:
                self._forget(worker)
            self._cond.notify()

    def _forget(self, worker: _Worker):
        with self._cond:
            self._live.discard(worker)
        worker.kill()

    def _start(self) -> _Worker:
        with self._cond:
            if self._setup is None:
                self._setup = self._make_setup()
            setup = self._setup
        worker = _Worker(setup, self.max_bytes)
        with self._cond:
            self._live.add(worker)
        return worker


def _pipe() -> tuple[int, int]:
    """(write end, read end) of a new pipe, both inheritable by a child that is handed them by number."""
    read, write = os.pipe()
    return write, read


def _outlines_core_dir() -> str:
    """Where outlines-core is installed: the worker's interpreter finds it there even when this process found it
    through a path added at run time."""
    import outlines_core
    return os.path.dirname(os.path.dirname(os.path.abspath(outlines_core.__file__)))
