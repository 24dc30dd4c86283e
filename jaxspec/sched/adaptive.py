"""Speculation length chosen per step (`SpeculativeConfig(adaptive=True)`): the host picks k in 0..K for the
next step, the one that maximises expected tokens per second.

    expected tokens per row  E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i     (a_i: acceptance at draft position i,
                                                                          given positions 1..i-1 were accepted)
    rate(k) = rows(k) * E(k) / t(k, T_k)
    t(k, T) = t0(k, T) + c(k, T) * rows(k) * (1+k) * L

rows(k) is how many of the B decoding rows fit the token budget at 1+k tokens each beside the step's tokens P
whose number k does not change (prefill tokens: the next step's are not known when its drafts are proposed, this
step's stand for them; and one token per decoding row of a request that does not speculate), T_k the token
bucket of the step's rows(k) * (1+k) + P tokens and t(k, T) the device time of the step compiled for draft width
k at bucket T, with L the decoding rows' mean context. Once the programs are compiled, the engine times each
(jaxspec.sched.pricing): t0 on blank steps (`calibrated`), c, each query token's attention per context token, on
steps whose rows read a context (`context_cost`). Until then, and for a pair without such a time, t is measured from the
loop's period (the
median of the pair's last few timed steps; a pair not yet measured is tried for a few steps, smallest k first; a
program's first runs and steps that compiled are no measure; while another k is chosen, plain decoding's time is
measured again every REMEASURE_STEPS steps): that period carries every host pause, so it prices a pair only until
its device time is known. Low acceptance makes every E(k) near 1, so the cheapest step (k = 0, plain decoding)
wins; a large batch makes the step time grow with its tokens (and the budget fit fewer rows at 1+k), so k falls
back toward 0 there too.

a_i is a running estimate: accepted and tried counts per position, decayed each step, with a prior
(`PRIOR_ACCEPTANCE` at position 1, position i-1's estimate at position i) weighted as `PRIOR_WEIGHT`
observations. While k = 0 nothing is observed and the counts decay back to the prior, so a drafter that
starts to match again (a repetitive stretch for n-gram lookup) is tried again.

Observations of step N are folded in before choosing at step N+2, never earlier: async scheduling reads step
N only after dispatching N+1, and sync scheduling is made to wait as long, so that both modes choose the same
k from the same requests (the measured times differ from run to run; `time_model` replaces them).
"""
from __future__ import annotations

import collections
from typing import Callable

import numpy as np

PRIOR_ACCEPTANCE = 0.6    # acceptance at position 1 before anything is observed
PRIOR_WEIGHT = 1.0        # the prior counts as this many observations
# Per step: observations ~100 steps old weigh e^-1 as much as new ones. After k fell to 0 for a drafter that
# never matches, the prior takes over again (and k > 0 is tried for a few steps) only after a hundred steps
# or more: rarely enough to cost little, often enough to notice a drafter that matches again.
DECAY = 0.99
# A pair's time is the median of its last TIME_SAMPLES timed steps, none older than REMEASURE_STEPS. A step's time
# is the loop's period (jaxspec.sched.engine._observe), and a host pause (the GIL held by a request's thread, a
# neighbour process) lengthens one period by several times: on two H200s (2026-11-28) single samples put plain
# decoding's time at 4.7 ms where its steps took ~2 ms, and an average that a first sample dominates kept such a
# time for the next REMEASURE_STEPS steps. An exploration or a re-measure gives three or more samples, so the
# median drops one such pause.
TIME_SAMPLES = 5
# steps an unmeasured (k, bucket) is kept to measure it (exploring): the steps of width k are the 2nd to the last,
# and a program's first two runs are no measure (jaxspec.decode.runner.UNTIMED_RUNS), so the 4th is the first
# that can be, read two steps later
EXPLORE_STEPS = 5
EXPLORE_ATTEMPTS = 2      # explorations of a pair that stays unmeasured (its steps compiled) before giving up
# Steps after which plain decoding's time (k = 0 at its bucket), while another k is chosen, is measured again. A
# pair's time is otherwise refreshed only when it runs, and k = 0, the rate adaptive k must not fall below, would
# keep a time taken once (early in a run, under other load, at shorter contexts) for as long as it is not picked.
# Costs at most EXPLORE_STEPS steps of k = 0 in REMEASURE_STEPS (2%) for each bucket plain decoding runs at.
REMEASURE_STEPS = 256
# Another k must promise this much more throughput to replace the current one: damping for the noise of measured
# times and running estimates, nothing else. So it holds only while no k's token bucket (nor its share of the rows
# under the budget) changed since the last choice (crossing a bucket edge changes the rates for real, and the
# choice is made afresh), and never holds a k that plain decoding (k = 0) beats: adaptive k never loses to it.
MARGIN = 0.03


