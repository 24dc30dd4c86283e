"""Adaptive k's step prices: each (draft width, token bucket)'s device time, timed on the live engine.

Each compiled (k, bucket) is timed twice (`StepPricing.time_steps`): on blank steps (no row; every write goes to the
trash slot, so live requests are untouched), and on steps whose rows read TIMED_CONTEXT tokens of context each
(`context_inputs`, writing their own KV to a block taken from the pool for the while). The first is the step's
price with no context; the difference, per query token and context token, what each adds (the chooser scales it by
the rows' contexts). A blank step alone leaves out that attention, which grows with a row's k + 1 queries: on an
H200 at batch 32 a live k = 3 step took ~1.4x its blank time, and adaptive k chose k = 3 where plain decoding
delivered as much. With the contexts priced, the prices came within 2-5% of the live steps' periods, and adaptive k
was above plain over the saturated part at every batch from 1 to 64 (docs/lab/2026-11-28-adaptive-k-device-prices.md,
docs/lab/2026-11-28-adaptive-k-context-prices.md). A time measured from the loop's period instead carries every host pause (plain
decoding's steps were timed at 1.5-3x their real time there).

Prices are taken once the programs are compiled, at their best tier: at the end of a full warm-up, or (a tiered
start) between live steps once the background compiles have ended. A pass keeps each pair's best of TIMING_ROUNDS
(the first pass after a warm-up timed steps at 1.5-2x the live loop's on a CPU, where the best of two came within
0-13% of it) and stops after PRICING_BUDGET_S seconds, fewer timed runs where a step is slow (a pair left out keeps
the loop's measured periods). On a GPU a pass of every pair takes a few seconds; on a CPU a step of SmolLM2 drafting
for itself at k = 4 with a 4096-token context took ~1.8 s, and its first pair alone was timed for 37 s.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import jax
import numpy as np

from jaxspec.decode.inputs import StepInputs
from jaxspec.decode.runner import UNTIMED_RUNS, ModelRunner
from jaxspec.decode.step import StepVariant

# Passes over every (draft width, bucket): each pair's best is its price.
TIMING_ROUNDS = 2
# Tokens of context each row of a context step reads (at most half of max_model_len).
TIMED_CONTEXT = 1024
# Runs of a step timed back to back, after UNTIMED_RUNS untimed ones: their mean.
TIMED_RUNS = 8
# Seconds a pricing pass may take: pairs are timed smallest bucket first (what few requests use), every width at
# each, until it is spent.
PRICING_BUDGET_S = 10.0


def context_rows(runner: ModelRunner, T: int, k: int) -> int:
    """Decode rows of draft width k that bucket T holds: the rows `context_inputs` fills."""
    return min(runner.rows_for(T), T // (k + 1))


def context_inputs(runner: ModelRunner, T: int, k: int, context: int, scratch_block: int) -> StepInputs:
    """Bucket T's inputs as a step of `context_rows(T, k)` decode rows at draft width k would have them, each `context`
    tokens into its sequence (a multiple of the block size): its keys before the context's last block are read from
    KV blocks of the pool, whatever they hold, a run of its own per row (live steps do not share their contexts'
    blocks); the rest of its table is `scratch_block`, where its own tokens' KV (and a drafter's) is written. Its slot
    is the trash slot. A step on these inputs does a live step's attention and leaves every live request untouched,
    provided no request holds `scratch_block`."""
    sc = runner.step_config
    n, width, per_row = context_rows(runner, T, k), k + 1, context // sc.block_size
    if context % sc.block_size or context + 2 * width > sc.max_model_len:
        raise ValueError(f"context {context} must be a multiple of the block size {sc.block_size} and leave "
                         f"{2 * width} positions before max_model_len {sc.max_model_len}")
    inp = runner.new_inputs(T)
    tokens, rows = inp.tokens, inp.rows
    tokens["row"][:n * width] = np.repeat(np.arange(n), width)
    tokens["offset"][:n * width] = np.tile(np.arange(width), n)
    for name, value in (("num_new", width), ("start", context), ("num_drafts", k), ("sample", 1),
                        ("first_token", np.arange(n) * width)):
        rows[name][:n] = value
    inp.block_tables[:n] = scratch_block
    # a drafter may write the KV of the position before a row's first token (an EAGLE head's, once the token after it
    # is known): the context's last block is the scratch block too
    reads = per_row - 1
    inp.block_tables[:n, :reads] = np.arange(n * reads).reshape(n, reads) % sc.num_blocks
    return inp


def time_step(runner: ModelRunner, T: int, variant: StepVariant, runs: int = TIMED_RUNS,
              inputs: StepInputs | None = None, seconds_left: float = float("inf")) -> float | None:
    """Device seconds of one step of bucket T under this variant: its program run up to `runs` times back to back on
    `inputs` (by default blank ones; `context_inputs` adds the attention over live contexts that a blank step leaves
    out), after UNTIMED_RUNS untimed runs that also wait out a live step in flight. Back to back, as the loop issues
    steps, the host's dispatch overlaps the device. No more timed runs than fit `seconds_left` by the untimed ones'
    pace; None where not one does (a step that slow is left to the loop's measured periods). The runs are not kept as
    the bucket's last live inputs (benchmarks replay those)."""
    buf = (runner.new_inputs(T) if inputs is None else inputs).pack()   # read, never written: every run may take it
    t0 = time.perf_counter()
    for _ in range(UNTIMED_RUNS):
        out = runner.run_packed(T, variant, buf, record=False)
    jax.block_until_ready(out)
    pace = (time.perf_counter() - t0) / UNTIMED_RUNS   # an upper bound: the first also waited for the step in flight
    fit = (seconds_left - (time.perf_counter() - t0)) / max(pace, 1e-9)
    runs = min(runs, int(fit)) if fit < runs else runs
    if runs < 1:
        return None
    t0 = time.perf_counter()
    for _ in range(runs):
        out = runner.run_packed(T, variant, buf, record=False)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / runs


class StepPricing:
    """Prices the chooser's (k, bucket) pairs on the live engine: at once (`time_steps`), or once the background
    compiles a tiered start began have ended (`after_compiles`, then `when_compiled` between steps)."""

    def __init__(self, runner: ModelRunner, blocks, chooser, lock: threading.RLock):
        self.runner, self.blocks, self.chooser, self.lock = runner, blocks, chooser, lock
        self.waiting = False   # prices are due once the background compiles end
        self.budget_s = PRICING_BUDGET_S
        self.clock = time.perf_counter   # what the budget is kept by

    def after_compiles(self):
        """Prices are due when the background compiles end (a tiered start)."""
        self.waiting = self.chooser is not None

    def when_compiled(self):
        """Between steps: prices every pair once the background compiles have ended, if they are due."""
        if self.waiting and not self.runner.compiled.compiling():
            self.waiting = False
            self.time_steps()

    def time_steps(self):
        """Times the compiled (k, bucket) pairs (the module's docstring says how) on the first serving variant (greedy,
        unless only sampling steps were warmed up), within `budget_s`, and hands the chooser their prices."""
        chooser, runner = self.chooser, self.runner
        if chooser is None:
            return
        from tqdm.auto import tqdm
        sc = runner.step_config
        K, base = sc.num_speculative_tokens, runner.compiled.serving_variants[0]
        variants = {(k, T): dataclasses.replace(base, drafts=None if k == K else k)
                    for T in runner.token_buckets for k in range(K + 1)}
        # compiled programs only: timing never compiles (a pair left out keeps its measured periods)
        pairs = [kT for kT, v in variants.items() if runner.programs.ready(runner.program_key(kT[1], v))]
        context = min(TIMED_CONTEXT, sc.max_model_len // 2) // sc.block_size * sc.block_size
        with self.lock:
            scratch = []   # the block the context steps write their own tokens' KV to: no request holds it
            if context < sc.block_size or context + 2 * (K + 1) > sc.max_model_len \
                    or not self.blocks.grow(scratch, sc.block_size):
                context = 0
            if runner.programs.store is not None:
                runner.programs.store.flush()   # its writes serialize programs on another thread
            blank, with_context = {}, {}
            deadline = self.clock() + self.budget_s
            try:
                for k, T in tqdm(pairs * TIMING_ROUNDS, desc="timing steps", leave=False):
                    seconds = time_step(runner, T, variants[(k, T)], seconds_left=deadline - self.clock())
                    if seconds is None:
                        break
                    blank[(k, T)] = min(seconds, blank.get((k, T), seconds))
                    if context:
                        inputs = context_inputs(runner, T, k, context, scratch[0])
                        seconds = time_step(runner, T, variants[(k, T)], inputs=inputs,
                                            seconds_left=deadline - self.clock())
                        if seconds is None:
                            break
                        with_context[(k, T)] = min(seconds, with_context.get((k, T), seconds))
            finally:
                self.blocks.free_blocks(scratch)
            cost = {(k, T): max(seconds - blank[(k, T)], 0.0) / (context_rows(runner, T, k) * (k + 1) * context)
                    for (k, T), seconds in with_context.items()}
            # a pair priced without its context cost would be priced low for every live step: left to the periods
            chooser.price({kT: t for kT, t in blank.items() if kT in cost or not context}, cost)
