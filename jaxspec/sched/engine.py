"""The engine loop: schedule step N+1, dispatch it, then read step N (dispatched one iteration ago).

    schedule(N+1) -> build host inputs -> dispatch step(N+1) -> start copy of out(N+1) to host
                 -> read out(N) -> settle the plan, confirm tokens, stop checks, free -> publish deltas

Sync mode is the same loop reading out(N+1) at once; both run the same jitted step (the ModelRunner, the
device side). The loop is driven by `LLM.generate` / `LLM.stream`, or runs on its own thread (`start`), in
which case callers read each request's deltas from their output queues.

The engine runs the loop between its rooms, each built once (sched/build.py) and asked, never written to: the
intake (requests checked, built and handed in: sched/intake.py), the scheduler (plans a step and settles it when
read: sched/scheduler.py), the step builder (a plan's host inputs: sched/step_builder.py), the runner (the device
side: decode/runner.py, with what is compiled in decode/compiled.py), output processing (sched/output.py) and the
counters (sched/stats.py). Warm-up (sched/warmup.py) compiles the steps before and while the loop serves; adaptive
k's step prices are taken on the live engine (sched/pricing.py). Configuration and KV sizing: sched/config.py.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import traceback

import jax
import numpy as np

from jaxspec.sampling_params import SamplingParams
from jaxspec.sched.build import build_parts
from jaxspec.sched.config import EngineConfig
from jaxspec.sched.output import (PROMPT_LOGPROB_ARRAYS, confirm_tokens, record_prompt_logprobs, render_texts,
                                  row_logprobs, take_delta)
from jaxspec.sched.pricing import StepPricing
from jaxspec.sched.request import Request
from jaxspec.sched.stats import quantization_report
from jaxspec.sched.step_builder import StepPlan
from jaxspec.sched.warmup import Warmup
from jaxspec.structured.compiler import TokenAutomaton
from jaxspec.structured.params import StructuredOutputsParams

__all__ = ["Engine", "EngineConfig"]


@dataclasses.dataclass
class _InFlight:
    plan: StepPlan
    out: dict
    index: int = 0                 # the step's number (steps counted before it)
    dispatched: float = 0.0        # host clock when its dispatch began (the inputs' transfer)
    untimed: bool = False          # its dispatch compiled the step or ran a program for one of its first times
                                   # (runner.UNTIMED_RUNS): its time is no measure


class Engine:
    def __init__(self, model, config: EngineConfig, speculative_config=None):
        t_start = time.perf_counter()
        parts = build_parts(model, config, speculative_config)
        self.model, self.config, self.speculative_config = parts.model, parts.config, parts.speculative_config
        self.tokenizer = self.model.tokenizer
        self.step_config, self.runner, self.blocks = parts.step_config, parts.runner, parts.blocks
        self.scheduler, self.intake, self.grammar_tables = parts.scheduler, parts.intake, parts.grammar_tables
        self.adapters = parts.adapters   # LoRA adapters on the device (jaxspec.lora.slots), or None
        self.k_chooser, self.builder, self.counts = parts.k_chooser, parts.builder, parts.counts
        self.prefix_cache_disabled_reason = parts.prefix_cache_disabled_reason
        self.warmup_mode = parts.warmup_mode
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
        # adaptive k's step prices (jaxspec.sched.pricing) and the warm-up that compiles the steps first
        self.pricing = StepPricing(self.runner, self.blocks, self.k_chooser, self._lock)
        self.warm = Warmup(self.runner, self.warmup_mode, self.k_chooser is not None, self.pricing, self._lock)
        # Start-up phases in seconds: the engine built (KV pool allocated, params placed), the compiles it waited for.
        self.startup = {"engine_s": time.perf_counter() - t_start, "compile_blocking_s": 0.0}
        if self.warmup_mode != "none":
            t0 = time.perf_counter()
            self.warm.warmup()
            self.startup["compile_blocking_s"] = time.perf_counter() - t0

    @property
    def requests(self) -> dict[str, Request]:
        """Unfinished requests by id."""
        return self.intake.requests

    @property
    def counters(self) -> dict:
        return self.counts.counters

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, outputs=None, lora_request=None) -> Request:
        """Queues a request (checked first: a ValueError queues nothing). `outputs`: a queue that receives the
        request's RequestOutput deltas as the engine confirms them (its text rendered as it grows).
        One completion: `add_group` takes SamplingParams.n > 1."""
        if isinstance(params, SamplingParams) and params.n != 1:
            raise ValueError(f"SamplingParams.n={params.n}: add_request queues one completion; use add_group")
        return self.add_group(prompt_token_ids, params, prompt, request_id, outputs, lora_request)[0]

    def add_group(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                  request_id: str | None = None, outputs=None, lora_request=None) -> list[Request]:
        """Queues a prompt's SamplingParams.n completions, one request each (ids "<request_id>-<index>" when
        n > 1; `abort(request_id)` ends them all). Completions after the first wait for the first to have
        cached the prompt's blocks, then share them."""
        if self.failure is not None:
            raise RuntimeError(f"the engine loop stopped after an error: {self.failure!r}")
        group = self.intake.build(prompt_token_ids, params, prompt, request_id, outputs, lora_request)
        try:
            self.submit(group)
        except BaseException:
            self.intake.discard(group)
            raise
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
                if not req.params.speculative:
                    self.counts.count_opted_out_request()
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
        if req.lora_request is not None:   # its adapter's slot goes back (or, still queued, it no longer waits for one)
            if req.lora_slot:
                self.adapters.release(req.lora_slot)
                req.lora_slot = 0
            else:
                self.adapters.unstage(req.lora_request)
            self.adapters.record(req.lora_request.lora_name, len(req.output_token_ids), req.num_draft_tokens,
                                 req.num_accepted_tokens)

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
            self.pricing.when_compiled()   # adaptive k's prices, once the background compiles have ended
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
                confirmed = confirm_tokens(req, row_tokens[:n_acc + 1], self.step_config.max_model_len, token_lp, now)
                if not req.params.speculative:
                    self.counts.count_opted_out_tokens(len(confirmed))
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
    def warmup(self, sample: bool | None = None):
        """Compiles the warm step programs as the engine's warm-up mode says (jaxspec.sched.warmup). `sample`: only
        the greedy (False) or only the random (True) variants; None: both."""
        self.warm.warmup(sample)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Waits for the background compiles (warmup="tiered"): then every warm program has its best tier and the
        steps run at full speed (benchmarks wait here before timing). False if they still run after `timeout`."""
        return self.warm.wait_compiled(timeout)

    def warmup_structured(self, params: StructuredOutputsParams, sample: bool | None = None):
        """Compiles a constraint and the grammar variants of the step for its table (jaxspec.sched.warmup): requests
        with this constraint then compile nothing. Call it with no request running."""
        self.warm.warmup_structured(self.compile_structured(params), self.grammar_tables, sample)

    def kv_cache(self) -> dict:
        """The target's KV pool: blocks, tokens and bytes, and how many requests of max_model_len tokens it holds at
        once (vLLM's "maximum concurrency"; a request's blocks are its context's, so fewer if windows cap them)."""
        block_size, max_model_len = self.step_config.block_size, self.step_config.max_model_len
        blocks = self.blocks.num_blocks
        return {"blocks": blocks, "tokens": blocks * block_size, "max_model_len": max_model_len,
                "dtype": self.step_config.kv_dtype,
                "bytes": blocks * block_size * self.runner.kv_bytes_per_token(),
                "max_model_len_requests": blocks / -(-max_model_len // block_size)}

    def stats(self) -> dict:
        out = self.counts.report(runner=self.runner, scheduler=self.scheduler, blocks=self.blocks,
                                 grammar_tables=self.grammar_tables, grammar_compiler=self.intake.grammar_compiler,
                                 prefix_cache_disabled_reason=self.prefix_cache_disabled_reason,
                                 async_scheduling=self.config.async_scheduling,
                                 compiled_before_warmup_ended=self.warm.compiled_on_demand_before) | {
            "quantization": quantization_report(self.config.quantization, self.runner,
                                                getattr(self.model, "quantization_detail", None)),
            "kv_cache": self.kv_cache()}
        if "spec" in out and self.speculative_config is not None:   # which drafter, and a draft model's mode
            out["spec"]["method"] = self.speculative_config.method
            out["spec"]["parallel_drafting"] = self.speculative_config.parallel_drafting
        if self.k_chooser is not None:   # adaptive k: the measured step times and acceptance it chooses from
            out["spec"]["chooser"] = self.k_chooser.snapshot()
        if self.adapters is not None:   # LoRA: slots, loads, the adapters resident now, and requests waiting for a slot
            out["lora"] = self.adapters.stats() | {"waiting_for_slot": len(self.scheduler.adapter_waiters),
                                                   "waited_for_slot": self.scheduler.num_adapter_waits}
        return out
