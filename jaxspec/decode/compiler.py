"""The runner's compiled step programs, and when each is compiled: before the engine serves, in the background while
it serves, or when a step first needs it.

Where a fresh engine's compile time goes (H100, Qwen2.5-Coder-1.5B, random weights, docs/lab/2026-11-26-startup.md):
an 8-token step compiles in ~30 s, ~25 s of it XLA autotuning the step's Triton GEMMs on the GPU; the same step
with cuBLAS GEMMs and no autotuning compiles in ~3.5 s (with a 0.5B draft model at k = 4: 71 s against 12 s).
Tracing and lowering take 0.5-0.7 s a step (3 s with the draft model); a step holds two Pallas kernels. Autotuning
times kernels on the GPU, so compiles that autotune run one at a time: twelve at once took as long as one after
another, and XLA warned that its timings were disturbed. Compiles that do not autotune run in parallel.

So each program has two tiers:
    fast   no autotuning (cuBLAS GEMMs, XLA's heuristic choice): seconds to compile, slower small steps
    tuned  the engine's measured choice (Ops.compiler_options: autotuned Triton GEMMs below 128 tokens)
Where the two are the same compile (a CPU), there is one. A program's tuned tier replaces its fast one when it
lands; a step always runs the best tier compiled so far. Programs are keyed by (token bucket, variant, the shapes
of the grammar table a grammar variant reads).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import pathlib
import threading
import time
import weakref
from typing import Callable

FAST, TUNED = "fast", "tuned"
_RANK = {FAST: 0, TUNED: 1}
_CACHE_HIT = "/jax/compilation_cache/cache_hits"   # JAX's event: a compile loaded from its persistent cache
_hits = threading.local()   # cache hits seen on this thread (compiles run on the thread that asks for them)
_listening = False


def _count_cache_hits(event: str, **_):
    if event == _CACHE_HIT:
        _hits.count = getattr(_hits, "count", 0) + 1


def _listen_for_cache_hits():
    global _listening
    if not _listening:
        import jax
        jax.monitoring.register_event_listener(_count_cache_hits)
        _listening = True


_BACKGROUND: "weakref.WeakSet[StepPrograms]" = weakref.WeakSet()   # engines compiling in the background


@atexit.register
def _stop_background_compiles():
    """At exit, background compiles stop after the one in progress, which is waited for: a thread left inside XLA's
    compiler while the interpreter and XLA's objects are torn down can crash the exit."""
    for programs in list(_BACKGROUND):
        programs.stop()
        programs.join(timeout=120)


def compile_threads() -> int:
    """Compiles run at once when none autotunes: the host's cores (XLA's own compile is mostly one thread)."""
    return max(1, min(16, os.cpu_count() or 1))


