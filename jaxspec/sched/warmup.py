"""Warm-up: which step programs compile before the engine serves, which in the background, and the compiles a
server asks for ahead (a structured-outputs constraint's). What is compiled is the runner's `compiled` to answer
(jaxspec.decode.compiled); adaptive k's step prices are taken once the programs are there (jaxspec.sched.pricing).

    full    every warm program at the full draft width, autotuned; then the prices
    fast    the same without autotuning
    tiered  the smallest bucket's full-width programs without autotuning (tuned at once where the program store holds
            them tuned), then the engine serves while every other one compiles in the background, fast then tuned;
            the prices once those compiles end
    none    nothing ahead: each program compiles when a step first needs it

Under adaptive k every mode but "none" compiles the narrower draft widths in the background: every step can run at the
full width, and the chooser picks a narrower one once it is compiled (jaxspec.decode.compiled), so a request never waits
for a program it does not need. (Compiled ahead, SmolLM2 drafting for itself at k = 4 held a CPU's first token for
K + 1 = 5 times the programs, each with the draft model's forwards inside.) The prices are taken once they are all in.
"""
from __future__ import annotations

import dataclasses
import threading

from jaxspec.decode.compiler import FAST, TUNED
from jaxspec.decode.runner import ModelRunner
from jaxspec.decode.step import StepVariant
from jaxspec.sched.pricing import StepPricing

# Compiled for every bucket at warm-up: greedy rows only, and rows that sample (no top-k/top-p, penalties or
# logprobs). Other variants compile the first time a step needs them (counted in stats()["recompiles"]).
WARM_VARIANTS = (StepVariant(), StepVariant(sample=True))


class Warmup:
    def __init__(self, runner: ModelRunner, mode: str, adaptive: bool, pricing: StepPricing, lock: threading.RLock):
        self.runner, self.mode, self.adaptive, self.pricing, self.lock = runner, mode, adaptive, pricing, lock
        self.compiled_on_demand_before = None   # programs steps compiled before warm-up ended (None: no warm-up)
        runner.compiled.serve(WARM_VARIANTS)

    def variants(self, sample: bool | None = None) -> list[StepVariant]:
        """The warm variants (`sample`: only the greedy (False) or the random (True) ones), at every draft width
        adaptive k may pick."""
        base = [v for v in WARM_VARIANTS if sample is None or v.sample == sample]
        if not self.adaptive:
            return base
        K = self.runner.step_config.num_speculative_tokens
        return base + [dataclasses.replace(v, drafts=k) for k in range(K) for v in base]

    def warmup(self, sample: bool | None = None):
        """Compiles the step programs of every token bucket and warm variant as the mode says (the module's
        docstring); an engine built with warmup=False compiles them all, autotuned. `sample`: only the greedy (False)
        or only the random (True) variants (a greedy benchmark compiles half); None: both."""
        runner, variants = self.runner, self.variants(sample)
        runner.compiled.serve(variants)
        if self.mode == "tiered":
            programs, key = runner.programs, runner.program_key
            first = [key(runner.token_buckets[0], v) for v in variants if v.drafts is None]
            for tier in (FAST, TUNED):
                programs.compile([k for k in first if programs.start_tier(k) == tier], tier, desc="compiling steps")
            every = [key(T, v) for T in runner.token_buckets for v in variants]
            programs.start_background([(k, FAST) for k in every if programs.start_tier(k) == FAST]
                                      + [(k, TUNED) for k in every])
        else:
            tier = FAST if self.mode == "fast" else None
            runner.warmup([v for v in variants if v.drafts is None], tier=tier)
            runner.programs.start_background([(runner.program_key(T, v), tier or TUNED) for T in runner.token_buckets
                                              for v in variants if v.drafts is not None])
        runner.warm_transfers(variants)
        self.compiled_on_demand_before = runner.compiled_on_demand
        if runner.compiled.compiling():
            self.pricing.after_compiles()
        else:
            self.pricing.time_steps()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Waits for the background compiles (a tiered start): then every warm program has its best tier and is
        priced, and the steps run at full speed (benchmarks wait here before timing). False if they still run after
        `timeout`."""
        done = self.runner.compiled.wait(timeout)
        if done:
            with self.lock:
                self.pricing.when_compiled()
        return done

    def warmup_structured(self, automaton, grammar_tables, sample: bool | None = None):
        """Places a compiled constraint's automaton in the device table and compiles the grammar variants of the step
        for every token bucket and that table's shape: requests with this constraint then compile nothing (a
        benchmark, or a server that knows its constraints ahead). `sample`: only the greedy (False) or only the
        random (True) variants; None: both. Call it with no request running."""
        with self.lock:
            grammar_tables.acquire(automaton)   # its place stays after the release, until space is needed
            grammar_tables.release(automaton)
            variants = [dataclasses.replace(v, grammar=True) for v in self.variants(sample)]
            self.runner.warmup(variants, grammar_tables.device_table())
