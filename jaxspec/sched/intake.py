"""What enters the engine: each request checked and built once (its structured-outputs constraint compiled once),
handed to the loop through a queue that any thread may append to, and the registry of unfinished requests by id.

    build(prompt ids, params)  -> a group of Requests (SamplingParams.n of them), or a ValueError naming what is wrong
    submit(group) / submit_abort(request_id)   from any thread; never waits for a step
    take()                     the loop, at the start of a step: what was handed in, in order
    register(group) / forget(request)          the loop: requests it runs, and those that ended
"""
from __future__ import annotations

import collections
import itertools
import numbers
import threading

import numpy as np

from jaxspec.decode.inputs import MAX_STOP_IDS, request_values
from jaxspec.decode.runner import logit_bias_row
from jaxspec.decode.step import StepVariant
from jaxspec.sampling_params import SamplingParams
from jaxspec.sched.request import Request
from jaxspec.structured.compiler import GrammarCompiler, TokenAutomaton
from jaxspec.structured.params import StructuredOutputsParams


class Intake:
    def __init__(self, *, vocab_size: int, eos_token_ids, tokenizer, step_config, num_kv_blocks: int,
                 draft_lookahead: int, share_prompt_blocks: bool, compile_timeout: float, seed: int,
                 compile_memory: float = 2.0, window_tokens: int | None = None, adapters=None):
        self.adapters = adapters   # jaxspec.lora.slots.AdapterSlots (EngineConfig.enable_lora), or None
        self.vocab_size, self.eos_token_ids, self.tokenizer = vocab_size, tuple(eos_token_ids), tokenizer
        # With a sliding window: the most positions a request holds blocks for at once, whatever its length.
        self.window_tokens = window_tokens
        self.step_config, self.num_kv_blocks, self.draft_lookahead = step_config, num_kv_blocks, draft_lookahead
        self.share_prompt_blocks = share_prompt_blocks   # prefix caching on: a group's completions share the prompt
        self.compile_timeout, self.compile_memory = compile_timeout, compile_memory
        self.grammar_compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        # Unfinished requests by id, and groups (SamplingParams.n > 1) with any unfinished completion: what
        # `abort` finds and what a new request's id must not repeat. A finished request is forgotten here.
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}
        self._ids = itertools.count()
        self._rng = np.random.default_rng(seed)
        self._queue: collections.deque = collections.deque()   # ("add", [Request]) | ("abort", request_id)
        self._lock = threading.Lock()                           # held for an append or a drain, never a step
        self._pending_ids: set[str] = set()                     # ids submitted, not yet taken by the loop
        self.closed_by: BaseException | None = None             # what stopped the loop: nothing enters after it
        # Why this engine refuses structured outputs, if it does (`refuse_structured_outputs`)
        self.refuse_structured: str | None = None

    def refuse_structured_outputs(self, reason: str | None):
        """From now on requests with structured outputs are refused for `reason` (an engine across processes:
        jaxspec.distributed); None: accepted again."""
        self.refuse_structured = reason

    # ---- checking and building ---------------------------------------------------------------------
    def validate(self, prompt_token_ids, params: SamplingParams) -> TokenAutomaton | None:
        """A ValueError naming what is wrong, or the request's compiled constraint (None: unconstrained)."""
        sc, v = self.step_config, self.vocab_size
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
        bad = [t for t in (params.logit_bias or ()) if not 0 <= t < v]
        if bad:
            raise ValueError(f"SamplingParams.logit_bias has token ids {bad[:5]} outside the vocabulary [0, {v})")
        if params.structured_outputs is not None and self.refuse_structured:
            raise ValueError(f"SamplingParams.structured_outputs: {self.refuse_structured}")
        grammar = (self.compile_structured(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        if n + max(1, params.min_tokens) > sc.max_model_len:
            raise ValueError(f"the prompt has {n} tokens and min_tokens={params.min_tokens}: more than "
                             f"max_model_len={sc.max_model_len} allows (prompt + max(1, min_tokens) <= max_model_len)")
        # Alone in the pool, a request must reach its end: prompt + max_tokens (+ drafts in flight), or under a
        # sliding window what it holds at once.
        need = min(n + params.max_tokens + sc.num_speculative_tokens + self.draft_lookahead, sc.max_model_len,
                   self.window_tokens or sc.max_model_len)
        if -(-need // sc.block_size) > self.num_kv_blocks:
            raise ValueError(f"the prompt has {n} tokens and max_tokens={params.max_tokens}: that can never fit the "
                             f"KV pool of {self.num_kv_blocks} blocks x {sc.block_size} tokens; raise "
                             f"num_kv_blocks or lower max_tokens")
        return grammar

    def compile_structured(self, params: StructuredOutputsParams) -> TokenAutomaton:
        """The constraint's token automaton: compiled once (in a compile process, within the per-request limits
        `structured_compile_timeout` and `structured_compile_memory`) and cached. A ValueError says why a constraint
        cannot be used; a CompileUnavailable (RuntimeError) that the compile processes were busy with other
        requests' constraints. Thread-safe: a server compiles here before it queues the request, off its event loop
        and off the engine loop. The compile processes start on the first constraint."""
        with self._compiler_lock:
            if self.grammar_compiler is None:
                self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.compile_timeout,
                                                        self.compile_memory)
        return self.grammar_compiler.compile(params)

    def stop_compiling(self):
        """Ends the constraint compiles under way (they raise CompileUnavailable) and refuses later ones."""
        with self._compiler_lock:
            if self.grammar_compiler is not None:
                self.grammar_compiler.close()

    def build(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
              request_id: str | None = None, outputs=None, lora_request=None) -> list[Request]:
        """A prompt's SamplingParams.n completions, one Request each (ids "<request_id>-<index>" when n > 1),
        checked first: a ValueError builds nothing. `outputs`: where their deltas go as they are confirmed (an
        object with `put`). Completions after the first wait for the first to have cached the prompt's blocks,
        then share them. `lora_request`: the jaxspec.LoRARequest they run with (its adapter read and checked
        here; each completion takes its slot when the scheduler admits it and holds it until it ends), or None."""
        grammar = self.validate(prompt_token_ids, params)
        if lora_request is not None and self.adapters is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r} needs an engine built with enable_lora=True "
                             "(--enable-lora)")
        with self._lock:   # ids and seeds in the order requests are built, from any thread
            request_id = request_id if request_id is not None else str(next(self._ids))
            seeds = [sp.seed if sp.seed is not None else int(self._rng.integers(0, 2**31 - 1))
                     for sp in map(params.for_completion, range(params.n))]
        bias_row = logit_bias_row(params.logit_bias) if params.logit_bias else None
        group = []
        for index, seed in enumerate(seeds):
            sp = params.for_completion(index)
            req = Request(request_id if params.n == 1 else f"{request_id}-{index}", list(prompt_token_ids), sp,
                          seed, self.eos_token_ids, prompt=prompt, parent_id=request_id if params.n > 1 else None,
                          index=index)
            stop_ids = ([] if sp.ignore_eos else list(self.eos_token_ids)) + sp.stop_token_ids
            req.min_tokens_stop_ids = stop_ids[:MAX_STOP_IDS] if sp.min_tokens else []
            if lora_request is not None:   # its adapter, checked (a ValueError builds nothing); its slot comes later
                try:
                    self.adapters.stage(lora_request)
                except ValueError:
                    self.discard(group)
                    raise
                req.lora_request = lora_request
            req.row_ints, req.row_floats = request_values(req, self.vocab_size)
            req.step_variant = StepVariant.of(sp)
            req.grammar = grammar
            req.logit_bias_row = bias_row
            if sp.prompt_logprobs is not None and index == 0:   # siblings share the prompt: one computes them
                req.prompt_logprobs = [None]
            if outputs is not None:
                req.outputs, req.stream_text = outputs, True
            if group and self.share_prompt_blocks:
                req.prefix_leader = group[0]
            group.append(req)
        return group

    def discard(self, group: list[Request]):
        """A built group that will not be queued: its requests' adapters are no longer awaited."""
        for req in group:
            if req.lora_request is not None:
                self.adapters.unstage(req.lora_request)
                req.lora_request = None

    # ---- the hand-off to the loop ------------------------------------------------------------------
    def submit(self, group: list[Request]):
        """Queues a built group for the loop. A ValueError when its id names a request still running."""
        group_id = group_id_of(group)
        with self._lock:
            if self.closed_by is not None:
                raise RuntimeError(f"the engine loop stopped after an error: {self.closed_by!r}")
            if group_id in self._pending_ids or any(not r.finished for r in self.requests_of(group_id)):
                raise ValueError(f"request_id {group_id!r} is already running")
            self._pending_ids.add(group_id)
            self._queue.append(("add", group))

    def submit_abort(self, request_id: str):
        with self._lock:
            self._queue.append(("abort", request_id))

    def take(self) -> list[tuple[str, object]]:
        """What was submitted since the last take, in order (no lock taken when nothing was)."""
        if not self._queue:
            return []
        with self._lock:
            items = list(self._queue)
            self._queue.clear()
            self._pending_ids.clear()
        return items

    def close(self, reason: BaseException):
        """The loop has stopped: nothing is submitted after this (what was, it still takes and ends)."""
        with self._lock:
            self.closed_by = reason

    def __bool__(self) -> bool:
        return bool(self._queue)

    # ---- the registry ------------------------------------------------------------------------------
    def register(self, group: list[Request]):
        for req in group:
            self.requests[req.request_id] = req
        if len(group) > 1:
            self.groups[group_id_of(group)] = group

    def requests_of(self, request_id: str) -> list[Request]:
        """The requests `request_id` names: one, or a group's n completions."""
        if request_id in self.groups:
            return self.groups[request_id]
        return [self.requests[request_id]] if request_id in self.requests else []

    def forget(self, req: Request) -> bool:
        """Drops a finished request; True when it was registered (it held what registering gave it)."""
        registered = self.requests.get(req.request_id) is req
        self.requests.pop(req.request_id, None)
        if req.parent_id is not None and all(r.finished for r in self.groups.get(req.parent_id, ())):
            self.groups.pop(req.parent_id, None)
        return registered


def group_id_of(group: list[Request]) -> str:
    return group[0].parent_id if group[0].parent_id is not None else group[0].request_id

