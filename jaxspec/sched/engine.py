"""The engine loop: schedule step N+1, dispatch it, then read step N (dispatched one iteration ago).

    schedule(N+1) -> build host inputs -> dispatch step(N+1) -> start copy of out(N+1) to host
                 -> read out(N) -> update requests, stop checks, free -> publish deltas

Sync mode is the same loop reading out(N+1) at once; both run the same jitted step (the ModelRunner, the
device side). The loop is driven by `LLM.generate` / `LLM.stream`, or runs on its own thread (`start`), in
which case callers read each request's deltas from its output queue (`subscribe`).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import numbers
import queue
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode.inputs import (MAX_STOP_IDS, REQUEST_FLOAT_ROWS, REQUEST_INT_ROWS, STEP_INT_ROWS,
                                   request_values)
from jaxspec.decode.runner import ModelRunner
from jaxspec.decode.state import LOGPROBS_MODES, StepConfig
from jaxspec.decode.step import StepVariant
from jaxspec.nn.ops import Ops
from jaxspec.nn.sharding import TensorParallel
from jaxspec.sampling_params import SamplingParams
from jaxspec.sched.adaptive import KChooser
from jaxspec.sched.block_manager import BlockManager
from jaxspec.sched.output import confirm_tokens, render_texts, take_delta
from jaxspec.sched.request import Request, Status
from jaxspec.sched.scheduler import ScheduledRow, Scheduler
from jaxspec.structured.compiler import GrammarCompiler, TokenAutomaton
from jaxspec.structured.params import StructuredOutputsParams
from jaxspec.structured.table import GrammarTables

# The step's per-step row ints, in the order `_dispatch` writes them (decode/inputs.py declares them).
assert STEP_INT_ROWS == ["slot", "num_new", "start", "num_drafts", "first_token", "sample", "new_slot", "grammar_base",
                         "grammar_init"]
GRAMMAR_BASE_COLUMN = STEP_INT_ROWS.index("grammar_base")

# Compiled for every bucket at warm-up: greedy rows only, and rows that sample (no top-k/top-p, penalties
# or logprobs). Other variants compile the first time a step needs them (counted in stats()["recompiles"]).
WARM_VARIANTS = (StepVariant(), StepVariant(sample=True))


@dataclasses.dataclass
class EngineConfig:
    max_num_seqs: int = 16
    max_model_len: int | None = None          # default: min(model's max positions, 4096)
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None          # default: from kv_memory_fraction on a GPU, else enough for all
    kv_memory_fraction: float | None = None   # share of free device memory for the KV pool (GPU default 0.5)
    async_scheduling: bool = True
    enable_prefix_caching: bool = True        # off by itself for models with per-slot (recurrent) layer state
    warmup: bool = True
    seed: int = 0
    # Device-specific choices, measured on an H100 (docs/benchmarks.md); "auto" picks the GPU ones there.
    attention: str = "auto"           # "pallas" (reads KV pages in place) or "reference" (jnp gather)
    unroll_layers: bool | None = None  # layers unrolled (stacked weights indexed statically) or scanned
    delta_rule: str = "auto"     # Gated DeltaNet recurrence: "reference" (JAX scan), "pallas" (kernel), "auto" (GPU: kernel)
    tensor_parallel_size: int = 1     # devices the model is split over (nn/sharding.py)
    structured_compile_timeout: float = 30.0   # seconds one request's structured-outputs constraint may compile
    logprobs_mode: str = "raw_logprobs"   # what `logprobs` returns: "raw_logprobs" or "processed_logprobs" (vLLM's)

    def validate(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid; it must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} is invalid; it must be >= 2")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} is invalid; it must be >= 1")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction < 1:
            raise ValueError(f"kv_memory_fraction={self.kv_memory_fraction} is invalid; it must be in (0, 1)")
        if not (isinstance(self.structured_compile_timeout, (int, float)) and self.structured_compile_timeout > 0):
            raise ValueError(f"structured_compile_timeout={self.structured_compile_timeout!r} is invalid; it must be "
                             "a number of seconds > 0")
        if self.attention not in ("auto", "pallas", "reference"):
            raise ValueError(f"attention={self.attention!r} is invalid; choose 'auto', 'pallas' or 'reference'")
        if self.delta_rule not in ("auto", "pallas", "reference"):
            raise ValueError(f"delta_rule={self.delta_rule!r} is invalid; choose 'auto', 'pallas' or 'reference'")
        if self.logprobs_mode not in LOGPROBS_MODES:
            logits_mode = self.logprobs_mode in ("raw_logits", "processed_logits")
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r} is invalid"
                             f"{' (vLLM logits modes are not supported)' if logits_mode else ''}; choose "
                             f"{' or '.join(map(repr, LOGPROBS_MODES))}")


@dataclasses.dataclass
class _InFlight:
    rows: list[ScheduledRow]
    out: dict
    want_logprobs: bool
    index: int = 0                 # the step's number (counters["steps"] before it)
    draft_width: int = 0           # drafts it verifies (at most) and proposes per row
    num_tokens: int = 0            # its token bucket
    dispatched: float = 0.0        # host clock when its dispatch began (the inputs' transfer)
    compiled: bool = False         # its dispatch compiled the step (its time is no measure)
    proposed: int = 0              # drafts it proposes for its sampling rows (the k chosen for them)


class Engine:
    def __init__(self, model, config: EngineConfig, speculative_config=None):
        from jaxspec.spec import SpeculativeConfig, build_drafter
        config.validate()
        self.model, self.config, self.tokenizer = model, config, model.tokenizer
        mc = model.config
        max_model_len = config.max_model_len or min(mc.max_position_embeddings, 4096)
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} is invalid for this model: it has "
                             f"max_position_embeddings={mc.max_position_embeddings}; give max_model_len in "
                             f"[2, {mc.max_position_embeddings}]")
        spec = SpeculativeConfig.coerce(speculative_config)
        self.speculative_config = spec
        drafter, drafter_params = build_drafter(spec, model) if spec is not None else (None, None)
        draft_configs = [drafter.config] if drafter is not None and hasattr(drafter, "config") else []
        tp = TensorParallel.create(config.tensor_parallel_size, [mc, *draft_configs])
        max_blocks = -(-max_model_len // config.block_size)
        dtype = model.params["embed"].dtype
        num_blocks = config.num_kv_blocks or self._default_num_blocks(config, mc, max_blocks, dtype, tp)
        self.step_config = StepConfig(block_size=config.block_size, num_blocks=num_blocks,
                                      num_slots=config.max_num_seqs, max_model_len=max_model_len,
                                      num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                                      logprobs_mode=config.logprobs_mode)
        ops = Ops.for_backend(config.block_size, config.attention, config.unroll_layers, tp, config.delta_rule)
        self.runner = ModelRunner(model, self.step_config, ops, drafter, drafter_params,
                                  max_rows=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens)
        # A cached block holds KV only: a layer kind with per-slot state (a recurrent state) would need that
        # state at the prefix's end too, which is not kept, so such models run without the cache.
        recurrent = sorted(k for k, f in self.runner.target.per_slot_fields(self.step_config.cache_shape).items() if f)
        caching = config.enable_prefix_caching and not recurrent
        self.prefix_cache_disabled_reason = None if caching else (
            "enable_prefix_caching=False" if not config.enable_prefix_caching else
            f"the model's {', '.join(recurrent)} layers keep a per-slot recurrent state that a cached block of KV "
            "does not hold (the state at the prefix's end is not saved), so reusing cached blocks would not be exact")
        self.blocks = BlockManager(num_blocks, config.block_size, config.max_num_seqs, enable_prefix_caching=caching,
                                   key_overlap=int(drafter is not None and drafter.kv_reads_next_token))
        # Structured outputs: constraints compiled on first use (jaxspec.structured), and the device table of the
        # automata running requests use.
        self.grammar_compiler: GrammarCompiler | None = None
        self._grammar_compiler_lock = threading.Lock()
        self.grammar_tables = GrammarTables(mc.vocab_size, self.runner.input_sharding)
        self.scheduler = Scheduler(self.blocks, self.step_config, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   draft_lookahead=drafter is not None and drafter.needs_kv_lookahead)
        # Unfinished requests by id, and groups (SamplingParams.n > 1) with any unfinished completion: what
        # `abort` finds and what a new request's id must not repeat. A finished request is forgotten here.
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}
        self._ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self._in_flight: _InFlight | None = None
        # Each slot's request's fixed row values and stop ids (`_write_slot_values`), gathered per step.
        slots = self.step_config.num_slots
        self._slot_ints = np.zeros((slots, len(REQUEST_INT_ROWS)), np.int32)
        self._slot_floats = np.zeros((slots, len(REQUEST_FLOAT_ROWS)), np.float32)
        self._slot_stop_ids = np.full((slots, MAX_STOP_IDS), -1, np.int32)
        self._compiled_at_warmup: int | None = None
        self.counters = {"steps": 0, "scheduled_rows": 0, "padded_tokens": 0, "scheduled_tokens": 0}
        k = self.step_config.num_speculative_tokens
        self.spec_counters = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                              "accepted_per_position": np.zeros(max(k, 1), np.int64),
                              "chosen_k": np.zeros(k + 1, np.int64)}
        # Adaptive speculation: the host picks each step's k (jaxspec.sched.adaptive); None: always k.
        self.k_chooser = (KChooser(k, config.max_num_batched_tokens, self.runner.bucket_for)
                          if spec is not None and spec.adaptive else None)
        self._last_ready: float | None = None   # when the last step read was found ready (host clock)
        # The loop on its own thread (start/stop): every engine change is made under this lock, which the loop
        # holds for a whole step (the device wait included). Other threads never wait for it: their new
        # requests and aborts go into `_intake`, which the loop applies at the start of its next step.
        self._lock = threading.RLock()
        self._intake: collections.deque = collections.deque()   # ("add", [Request]) | ("abort", request_id)
        self._intake_lock = threading.Lock()                     # held for an append or a drain, never a step
        self._pending_ids: set[str] = set()                      # ids added to the intake, not yet applied
        self._stepped = threading.Condition(self._lock)   # notified after each step of the thread's loop
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: BaseException | None = None   # what stopped the loop thread, if anything did
        if config.warmup:
            self.warmup()

    @staticmethod
    def _default_num_blocks(config, mc, max_blocks, dtype, tp=None) -> int:
        enough = config.max_num_seqs * max_blocks
        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform == "gpu" else None
        if not stats:
            return enough
        itemsize = jnp.dtype(dtype).itemsize
        per_block = 2 * mc.num_layers * config.block_size * mc.num_kv_heads * mc.head_dim * itemsize
        if tp is not None and tp.shard_attention:
            per_block //= tp.size   # each device holds its KV heads' share of a block
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        return max(1, min(enough, int(free * (config.kv_memory_fraction or 0.5) // per_block)))

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, outputs: queue.SimpleQueue | None = None) -> Request:
        """Queues a request (checked first: a ValueError queues nothing). `outputs`: a queue that receives the
        request's RequestOutput deltas as the engine confirms them (its text rendered as it grows).
        One completion: `add_group` takes SamplingParams.n > 1."""
        if isinstance(params, SamplingParams) and params.n != 1:
            raise ValueError(f"SamplingParams.n={params.n}: add_request queues one completion; use add_group")
        return self.add_group(prompt_token_ids, params, prompt, request_id, outputs)[0]

    def add_group(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                  request_id: str | None = None, outputs: queue.SimpleQueue | None = None) -> list[Request]:
        """Queues a prompt's SamplingParams.n completions, one request each (ids "<request_id>-<index>" when
        n > 1; `abort(request_id)` ends them all). Completions after the first wait for the first to have
        cached the prompt's blocks, then share them."""
        if self.failure is not None:
            raise RuntimeError(f"the engine loop stopped after an error: {self.failure!r}")
        self.validate_request(prompt_token_ids, params)
        # The completions share their constraint's automaton (compiled by validate_request: a cache hit here).
        grammar = self.compile_structured(params.structured_outputs) if params.structured_outputs is not None else None
        eos = tuple(self.tokenizer.eos_token_ids) if self.tokenizer is not None else tuple(
            self.model.config.eos_token_ids)
        with self._intake_lock:
            request_id = request_id if request_id is not None else str(next(self._ids))
            if request_id in self._pending_ids or any(not r.finished for r in self._requests_of(request_id)):
                raise ValueError(f"request_id {request_id!r} is already running")
            group = []
            for index in range(params.n):
                sp = params.for_completion(index)
                seed = sp.seed if sp.seed is not None else int(self._rng.integers(0, 2**31 - 1))
                req = Request(request_id if params.n == 1 else f"{request_id}-{index}", list(prompt_token_ids), sp,
                              seed, eos, prompt=prompt, parent_id=request_id if params.n > 1 else None, index=index)
                stop_ids = ([] if sp.ignore_eos else list(eos)) + sp.stop_token_ids
                req.min_tokens_stop_ids = stop_ids[:MAX_STOP_IDS] if sp.min_tokens else []
                req.row_ints, req.row_floats = request_values(req, self.model.config.vocab_size)
                req.step_variant = StepVariant.of(sp)
                req.grammar = grammar
                if outputs is not None:
                    req.outputs, req.stream_text = outputs, True
                if group and self.blocks.enable_prefix_caching:
                    req.prefix_leader = group[0]
                group.append(req)
            if self.failure is not None:   # checked again under the intake lock: the failing loop drains it
                raise RuntimeError(f"the engine loop stopped after an error: {self.failure!r}")
            self._pending_ids.add(request_id)
            self._intake.append(("add", (request_id, group)))
        if not self.running_on_thread:
            with self._lock:
                self._apply_intake()
        self._wake.set()
        return group

    def _apply_intake(self):
        """(Under `_lock`.) Queues the requests and applies the aborts other threads handed in, in order."""
        if not self._intake:   # the common case of a step: no lock taken
            return
        with self._intake_lock:
            items = list(self._intake)
            self._intake.clear()
            self._pending_ids.clear()
        for kind, value in items:
            if kind == "abort":
                self._abort_now(value)
                continue
            request_id, group = value
            for req in group:
                self.requests[req.request_id] = req
                self.scheduler.add(req)
                if req.grammar is not None:
                    self.grammar_tables.acquire(req.grammar)
            if len(group) > 1:
                self.groups[request_id] = group

    def _requests_of(self, request_id: str) -> list[Request]:
        """The requests `request_id` names: one, or a group's n completions."""
        if request_id in self.groups:
            return self.groups[request_id]
        return [self.requests[request_id]] if request_id in self.requests else []

    def validate_request(self, prompt_token_ids, params: SamplingParams):
        sc, v = self.step_config, self.model.config.vocab_size
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token")
        not_ids = [t for t in prompt_token_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if not_ids:
            raise ValueError(f"prompt token ids must be ints; got {type(not_ids[0]).__name__} {not_ids[0]!r}")
        bad = [t for t in prompt_token_ids if not 0 <= t < v]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {v})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < v]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids has ids {bad[:5]} outside the vocabulary [0, {v})")
        if params.structured_outputs is not None:
            self.compile_structured(params.structured_outputs)
        if n + max(1, params.min_tokens) > sc.max_model_len:
            raise ValueError(f"the prompt has {n} tokens and min_tokens={params.min_tokens}: more than "
                             f"max_model_len={sc.max_model_len} allows (prompt + max(1, min_tokens) <= max_model_len)")
        # Alone in the pool, a request must reach its end: prompt + max_tokens (+ drafts in flight).
        need = min(n + params.max_tokens + sc.num_speculative_tokens + self.scheduler.draft_lookahead,
                   sc.max_model_len)
        if self.blocks.blocks_for(need) > self.blocks.num_blocks:
            raise ValueError(f"the prompt has {n} tokens and max_tokens={params.max_tokens}: that can never fit the "
                             f"KV pool of {self.blocks.num_blocks} blocks x {sc.block_size} tokens; raise "
                             f"num_kv_blocks or lower max_tokens")

    def compile_structured(self, params: StructuredOutputsParams) -> TokenAutomaton:
        """The constraint's token automaton: compiled once (on a worker thread, within the per-request limit
        `structured_compile_timeout`) and cached. A ValueError says why a constraint cannot be used. Thread-safe:
        a server compiles here before it queues the request, off its event loop and off the engine loop."""
        with self._grammar_compiler_lock:
            if self.grammar_compiler is None:
                self.grammar_compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size,
                                                        self.config.structured_compile_timeout)
        return self.grammar_compiler.compile(params)

    def abort(self, request_id: str):
        """Ends the request (or every completion of a group) with finish_reason "abort": at once when the
        caller drives the loop, at the start of the loop's next step when it runs on its own thread."""
        with self._intake_lock:
            self._intake.append(("abort", request_id))
        if not self.running_on_thread:
            with self._lock:
                self._apply_intake()
        self._wake.set()

    def _abort_now(self, request_id: str):
        with self._lock:
            reqs = [r for r in self._requests_of(request_id) if not r.finished]
            for req in reqs:
                self.scheduler.finish(req, "abort")
                req.finish_time = time.perf_counter()
                self._forget(req)
            self._publish(reqs)

    def _forget(self, req: Request):
        if req.grammar is not None and self.requests.get(req.request_id) is req:
            self.grammar_tables.release(req.grammar)
        self.requests.pop(req.request_id, None)
        if req.parent_id is not None and all(r.finished for r in self.groups.get(req.parent_id, ())):
            self.groups.pop(req.parent_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._intake) or self.scheduler.has_work() or self._in_flight is not None

    # ---- one iteration -----------------------------------------------------------------------------
    def step(self, timings: dict | None = None) -> list[Request]:
        """Plan and dispatch the next step, then read the previous one. Returns requests with news.
        `timings`: host seconds per phase (schedule, build, issue, wait, process, publish) are added to it."""
        with self._lock:
            clock = time.perf_counter
            t0 = clock()
            self._apply_intake()
            rows = self.scheduler.schedule()
            t1 = clock()
            record = self._dispatch(rows, timings) if rows else None
            t2 = clock()
            updated: list[Request] = []
            if self._in_flight is not None:
                updated += self._process(self._in_flight, timings)
                self._in_flight = None
            if record is not None:
                if self.config.async_scheduling:
                    self._in_flight = record
                else:
                    updated += self._process(record, timings)
            elif not updated and self.scheduler.has_work():
                raise RuntimeError("the scheduler can place no request although some wait: the KV pool "
                                   f"({self.blocks.num_blocks} blocks) or max_num_batched_tokens is too small")
            t3 = clock()
            self._publish(updated)
            if timings is not None:
                timings["schedule"] = timings.get("schedule", 0.0) + t1 - t0
                timings["dispatch"] = timings.get("dispatch", 0.0) + t2 - t1
                timings["publish"] = timings.get("publish", 0.0) + clock() - t3
            return updated

    def flush(self) -> list[Request]:
        """Reads the in-flight step, if any, without dispatching another."""
        with self._lock:
            pending, self._in_flight = self._in_flight, None
            updated = self._process(pending) if pending is not None else []
            self._publish(updated)
            return updated

    def _dispatch(self, rows: list[ScheduledRow], timings: dict | None = None) -> _InFlight:
        t0 = time.perf_counter()
        num_new = [row.num_new for row in rows]
        num_tokens = sum(num_new)
        T = self.runner.bucket_for(num_tokens)
        inp = self.runner.new_inputs(T)
        n = len(rows)
        first = list(itertools.accumulate(num_new, initial=0))   # each row's first token in the step (and the end)
        counts = np.asarray(num_new, np.int64)
        tokens = inp.tokens
        tokens["row"][:num_tokens] = np.repeat(np.arange(n), counts)
        tokens["offset"][:num_tokens] = np.arange(num_tokens) - np.repeat(first[:-1], counts)
        for r, row in enumerate(rows):
            if row.new_slot:   # the request's first step in its slot: its fixed values go in the slot's table row
                self._write_slot_values(row.request)
            if row.token_ids:
                tokens["token_id"][first[r]:first[r] + row.num_new] = row.token_ids
            if row.cached_ids:
                self.runner.write_history(row.request.slot, row.cached_ids)
        slots = [row.request.slot for row in rows]
        inp.write_rows(self._step_row_values(rows, slots, counts, first), self._slot_ints[slots],
                       self._slot_floats[slots])
        inp.stop_ids[:n] = self._slot_stop_ids[slots]
        block_ids = [row.request.block_ids for row in rows]
        lengths = np.fromiter(map(len, block_ids), np.int64, n)
        inp.block_tables[:n][np.arange(inp.block_tables.shape[1]) < lengths[:, None]] = list(
            itertools.chain.from_iterable(block_ids))   # row-major: each row's blocks, then padding
        variant = StepVariant.union([row.request.step_variant for row in rows if row.sample])
        index = self.counters["steps"]
        width, proposed = self._draft_width(rows, index)
        if width != self.step_config.num_speculative_tokens:
            variant = dataclasses.replace(variant, drafts=width)
        grammar_table = self.grammar_tables.device_table() if variant.grammar else None
        t1 = time.perf_counter()
        out = self.runner.run(inp, variant, grammar_table)
        if timings is not None:
            timings["build"] = timings.get("build", 0.0) + t1 - t0
            timings["issue"] = timings.get("issue", 0.0) + time.perf_counter() - t1
        self.counters["steps"] += 1
        self.counters["scheduled_rows"] += n
        self.counters["scheduled_tokens"] += num_tokens
        self.counters["padded_tokens"] += T
        return _InFlight(rows, out, variant.logprobs, index, width, T, t1, self.runner.last_run_compiled, proposed)

    def _write_slot_values(self, req: Request):
        """The request's fixed row values (decode/inputs.py) and its stop ids masked until min_tokens, in the
        host tables indexed by slot, from which each step's rows are gathered in one indexing."""
        self._slot_ints[req.slot] = req.row_ints
        self._slot_floats[req.slot] = req.row_floats
        self._slot_stop_ids[req.slot] = -1
        self._slot_stop_ids[req.slot, :len(req.min_tokens_stop_ids)] = req.min_tokens_stop_ids

    def _step_row_values(self, rows: list[ScheduledRow], slots: list[int], counts: np.ndarray,
                         first: list[int]) -> np.ndarray:
        """[n, len(STEP_INT_ROWS)]: the step's own row values. Whole columns as decode rows have them (the
        device's own start, drafts = the rest of the row, sampling, no grammar); then rows that differ
        (prefill rows, constrained ones) one by one. Named by column: a new STEP_INT_ROWS field is a KeyError
        here until it is given its value."""
        decode_rows = {"slot": slots, "num_new": counts, "start": -1, "num_drafts": counts - 1,
                       "first_token": first[:-1], "sample": 1, "new_slot": 0, "grammar_base": -1, "grammar_init": -1}
        values = np.empty((len(rows), len(STEP_INT_ROWS)), np.int32)
        for i, name in enumerate(STEP_INT_ROWS):
            values[:, i] = decode_rows[name]
        for r, row in enumerate(rows):
            if row.start < 0 and row.request.grammar is not None:   # a constrained decode row: its automaton
                values[r, GRAMMAR_BASE_COLUMN] = self.grammar_tables.base(row.request.grammar)
            elif row.start >= 0:
                base, init = self._grammar_row(row)
                own = {"slot": slots[r], "num_new": row.num_new, "start": row.start, "num_drafts": row.num_drafts,
                       "first_token": first[r], "sample": row.sample, "new_slot": row.new_slot,
                       "grammar_base": base, "grammar_init": init}
                values[r] = [own[name] for name in STEP_INT_ROWS]
        return values

    def _grammar_row(self, row: ScheduledRow) -> tuple[int, int]:
        """(grammar_base, grammar_init) of a row: where its automaton sits in the table (-1: unconstrained)
        and, for the prefill row that emits its first token, the state its outputs so far lead to (the initial
        state, or after a preemption the state the device had reached: every output is confirmed by then)."""
        req = row.request
        if req.grammar is None:
            return -1, -1
        init = req.grammar.walk(req.output_token_ids) if row.start >= 0 and row.sample else -1
        return self.grammar_tables.base(req.grammar), init

    def _draft_width(self, rows: list[ScheduledRow], index: int) -> tuple[int, int]:
        """-> (the step's draft width, the k it proposes for its sampling rows). k is K, or the chooser's pick
        under adaptive speculation; each row's next decode step verifies that many. The width is at least k
        and every row's drafts to verify (a step that lowers k still verifies the drafts proposed before it)."""
        K = self.step_config.num_speculative_tokens
        sampling = [row for row in rows if row.sample]
        if not K:
            return 0, 0
        k = K
        if sampling and self.k_chooser is not None:
            k = self.k_chooser.choose(index, len(sampling))
        for row in sampling:
            row.request.num_proposed = k
        if self.k_chooser is None:
            return K, k
        return max([k if sampling else 0] + [row.num_drafts for row in rows]), k

    def _process(self, rec: _InFlight, timings: dict | None = None) -> list[Request]:
        t0 = time.perf_counter()
        out = rec.out
        # The loop's one read of the device: allowed under any transfer guard (a test runs the loop with every
        # other device-to-host transfer disallowed)
        with jax.transfer_guard_device_to_host("allow"):
            tokens = np.asarray(out["tokens"])         # [R, K+2]: emitted tokens, then the accepted count
            lp = {k: np.asarray(out[k]) for k in ("logprob", "top_ids", "top_logprobs")} if rec.want_logprobs else None
        t1 = time.perf_counter()
        if self.k_chooser is not None:
            self._observe(rec, tokens[:, -1], t1)
        if self.step_config.num_speculative_tokens and any(row.sample and not row.request.finished
                                                           for row in rec.rows):
            self.spec_counters["chosen_k"][rec.proposed] += 1   # counted as read: async counts as sync does
        rows_tokens = tokens.tolist()   # Python ints, read once: no per-row array indexing below
        now = time.perf_counter()      # the arrival time of every token this step confirms
        live, sampled = [], []
        for r, (row, row_tokens) in enumerate(zip(rec.rows, rows_tokens)):
            req = row.request
            req.in_flight -= 1
            req.in_flight_samples -= int(row.sample)
            if req.finished:
                continue  # finished one step ago: this step's result for it is dropped
            live.append(row)
            n_acc = row_tokens[-1]
            if row.num_drafts:
                self._count_spec(req, row.num_drafts, n_acc)
                if req.status is Status.RUNNING:
                    req.num_computed -= row.num_drafts - n_acc   # the optimistic plan assumed all accepted
            if row.sample:
                per_token_lp = None
                if lp is not None and req.params.logprobs is not None:
                    n_top = req.params.logprobs
                    per_token_lp = [{"logprob": float(lp["logprob"][r, j]),
                                     "top": list(zip(lp["top_ids"][r, j, :n_top].tolist(),
                                                     lp["top_logprobs"][r, j, :n_top].tolist()))}
                                    for j in range(n_acc + 1)]
                confirm_tokens(req, row_tokens[:n_acc + 1], self.step_config.max_model_len, per_token_lp, now)
                sampled.append(req)
        render_texts(sampled, self.tokenizer)
        updated = []
        for row in live:
            req = row.request
            if not row.sample:
                if req.status is Status.RUNNING:
                    self._cache_final_blocks(req, row.start + row.num_new)
                continue
            if req.status is Status.RUNNING:
                self._cache_final_blocks(req, req.num_tokens - 1)   # the last emitted token's KV is not written
            if req.finish_reason:
                self.scheduler.finish(req, req.finish_reason)
                self._forget(req)
                req.finish_time = time.perf_counter()
            updated.append(req)
        if timings is not None:
            timings["wait"] = timings.get("wait", 0.0) + t1 - t0
            timings["process"] = timings.get("process", 0.0) + time.perf_counter() - t1
        return updated

    def _observe(self, rec: _InFlight, accepted, ready: float):
        """The chooser learns what the step's rows accepted, and the step's time: from when the device could
        start it (its dispatch began and the step before it was done) to when it was found ready."""
        start = rec.dispatched if self._last_ready is None else max(rec.dispatched, self._last_ready)
        self._last_ready = ready
        # No measure when it compiled, or when the host compiled the step dispatched after it before reading
        # it (async): the host then found it ready late.
        seconds = None if rec.compiled or self.runner.last_run_compiled else ready - start
        rows = [(row.num_drafts, int(accepted[r])) for r, row in enumerate(rec.rows)
                if row.num_drafts and not row.request.finished]
        self.k_chooser.observe(rec.index, rows, (rec.draft_width, rec.num_tokens, seconds))

    def _cache_final_blocks(self, req: Request, num_computed: int):
        """Registers the request's blocks whose KV is final, now that a step computing its first
        `num_computed` tokens has been read: confirmed tokens only, never drafts, and with an EAGLE head all
        but the last of them (the head writes position p-1 when it is fed token p)."""
        num_final = num_computed - self.blocks.key_overlap
        if self.blocks.enable_prefix_caching and num_final // self.blocks.block_size > len(req.block_hashes):
            tokens = req.prompt_token_ids + req.output_token_ids
            self.blocks.cache_blocks(req.block_ids, tokens, req.block_hashes, num_final)

    def _publish(self, updated: list[Request]):
        """Each streamed request with news gets its delta on its output queue."""
        for req in updated:
            if req.outputs is not None:
                delta = take_delta(req, self.tokenizer)
                if delta is not None:
                    req.outputs.put(delta)

    def _count_spec(self, req: Request, num_drafts: int, n_acc: int):
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += n_acc
        s = self.spec_counters
        s["drafts"] += 1
        s["draft_tokens"] += num_drafts
        s["accepted_tokens"] += n_acc
        s["accepted_per_position"][:n_acc] += 1

    # ---- the loop on its own -----------------------------------------------------------------------
    def start(self):
        """Runs the loop on a thread of its own until `stop()`: requests added from any thread are served,
        and their deltas arrive on their output queues (`add_request(..., outputs=queue)`)."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="jaxspec-engine", daemon=True)
        self._thread.start()

    def stop(self):
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping = True
            self._wake.set()
            thread.join()

    @property
    def running_on_thread(self) -> bool:
        return self._thread is not None

    def _serve(self):
        try:
            while not self._stopping:
                if self.has_unfinished():
                    self.step()
                    with self._stepped:
                        self._stepped.notify_all()
                else:
                    self._wake.wait(0.1)
                    self._wake.clear()
        except BaseException as e:   # the loop is gone: end every request rather than leave its reader waiting
            self.failure = e
            traceback.print_exc()
            with self._lock:
                self._apply_intake()   # after `failure` is set nothing more enters the intake
            for request_id in list(self.requests):
                self._abort_now(request_id)
            with self._stepped:
                self._stepped.notify_all()

    def run_until(self, done, on_update=None):
        """Until `done()`: drives the loop (or, when it runs on its own thread, waits for it). `on_update`
        gets the requests each step updated (driven mode)."""
        if self.running_on_thread:
            with self._stepped:
                self._stepped.wait_for(done)
            return
        while not done():
            updated = self.step()
            if on_update is not None:
                on_update(updated)

    def drain(self):
        """Reads the last in-flight step when nothing else is scheduled, so a driven engine ends quiet."""
        if not self.running_on_thread:
            while self.has_unfinished() and not self.scheduler.has_work():
                self.step()

    # ---- compilation and stats ---------------------------------------------------------------------
    def _warm_variants(self) -> list[StepVariant]:
        variants = list(WARM_VARIANTS)
        if self.k_chooser is not None:   # every draft width the chooser may pick
            variants += [dataclasses.replace(v, drafts=k) for k in range(self.step_config.num_speculative_tokens)
                         for v in WARM_VARIANTS]
        return variants

    def warmup(self):
        """Compile the step for every token bucket and warm variant."""
        self.runner.warmup(self._warm_variants())
        self._compiled_at_warmup = self.runner.num_compiled()

    def warmup_structured(self, params: StructuredOutputsParams, sample: bool | None = None):
        """Compiles a constraint, places its automaton in the device table and compiles the grammar variants of
        the step for every token bucket and that table's shape: requests with this constraint then compile
        nothing (a benchmark, or a server that knows its constraints ahead). `sample`: only the greedy (False) or
        only the random (True) variants; None: both. Call it with no request running."""
        automaton = self.compile_structured(params)
        with self._lock:
            self.grammar_tables.acquire(automaton)   # its place stays after the release, until space is needed
            self.grammar_tables.release(automaton)
            variants = [dataclasses.replace(v, grammar=True) for v in self._warm_variants()
                        if sample is None or v.sample == sample]
            self.runner.warmup(variants, self.grammar_tables.device_table())
            if self._compiled_at_warmup is not None:
                self._compiled_at_warmup = self.runner.num_compiled()

    def stats(self) -> dict:
        c, runner = self.counters, self.runner
        baseline = self._compiled_at_warmup
        out = {
            "steps": c["steps"],
            "token_buckets": list(runner.token_buckets),
            "compiled_steps": runner.num_compiled(),   # (bucket, variant) pairs compiled so far
            "recompiles": max(0, runner.num_compiled() - baseline) if baseline is not None else None,
            "argument_buffers": runner.argument_buffers(),
            "scheduled_rows": c["scheduled_rows"],
            "scheduled_tokens": c["scheduled_tokens"],
            "padded_tokens": c["padded_tokens"],
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_kv_blocks": self.blocks.num_blocks,
            "free_kv_blocks": self.blocks.num_free_blocks,
            "prefix_cache": {**self.blocks.stats(), "disabled_reason": self.prefix_cache_disabled_reason},
            "async_scheduling": self.config.async_scheduling,
            "structured_outputs": {**self.grammar_tables.stats(), "compiled": (
                len(self.grammar_compiler) if self.grammar_compiler is not None else 0)},
        }
        k = self.step_config.num_speculative_tokens
        if k:
            s = self.spec_counters
            drafts, dt, acc = s["drafts"], s["draft_tokens"], s["accepted_tokens"]
            out["spec"] = {
                "num_speculative_tokens": k,
                "drafts": drafts, "draft_tokens": dt, "accepted_tokens": acc,
                "acceptance_rate": acc / dt if dt else 0.0,
                "mean_acceptance_length": 1 + acc / drafts if drafts else 1.0,
                "per_position_acceptance": (s["accepted_per_position"] / drafts).tolist() if drafts else [0.0] * k,
                "adaptive": self.k_chooser is not None,
                "chosen_k": s["chosen_k"].tolist(),   # steps that proposed k drafts, k = 0..K
            }
        return out
