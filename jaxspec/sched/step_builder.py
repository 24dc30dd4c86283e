"""A step's host inputs from the scheduler's rows: the packed token and row values (decode/inputs.py), the block
tables, each slot's fixed request values, and the compiled variant and draft width the step runs with.

Each slot's request values (sampling parameters, seed, stop ids) are written once, when the request takes the
slot, into host tables indexed by slot; a step gathers its rows' from there in one indexing.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from jaxspec.decode.inputs import MAX_STOP_IDS, REQUEST_FLOAT_ROWS, REQUEST_INT_ROWS, STEP_INT_ROWS, StepInputs
from jaxspec.decode.step import StepVariant
from jaxspec.sched.request import Request
from jaxspec.sched.scheduler import ScheduledRow

# The step's per-step row ints (decode/inputs.py declares them), each given its value in `_step_row_values`.
assert STEP_INT_ROWS == ["slot", "num_new", "start", "num_drafts", "first_token", "sample", "new_slot", "grammar_base",
                         "grammar_init"]
GRAMMAR_BASE_COLUMN = STEP_INT_ROWS.index("grammar_base")


@dataclasses.dataclass
class StepPlan:
    rows: list[ScheduledRow]
    inputs: StepInputs
    variant: StepVariant
    num_tokens: int        # tokens scheduled
    bucket: int            # the token bucket it is padded to
    draft_width: int       # drafts it verifies (at most) and proposes per row
    proposed: int          # drafts it proposes for its sampling rows (the k chosen for them)


class StepBuilder:
    def __init__(self, runner, step_config, grammar_tables, k_chooser=None):
        self.runner, self.step_config, self.grammar_tables, self.k_chooser = runner, step_config, grammar_tables, k_chooser
        slots = step_config.num_slots
        self._slot_ints = np.zeros((slots, len(REQUEST_INT_ROWS)), np.int32)
        self._slot_floats = np.zeros((slots, len(REQUEST_FLOAT_ROWS)), np.float32)
        self._slot_stop_ids = np.full((slots, MAX_STOP_IDS), -1, np.int32)

    def build(self, rows: list[ScheduledRow], index: int) -> StepPlan:
        """Step `index`'s inputs for these rows (fresh host arrays: nothing here is written again once sent)."""
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
                self._write_slot_tables(row.request)
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
        if any(row.start >= 0 and row.request.needs_prompt_logprobs for row in rows):
            variant = dataclasses.replace(variant, prompt_logprobs=True)
        width, proposed = self._draft_width(rows, index, T)
        if width != self.step_config.num_speculative_tokens:
            variant = dataclasses.replace(variant, drafts=width)
        return StepPlan(rows, inp, variant, num_tokens, T, width, proposed)

    def _write_slot_values(self, req: Request):
        """The request's fixed row values (decode/inputs.py) and its stop ids masked until min_tokens, in the
        host tables indexed by slot, from which each step's rows are gathered in one indexing."""
        self._slot_ints[req.slot] = req.row_ints
        self._slot_floats[req.slot] = req.row_floats
        self._slot_stop_ids[req.slot] = -1
        self._slot_stop_ids[req.slot, :len(req.min_tokens_stop_ids)] = req.min_tokens_stop_ids

    def _write_slot_tables(self, req: Request):
        """The device tables a request reads by its slot: its logit-bias row, and for prompt logprobs the whole
        prompt in the slot's history (each prompt token's logprob is read at the token after it, which for a
        chunk's last token is in the next chunk)."""
        if req.logit_bias_row is not None:
            self.runner.write_logit_bias(req.slot, req.logit_bias_row)
        if req.needs_prompt_logprobs:
            self.runner.write_history(req.slot, req.prompt_token_ids)

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

    def _draft_width(self, rows: list[ScheduledRow], index: int, T: int) -> tuple[int, int]:
        """-> (the step's draft width, the k it proposes for its sampling rows). k is K, or the chooser's pick
        under adaptive speculation; each row's next decode step verifies that many, except the rows of requests
        that do not speculate (SamplingParams.speculative false): theirs verify none (the drafter still proposes
        for every row of the step; their drafts are never scheduled). The width is at least k and every row's
        drafts to verify (a step that lowers k still verifies the drafts proposed before it)."""
        K = self.step_config.num_speculative_tokens
        if not K:
            return 0, 0
        sampling = [row for row in rows if row.sample]
        drafting = [row for row in sampling if row.request.params.speculative]
        k = K if drafting else 0
        if drafting and self.k_chooser is not None:
            context = sum(row.request.num_computed for row in drafting) / len(drafting)   # tokens each row reads
            # tokens whatever k is: prefill chunks, and the next step's single token of each row that does not draft
            fixed_tokens = sum(row.num_new for row in rows if not row.sample) + len(sampling) - len(drafting)
            k = self.k_chooser.choose(index, len(drafting), fixed_tokens, context)
        for row in sampling:
            row.request.num_proposed = k if row.request.params.speculative else 0
        if self.k_chooser is None:
            return K, k
        width = max([k] + [row.num_drafts for row in rows])
        ready = self.runner.compiled.ready
        if not ready(width, T):
            # programs still compile in the background: a step that proposes nothing of its own width (a prefill
            # chunk) runs the narrowest compiled program that is wider, rather than wait for its own
            width = next((w for w in range(width + 1, K + 1) if ready(w, T)), width)
        return width, k
