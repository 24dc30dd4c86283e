"""A smaller model of the same vocabulary drafts k tokens autoregressively inside the step.

Its own paged KV cache shares the target's block tables and slot mapping (same block size and count),
so the scheduler's blocks cover both. Each step:
  (a) one draft forward over the step's batch (the target's ids, positions and slots) writes the draft
      KV of every token the target saw; positions past the accepted ones hold rejected drafts and are
      overwritten by a later step before anything reads them;
  (b) k single-token-per-row forwards: the first feeds the row's last emitted token at position
      num_tokens-1, each next one the draft just proposed. These write KV up to num_tokens-1+k-1, which
      is why the drafter asks the scheduler for `needs_kv_lookahead`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.decode.drafters.common import (
    check_same_vocab, init_draft_logprobs, one_token_batch, pick_drafts)
from jaxspec.models.llama import forward, init_kv_cache, unstack_layers
from jaxspec.pallas.paged_attention import attention_fn_for


class DraftModelDrafter:
    needs_kv_lookahead = True
    aux_layers = ()

    def __init__(self, draft_config, num_spec_tokens: int, draft_sampling: str):
        self.config = draft_config
        self.num_spec_tokens = num_spec_tokens
        self.draft_sampling = draft_sampling
        self.block_size = None  # set by init_state from the engine's step config
        self.attention_fn = None

    def prepare_params(self, params, unroll_layers: bool):
        """The engine's weight layout for this device (see EngineConfig.unroll_layers)."""
        return unstack_layers(params) if unroll_layers else params

    def init_state(self, step_config, dtype):
        self.block_size = step_config.block_size
        self.attention_fn = attention_fn_for(step_config.attention)
        state = {"kv": init_kv_cache(self.config, step_config.num_blocks, step_config.block_size, dtype)}
        if self.draft_sampling == "sample":
            state["draft_logprobs"] = init_draft_logprobs(step_config, self.config.vocab_size)
        return state

    def propose(self, params, state, ctx):
        c, bs, k = self.config, self.block_size, self.num_spec_tokens
        kv = state["kv"]
        num_kv_slots = kv["k"].shape[1]
        # (a) the draft KV of this step's tokens; no logits are needed from this pass.
        step_batch = ctx.batch._replace(logits_indices=jnp.zeros((1,), jnp.int32))
        _, _, _, kv = forward(c, params, kv, step_batch, block_size=bs, attention_fn=self.attention_fn)

        # (b) k autoregressive single-token forwards per row; rows that emitted nothing write nothing.
        first_tok = jnp.take_along_axis(ctx.emitted, ctx.num_accepted[:, None], axis=1)[:, 0]   # [R]
        first_pos = ctx.num_tokens - 1                                                          # [R]

        def draft_one(carry, j):
            kv, tok, pos = carry
            batch = one_token_batch(tok, pos, ctx.sample_rows, ctx.batch.block_tables, bs, num_kv_slots)
            logits, _, _, kv = forward(c, params, kv, batch, block_size=bs,
                                       attention_fn=self.attention_fn)                         # [R, V]
            draft, logprobs = pick_drafts(logits, ctx, j, self.draft_sampling)
            return (kv, draft, pos + 1), (draft, logprobs)

        (kv, _, _), (drafts, logprobs) = jax.lax.scan(
            draft_one, (kv, first_tok, first_pos), jnp.arange(k, dtype=jnp.int32))
        new_state = dict(state, kv=kv)
        if self.draft_sampling == "sample":   # [k, R, V] -> this slot's q for the next step's verification
            new_state["draft_logprobs"] = state["draft_logprobs"].at[ctx.slot].set(jnp.swapaxes(logprobs, 0, 1))
        return new_state, drafts.T                                                              # [R, k]


def _as_model(spec_model, dtype_name: str):
    from jaxspec.models.loader import load_model
    if hasattr(spec_model, "params"):
        model = spec_model
        dtype = jnp.dtype(dtype_name)
        params = jax.tree_util.tree_map(
            lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, model.params)
        return model, params
    model = load_model(spec_model, dtype=dtype_name)
    return model, model.params


def build_draft_model_drafter(spec, target):
    """-> (DraftModelDrafter, draft params). `spec.model`: preset, GGUF, directory or a Model object."""
    dtype_name = jnp.dtype(target.params["embed"].dtype).name
    draft, params = _as_model(spec.model, dtype_name)
    check_same_vocab(target, draft.config.vocab_size, draft.tokenizer, "the draft model")
    return DraftModelDrafter(draft.config, spec.num_speculative_tokens, spec.draft_sampling), params
