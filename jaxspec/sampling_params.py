"""`SamplingParams`: how one request samples and when it stops (vLLM's names and defaults)."""
from __future__ import annotations

import dataclasses

MAX_LOGPROBS = 20  # top-n logprobs the step can return per token


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self):
        def bad(name, value, valid):
            raise ValueError(f"SamplingParams.{name}={value!r} is invalid; {valid}")
        if self.temperature < 0:
            bad("temperature", self.temperature, "it must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "it must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", self.top_k, "it must be -1 (off) or >= 1")
        if not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "it must be in [0, 1]")
        if self.max_tokens is None or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "it must be >= 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"it must be in [0, max_tokens={self.max_tokens}]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "it must be > 0 (1 means off)")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", self.presence_penalty, "it must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", self.frequency_penalty, "it must be in [-2, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", self.logprobs, f"it must be in [0, {MAX_LOGPROBS}]")
        if len(self.stop_token_ids) > 8:
            bad("stop_token_ids", self.stop_token_ids, "at most 8 ids are supported")
        if any(not s for s in self.stop):
            bad("stop", self.stop, "stop strings must be non-empty")