def median(values) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


class KChooser:
    def __init__(self, num_speculative_tokens: int, max_num_batched_tokens: int, bucket_for: Callable[[int], int],
                 compiled=None):
        self.K = num_speculative_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.bucket_for = bucket_for
        # What is compiled (jaxspec.decode.compiled.CompiledSteps, asked at each choice): while programs compile in
        # the background only compiled widths are chosen, within the largest compiled bucket. None: everything is.
        self.compiled = compiled
        self.accepted = np.zeros(self.K)   # decayed counts per draft position
        self.tried = np.zeros(self.K)
        # (draft width, token bucket) -> the step's device seconds, timed on blank steps once its program was
        # compiled (jaxspec.sched.pricing): the price of a pair that has one; measured times price the others
        self.calibrated: dict[tuple[int, int], float] = {}
        # (draft width, token bucket) -> the seconds each query token's attention adds per context token, timed with
        # `calibrated`: what a blank step leaves out
        self.context_cost: dict[tuple[int, int], float] = {}
        self.context = 0.0   # the decoding rows' mean context at the last choice
        self.times: dict[tuple[int, int], float] = {}   # (draft width, token bucket) -> seconds (median)
        self._samples: dict[tuple[int, int], collections.deque] = {}   # (k, T) -> its last (step, seconds)
        # (k, T) -> seconds: replaces the measured times (deterministic choices for tests; a cost model)
        self.time_model: Callable[[int, int], float] | None = None
        self.current = self.K
        self._pending: collections.deque = collections.deque()   # (step, kind, payload), in step order
        # (k, T, last step, whether to stop at its first measure) of the pair being measured: a pair never measured
        # is kept until it has a time; plain decoding measured again, for all its steps (a median of fresh samples)
        self._explore: tuple[int, int, int, bool] | None = None
        self.measured_at: dict[tuple[int, int], int] = {}   # (k, T) -> the step its time was last measured at
        self._attempts: collections.Counter = collections.Counter()   # explorations per (k, T)
        self._shape: tuple | None = None   # (k, T, share of the rows) per k at the last choice (see MARGIN)

    # ---- observations --------------------------------------------------------------------------------
    def price(self, device_seconds: dict[tuple[int, int], float], context_cost: dict[tuple[int, int], float]):
        """Prices timed on the engine (jaxspec.sched.pricing): each (k, T)'s device seconds with no context, and the
        seconds each of its query tokens' attention adds per context token."""
        self.calibrated.update(device_seconds)
        self.context_cost.update(context_cost)

    def observe(self, step: int, drafted_accepted: list[tuple[int, int]], time: tuple[int, int, float | None]):
        """Step `step` was read: (drafts verified, accepted) of each of its rows that verified drafts, and
        (its draft width, its token bucket, its measured device seconds or None when it is no measure: the
        step compiled)."""
        self._pending.append((step, drafted_accepted, time))

    def _fold(self, upto: int):
        while self._pending and self._pending[0][0] <= upto:
            step, rows, time = self._pending.popleft()
            self.accepted *= DECAY
            self.tried *= DECAY
            for drafted, accepted in rows:
                self.accepted[:accepted] += 1
                self.tried[:min(accepted + 1, drafted)] += 1
            k, T, seconds = time
            if seconds is not None:
                samples = self._samples.setdefault((k, T), collections.deque(maxlen=TIME_SAMPLES))
                while samples and step - samples[0][0] > REMEASURE_STEPS:
                    samples.popleft()   # a time that old is no measure any more: newer ones replace it
                samples.append((step, seconds))
                self.times[(k, T)] = median(s for _, s in samples)
                self.measured_at[(k, T)] = step

    # ---- estimates -----------------------------------------------------------------------------------
    def acceptance(self) -> np.ndarray:
        """a_i, i = 1..K: the running conditional acceptance per draft position."""
        a, prior = np.zeros(self.K), PRIOR_ACCEPTANCE
        for i in range(self.K):
            a[i] = prior = (self.accepted[i] + PRIOR_WEIGHT * prior) / (self.tried[i] + PRIOR_WEIGHT)
        return a

    def expected_tokens(self, k: int, acceptance: np.ndarray | None = None) -> float:
        a = self.acceptance() if acceptance is None else acceptance
        return 1.0 + float(np.sum(np.cumprod(a[:k])))

    def step_time(self, k: int, T: int, query_tokens: int = 0, context: float = 0.0) -> float | None:
        """Seconds of a step of width k at bucket T whose `query_tokens` decode tokens each read `context` tokens
        (a measured period carries its contexts already)."""
        if self.time_model is not None:
            return self.time_model(k, T)
        if (k, T) in self.calibrated:
            return self.calibrated[(k, T)] + self.context_cost.get((k, T), 0.0) * query_tokens * context
        return self.times.get((k, T))

    def snapshot(self) -> dict:
        """What the chooser believes now (stats()["spec"]["chooser"]): each measured (k, bucket)'s step time and the
        step it was last measured at, each calibrated one's device time (the price, where there is one), and the
        running acceptance per draft position."""
        return {"step_ms": [[k, T, 1e3 * t, self.measured_at.get((k, T))] for (k, T), t in sorted(self.times.items())],
                "calibrated_ms": [[k, T, 1e3 * t] for (k, T), t in sorted(self.calibrated.items())],
                "context_ns": [[k, T, 1e9 * c] for (k, T), c in sorted(self.context_cost.items())],
                "context": self.context, "acceptance": self.acceptance().tolist()}

    # ---- the choice ----------------------------------------------------------------------------------
    def choose(self, step: int, num_rows: int, fixed_tokens: int = 0, context: float = 0.0) -> int:
        """k for the drafts step `step` proposes (the next step of its `num_rows` drafting rows verifies them),
        priced as if that step also carries `fixed_tokens` whose number k does not change (this step's prefill
        chunks, the rows that do not speculate), which take their share of the token budget and of the step's
        bucket, and its drafting rows read `context` tokens each."""
        self._fold(step - 2)
        if self._explore is not None:
            k, T, last, until_measured = self._explore
            if step <= last and not (until_measured and (k, T) in self.measured_at):
                return k
            self._explore = None
        a = self.acceptance()
        self.context = context
        rates, unmeasured, shape = {}, [], []
        compiled = self.compiled
        budget = self.max_num_batched_tokens if compiled is None else compiled.token_budget()
        fixed_tokens = max(0, min(fixed_tokens, budget - num_rows))   # decode rows are planned first
        for k in range(self.K + 1):
            rows = min(num_rows, (budget - fixed_tokens) // (1 + k))
            if rows == 0:
                continue
            T = self.bucket_for(rows * (1 + k) + fixed_tokens)
            if compiled is not None and not compiled.ready(k, T):
                continue
            t = self.step_time(k, T, rows * (1 + k), context)
            if t is None:
                if self._attempts[(k, T)] < EXPLORE_ATTEMPTS:
                    unmeasured.append((k, T))
                continue
            rates[k] = rows * self.expected_tokens(k, a) / max(t, 1e-9)
            shape.append((k, T, rows / num_rows))
        if unmeasured:
            # Measure it: the step proposing k may be wider (it verifies the drafts proposed before it); the
            # next one, proposing k again, is a step of width k, and its time is folded in two steps later.
            k, T = unmeasured[0]
            self._attempts[(k, T)] += 1
            self._explore = (k, T, step + EXPLORE_STEPS, True)
            self.current, self._shape = k, None
            return k
        if not rates:
            return self.current
        best = max(rates, key=rates.get)
        plain = next(((k, T) for k, T, _ in shape if k == 0), None)
        if (best != 0 and plain is not None and self.time_model is None and plain not in self.calibrated
                and step - self.measured_at.get(plain, step) > REMEASURE_STEPS):
            # plain decoding's time is old: measure it again before trusting that another k beats it
            self._explore = (0, plain[1], step + EXPLORE_STEPS, False)
            self.current, self._shape = 0, None
            return 0
        same, self._shape = tuple(shape) == self._shape, tuple(shape)
        held = rates.get(self.current, 0.0)
        if same and held >= rates.get(0, 0.0) and rates[best] <= held * (1 + MARGIN):
            return self.current
        self.current = best
        return best
