"""Drafters: each proposes the next k drafts per row inside the jitted step.

A drafter has `num_spec_tokens`, `draft_sampling` ("argmax" or "sample"), `aux_layers` (target layers whose
hidden states it reads), `init_state(step_config, dtype)` -> its device state (or None), and
`propose(params, state, ctx: DraftContext) -> (state, drafts i32[R, k])`. A sampling drafter also keeps
`state["draft_logprobs"]` [slots+1, k, V] at the rows' slots, for the rejection sampler.
"""