class TunedOnDisk:
    """The programs whose tuned tier an engine of the same fingerprint compiled on this machine before, kept in a
    small file in jaxspec's cache directory, beside JAX's persistent compilation cache, which holds their executables
    (kept there only while that cache is on): those load in about a
    second, so a tiered start takes them at once instead of compiling their fast tier first. A hint only: a program
    it names that is no longer in the cache compiles (autotunes) again, to the same program."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        self._lock = threading.Lock()
        try:
            self.names = set(json.loads(self.path.read_text()))
        except (OSError, ValueError):
            self.names = set()

    @staticmethod
    def name(key) -> str | None:
        T, variant, grammar = key
        return None if grammar is not None else f"{T}:{variant.name()}"

    def has(self, key) -> bool:
        return self.name(key) in self.names

    def add(self, key):
        name = self.name(key)
        if name is None or name in self.names:
            return
        with self._lock:
            self.names.add(name)
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(sorted(self.names)))
                os.replace(tmp, self.path)
            except OSError:
                pass   # a read-only cache: the hint is lost, nothing else


class StepPrograms:
    """`lower(key, tier, grammar_spec)` -> (jax.stages.Lowered, trace seconds, lower seconds); `tiers(bucket)` -> the
    tiers a bucket's programs have, cheapest first. `get(key)` is the loop's lookup; `compile` compiles now (the
    caller waits), `start_background` on a thread of its own."""

    def __init__(self, lower: Callable, tiers: Callable[[int], tuple[str, ...]]):
        self._lower, self.tiers = lower, tiers
        self.programs: dict[tuple, object] = {}   # key -> compiled program (jax.stages.Compiled), the best tier
        self.tier: dict[tuple, str] = {}
        self.log: list[dict] = []   # one entry per compile: bucket, variant, tier, trace/lower/compile seconds, ...
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.failure: BaseException | None = None   # what stopped the background compiles
        self.tuned_on_disk: TunedOnDisk | None = None   # set where a persistent compilation cache keeps programs
        # Called on the compiling thread before each compile with (key, tier): tests hold a compile back with it.
        self.before_compile: Callable[[tuple, str], None] | None = None
        _listen_for_cache_hits()

    # ---- the loop's side -----------------------------------------------------------------------------
    def get(self, key):
        return self.programs.get(key)

    def start_tier(self, key) -> str:
        """The tier a tiered start compiles `key` at first: tuned where the disk cache has it, else fast."""
        return TUNED if self.tuned_on_disk is not None and self.tuned_on_disk.has(key) else FAST

    def ready(self, key, tier: str | None = None) -> bool:
        have = self.tier.get(key)
        return have is not None and (tier is None or _RANK[have] >= _RANK[tier])

    def num_programs(self) -> int:
        return len(self.programs)

    def stats(self) -> dict:
        tiers = list(self.tier.values())
        return {"programs": len(self.programs), "fast": tiers.count(FAST), "tuned": tiers.count(TUNED),
                "compiling": self.compiling(), "compiles": len(self.log),
                "compile_seconds": round(sum(e["compile_s"] for e in self.log), 3)}

    # ---- compiling -----------------------------------------------------------------------------------
    def compile(self, keys, tier: str | None = None, grammar_spec=None, parallel: bool = True,
                desc: str | None = None):
        """Compiles these keys' programs at `tier` (None: each bucket's best tier) unless a program at least as good
        is there. Programs that autotune compile one by one; others in parallel when `parallel`."""
        self._run_jobs([(key, tier) for key in keys], grammar_spec, parallel, desc)

    def _tier_of(self, key, tier: str | None) -> str:
        """The tier a job compiles at: `tier` where the bucket has it, else (None, or one tier only) its best."""
        tiers = self.tiers(key[0])
        return tier if tier in tiers else tiers[-1]

    def _run_jobs(self, jobs, grammar_spec, parallel: bool, desc: str | None):
        jobs = [(key, self._tier_of(key, tier)) for key, tier in jobs]
        jobs = [(key, tier) for key, tier in dict.fromkeys(jobs) if not self.ready(key, tier)]
        if not jobs:
            return
        from tqdm.auto import tqdm
        bar = tqdm(total=len(jobs), desc=desc, leave=False, disable=desc is None)
        autotuned = [(k, t) for k, t in jobs if t == TUNED and len(self.tiers(k[0])) > 1]
        plain = [(k, t) for k, t in jobs if (k, t) not in autotuned]
        if parallel and len(plain) > 1:
            lowered = []
            for key, tier in plain:   # tracing holds the GIL: one by one; XLA's compiles release it
                if self._stop.is_set():
                    return
                lowered.append((key, tier, *self._lower(key, tier, grammar_spec)))
            with concurrent.futures.ThreadPoolExecutor(min(compile_threads(), len(lowered))) as pool:
                for _ in pool.map(lambda job: self._compile_lowered(*job), lowered):
                    bar.update()
        else:
            autotuned = plain + autotuned
        for key, tier in autotuned:
            if self._stop.is_set():
                return
            if not self.ready(key, tier):
                self._compile_lowered(key, tier, *self._lower(key, tier, grammar_spec))
            bar.update()
        bar.close()

    def _compile_lowered(self, key, tier, lowered, trace_s, lower_s):
        if self.before_compile is not None:
            self.before_compile(key, tier)
        if self._stop.is_set() and threading.current_thread() is not threading.main_thread():
            return   # stopped: what was lowered is dropped
        hits = getattr(_hits, "count", 0)
        t0 = time.perf_counter()
        program = lowered.compile()
        done = time.perf_counter()
        source = "disk" if getattr(_hits, "count", 0) > hits else "compiled"
        with self._lock:
            if not self.ready(key, tier):   # a better tier may have landed meanwhile
                self.programs[key], self.tier[key] = program, tier
            if tier == TUNED and self.tuned_on_disk is not None:
                self.tuned_on_disk.add(key)
            T, variant, _ = key
            self.log.append({"bucket": T, "variant": variant.name(), "tier": tier, "source": source,
                             "trace_s": round(trace_s, 3),
                             "lower_s": round(lower_s, 3), "compile_s": round(done - t0, 3), "done_at": done,
                             "thread": "main" if threading.current_thread() is threading.main_thread() else "pool"})

    # ---- in the background ---------------------------------------------------------------------------
    def start_background(self, jobs: list[tuple[tuple, str]]):
        """Compiles these (key, tier) jobs on a thread of its own: the fast ones first, in parallel, then the
        tuned ones (one by one where they autotune). The engine serves meanwhile with whatever is ready."""
        if all(self.ready(k, self._tier_of(k, t)) for k, t in jobs):
            return

        def run():
            try:
                jobs_at = [(key, self._tier_of(key, tier)) for key, tier in jobs]
                self._run_jobs([j for j in jobs_at if j[1] == FAST], None, True, None)
                self._run_jobs([j for j in jobs_at if j[1] == TUNED], None, True, None)
            except BaseException as e:   # noqa: BLE001 - kept for the engine to report; the loop goes on
                self.failure = e
        self._thread = threading.Thread(target=run, name="jaxspec-compile", daemon=True)
        _BACKGROUND.add(self)
        self._thread.start()

    def compiling(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the background compiles; False if they are still running after `timeout` seconds."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self.failure is not None:
            raise RuntimeError(f"compiling step programs in the background failed: {self.failure!r}") from self.failure
        return not self.compiling()

    def stop(self):
        """Stops the background compiles after the one in progress."""
        self._stop.set()

    def join(self, timeout: float | None = None):
        """Waits for the background thread to end (after `stop`: the compile in progress)."""
        if self._thread is not None:
            self._thread.join(timeout)
