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
lands; a step always runs the best tier compiled so far. A tuned compile that XLA cannot finish for lack of memory
(its autotuner sizes a buffer for every operand of a fusion: a stacked weight of tens of GB, H100, GPT-OSS-20B's
experts, docs/lab/2026-11-27-moe-kernel.md) leaves that program at its fast tier, with a warning, instead of
stopping the engine. Programs are keyed by (token bucket, variant, the shapes
of the grammar table a grammar variant reads). On a GPU every compiled program is also kept in a ProgramStore, from
which the next engine of the same fingerprint loads it without tracing, lowering or compiling.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import os
import pathlib
import threading
import time
import warnings
import weakref
from typing import Callable

FAST, TUNED = "fast", "tuned"
_RANK = {FAST: 0, TUNED: 1}


def out_of_memory(error: BaseException) -> bool:
    """Whether a compile failed for lack of device memory (XLA's RESOURCE_EXHAUSTED), not for a fault in the
    program."""
    return isinstance(error, RuntimeError) and "RESOURCE_EXHAUSTED" in str(error)
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


def compile_threads(background: bool = False) -> int:
    """Compiles run at once when none autotunes: the host's cores (XLA's own compile is mostly one thread), one of them
    left to the engine loop while it serves beside background compiles."""
    return max(1, min(16, os.cpu_count() or 1) - background)


def store_wanted(platform: str) -> bool:
    """Whether engines keep their compiled programs in a ProgramStore: JAXSPEC_PROGRAM_STORE "1" / "0", or (unset,
    "auto") on GPUs only. A CPU program serialized by one process failed to run in another ("Function ... not
    found": its code is not all in the serialized bytes), docs/lab/2026-11-26-startup.md."""
    value = os.environ.get("JAXSPEC_PROGRAM_STORE", "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"JAXSPEC_PROGRAM_STORE={value!r}; valid: auto, 0, 1")
    return value == "1" or (value == "auto" and platform in ("gpu", "cuda", "rocm"))


class ProgramStore:
    """Compiled step programs kept on disk per engine fingerprint (the runner's hash of everything a program is
    compiled from, jaxspec's source included), one file per program and tier. A warm start loads a program from here
    without tracing or lowering it, which JAX's persistent cache needs first to compute its key (0.85 s a program for
    the 1.5B model, 2.1 s with a draft model, measured on an H100), and knows at once which programs it has tuned.
    A file that fails to load is removed and its program compiled again. Only programs compiled by this process are
    kept: a CPU program loaded from JAX's persistent cache and serialized again failed to run ("Function ... not
    found"). The fingerprints used least recently are pruned beyond `keep`. `device_ids`: the devices every program
    runs on, in the order it is compiled for (the runner's: its mesh's, or its one device)."""

    SUFFIX = ".xla"

    def __init__(self, root, fingerprint: str, device_ids: list[int], keep: int = 8):
        self.dir = pathlib.Path(root) / fingerprint
        self.device_ids = list(device_ids)
        self.saves = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxspec-store")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            os.utime(self.dir)
            self.names = {p.name[:-len(self.SUFFIX)] for p in self.dir.glob("*" + self.SUFFIX)}
            others = sorted((p for p in self.dir.parent.iterdir() if p.is_dir() and p != self.dir),
                            key=lambda p: p.stat().st_mtime, reverse=True)
            for old in others[keep - 1:]:
                for f in old.iterdir():
                    f.unlink()
                old.rmdir()
        except OSError:
            self.names = set()

    @staticmethod
    def name(key, tier: str) -> str | None:
        T, variant, grammar = key
        # grammar programs are compiled for a table's shapes, which grow with the constraints served: not kept
        return None if grammar is not None else f"{T}-{variant.name().replace('/', '_')}-{tier}"

    def has(self, key, tier: str) -> bool:
        return self.name(key, tier) in self.names

    def load(self, key, tier: str):
        """The stored program (jax.stages.Compiled), or None where it is not there or does not load."""
        import pickle

        import jax

        from jax.experimental import serialize_executable
        name = self.name(key, tier)
        if name not in self.names:
            return None
        path = self.dir / (name + self.SUFFIX)
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            by_id = {d.id: d for d in jax.devices()}
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                             execution_devices=[by_id[i] for i in self.device_ids])
        except Exception:   # noqa: BLE001 - a stale or truncated file: compiled again, and replaced
            self.names.discard(name)
            path.unlink(missing_ok=True)
            return None

    def save(self, key, tier: str, program):
        """Writes the program on the store's own thread (serializing a large program takes a while)."""
        name = self.name(key, tier)
        if name is not None and name not in self.names:
            self.names.add(name)
            self.saves.submit(self._write, name, program)

    def _write(self, name: str, program):
        import pickle

        from jax.experimental import serialize_executable
        try:
            data = pickle.dumps(serialize_executable.serialize(program))
            tmp = self.dir / f"{name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self.dir / (name + self.SUFFIX))
        except Exception:   # noqa: BLE001 - a program that does not serialize, a read-only cache: not kept
            self.names.discard(name)

    def flush(self):
        """Waits for the writes in progress."""
        self.saves.submit(lambda: None).result()


