"""What is compiled: the one object the scheduler, the runner and adaptive k ask which step programs a step may use.

While a tiered start compiles in the background (jaxspec.decode.compiler), only some token buckets have their
programs: a step pads to the smallest compiled bucket that holds it, the token budget is the largest compiled
bucket, and adaptive k picks among the draft widths compiled at the step's bucket. Once the background compiles
have ended every bucket and width is there (a step that needs a program nobody compiled ahead compiles it then).
The answers are read from the programs the runner holds each time they are asked, so nothing copies them; once the
compiles are over they are constants and the loop pays one flag test a question.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from jaxspec.decode.compiler import StepPrograms
from jaxspec.decode.step import StepVariant


class CompiledSteps:
    def __init__(self, programs: StepPrograms, program_key: Callable, token_buckets: Sequence[int],
                 num_speculative_tokens: int, max_num_batched_tokens: int):
        self.programs, self._key = programs, program_key
        self.token_buckets = list(token_buckets)
        self.K = num_speculative_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        # the full-width variants steps are planned for: a bucket is ready when each of them is compiled there
        self.serving_variants: tuple[StepVariant, ...] = ()

    def serve(self, variants: Sequence[StepVariant]):
        """The warm-up's variants at the full draft width (what a bucket needs to be ready)."""
        self.serving_variants = tuple(v for v in variants if v.drafts is None)

    def compiling(self) -> bool:
        """Whether background compiles still run. Once they have ended it raises what stopped them, if anything did
        (the loop asks every step, so a failure surfaces at the next step)."""
        if self.programs.compiling():
            return True
        if self.programs.failure is not None:
            self.programs.wait()   # raises it
        return False

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the background compiles; False if they still run after `timeout` seconds."""
        return self.programs.wait(timeout) and not self.compiling()

    # ---- what the loop's planners ask ------------------------------------------------------------------
    def ready_buckets(self) -> list[int]:
        """Buckets where every serving variant is compiled (any tier); every bucket once the compiles are over."""
        if not self.compiling():
            return self.token_buckets
        return [T for T in self.token_buckets
                if all(self.programs.ready(self._key(T, v)) for v in self.serving_variants)]

    def token_budget(self) -> int:
        """Tokens a step may carry: max_num_batched_tokens, or while compiling the largest compiled bucket."""
        if not self.compiling():
            return self.max_num_batched_tokens
        ready = self.ready_buckets()
        return min(self.max_num_batched_tokens, ready[-1]) if ready else self.max_num_batched_tokens

    def bucket_for(self, num_tokens: int) -> int:
        """The smallest bucket that holds `num_tokens`; while compiling, the smallest compiled one that does (else
        the smallest that does: its step compiles on demand)."""
        if self.compiling():
            T = next((b for b in self.ready_buckets() if b >= num_tokens), None)
            if T is not None:
                return T
        return next(b for b in self.token_buckets if b >= num_tokens)

    def ready(self, k: int, T: int) -> bool:
        """Whether the step of draft width k at bucket T is compiled for every serving variant (always, once the
        compiles are over)."""
        if not self.compiling():
            return True
        width = None if k == self.K else k
        return all(self.programs.ready(self._key(T, dataclasses.replace(v, drafts=width)))
                   for v in self.serving_variants)
