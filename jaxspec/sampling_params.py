"""`SamplingParams`: how one request samples and when it stops (vLLM's names and defaults)."""
from __future__ import annotations

import dataclasses
import math
import numbers

from jaxspec.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20  # top-n logprobs the step can return per token
MAX_STOP_TOKEN_IDS = 8
INT32_MAX = 2**31 - 1  # per-request integers travel to the device as int32
MAX_N = 256            # completions per prompt
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request: the device keeps a fixed-size table row per slot


@dataclasses.dataclass
class SamplingParams:
    n: int = 1                        # completions per prompt (siblings share the prompt's cached blocks)
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
    # Top-n logprobs of every prompt token given the tokens before it (the first has none); computed in the
    # prefill, whose cached prefix such a request does not reuse.
    prompt_logprobs: int | None = None
    # token id -> a value added to its logit before penalties and sampling, at every generated position
    logit_bias: dict[int, float] | None = None
    # The text keeps the stop string (or stop token) that ended it.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True            # special tokens (<|im_end|>, ...) left out of the text
    # Slow (Python) tokenizers only: spaces between special tokens in the text; fast tokenizers render none
    # either way, as in vLLM.
    spaces_between_special_tokens: bool = True
    # The output must match a JSON schema, a regex or one of some choices (applied on the device, each step).
    structured_outputs: StructuredOutputsParams | None = None
    # jaxspec's own (vLLM has no such field). False: this request verifies no drafts (plain decoding) while other
    # requests of the same engine speculate; its tokens are plain decoding's, seeds included. Changes nothing on an
    # engine without speculation.
    speculative: bool = True

    def __post_init__(self):
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_completion(self, index: int) -> "SamplingParams":
        """The params of completion `index` of n: one completion each, and a seed of its own (index 0 keeps
        the seed, so its tokens are those of the same request with n=1)."""
        seed = self.seed
        if seed is not None and index:
            seed = (seed + index * 0x9E3779B97F4A7C15) % 2**64   # golden-ratio stride: well spread seeds
        return dataclasses.replace(self, n=1, seed=seed)

    def validate(self):
        """Every field checked before a request is queued: a ValueError names the field, its value and the
        valid range (NaN, infinities, bools and values that overflow the device's int32 are refused)."""
        def bad(name, valid):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid; {valid}")

        def real(name, lo, hi, lo_open=False, hi_open=False):
            v = getattr(self, name)
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
            ok = ok and (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)
            if not ok:
                bad(name, f"it must be a finite number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")

        def integer(name, lo, hi, what=""):
            v = getattr(self, name)
            if not (isinstance(v, numbers.Integral) and not isinstance(v, bool) and lo <= v <= hi):
                bad(name, what or f"it must be an int in [{lo}, {hi}]")

        integer("n", 1, MAX_N)
        real("temperature", 0, math.inf, hi_open=True)
        real("top_p", 0, 1, lo_open=True)
        integer("top_k", -1, INT32_MAX, f"it must be -1 (off) or an int in [1, {INT32_MAX}]")
        if self.top_k == 0:
            bad("top_k", f"it must be -1 (off) or an int in [1, {INT32_MAX}]")
        real("min_p", 0, 1)
        integer("max_tokens", 1, INT32_MAX)
        integer("min_tokens", 0, self.max_tokens, f"it must be an int in [0, max_tokens={self.max_tokens}]")
        if self.seed is not None:
            integer("seed", -2**63, 2**64 - 1, "it must be None or an int in [-2**63, 2**64)")
        real("presence_penalty", -2, 2)
        real("frequency_penalty", -2, 2)
        real("repetition_penalty", 0, math.inf, lo_open=True, hi_open=True)
        if self.logprobs is not None:
            integer("logprobs", 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            integer("prompt_logprobs", 0, MAX_LOGPROBS)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "it must be a bool")
        if self.logit_bias is not None:
            self._validate_logit_bias(bad)
        ids = self.stop_token_ids
        if len(ids) > MAX_STOP_TOKEN_IDS or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in ids):
            bad("stop_token_ids", f"give at most {MAX_STOP_TOKEN_IDS} token ids, each an int in [0, {INT32_MAX}] "
                                  "(and inside the model's vocabulary)")
        self.stop_token_ids = [int(t) for t in ids]
        if not all(isinstance(x, str) and x for x in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "give a StructuredOutputsParams (or a dict of its fields) or None")
            self.structured_outputs.validate()

    def _validate_logit_bias(self, bad):
        """At most MAX_LOGIT_BIAS entries, int token ids -> finite numbers (ids inside the vocabulary are checked
        where the vocabulary is known: the engine's intake)."""
        bias = self.logit_bias
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"give a dict of at most {MAX_LOGIT_BIAS} token ids -> bias")
        for t, v in bias.items():
            if not (isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t <= INT32_MAX):
                bad("logit_bias", f"key {t!r} is not a token id (an int in [0, {INT32_MAX}])")
            if not (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)):
                bad("logit_bias", f"the bias of token {t} is {v!r}; it must be a finite number")
        self.logit_bias = {int(t): float(v) for t, v in bias.items()}
