"""The engine loop: schedule step N+1, dispatch it, then read step N (dispatched one iteration ago).

    schedule(N+1) -> build host inputs -> dispatch step(N+1) -> start copy of out(N+1) to host
                 -> read out(N) -> settle the plan, confirm tokens, stop checks, free -> publish deltas

Sync mode is the same loop reading out(N+1) at once; both run the same jitted step (the ModelRunner, the
device side). The loop is driven by `LLM.generate` / `LLM.stream`, or runs on its own thread (`start`), in
which case callers read each request's deltas from their output queues.

The engine composes its rooms and runs the loop between them: the intake (requests checked, built and handed
in: sched/intake.py), the scheduler (plans a step and settles it when read: sched/scheduler.py), the step
builder (a plan's host inputs: sched/step_builder.py), the runner (the device side: decode/runner.py), output
processing (sched/output.py) and the counters (sched/stats.py). Configuration and KV sizing: sched/config.py.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import traceback

import jax
import numpy as np

from jaxspec.decode.compiler import FAST, TUNED
from jaxspec.decode.runner import ModelRunner
from jaxspec.decode.state import StepConfig
from jaxspec.decode.step import StepVariant
from jaxspec.nn.ops import Ops
from jaxspec.nn.sharding import TensorParallel
from jaxspec.sampling_params import SamplingParams
from jaxspec.sched.adaptive import KChooser
from jaxspec.sched.block_manager import BlockManager
from jaxspec.sched.config import EngineConfig
from jaxspec.sched.intake import Intake
from jaxspec.sched.output import (PROMPT_LOGPROB_ARRAYS, confirm_tokens, record_prompt_logprobs, render_texts,
                                  row_logprobs, take_delta)
from jaxspec.sched.request import Request
from jaxspec.sched.scheduler import Scheduler
from jaxspec.sched.stats import EngineCounts
from jaxspec.sched.step_builder import StepBuilder, StepPlan
from jaxspec.structured.compiler import TokenAutomaton
from jaxspec.structured.params import StructuredOutputsParams
from jaxspec.structured.table import GrammarTables

__all__ = ["Engine", "EngineConfig"]

# Compiled for every bucket at warm-up: greedy rows only, and rows that sample (no top-k/top-p, penalties
# or logprobs). Other variants compile the first time a step needs them (counted in stats()["recompiles"]).
WARM_VARIANTS = (StepVariant(), StepVariant(sample=True))


@dataclasses.dataclass
class _InFlight:
    plan: StepPlan
    out: dict
    index: int = 0                 # the step's number (steps counted before it)
    dispatched: float = 0.0        # host clock when its dispatch began (the inputs' transfer)
    untimed: bool = False          # its dispatch compiled the step or ran a program for one of its first times
                                   # (runner.UNTIMED_RUNS): its time is no measure


# A draft model under tensor parallelism, split as the target is, reads 1/N of its weights per forward and adds two
# all-reduces per layer; whole on each device it reads all of them and adds none. Unset
# (SpeculativeConfig.draft_tensor_parallel_size), it runs whole where the reads that adds take less time than the
# all-reduces it saves. The constants are measured: an all-reduce with the idle around it, ~19 us at TP=2 (an
# H100 pair's trace, docs/lab/2026-11-27-tp-ray.md) and ~23 us at TP=4 (four H100s' steps, docs/lab/2026-11-27-tp4.md;
# three or more devices are priced as four); ~3e12 bytes/s of copy bandwidth (an H100's 2.98, an H200's 3.67 TB/s). A
# Llama-3.2-1B draft (2.5 GB, 16 layers) at TP=2: 0.41 ms of reads against 0.61 ms of all-reduces per forward, so
# whole; measured on two H200s, its four forwards a step took 0.82 ms less whole than split (0.91x the step at batch
# 1, docs/lab/2026-11-28-tp-draft-h200.md). An 8B draft (16 GB, 32 layers): 2.7 against 1.2 ms, so split.
DRAFT_ALL_REDUCE_S = {2: 19e-6, 4: 23e-6}
DRAFT_HBM_BYTES_PER_S = 3e12
# Passes over every (draft width, bucket) that Engine.time_steps times: each pair's best is its price.
TIMING_ROUNDS = 2
# Tokens of context each row of Engine.time_steps's context steps reads (at most half of max_model_len): what a
# query token's attention costs per context token is their time over a blank step's, divided out.
TIMED_CONTEXT = 1024


def draft_runs_whole(weight_bytes: int, num_layers: int, tensor_parallel_size: int) -> bool:
    """Whether a draft model of these weights and layers runs faster whole on each of the devices than split."""
    all_reduce_s = DRAFT_ALL_REDUCE_S[2 if tensor_parallel_size == 2 else 4]
    reads_added = weight_bytes * (1 - 1 / tensor_parallel_size) / DRAFT_HBM_BYTES_PER_S
    return reads_added < 2 * num_layers * all_reduce_s


class Engine:
    def __init__(self, model, config: EngineConfig, speculative_config=None):
        from jaxspec.spec import SpeculativeConfig, build_drafter
        t_start = time.perf_counter()
        config.validate()
        if config.quantization is None and getattr(model, "quantization", None):
            # a checkpoint stored quantized (FP8) runs as such, as vLLM takes the checkpoint's scheme
            config = dataclasses.replace(config, quantization=model.quantization)
        self.model, self.config, self.tokenizer = model, config, model.tokenizer
        mc = model.config
        max_model_len = config.resolve_max_model_len(mc)
        spec = self.speculative_config = SpeculativeConfig.coerce(speculative_config)
        drafter, drafter_params = build_drafter(spec, model) if spec is not None else (None, None)
        if config.quantization is not None:
            model, drafter, drafter_params = self._quantize(config.quantization, model, drafter, drafter_params)
            self.model = model
        draft_configs = [drafter.config] if drafter is not None and hasattr(drafter, "config") else []
        whole_draft = self._draft_whole_on_each_device(spec, config.tensor_parallel_size, drafter, drafter_params)
        # a draft model kept whole on each device is not split: its widths need not divide by the devices
        tp = TensorParallel.create(config.tensor_parallel_size, [mc] if whole_draft else [mc, *draft_configs])
        if whole_draft:
            drafter.whole_on_each_device = True
        num_blocks = config.num_blocks(mc, -(-max_model_len // config.block_size), model.params["embed"].dtype, tp)
        K = spec.num_speculative_tokens if spec else 0
        self.step_config = StepConfig(block_size=config.block_size, num_blocks=num_blocks,
                                      num_slots=config.max_num_seqs, max_model_len=max_model_len,
                                      num_speculative_tokens=K, logprobs_mode=config.logprobs_mode)
        ops = Ops.for_backend(config.block_size, config.attention, config.unroll_layers, tp, config.delta_rule,
                              config.quantization)
        self.runner = ModelRunner(model, self.step_config, ops, drafter, drafter_params,
                                  max_rows=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens)
        recurrent = sorted(k for k, f in self.runner.target.per_slot_fields(self.step_config.cache_shape).items() if f)
        self.prefix_cache_disabled_reason = config.prefix_caching_off_because(recurrent)
        caching = self.prefix_cache_disabled_reason is None
        self.blocks = BlockManager(num_blocks, config.block_size, config.max_num_seqs, enable_prefix_caching=caching,
                                   key_overlap=int(drafter is not None and drafter.kv_reads_next_token))
        windows = [mc.kv_window] + [c.kv_window for c in draft_configs]   # each reader of the KV
        self.scheduler = Scheduler(self.blocks, self.step_config, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   draft_lookahead=drafter is not None and drafter.needs_kv_lookahead,
                                   kv_window=None if None in windows else max(windows))
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else mc.eos_token_ids
        self.intake = Intake(vocab_size=mc.vocab_size, eos_token_ids=eos, tokenizer=self.tokenizer,
                             step_config=self.step_config, num_kv_blocks=num_blocks,
                             draft_lookahead=self.scheduler.draft_lookahead, share_prompt_blocks=caching,
                             compile_timeout=config.structured_compile_timeout,
                             compile_memory=config.structured_compile_memory, seed=config.seed,
                             window_tokens=self._window_tokens(config))
        # The device table of the automata running requests use (structured outputs).
        self.grammar_tables = GrammarTables(mc.vocab_size, self.runner.input_sharding)
        # Adaptive speculation: the host picks each step's k (jaxspec.sched.adaptive); None: always K.
        self.k_chooser = (KChooser(K, config.max_num_batched_tokens, self.runner.bucket_for)
                          if spec is not None and spec.adaptive else None)
        self.warmup_mode = config.warmup_mode(gpu=jax.default_backend() == "gpu")
        if self.warmup_mode in ("tiered", "fast"):
            self.runner.on_demand_tier = FAST
        self.builder = StepBuilder(self.runner, self.step_config, self.grammar_tables, self.k_chooser)
        self.counts = EngineCounts(K, adaptive=self.k_chooser is not None)
        self._in_flight: _InFlight | None = None
        self._last_ready: float | None = None   # when the last step read was found ready (host clock)
        # The loop on its own thread (start/stop): every engine change is made under this lock, which the loop
        # holds for a whole step (the device wait included). Other threads never wait for it: their new
        # requests and aborts go into the intake, which the loop applies at the start of its next step.
        self._lock = threading.RLock()
        self._stepped = threading.Condition(self._lock)   # notified after each step of the thread's loop
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: BaseException | None = None   # what stopped the loop thread, if anything did
        # Start-up phases in seconds: the engine built (KV pool allocated, params placed), the compiles it waited for.
        self.startup = {"engine_s": time.perf_counter() - t_start, "compile_blocking_s": 0.0}
        self._compiling = False   # background compiles run: steps use compiled buckets only (_follow_compiles)
        self._serving_variants = list(WARM_VARIANTS)   # the full-width variants warmup() compiles (_follow_compiles)
        if self.warmup_mode != "none":
            t0 = time.perf_counter()
            self.warmup()
            self.startup["compile_blocking_s"] = time.perf_counter() - t0

    @staticmethod
    def _draft_whole_on_each_device(spec, tensor_parallel_size: int, drafter=None, drafter_params=None) -> bool:
        """Whether the drafter runs whole on every device (SpeculativeConfig.draft_tensor_parallel_size=1 under
        tensor parallelism); a ValueError names a placement that is not offered. Unset, a draft model runs whole
        where that is the faster placement (`draft_runs_whole`)."""
        if spec is None:
            return False
        d = spec.draft_tensor_parallel_size
        if d is None:
            if spec.method != "draft_model" or tensor_parallel_size == 1:
                return False
            weight_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(drafter_params))
            return draft_runs_whole(weight_bytes, drafter.config.num_layers, tensor_parallel_size)
        if d == tensor_parallel_size:
            return False
        if d != 1:
            split = f" or {tensor_parallel_size} (split as the target is)" if tensor_parallel_size > 1 else ""
            raise ValueError(f"draft_tensor_parallel_size={d} is invalid with tensor_parallel_size="
                             f"{tensor_parallel_size}; give 1 (the draft model whole on every device){split}, or "
                             "leave it unset")
        if spec.method != "draft_model":
            raise ValueError(f"draft_tensor_parallel_size=1 is implemented for method 'draft_model' only, not "
                             f"{spec.method!r} (an EAGLE or MTP head reads the target's split embedding and lm_head; "
                             f"n-gram lookup has no model): give {tensor_parallel_size} or leave it unset")
        return True

    @staticmethod
    def _quantize(scheme: str, model, drafter, drafter_params):
        """The target's projections quantized (a model passed in already quantized is taken as it is), and those of
        a drafter with weights: a draft model's, an EAGLE, EAGLE-3 or MTP head's (fc and its layers'; an EAGLE-3 head's
        lm_head stays, as the target's does). The drafter then declares quantized params (`param_schema`: placement,
        sharding and the step's program specs read it). Heads are quantized here, at serving only: training
        (jaxspec.train) builds unquantized heads. stats()["quantization"] says which weights are quantized."""
        from jaxspec.nn import quant
        if model.quantization is None:
            model = dataclasses.replace(model, params=quant.quantize_params(model.params), quantization=scheme)
        elif model.quantization != scheme:
            raise ValueError(f"quantization={scheme!r}, but the model passed in is quantized as {model.quantization!r}")
        if drafter_params is not None:   # n-gram has no weights
            drafter.quantization = scheme
            if not quant.quantized_names(drafter_params):   # a draft model from an FP8 checkpoint is taken as it is
                drafter_params = quant.quantize_params(drafter_params)
        return model, drafter, drafter_params

    def quantization_report(self) -> dict | None:
        """Which weights are quantized, how, and how each step multiplies them (None: not quantized)."""
        if self.config.quantization is None:
            return None
        from jaxspec.nn import quant
        ops, runner = self.runner.ops, self.runner
        target = quant.quantized_names(runner.params)
        drafter = quant.quantized_names(runner.drafter_params) if isinstance(runner.drafter_params, dict) else []
        experts = any(".experts_" in name for name in target + drafter)
        weights = (getattr(self.model, "quantization_detail", None)   # stored so by the checkpoint: its format, scales
                   or "float8_e4m3fn, one float32 scale per output channel")
        return {"scheme": self.config.quantization, "weights": weights,
                "activations": self._activation_scheme(ops)
                + ("; MoE experts W8A16 at every size (a grouped matmul)" if experts else ""),
                "target": target, "drafter": drafter,
                "kept": "embeddings, norms, biases, lm_heads (the target's, an EAGLE-3 head's), routers and gates"}

    @staticmethod
    def _activation_scheme(ops) -> str:
        """How a step of each size multiplies the FP8 weights: the gemv kernel converts them (W8A16) up to its token
        limit; XLA's matmuls quantize the activations per token from w8a8_from_tokens (W8A8), convert below."""
        from jaxspec.nn.ops import GEMV_MAX_TOKENS_FP8
        xla = ("W8A16 (weights converted inside the matmul)" if ops.w8a8_from_tokens is None else
               "W8A8 (activations quantized per token to e4m3)" if ops.w8a8_from_tokens <= 1 else
               f"W8A16 below {ops.w8a8_from_tokens} tokens a step, W8A8 (per-token e4m3) from there")
        if not ops.gemv or ops.tp is not None:
            return xla
        return (f"steps of up to {GEMV_MAX_TOKENS_FP8} tokens: the gemv kernel over e4m3 tiles (W8A16) for "
                f"{', '.join(sorted(ops.gemv))}; larger steps: {xla}")

    @property
    def requests(self) -> dict[str, Request]:
        """Unfinished requests by id."""
        return self.intake.requests

    @property
    def counters(self) -> dict:
        return self.counts.counters

    # ---- requests ----------------------------------------------------------------------------------
    def _window_tokens(self, config) -> int | None:
        """With blocks released behind a sliding window: the most positions a request holds blocks for at once.
        The window's keys before a step, that step's tokens and the next one's, planned before the first is read
        (a chunk each, at most), the drafts in flight, and a block at each end."""
        window = self.scheduler.kv_window
        if window is None:
            return None
        k = self.step_config.num_speculative_tokens
        return window + 2 * config.max_num_batched_tokens + 2 * k + self.scheduler.draft_lookahead \
            + 2 * config.block_size

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, outputs=None) -> Request:
        """Queues a request (checked first: a ValueError queues nothing). `outputs`: a queue that receives the
        request's RequestOutput deltas as the engine confirms them (its text rendered as it grows).
        One completion: `add_group` takes SamplingParams.n > 1."""
        if isinstance(params, SamplingParams) and params.n != 1:
            raise ValueError(f"SamplingParams.n={params.n}: add_request queues one completion; use add_group")
        return self.add_group(prompt_token_ids, params, prompt, request_id, outputs)[0]

    def add_group(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                  request_id: str | None = None, outputs=None) -> list[Request]:
        """Queues a prompt's SamplingParams.n completions, one request each (ids "<request_id>-<index>" when
        n > 1; `abort(request_id)` ends them all). Completions after the first wait for the first to have
        cached the prompt's blocks, then share them."""
        if self.failure is not None:
            raise RuntimeError(f"the engine loop stopped after an error: {self.failure!r}")
        group = self.intake.build(prompt_token_ids, params, prompt, request_id, outputs)
        self.submit(group)
        return group

    def submit(self, group: list[Request]):
        """Queues a group the intake built (`intake.build`): the loop takes it at the start of its next step."""
        self.intake.submit(group)
        if not self.running_on_thread:
            with self._lock:
                self._apply_intake()
        self._wake.set()

    def _apply_intake(self):
        """(Under `_lock`.) Queues the requests and applies the aborts other threads handed in, in order."""
        for kind, value in self.intake.take():
            if kind == "abort":
                self._abort_now(value)
                continue
            for req in value:
                self.scheduler.add(req)
                if req.grammar is not None:
                    self.grammar_tables.acquire(req.grammar)
            self.intake.register(value)

    def validate_request(self, prompt_token_ids, params: SamplingParams):
        self.intake.validate(prompt_token_ids, params)

    def compile_structured(self, params: StructuredOutputsParams) -> TokenAutomaton:
        return self.intake.compile_structured(params)

    def stop_compiling(self):
        """Ends the constraint compiles under way and refuses later ones (a server shutting down)."""
        self.intake.stop_compiling()

    def abort(self, request_id: str):
        """Ends the request (or every completion of a group) with finish_reason "abort": at once when the
        caller drives the loop, at the start of the loop's next step when it runs on its own thread."""
        self.intake.submit_abort(request_id)
        if not self.running_on_thread:
            with self._lock:
                self._apply_intake()
        self._wake.set()

    def _abort_now(self, request_id: str):
        with self._lock:
            reqs = [r for r in self.intake.requests_of(request_id) if not r.finished]
            for req in reqs:
                self._finish(req, "abort")
            self._publish(reqs)

    def _finish(self, req: Request, reason: str):
        self.scheduler.finish(req, reason)
        req.finish_time = time.perf_counter()
        if self.intake.forget(req) and req.grammar is not None:
            self.grammar_tables.release(req.grammar)

    def has_unfinished(self) -> bool:
        return bool(self.intake) or self.scheduler.has_work() or self._in_flight is not None

    # ---- one iteration -----------------------------------------------------------------------------
    def step(self, timings: dict | None = None) -> list[Request]:
        """Plan and dispatch the next step, then read the previous one. Returns requests with news.
        `timings`: host seconds per phase (schedule, build, issue, wait, process, publish) are added to it."""
        with self._lock:
            clock = time.perf_counter
            t0 = clock()
            self._apply_intake()
            if self._compiling:
                self._follow_compiles()
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

    def _dispatch(self, rows, timings: dict | None = None) -> _InFlight:
        t0 = time.perf_counter()
        index = self.counts.steps
        plan = self.builder.build(rows, index)
        grammar_table = self.grammar_tables.device_table() if plan.variant.grammar else None
        t1 = time.perf_counter()
        out = self.runner.run(plan.inputs, plan.variant, grammar_table)
        if timings is not None:
            timings["build"] = timings.get("build", 0.0) + t1 - t0
            timings["issue"] = timings.get("issue", 0.0) + time.perf_counter() - t1
        self.counts.count_step(len(rows), plan.num_tokens, plan.bucket)
        return _InFlight(plan, out, index, t1, self.runner.last_run_untimed)

    def _process(self, rec: _InFlight, timings: dict | None = None) -> list[Request]:
        """Reads a dispatched step: each row's plan settled, its confirmed tokens appended, stops checked,
        blocks whose KV is final cached, finished requests freed. -> the requests with news."""
        t0 = time.perf_counter()
        plan, out = rec.plan, rec.out
        # The loop's one read of the device: allowed under any transfer guard (a test runs the loop with every
        # other device-to-host transfer disallowed)
        with jax.transfer_guard_device_to_host("allow"):
            tokens = np.asarray(out["tokens"])         # [R, K+2]: emitted tokens, then the accepted count
            lp = ({k: np.asarray(out[k]) for k in ("logprob", "top_ids", "top_logprobs")}
                  if plan.variant.logprobs else None)
            prompt_lp = ({k: np.asarray(out[k]) for k in PROMPT_LOGPROB_ARRAYS}
                         if plan.variant.prompt_logprobs else None)
        t1 = time.perf_counter()
        if self.k_chooser is not None:
            self._observe(rec, tokens[:, -1], t1)
        if self.step_config.num_speculative_tokens and any(row.sample and not row.request.finished
                                                           for row in plan.rows):
            self.counts.count_proposal(plan.proposed)
        rows_tokens = tokens.tolist()   # Python ints, read once: no per-row array indexing below
        now = time.perf_counter()      # the arrival time of every token this step confirms
        live, sampled = [], []
        first_token = 0   # the row's first token in the step (rows' tokens are laid out in row order)
        for r, (row, row_tokens) in enumerate(zip(plan.rows, rows_tokens)):
            req, n_acc = row.request, row_tokens[-1]
            first_token += row.num_new
            self.scheduler.settle(row, n_acc)
            if req.finished:
                continue  # finished one step ago: this step's result for it is dropped
            live.append(row)
            if prompt_lp is not None and row.start >= 0 and req.needs_prompt_logprobs:
                record_prompt_logprobs(req, row.start, first_token - row.num_new, row.num_new, prompt_lp)
            if row.num_drafts:
                self.counts.count_drafts(req, row.num_drafts, n_acc)
            if row.sample:
                token_lp = row_logprobs(lp, r, n_acc + 1, req.params.logprobs) if lp is not None else None
                confirm_tokens(req, row_tokens[:n_acc + 1], self.step_config.max_model_len, token_lp, now)
                sampled.append(req)
        render_texts(sampled, self.tokenizer)
        updated = []
        for row in live:
            self.scheduler.cache_confirmed(row)
            self.scheduler.release_behind_window(row)
            if row.sample:
                req = row.request
                if req.finish_reason:
                    self._finish(req, req.finish_reason)
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
        # No measure when it compiled or was one of its program's first runs, or when the host compiled the step
        # dispatched after it before reading it (async): the host then found it ready late.
        seconds = None if rec.untimed or self.runner.last_run_compiled else ready - start
        rows = [(row.num_drafts, int(accepted[r])) for r, row in enumerate(rec.plan.rows)
                if row.num_drafts and not row.request.finished]
        self.k_chooser.observe(rec.index, rows, (rec.plan.draft_width, rec.plan.bucket, seconds))

    def _publish(self, updated: list[Request]):
        """Each streamed request with news gets its delta on its output queue."""
        for req in updated:
            if req.outputs is not None:
                delta = take_delta(req, self.tokenizer)
                if delta is not None:
                    req.outputs.put(delta)

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
            self.intake.close(e)       # nothing more enters the intake
            with self._lock:
                self._apply_intake()
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
    def _warm_variants(self, sample: bool | None = None) -> list[StepVariant]:
        base = [v for v in WARM_VARIANTS if sample is None or v.sample == sample]
        variants = list(base)
        if self.k_chooser is not None:   # every draft width the chooser may pick
            variants += [dataclasses.replace(v, drafts=k) for k in range(self.step_config.num_speculative_tokens)
                         for v in base]
        return variants

    def warmup(self, sample: bool | None = None):
        """Compiles the step programs of every token bucket and warm variant, as `warmup_mode` says: all of them
        now ("full", and an engine built with warmup=False: autotuned; "fast": not), or ("tiered") the smallest
        bucket's full-width programs now without autotuning and the rest in the background. `sample`: only the
        greedy (False) or only the random (True) variants (a greedy benchmark compiles half); None: both."""
        runner, variants = self.runner, self._warm_variants(sample)
        self._serving_variants = [v for v in variants if v.drafts is None]
        if self.warmup_mode == "tiered":
            # the smallest bucket at the full draft width (adaptive k starts there); programs the store holds
            # tuned load at their tuned tier at once
            programs, key = runner.programs, runner.program_key
            first = [key(runner.token_buckets[0], v) for v in variants if v.drafts is None]
            for tier in (FAST, TUNED):
                programs.compile([k for k in first if programs.start_tier(k) == tier], tier, desc="compiling steps")
            every = [key(T, v) for T in runner.token_buckets for v in variants]
            jobs = [(k, FAST) for k in every if programs.start_tier(k) == FAST] + [(k, TUNED) for k in every]
            programs.start_background(jobs)
            self._compiling = runner.programs.compiling()
            if self._compiling:
                self._follow_compiles()
        else:
            runner.warmup(variants, tier=FAST if self.warmup_mode == "fast" else None)
        runner.warm_transfers(variants)
        self.counts.compiled_at_warmup = runner.compiled_on_demand
        if not self._compiling:
            self.time_steps()

    def _follow_compiles(self):
        """While programs compile in the background: steps are planned for compiled buckets only (the token
        budget is the largest compiled bucket's; a step pads to the smallest compiled bucket that holds it) and
        adaptive k picks among compiled draft widths. Back to every bucket once the compiles are done."""
        runner, chooser = self.runner, self.k_chooser
        if not runner.programs.compiling():
            runner.programs.wait()   # raises what stopped the compiles, if anything did
            self._compiling = False
            runner.serving_buckets = None
            self.scheduler.max_num_batched_tokens = self.config.max_num_batched_tokens
            if chooser is not None:
                chooser.ready, chooser.budget = None, self.config.max_num_batched_tokens
                self.time_steps()   # every program at its best tier now
            return
        ready = runner.ready_buckets(self._serving_variants)
        runner.serving_buckets = ready or None
        self.scheduler.max_num_batched_tokens = min(self.config.max_num_batched_tokens,
                                                    ready[-1] if ready else self.config.max_num_batched_tokens)
        if chooser is not None:
            K = self.step_config.num_speculative_tokens
            chooser.budget = self.scheduler.max_num_batched_tokens
            chooser.ready = lambda k, T: all(runner.programs.ready(
                (T, dataclasses.replace(v, drafts=None if k == K else k), None)) for v in self._serving_variants)

    def time_steps(self):
        """Adaptive k's price of each (draft width, token bucket): its compiled step's device time, measured here
        (runner.time_step) on the first variant warmed up (greedy, unless only sampling steps were), twice: on blank
        steps, and on steps whose rows read TIMED_CONTEXT tokens of context each (runner.context_inputs, writing to a
        block taken from the pool for the while). The first is the step's price with no context; the difference,
        per query token and context token, what each adds (the chooser scales it by the rows' contexts). A blank
        step alone leaves out that attention, which grows with a row's k + 1 queries: on an H200 at batch 32 a live
        k = 3 step took ~1.4x its blank time, and adaptive k chose k = 3 where plain decoding delivered as much.
        With the contexts priced, the prices came within 2-5% of the live steps' periods, and adaptive k was above
        plain over the saturated part at every batch from 1 to 64 (docs/lab/2026-11-28-trainer-and-drafters.md,
        seventh and eighth sessions). A time measured from the loop's period instead carries every host pause
        (plain decoding's steps were timed at 1.5-3x their real time there). Runs once the programs are compiled,
        at their best tier, after the program store's writes (serializing the new programs on another thread), and
        keeps each pair's best of TIMING_ROUNDS: the first pass after a warm-up timed steps at 1.5-2x the live
        loop's on a CPU, where the best of two came within 0-13% of it."""
        chooser = self.k_chooser
        if chooser is None:
            return
        from tqdm.auto import tqdm
        runner, sc = self.runner, self.step_config
        K, base = sc.num_speculative_tokens, self._serving_variants[0]
        variants = {(k, T): dataclasses.replace(base, drafts=None if k == K else k)
                    for T in runner.token_buckets for k in range(K + 1)}
        # compiled programs only: timing never compiles (a pair left out keeps its measured periods)
        pairs = [kT for kT, v in variants.items() if runner.programs.ready(runner.program_key(kT[1], v))]
        context = min(TIMED_CONTEXT, sc.max_model_len // 2) // sc.block_size * sc.block_size
        with self._lock:
            scratch = []   # the block the context steps write their own tokens' KV to: no request holds it
            if context < sc.block_size or context + 2 * (K + 1) > sc.max_model_len \
                    or not self.blocks.grow(scratch, sc.block_size):
                context = 0
            if runner.programs.store is not None:
                runner.programs.store.flush()
            blank, with_context = {}, {}
            try:
                for k, T in tqdm(pairs * TIMING_ROUNDS, desc="timing steps", leave=False):
                    seconds = runner.time_step(T, variants[(k, T)])
                    blank[(k, T)] = min(seconds, blank.get((k, T), seconds))
                    if context:
                        inputs = runner.context_inputs(T, k, context, scratch[0])
                        seconds = runner.time_step(T, variants[(k, T)], inputs=inputs)
                        with_context[(k, T)] = min(seconds, with_context.get((k, T), seconds))
            finally:
                self.blocks.free_blocks(scratch)
            chooser.calibrated.update(blank)
            for (k, T), seconds in with_context.items():
                query_tokens = runner.context_rows(T, k) * (k + 1)
                chooser.context_cost[(k, T)] = max(seconds - blank[(k, T)], 0.0) / (query_tokens * context)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Waits for the background compiles (warmup="tiered"): then every warm program has its best tier and the
        steps run at full speed (benchmarks wait here before timing). False if they still run after `timeout`."""
        done = self.runner.programs.wait(timeout)
        if done and self._compiling:
            with self._lock:
                self._follow_compiles()
        return done

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

    def stats(self) -> dict:
        out = self.counts.report(runner=self.runner, scheduler=self.scheduler, blocks=self.blocks,
                                 grammar_tables=self.grammar_tables, grammar_compiler=self.intake.grammar_compiler,
                                 prefix_cache_disabled_reason=self.prefix_cache_disabled_reason,
                                 async_scheduling=self.config.async_scheduling) | {
                                     "quantization": self.quantization_report()}
        if self.k_chooser is not None:   # adaptive k: the measured step times and acceptance it chooses from
            out["spec"]["chooser"] = self.k_chooser.snapshot()
        return out
