"""Drafters: each proposes the next k drafts per row inside the jitted step (k is the step's draft width,
`StepConfig.num_speculative_tokens` or a smaller one the host chose for this step, read from the DraftContext).
With k = 0 a drafter proposes nothing but keeps its own state current (its KV of the step's tokens, a saved
feature): a later step with k > 0 must propose exactly what it would have without the k = 0 steps."""
from __future__ import annotations

from typing import Protocol


class Drafter(Protocol):
    """Every member the engine and the step use of a drafter."""
    method: str                 # "draft_model", "eagle", "eagle3", "mtp" or "ngram"
    draft_sampling: str         # "argmax" (q a point mass) or "sample" (drawn; q kept per slot in the state)
    aux_layers: tuple[int, ...]  # target layers whose residual stream it reads (EAGLE-3), else ()
    needs_kv_lookahead: bool    # it writes its own KV up to k positions past what the target verifies
    # Its KV at position p depends on the token at p+1 too (an EAGLE head pairs token p+1 with the target's
    # feature at p): a prefix-cached block is then valid only for requests that agree one token past it.
    kv_reads_next_token: bool
    config: object              # the draft model's or head's ModelConfig (the mesh splits its widths; its sliding
                                # window reads the KV), None for n-gram lookup
    quantization: str | None    # the scheme its params are quantized in ("fp8"), or None
    whole_on_each_device: bool  # under tensor parallelism: whole on every device (a draft model), else split

    def configured(self, quantization: str | None, whole_on_each_device: bool) -> "Drafter":
        """The same drafter with its params quantized as `quantization` says and placed (decode.drafters.placement):
        a new drafter, this one unchanged."""

    def param_schema(self) -> dict | None:
        """Its weights, declared (tensor parallelism shards them by their logical axes), or None."""

    def state_schema(self, step_config) -> dict | None:
        """Its device state, declared (a sampling drafter includes "draft_logprobs" [slots+1, k, V])."""

    def propose(self, params, state, ctx) -> tuple:
        """(params, its state, DraftContext) -> (state, drafts i32[R, k]); k may be 0 (see above)."""
