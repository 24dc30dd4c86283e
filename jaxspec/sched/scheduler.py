"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

The scheduler plans step N+1 before step N's results are known. Prefill progress is exact; a decoding
request is planned as if every draft of its in-flight steps were accepted (`Request.num_computed` is an
upper bound), so the KV blocks it reserves always cover what the device will write.

LoRA (jaxspec.lora.slots): a request takes its adapter's slot when it is admitted. One whose adapter can get no slot
(every slot held by running requests of other adapters) keeps its place in the queue and is passed over, as vLLM's
scheduler does; requests behind it are admitted if they need no new slot. Fairness: while a request waits for a slot,
no request behind it takes a free slot or joins the held slot with the fewest holders (AdapterSlots.draining), so
that slot empties as its requests end and the first waiter in queue order takes it. A request keeps its slot until
it ends: through a pass where its KV blocks did not fit, and through preemption (it is readmitted without waiting
for an adapter again).
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable

from jaxspec.decode.inputs import with_request_value
from jaxspec.sched.block_manager import BlockManager
from jaxspec.sched.request import Request, Status


@dataclasses.dataclass(slots=True)   # a few dozen made per step: slots make them cheaper to make and read
class ScheduledRow:
    request: Request
    num_new: int          # tokens the row feeds the model this step
    num_drafts: int       # of those, drafts to verify (decode rows under speculation)
    start: int            # position of the first token for prefill rows; -1: the device's own count
    token_ids: list[int] | tuple  # host-known ids (prefill rows); decode rows read theirs on the device: ()
    sample: bool          # the row emits tokens this step
    new_slot: bool = False  # the request's first step in its slot (what the slot held before is stale)
    # A (re)admitted request whose first `start` tokens come from the prefix cache: their ids, which the
    # slot's device history needs (penalties and prompt lookup read it) though no step computes them.
    cached_ids: list[int] | tuple = ()


