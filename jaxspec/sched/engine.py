"""The engine loop: schedule step N+1, dispatch it, then read step N (dispatched one iteration ago).

    schedule(N+1) -> build host inputs -> dispatch step(N+1) -> start copy of out(N+1) to host
                 -> read out(N) -> update requests, stop checks, free

Sync mode is the same loop reading out(N+1) at once; both run the same jitted step.
"""
from __future__ import annotations

import dataclasses
import itertools
import numbers
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxspec.decode.state import (
    ROW_FIRST_TOKEN, ROW_MIN_TOKENS, ROW_NUM_DRAFTS, ROW_NUM_NEW, ROW_PROMPT_LEN, ROW_SAMPLE,
    ROW_SEED, ROW_SEED_HI, ROW_SLOT, ROW_START, ROW_TOP_K, MAX_STOP_IDS, NUM_ROW_INTS, StepConfig, empty_inputs, init_state, pack_inputs)
from jaxspec.decode.step import StepVariant, make_step
from jaxspec.models.llama import unstack_layers
from jaxspec.sampling_params import SamplingParams
from jaxspec.sched.block_manager import BlockManager
from jaxspec.sched.output import append_tokens
from jaxspec.sched.request import Request, Status
from jaxspec.sched.scheduler import ScheduledRow, Scheduler

# `_dispatch` writes each row's ints in this order: the step's own, then the request's fixed ones.
assert (ROW_SLOT, ROW_NUM_NEW, ROW_START, ROW_NUM_DRAFTS, ROW_FIRST_TOKEN, ROW_SAMPLE, ROW_PROMPT_LEN, ROW_SEED,
        ROW_SEED_HI, ROW_TOP_K, ROW_MIN_TOKENS) == tuple(range(NUM_ROW_INTS))

MIN_TOKEN_BUCKET = 8
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
    warmup: bool = True
    seed: int = 0
    # Device-specific choices, measured on an H100 (docs/benchmarks.md); "auto" picks the GPU ones there.
    attention: str = "auto"           # "pallas" (reads KV pages in place) or "reference" (jnp gather)
    unroll_layers: bool | None = None  # one weight buffer per layer, unrolled (True) or stacked + scanned

    def resolved(self) -> "EngineConfig":
        gpu = jax.default_backend() == "gpu"
        return dataclasses.replace(
            self, attention=("pallas" if gpu else "reference") if self.attention == "auto" else self.attention,
            unroll_layers=gpu if self.unroll_layers is None else self.unroll_layers)

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
        if self.attention not in ("auto", "pallas", "reference"):
            raise ValueError(f"attention={self.attention!r} is invalid; choose 'auto', 'pallas' or 'reference'")


@dataclasses.dataclass
class _InFlight:
    rows: list[ScheduledRow]
    out: dict
    want_logprobs: bool


