"""A request's host-side life: prompt, confirmed outputs, optimistic progress, KV blocks, device slot."""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from jaxspec.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                       # resolved seed: the device derives every random draw from it
    eos_token_ids: tuple[int, ...]
    prompt: str | None = None
    parent_id: str | None = None    # with SamplingParams.n > 1: the id its n completions answer to
    index: int = 0                  # ... and which of them it is
    min_tokens_stop_ids: list[int] = dataclasses.field(default_factory=list)  # masked until min_tokens
    row_ints: tuple = ()            # its fixed per-row step inputs (decode/inputs.py ROW_FIELDS), ints
    row_floats: tuple = ()          # ... and floats
    step_variant: Any = None        # decode.step.StepVariant: what this request needs of a compiled step
    grammar: Any = None             # structured outputs: its compiled TokenAutomaton (jaxspec.structured)
    logit_bias_row: Any = None      # its row of the device's logit-bias table (decode.runner.logit_bias_row), or None
    lora_request: Any = None        # jaxspec.LoRARequest: the adapter it runs with, or None
    lora_slot: int = 0              # that adapter's device slot while the request holds it (jaxspec.lora.slots)
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)

    status: Status = Status.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)  # confirmed by the device
    finish_reason: str | None = None
    slot: int | None = None
    block_ids: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[int] = dataclasses.field(default_factory=list)  # chained hashes of its cached blocks
    prefix_leader: Any = None        # the sibling (SamplingParams.n) whose prompt blocks this one reuses

    # Tokens a (re)admission prefills: the prompt, plus the outputs so far after a preemption.
    prefill_token_ids: list[int] = dataclasses.field(default_factory=list)
    # Tokens whose KV the dispatched steps write, assuming every draft is accepted (an upper bound
    # on the device's authoritative count; reconciled when a step's accepted counts are read).
    num_computed: int = 0
    in_flight: int = 0               # dispatched steps holding a row of this request, not yet read
    in_flight_samples: int = 0       # of those, rows that emit at least one token
    num_proposed: int = 0            # drafts its last sampling step proposed: what its next decode step verifies

    # output processing
    text: str = ""
    stream_text: bool = False        # render the text every step (a stream reads it as it grows)
    outputs: Any = None              # queue.SimpleQueue of RequestOutput deltas, for whoever streams it
    sent: tuple = (0, 0)             # tokens and characters already put on `outputs`
    detok_prefix: int = 0            # incremental detokenization window over output_token_ids
    detok_read: int = 0
    logprobs: list = dataclasses.field(default_factory=list)
    # SamplingParams.prompt_logprobs: None for the prompt's first token, then per prompt token
    # {"token_id", "logprob", "rank", "top": [(token_id, logprob), ...]}; filled as its prefill steps are read
    # (the first completion of a group only: its siblings share the prompt). None: not asked.
    prompt_logprobs: list | None = None
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    # gaps between consecutive token_times, kept as tokens arrive: each streamed delta's metrics copy it
    # rather than recompute it from the whole history
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def prefix_salt(self):
        """What the prompt's KV depends on besides its tokens (the prefix cache keys blocks by it): its adapter."""
        return None if self.lora_request is None else ("lora", self.lora_request.lora_int_id)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are not all computed yet: its prefill must compute every prompt position (no cached
        prefix) with the step's prompt-logprobs variant."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prefill_token_ids)