class Scheduler:
    def __init__(self, blocks: BlockManager, step_config, *, max_num_seqs: int, max_num_batched_tokens: int,
                 draft_lookahead: bool = False, kv_window: int | None = None,
                 token_budget: Callable[[], int] | None = None, adapters=None):
        self.blocks = blocks
        self.adapters = adapters   # jaxspec.lora.slots.AdapterSlots (EngineConfig.enable_lora), or None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # The tokens a step may carry, asked each step: max_num_batched_tokens, or while programs compile in the
        # background the largest compiled bucket (jaxspec.decode.compiled.CompiledSteps.token_budget).
        self.token_budget = token_budget or (lambda: max_num_batched_tokens)
        self.step_config = step_config
        self.max_model_len = step_config.max_model_len
        # A drafter with its own KV writes up to k positions past what the target verifies while it
        # proposes; decode rows reserve blocks for those too.
        self.draft_lookahead = step_config.num_speculative_tokens if draft_lookahead else 0
        # The sliding window of every model that reads the KV pools (the widest), or None: the whole context
        # is read and no block is released before its request ends.
        self.kv_window = kv_window
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # LoRA: queued requests passed over because their adapter could get no slot, and how many ever were
        self.adapter_waiters: set[Request] = set()
        self.num_adapter_waits = 0

    def add(self, request: Request):
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one planning pass -------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledRow]:
        budget = self.token_budget()
        rows: list[ScheduledRow] = []
        block_size = self.blocks.block_size
        for req in list(self.running):
            if req.status is not Status.RUNNING or budget == 0:
                continue
            row = self._plan_running(req, budget)
            if row is None:
                continue
            lookahead = self.draft_lookahead if row.sample else 0   # the drafts proposed after sampling
            need = req.num_computed + row.num_new + lookahead
            # (most steps a request's blocks already hold what it plans: no allocation to try)
            if need > len(req.block_ids) * block_size and not self._reserve(req, need, rows):
                continue
            rows.append(self._commit(row))
            budget -= row.num_new
        passed: list[Request] = []   # waiting for an adapter slot: they keep their place in the queue
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.in_flight:  # a preempted request whose last outputs are still on their way
                break
            leader = req.prefix_leader   # a sibling (SamplingParams.n) waits for the prompt its leader caches
            if leader is not None and not (leader.output_token_ids or leader.finished):
                break
            if not self._take_adapter(req, behind_waiter=bool(passed)):
                passed.append(self.waiting.popleft())
                continue
            row = self._admit(req, budget)
            if row is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            rows.append(self._commit(row))
            budget -= row.num_new
        self.waiting.extendleft(reversed(passed))
        return rows

    def _take_adapter(self, req: Request, behind_waiter: bool) -> bool:
        """The slot of the request's adapter, unless it has none or holds its slot already: False (the request waits)
        when none can be had now. The slot goes in the request's `lora` row value, which its first step in a device
        slot writes (sched/step_builder.py)."""
        if req.lora_request is None or req.lora_slot:
            return True
        slot = self.adapters.acquire(req.lora_request, behind_waiter)
        if slot is None:
            if req not in self.adapter_waiters:
                self.adapter_waiters.add(req)
                self.num_adapter_waits += 1
            return False
        self.adapter_waiters.discard(req)
        req.lora_slot = slot
        req.row_ints = with_request_value(req.row_ints, "lora", slot)
        return True

    def _admit(self, req: Request, budget: int) -> ScheduledRow | None:
        """The first row of a waiting request: its prompt (and outputs, after a preemption) minus the
        prefix the cache holds; None (nothing taken) when its blocks do not fit."""
        prefill = req.prompt_token_ids + req.output_token_ids
        req.block_hashes = []
        # A request still needing prompt logprobs computes every prompt position: no cached prefix (as vLLM)
        cached = ([] if req.needs_prompt_logprobs
                  else self.blocks.match_prefix(prefill, req.block_hashes, req.prefix_salt))
        start = len(cached) * self.blocks.block_size
        num_new = min(len(prefill) - start, budget)
        lookahead = self.draft_lookahead if start + num_new == len(prefill) else 0
        req.block_ids = list(cached)
        if not self.blocks.grow(req.block_ids, min(start + num_new + lookahead, self.max_model_len)):
            self.blocks.free_blocks(req.block_ids)
            return None
        self.blocks.record_lookup(len(prefill), start)
        req.slot = self.blocks.take_slot()
        req.status, req.prefill_token_ids, req.num_computed = Status.RUNNING, prefill, start
        return ScheduledRow(req, num_new, 0, start, prefill[start:start + num_new],
                            sample=start + num_new == len(prefill), new_slot=True, cached_ids=prefill[:start])

    def _plan_running(self, req: Request, budget: int) -> ScheduledRow | None:
        if req.prefilling:
            start = req.num_computed
            num_new = min(len(req.prefill_token_ids) - start, budget)
            return ScheduledRow(req, num_new, 0, start, req.prefill_token_ids[start:start + num_new],
                                sample=start + num_new == len(req.prefill_token_ids))
        # Decode: each in-flight sampling row yields >= 1 token, so stop planning once those alone
        # could reach max_tokens; and never plan a position past max_model_len - 1.
        if len(req.output_token_ids) + req.in_flight_samples >= req.params.max_tokens:
            return None
        room = self.max_model_len - 2 - req.num_computed
        if room < 0:
            return None
        num_drafts = min(req.num_proposed, room)   # what its last sampling step proposed (k, or a chosen one)
        if num_drafts < req.num_proposed and req.in_flight:
            # Near max_model_len the drafts are cut to the room left, and while a step is in flight the count assumes
            # all its drafts accepted: wait one step for the true count, so the cut is the one a sync run makes.
            return None
        if 1 + num_drafts > budget:
            return None
        return ScheduledRow(req, 1 + num_drafts, num_drafts, -1, (), sample=True)

    def _commit(self, row: ScheduledRow) -> ScheduledRow:
        """The plan's optimistic part: the row's tokens count as computed (every draft accepted) and the row is
        in flight until its step is read (`settle`)."""
        req = row.request
        req.num_computed += row.num_new
        req.in_flight += 1
        req.in_flight_samples += int(row.sample)
        return row

    # ---- settling what was planned, once the step is read ------------------------------------------
    def settle(self, row: ScheduledRow, num_accepted: int):
        """The step that carried `row` has been read: the row is no longer in flight, and the drafts it
        verified past the `num_accepted` the device accepted come off the request's count (`_commit` assumed
        all of them accepted). A preempted or finished request's count is left alone (it is recomputed or gone)."""
        req = row.request
        req.in_flight -= 1
        req.in_flight_samples -= int(row.sample)
        if row.num_drafts and req.status is Status.RUNNING:
            req.num_computed -= row.num_drafts - num_accepted

    def cache_confirmed(self, row: ScheduledRow):
        """After `settle` and the row's confirmed tokens: registers the request's blocks whose KV the read step
        made final: confirmed tokens only, never drafts (a sampling row's last emitted token has no KV yet), and
        with an EAGLE head all but the last of them (the head writes position p-1 when it is fed token p)."""
        req = row.request
        if req.status is not Status.RUNNING or not self.blocks.enable_prefix_caching:
            return
        num_computed = req.num_tokens - 1 if row.sample else row.start + row.num_new
        num_final = num_computed - self.blocks.key_overlap
        if num_final // self.blocks.block_size > len(req.block_hashes):
            tokens = req.prompt_token_ids + req.output_token_ids
            self.blocks.cache_blocks(req.block_ids, tokens, req.block_hashes, num_final, req.prefix_salt)

    def release_behind_window(self, row: ScheduledRow):
        """After `cache_confirmed`: with a sliding window, the request's blocks wholly before the window of the next
        position it computes go back to the pool. No later query reads them: every step dispatched after the read
        one, and the one in flight, computes from that position on (the device's own count, never below what the
        read step confirmed); a step that reuses a released block for another request runs after those."""
        req = row.request
        if self.kv_window is None or req.status is not Status.RUNNING:
            return
        next_position = req.num_tokens - 1 if row.sample else row.start + row.num_new
        first_key = next_position - self.kv_window + 1
        if first_key >= self.blocks.block_size:
            self.blocks.release_before(req.block_ids, first_key // self.blocks.block_size)

    def _reserve(self, req: Request, num_tokens: int, rows: list[ScheduledRow]) -> bool:
        """Blocks for `num_tokens`; preempts the newest running requests not in `rows` (this step's so far)
        when short."""
        num_tokens = min(num_tokens, self.max_model_len)   # a block table holds max_model_len positions
        while not self.blocks.grow(req.block_ids, num_tokens):
            scheduled = {id(row.request) for row in rows}
            victims = [r for r in self.running if r is not req and id(r) not in scheduled]
            victim = victims[-1] if victims else req
            self.preempt(victim)
            if victim is req:
                return False
        return True

    # ---- state changes -----------------------------------------------------------------------------
    def preempt(self, req: Request):
        """Recompute later: drop the KV and the slot; the request re-prefills prompt + outputs."""
        self._release(req)
        req.status, req.num_computed = Status.WAITING, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str):
        if req.finished:
            return
        if req in self.running:
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self.adapter_waiters.discard(req)
        req.status, req.finish_reason = Status.FINISHED, reason

    def _release(self, req: Request):
        # Steps already dispatched may still write these blocks and this slot; any later step that
        # reuses them runs after those on the device, since each step consumes the previous state.
        # (Cached blocks hold only final KV, below every position an in-flight step writes.)
        self.running.remove(req)
        self.blocks.free_blocks(req.block_ids)
        if req.slot is not None:
            self.blocks.free_slot(req.slot)
            req.slot = None
