"""A smaller model of the same vocabulary drafts k tokens autoregressively inside the step.

Its own paged KV cache shares the target's block tables and slot mapping (same block size and count),
so the scheduler's blocks cover both. Each step:
  (a) one draft forward over the step's batch (the target's ids, positions and slots) writes the draft
      KV of every token the target saw; positions past the accepted ones hold rejected drafts and are
      overwritten by a later step before anything reads them (per-slot layer state is kept at the row's
      last accepted token, as the target's is);
  (b) k single-token-per-row forwards: the first feeds the row's last emitted token at position
      num_tokens-1, each next one the draft just proposed. These write KV up to num_tokens-1+k-1, which
      is why the drafter asks the scheduler for `needs_kv_lookahead`; their per-slot state is speculative
      and dropped.
A step whose draft width is 0 (adaptive speculation chose plain decoding) runs (a) only: the draft KV stays
complete, so a later step that drafts proposes what it would have.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.decode.drafters.common import (
    check_same_vocab, draft_logprobs_spec, draft_loop, one_token_batch, pick_drafts)
from jaxspec.nn.decoder import Decoder


class DraftModelDrafter:
    method = "draft_model"
    needs_kv_lookahead = True
    kv_reads_next_token = False
    aux_layers = ()

    def __init__(self, draft_config, draft_sampling: str):
        self.config = draft_config
        self.draft_sampling = draft_sampling

    def param_schema(self) -> dict:
        return Decoder(self.config).param_schema()

    def state_schema(self, step_config):
        schema = {"layers": Decoder(self.config).state_schema(step_config.cache_shape)}
        if self.draft_sampling == "sample":
            schema["draft_logprobs"] = draft_logprobs_spec(step_config, self.config.vocab_size)
        return schema

    def propose(self, params, state, ctx):
        model = Decoder(self.config, ctx.ops)
        k, S = ctx.num_speculative_tokens, ctx.cache.num_kv_slots
        # (a) the draft KV of this step's tokens; no logits are needed from this pass.
        step_batch = ctx.batch._replace(logits_indices=jnp.zeros((1,), jnp.int32))
        _, _, _, layers, updates = model.forward(params, state["layers"], step_batch)
        committed = model.commit(layers, updates, ctx.slot, ctx.last_final)
        if k == 0:   # a plain decoding step: the draft KV of its tokens only, for later steps that draft
            return dict(state, layers=committed), jnp.zeros((ctx.emitted.shape[0], 0), jnp.int32)

        # (b) k autoregressive single-token forwards per row; rows that emitted nothing write nothing.
        first_tok = jnp.take_along_axis(ctx.emitted, ctx.num_accepted[:, None], axis=1)[:, 0]   # [R]
        rows = jnp.arange(first_tok.shape[0])

        def draft_one(carry, j):
            layers, tok, pos = carry
            batch = one_token_batch(tok, pos, ctx.sample_rows, ctx.batch.block_tables, ctx.ops.block_size, S,
                                    ctx.slot)
            logits, _, _, layers, updates = model.forward(params, layers, batch)                # [R, V]
            draft, logprobs = pick_drafts(logits, ctx, j, self.draft_sampling)
            return (model.commit(layers, updates, ctx.slot, rows), draft, pos + 1), (draft, logprobs)

        (speculative, _, _), (drafts, logprobs) = draft_loop(
            draft_one, (committed, first_tok, ctx.num_tokens - 1), k, ctx.ops.unroll)
        per_slot = model.per_slot_fields(ctx.cache)   # (b)'s pages are kept, its per-slot state is not
        layers = {kind: {name: committed[kind][name] if name in per_slot[kind] else speculative[kind][name]
                         for name in fields} for kind, fields in speculative.items()}
        new_state = dict(state, layers=layers)
        if self.draft_sampling == "sample":   # [k, R, V] -> this slot's q for the next step's verification
            new_state["draft_logprobs"] = state["draft_logprobs"].at[ctx.slot, :k].set(jnp.swapaxes(logprobs, 0, 1))
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
    return DraftModelDrafter(draft.config, spec.draft_sampling), params