class Engine:
    def __init__(self, model, config: EngineConfig, drafter=None, drafter_params=None):
        config.validate()
        config = config.resolved()
        self.model, self.config, self.tokenizer = model, config, model.tokenizer
        # Unrolled layers with fused q/k/v and gate/up weights: each weight is its own buffer, read once by
        # one matmul (on a GPU, scanning stacked weights copied each layer's slice first: 2x slower).
        self.params = unstack_layers(model.params) if config.unroll_layers else model.params
        mc = model.config
        max_model_len = config.max_model_len or min(mc.max_position_embeddings, 4096)
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} is invalid for this model: it has "
                             f"max_position_embeddings={mc.max_position_embeddings}; give max_model_len in "
                             f"[2, {mc.max_position_embeddings}]")
        k = drafter.num_spec_tokens if drafter is not None else 0
        max_blocks = -(-max_model_len // config.block_size)
        dtype = model.params["embed"].dtype
        num_blocks = config.num_kv_blocks or self._default_num_blocks(config, mc, max_blocks, dtype)
        self.step_config = StepConfig(block_size=config.block_size, num_blocks=num_blocks,
                                      num_slots=config.max_num_seqs, max_model_len=max_model_len,
                                      num_spec_tokens=k, attention=config.attention)
        self.blocks = BlockManager(num_blocks, config.block_size, config.max_num_seqs)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=max_model_len, num_spec_tokens=k,
                                   draft_lookahead=k if getattr(drafter, "needs_kv_lookahead", False) else 0)
        if drafter is not None and hasattr(drafter, "prepare_params"):
            drafter_params = drafter.prepare_params(drafter_params, unroll_layers=config.unroll_layers)
        self.drafter, self.drafter_params = drafter, drafter_params
        drafter_state = drafter.init_state(self.step_config, dtype) if drafter is not None else None
        self.state = init_state(mc, self.step_config, dtype, drafter_state)
        cap = max(config.max_num_batched_tokens, MIN_TOKEN_BUCKET)
        self.token_buckets = [b for b in (MIN_TOKEN_BUCKET << i for i in range(32)) if b < cap] + [cap]
        self._steps: dict[tuple[int, StepVariant], object] = {}
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self._pending: _InFlight | None = None
        self.last_inputs: dict[int, tuple[StepVariant, jax.Array]] = {}
        self._compiled_at_warmup: int | None = None
        self.counters = {"steps": 0, "scheduled_rows": 0, "padded_tokens": 0, "scheduled_tokens": 0}
        self.spec_counters = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                              "accepted_per_position": np.zeros(max(k, 1), np.int64)}
        if config.warmup:
            self.warmup()

    @staticmethod
    def _default_num_blocks(config, mc, max_blocks, dtype) -> int:
        enough = config.max_num_seqs * max_blocks
        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform == "gpu" else None
        if not stats:
            return enough
        itemsize = jnp.dtype(dtype).itemsize
        per_block = 2 * mc.num_layers * config.block_size * mc.num_kv_heads * mc.head_dim * itemsize
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        return max(1, min(enough, int(free * (config.kv_memory_fraction or 0.5) // per_block)))

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None) -> Request:
        self.validate_request(prompt_token_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests and not self.requests[request_id].finished:
            raise ValueError(f"request_id {request_id!r} is already running")
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        eos = tuple(self.tokenizer.eos_token_ids) if self.tokenizer is not None else tuple(
            self.model.config.eos_token_ids)
        req = Request(request_id, list(prompt_token_ids), params, seed, eos, prompt=prompt)
        stop_ids = ([] if params.ignore_eos else list(eos)) + params.stop_token_ids
        req.min_tokens_stop_ids = stop_ids[:MAX_STOP_IDS] if params.min_tokens else []
        # The step's per-row inputs that stay fixed for the request's life (see decode/state.py).
        seed64 = seed % 2**64   # the two 32-bit words of the seed, as the device's int32s
        req.row_ints = (len(req.prompt_token_ids), int(np.uint32(seed64 & 0xFFFFFFFF).view(np.int32)),
                        int(np.uint32(seed64 >> 32).view(np.int32)),
                        min(max(params.top_k, 0), self.model.config.vocab_size), params.min_tokens)
        req.step_variant = StepVariant.of(params)
        req.row_floats = (params.temperature, params.top_p, params.min_p, params.presence_penalty,
                          params.frequency_penalty, params.repetition_penalty)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

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
        if n + max(1, params.min_tokens) > sc.max_model_len:
            raise ValueError(f"the prompt has {n} tokens and min_tokens={params.min_tokens}: more than "
                             f"max_model_len={sc.max_model_len} allows (prompt + max(1, min_tokens) <= max_model_len)")
        # Alone in the pool, a request must reach its end: prompt + max_tokens (+ drafts in flight).
        need = min(n + params.max_tokens + sc.num_spec_tokens + self.scheduler.draft_lookahead, sc.max_model_len)
        if self.blocks.blocks_for(need) > self.blocks.num_blocks:
            raise ValueError(f"the prompt has {n} tokens and max_tokens={params.max_tokens}: that can never fit the "
                             f"KV pool of {self.blocks.num_blocks} blocks x {sc.block_size} tokens; raise "
                             f"num_kv_blocks or lower max_tokens")

    def abort(self, request_id: str):
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self.scheduler.finish(req, "abort")
            req.finish_time = time.perf_counter()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    # ---- one iteration -----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Plan and dispatch the next step, then read the previous one. Returns requests with news."""
        rows = self.scheduler.schedule()
        record = self._dispatch(rows) if rows else None
        updated: list[Request] = []
        if self._pending is not None:
            updated += self._process(self._pending)
            self._pending = None
        if record is not None:
            if self.config.async_scheduling:
                self._pending = record
            else:
                updated += self._process(record)
        elif not updated and self.scheduler.has_work():
            raise RuntimeError("the scheduler can place no request although some wait: the KV pool "
                               f"({self.blocks.num_blocks} blocks) or max_num_batched_tokens is too small")
        return updated

    def flush(self) -> list[Request]:
        """Reads the in-flight step, if any, without dispatching another."""
        pending, self._pending = self._pending, None
        return self._process(pending) if pending is not None else []

    def _bucket(self, num_tokens: int) -> int:
        return next(b for b in self.token_buckets if b >= num_tokens)

    def _rows_for(self, num_tokens: int) -> int:
        # A step has at most one row per token. At least MIN_TOKEN_BUCKET rows even when max_num_seqs is
        # smaller: with a single row the logits matmul has one row, which XLA runs as a slow
        # matrix-vector product on a GPU (measured: +0.9 ms per step at Qwen2.5-1.5B's vocabulary).
        return min(num_tokens, max(self.config.max_num_seqs, MIN_TOKEN_BUCKET))

    def _step_fn(self, T: int, variant: StepVariant):
        fn = self._steps.get((T, variant))
        if fn is None:
            fn = self._steps[(T, variant)] = make_step(self.model.config, self.step_config, self.drafter, T,
                                                       self._rows_for(T), variant)
        return fn

    def _run_step(self, T: int, variant: StepVariant, host_inputs: dict[str, np.ndarray]) -> dict:
        """Copies the inputs over, issues the step, starts copying its tokens back."""
        # One transfer of a buffer built for this step alone and never touched again: on the CPU backend
        # the transfer may read host memory after this call returns (even with may_alias=False), so a
        # reused staging buffer would need double-buffering.
        buf = jax.device_put(pack_inputs(host_inputs), may_alias=False)
        self.state, out = self._step_fn(T, variant)(self.params, self.drafter_params, self.state, buf)
        self.last_inputs[T] = (variant, buf)  # kept for benchmarks that replay a live step on the device
        for name in ("tokens",) + (("logprob", "top_ids", "top_logprobs") if variant.logprobs else ()):
            out[name].copy_to_host_async()
        return out

    def replay_step(self, T: int) -> dict:
        """Runs bucket T's last live inputs again (benchmarks: the device time of a real step). Each replay
        advances the same rows by one more token; abort those requests afterwards."""
        variant, buf = self.last_inputs[T]
        self.state, out = self._step_fn(T, variant)(self.params, self.drafter_params, self.state, buf)
        return out

    def _dispatch(self, rows: list[ScheduledRow]) -> _InFlight:
        sc = self.step_config
        num_new = [row.num_new for row in rows]
        num_tokens = sum(num_new)
        T = self._bucket(num_tokens)
        h = empty_inputs(T, self._rows_for(T), sc)
        n = len(rows)
        first = np.cumsum([0] + num_new[:-1])                  # each row's first token in the step
        counts = np.asarray(num_new, np.int64)
        tokens = h["tokens"]
        tokens[1, :num_tokens] = np.repeat(np.arange(n), counts)
        tokens[2, :num_tokens] = np.arange(num_tokens) - np.repeat(first, counts)
        h["rows"][:, :n] = np.array([(row.request.slot, row.num_new, row.start, row.num_drafts, f, row.sample)
                                     + row.request.row_ints for row, f in zip(rows, first.tolist())]).T
        h["rows_f"][:, :n] = np.array([row.request.row_floats for row in rows], np.float32).T
        for r, row in enumerate(rows):
            req = row.request
            if row.token_ids:
                tokens[0, first[r]:first[r] + row.num_new] = row.token_ids
            if req.min_tokens_stop_ids:
                h["stop_ids"][r, :len(req.min_tokens_stop_ids)] = req.min_tokens_stop_ids
            h["block_tables"][r, :len(req.block_ids)] = req.block_ids
        variant = StepVariant.union([row.request.step_variant for row in rows if row.sample])
        out = self._run_step(T, variant, h)
        self.counters["steps"] += 1
        self.counters["scheduled_rows"] += n
        self.counters["scheduled_tokens"] += num_tokens
        self.counters["padded_tokens"] += T
        return _InFlight(rows, out, variant.logprobs)

    def _process(self, rec: _InFlight) -> list[Request]:
        out = rec.out
        tokens = np.asarray(out["tokens"])             # [R, K+2]: emitted tokens, then the accepted count
        accepted = tokens[:, -1]
        lp = {k: np.asarray(out[k]) for k in ("logprob", "top_ids", "top_logprobs")} if rec.want_logprobs else None
        updated = []
        for r, row in enumerate(rec.rows):
            req = row.request
            req.in_flight -= 1
            req.in_flight_samples -= int(row.sample)
            if req.finished:
                continue  # finished one step ago: this step's result for it is dropped
            n_acc = int(accepted[r])
            if row.num_drafts:
                self._count_spec(req, row.num_drafts, n_acc)
                if req.status is Status.RUNNING:
                    req.num_computed -= row.num_drafts - n_acc   # the optimistic plan assumed all accepted
            if not row.sample:
                continue
            emitted = tokens[r, :n_acc + 1]
            per_token_lp = None
            if lp is not None and req.params.logprobs is not None:
                n_top = req.params.logprobs
                per_token_lp = [{"logprob": float(lp["logprob"][r, j]),
                                 "top": list(zip(lp["top_ids"][r, j, :n_top].tolist(),
                                                 lp["top_logprobs"][r, j, :n_top].tolist()))}
                                for j in range(n_acc + 1)]
            append_tokens(req, emitted, self.tokenizer, self.step_config.max_model_len, per_token_lp)
            if req.finish_reason:
                self.scheduler.finish(req, req.finish_reason)
                req.finish_time = time.perf_counter()
            updated.append(req)
        return updated

    def _count_spec(self, req: Request, num_drafts: int, n_acc: int):
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += n_acc
        s = self.spec_counters
        s["drafts"] += 1
        s["draft_tokens"] += num_drafts
        s["accepted_tokens"] += n_acc
        s["accepted_per_position"][:n_acc] += 1

    # ---- compilation and stats ---------------------------------------------------------------------
    def warmup(self):
        """Compile the step for every token bucket and warm variant (all-padding inputs touch only the
        trash slot)."""
        sc = self.step_config
        todo = [(T, v) for T in self.token_buckets for v in WARM_VARIANTS]
        for T, variant in tqdm(todo, desc="compiling steps", leave=False):
            self._run_step(T, variant, empty_inputs(T, self._rows_for(T), sc))
        self.last_inputs.clear()
        jax.block_until_ready(self.state.num_tokens)
        self._compiled_at_warmup = self.num_compiled()

    def num_compiled(self) -> int:
        return sum(f._cache_size() for f in self._steps.values())

    def stats(self) -> dict:
        c = self.counters
        baseline = self._compiled_at_warmup if self._compiled_at_warmup is not None else 0
        out = {
            "steps": c["steps"],
            "token_buckets": list(self.token_buckets),
            "compiled_steps": self.num_compiled(),   # (bucket, variant) pairs compiled so far
            "recompiles": max(0, self.num_compiled() - baseline) if self._compiled_at_warmup is not None else None,
            "scheduled_rows": c["scheduled_rows"],
            "scheduled_tokens": c["scheduled_tokens"],
            "padded_tokens": c["padded_tokens"],
            "num_preemptions": self.scheduler.num_preemptions,
            "num_kv_blocks": self.blocks.num_blocks,
            "free_kv_blocks": self.blocks.num_free_blocks,
            "async_scheduling": self.config.async_scheduling,
        }
        k = self.step_config.num_spec_tokens
        if k:
            s = self.spec_counters
            drafts, dt, acc = s["drafts"], s["draft_tokens"], s["accepted_tokens"]
            out["spec"] = {
                "num_speculative_tokens": k,
                "drafts": drafts, "draft_tokens": dt, "accepted_tokens": acc,
                "acceptance_rate": acc / dt if dt else 0.0,
                "mean_acceptance_length": 1 + acc / drafts if drafts else 1.0,
                "per_position_acceptance": (s["accepted_per_position"] / drafts).tolist() if drafts else [0.0] * k,
            }
        return out