class StepPrograms:
    """`lower(key, tier, grammar_spec)` -> (jax.stages.Lowered, trace seconds, lower seconds); `tiers(bucket)` -> the
    tiers a bucket's programs have, cheapest first. `get(key)` is the loop's lookup; `compile` compiles now (the
    caller waits), `start_background` on a thread of its own."""

    def __init__(self, lower: Callable, tiers: Callable[[int], tuple[str, ...]], store: ProgramStore | None = None):
        self._lower, self.tiers = lower, tiers
        self.programs: dict[tuple, object] = {}   # key -> compiled program (jax.stages.Compiled), the best tier
        self.tier: dict[tuple, str] = {}
        self.log: list[dict] = []   # one entry per compile: bucket, variant, tier, trace/lower/compile seconds, ...
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.failure: BaseException | None = None   # what stopped the background compiles
        self.untunable: dict[tuple, str] = {}   # key -> why its tuned compile failed: it stays at its fast tier
        self.store = store   # where compiled programs are kept on disk (store_wanted), or None
        # Called on the compiling thread before each compile with (key, tier): tests hold a compile back with it.
        self.before_compile: Callable[[tuple, str], None] | None = None
        _listen_for_cache_hits()

    # ---- the loop's side -----------------------------------------------------------------------------
    def get(self, key):
        return self.programs.get(key)

    def start_tier(self, key) -> str:
        """The tier a tiered start compiles `key` at first: tuned where the store has it, else fast."""
        return TUNED if self.store is not None and self.store.has(key, TUNED) else FAST

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
        """The tier a job compiles at: `tier` where the bucket has it, else (None, or one tier only) its best; fast
        for a program whose tuned compile ran out of memory."""
        tiers = self.tiers(key[0])
        if key in self.untunable and FAST in tiers:
            return FAST
        return tier if tier in tiers else tiers[-1]

    def _run_jobs(self, jobs, grammar_spec, parallel: bool, desc: str | None, background: bool = False):
        jobs = [(key, self._tier_of(key, tier)) for key, tier in jobs]
        jobs = [(key, tier) for key, tier in dict.fromkeys(jobs) if not self.ready(key, tier)]
        if not jobs:
            return
        from tqdm.auto import tqdm
        bar = tqdm(total=len(jobs), desc=desc, leave=False, disable=desc is None)
        jobs = self._load_stored(jobs, bar)
        autotuned = [(k, t) for k, t in jobs if t == TUNED and len(self.tiers(k[0])) > 1]
        plain = [(k, t) for k, t in jobs if (k, t) not in autotuned]
        if parallel and len(plain) > 1:
            lowered = []
            for key, tier in plain:   # tracing holds the GIL: one by one; XLA's compiles release it
                if self._stop.is_set():
                    return
                lowered.append((key, tier, *self._lower(key, tier, grammar_spec)))
            with concurrent.futures.ThreadPoolExecutor(min(compile_threads(background), len(lowered))) as pool:
                for _ in pool.map(lambda job: self._compile_lowered(*job), lowered):
                    bar.update()
        else:
            autotuned = plain + autotuned
        for key, tier in autotuned:
            if self._stop.is_set():
                return
            if not self.ready(key, tier):
                try:
                    self._compile_lowered(key, tier, *self._lower(key, tier, grammar_spec))
                except RuntimeError as e:
                    if tier != TUNED or FAST not in self.tiers(key[0]) or not out_of_memory(e):
                        raise
                    self._keep_fast(key, e, grammar_spec)
            bar.update()
        bar.close()

    def _keep_fast(self, key, error: BaseException, grammar_spec):
        """`key`'s tuned compile ran out of device memory: it runs its fast program from now on (compiled here if it
        has none yet), and no tuned compile of it is tried again."""
        reason = str(error).strip().splitlines()[0][:300]
        self.untunable[key] = reason
        warnings.warn(f"the tuned compile of the {key[0]}-token step ({key[1].name()}) ran out of device memory "
                      f"({reason}); that step runs its fast program (no autotuning)", RuntimeWarning, stacklevel=2)
        if not self.ready(key, FAST):
            self._compile_lowered(key, FAST, *self._lower(key, FAST, grammar_spec))

    def _load_stored(self, jobs, bar) -> list:
        """Loads the jobs the store has (in parallel: loading copies each program to the device), and returns the
        others (a grammar program is never stored)."""
        stored = [(k, t) for k, t in jobs if self.store is not None and self.store.has(k, t)]
        if not stored:
            return jobs
        in_background = threading.current_thread() is not threading.main_thread()

        def load(job):
            key, tier = job
            if self._stop.is_set() and in_background:
                return False
            t0 = time.perf_counter()
            program = self.store.load(key, tier)
            if program is not None:
                self._keep(key, tier, program, "store", 0.0, 0.0, t0, time.perf_counter())
                bar.update()
            return program is not None

        with concurrent.futures.ThreadPoolExecutor(min(compile_threads(), len(stored))) as pool:
            loaded = dict(zip(stored, pool.map(load, stored)))
        return [job for job in jobs if not loaded.get(job)]

    def _keep(self, key, tier, program, source, trace_s, lower_s, t0, done):
        with self._lock:
            if not self.ready(key, tier):   # a better tier may have landed meanwhile
                self.programs[key], self.tier[key] = program, tier
            if self.store is not None and source == "compiled":
                self.store.save(key, tier, program)
            T, variant, _ = key
            self.log.append({"bucket": T, "variant": variant.name(), "tier": tier, "source": source,
                             "trace_s": round(trace_s, 3),
                             "lower_s": round(lower_s, 3), "compile_s": round(done - t0, 3), "done_at": done,
                             "thread": "main" if threading.current_thread() is threading.main_thread() else "pool"})

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
        self._keep(key, tier, program, source, trace_s, lower_s, t0, done)

    # ---- in the background ---------------------------------------------------------------------------
    def start_background(self, jobs: list[tuple[tuple, str]]):
        """Compiles these (key, tier) jobs on a thread of its own: the fast ones first, in parallel, then the
        tuned ones (one by one where they autotune). The engine serves meanwhile with whatever is ready."""
        if all(self.ready(k, self._tier_of(k, t)) for k, t in jobs):
            return

        def run():
            try:
                jobs_at = [(key, self._tier_of(key, tier)) for key, tier in jobs]
                self._run_jobs([j for j in jobs_at if j[1] == FAST], None, True, None, background=True)
                self._run_jobs([j for j in jobs_at if j[1] == TUNED], None, True, None, background=True)
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
