"""A smaller model of the same vocabulary drafts k tokens autoregressively inside the step, in k forwards.

Its own paged KV cache shares the target's block tables and slot mapping (same block size and count),
so the scheduler's blocks cover both. Each step, after verification:
  (a) one draft forward over the tokens each row now has: the step's tokens up to the row's last accepted
      one, then the token the row emitted (the correction or the bonus, at position num_tokens-1). Its
      logits at the emitted token are the first proposal. The emitted token takes the place of the first
      rejected draft, or, when every draft was accepted (or a prefill chunk was the prompt's last), a spare
      slot one past the row's tokens: the batch has T + R tokens, each row's kept contiguous (its tokens,
      then its spare), rows that emitted nothing get no spare, and rejected drafts past the emitted token
      write no KV and keep no per-slot state. Per-slot layer state is kept by position, as the target's: the
      next step starts after the row's last accepted token and reads the entry kept there.
  (b) k-1 single-token-per-row forwards, each feeding the draft just proposed. Draft KV is written up to
      position num_tokens-1+k-1, which is why the drafter asks the scheduler for `needs_kv_lookahead`. Their
      per-slot entries (positions num_tokens..num_tokens+k-2) are speculative: they fall on ring entries of
      positions the next step never reads (it reads those of num_tokens-K..num_tokens-2 at most, K the conv
      width), and the next step rewrites them before anything reads them.
Unfolded, (a) ran over the step's tokens before verification and (b) took k forwards, the first feeding the
emitted token alone: the same proposals from k+1 forwards.
A parallel draft model (`parallel_drafting`, PARD's recipe) replaces (b) by one forward over k-1 mask tokens per
row at positions num_tokens..num_tokens+k-2 (where (b) feeds its drafts): its logits there are drafts 2..k. Their KV
is as speculative as (b)'s, at the same positions, and the next step rewrites it with the tokens accepted there.
A step whose draft width is 0 (adaptive speculation chose plain decoding) runs (a) without proposing: the
draft KV stays complete, so a later step that drafts proposes what it would have.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxspec.decode.drafters.common import (
    check_same_vocab, draft_logprobs_spec, draft_loop, grammar_next, grammar_start, kv_slots_for, on_each_device,
    one_token_batch, pick_drafts)
from jaxspec.models.heads import load_draft_model
from jaxspec.nn.decoder import Decoder
from jaxspec.nn.ops import ForwardBatch, Ops


class DraftModelDrafter:
    method = "draft_model"
    needs_kv_lookahead = True
    kv_reads_next_token = False
    aux_layers = ()

    def __init__(self, draft_config, draft_sampling: str, quantization: str | None = None,
                 whole_on_each_device: bool = False, mask_token_id: int | None = None):
        self.config = draft_config
        self.draft_sampling = draft_sampling
        self.mask_token_id = mask_token_id   # parallel drafting's mask token (None: k-1 forwards, one per draft)
        self.quantization = quantization   # "fp8": its params are quantized (the engine's quantization)
        # under tensor parallelism: whole on every device, its forwards free of all-reduces (placement.py decides);
        # otherwise split over the devices as the target is
        self.whole_on_each_device = whole_on_each_device

    def configured(self, quantization: str | None, whole_on_each_device: bool) -> "DraftModelDrafter":
        return DraftModelDrafter(self.config, self.draft_sampling, quantization, whole_on_each_device,
                                 self.mask_token_id)

    def param_schema(self) -> dict:
        return Decoder(self.config, Ops(quantization=self.quantization)).param_schema()

    def state_schema(self, step_config):
        schema = {"layers": Decoder(self.config).state_schema(step_config.cache_shape)}
        if self.draft_sampling == "sample":
            schema["draft_logprobs"] = draft_logprobs_spec(step_config, self.config.vocab_size)
        return schema

    def propose(self, params, state, ctx):
        if self.whole_on_each_device:   # set only under tensor parallelism
            return on_each_device(self._propose, params, state, ctx)
        return self._propose(params, state, ctx)

    def _propose(self, params, state, ctx):
        model = Decoder(self.config, ctx.ops)
        k, S = ctx.num_speculative_tokens, ctx.cache.num_kv_slots
        # (a) the draft KV of the tokens each row has now, and the first proposal at its emitted token.
        batch = folded_batch(ctx, S)
        logits, _, _, layers = model.forward(params, state["layers"], batch)                  # [R, V]
        if k == 0:   # a plain decoding step: the draft KV of its tokens only, for later steps that draft
            return dict(state, layers=layers), jnp.zeros((ctx.emitted.shape[0], 0), jnp.int32)
        grammar_state = grammar_start(ctx, logits.shape[0])
        first, first_logprobs = pick_drafts(logits, ctx, 0, self.draft_sampling, grammar_state)
        drafts, logprobs = first[None], None if first_logprobs is None else first_logprobs[None]
        if k > 1 and self.mask_token_id is not None:
            # (b') drafts 2..k from one forward over k-1 mask tokens per row
            logits, _, _, layers = model.forward(params, layers, mask_batch(ctx, self.mask_token_id, k - 1, S))
            logits = logits.reshape(first.shape[0], k - 1, -1)                                # [R, k-1, V]
            grammar_state, picked = grammar_next(ctx, grammar_state, first), []
            for j in range(k - 1):   # (a grammar's state follows the drafts before; sampled drafts use key j+1)
                draft, draft_logprobs = pick_drafts(logits[:, j], ctx, j + 1, self.draft_sampling, grammar_state)
                picked.append((draft, draft_logprobs))
                grammar_state = grammar_next(ctx, grammar_state, draft)
            drafts = jnp.concatenate([drafts, jnp.stack([d for d, _ in picked])])               # [k, R]
            if first_logprobs is not None:
                logprobs = jnp.concatenate([logprobs, jnp.stack([lp for _, lp in picked])])
        elif k > 1:
            # (b) k-1 autoregressive single-token forwards per row, each starting after the token before it;
            # rows that emitted nothing write nothing.
            def draft_one(carry, j):
                layers, tok, pos, grammar_state = carry
                batch = one_token_batch(tok, pos, ctx.sample_rows, ctx.batch.block_tables, ctx.ops.block_size, S,
                                        ctx.slot)
                logits, _, _, layers = model.forward(params, layers, batch)                   # [R, V]
                draft, logprobs = pick_drafts(logits, ctx, j + 1, self.draft_sampling, grammar_state)
                return (layers, draft, pos + 1, grammar_next(ctx, grammar_state, draft)), (draft, logprobs)

            (layers, _, _, _), (rest, rest_logprobs) = draft_loop(
                draft_one, (layers, first, ctx.num_tokens, grammar_next(ctx, grammar_state, first)), k - 1,
                ctx.ops.unroll)
            drafts = jnp.concatenate([drafts, rest])                                            # [k, R]
            logprobs = None if first_logprobs is None else jnp.concatenate([logprobs, rest_logprobs])
        new_state = dict(state, layers=layers)
        if self.draft_sampling == "sample":   # [k, R, V] -> this slot's q for the next step's verification
            new_state["draft_logprobs"] = state["draft_logprobs"].at[ctx.slot, :k].set(jnp.swapaxes(logprobs, 0, 1))
        return new_state, drafts.T                                                              # [R, k]


def folded_batch(ctx, num_kv_slots: int) -> ForwardBatch:
    """The tokens each row has after this step's verification, T + R of them: a ForwardBatch with logits at
    each row's emitted token [R].

    Row r keeps its tokens at positions < num_tokens-1 (its prefill chunk, its decode token, its accepted
    drafts) and gets its emitted token at position num_tokens-1: in place of the first rejected draft, or in
    its spare slot just past its tokens. The target's rows are contiguous; each stays so, moved up by the
    spares of the sampling rows before it. Rejected drafts past the emitted token keep their place but
    write no KV; padding tokens and the spares of rows that emitted nothing are left out (position 0, KV
    slot S: nothing written, their outputs unread).
    """
    b, S = ctx.batch, num_kv_slots
    T, R = b.token_ids.shape[0], ctx.slot.shape[0]
    N = T + R
    rows = jnp.arange(R, dtype=jnp.int32)
    sample, first = ctx.sample_rows, ctx.first_token                                       # [R]
    emit_pos = ctx.num_tokens - 1                                                          # [R]
    emit_tok = jnp.take_along_axis(ctx.emitted, ctx.num_accepted[:, None], axis=1)[:, 0]   # [R]
    start = b.positions[jnp.clip(first, 0, T - 1)]                                         # [R] (rows with tokens)
    # Spares of the sampling rows placed before row r: its tokens move up by as many.
    shift = jnp.sum(sample[None, :] & (first[None, :] < first[:, None]), axis=1).astype(jnp.int32)   # [R]
    row = b.row_of_token
    to = jnp.where(ctx.token_valid, jnp.arange(T, dtype=jnp.int32) + shift[row], N)         # [T]
    kept = ctx.token_valid & ~(sample[row] & (b.positions >= emit_pos[row]))
    emitted_at = first + shift + emit_pos - start                                          # [R]
    at = jnp.where(sample, emitted_at, N)
    emit_slot = kv_slots_for(emit_pos, rows, sample, b.block_tables, ctx.ops.block_size, S)

    def place(fill, tokens, emitted):
        return jnp.full((N,), fill, jnp.int32).at[to].set(tokens, mode="drop").at[at].set(emitted, mode="drop")

    writes = jnp.zeros((N,), bool).at[to].set(kept, mode="drop").at[at].set(True, mode="drop")
    return ForwardBatch(place(0, b.token_ids, emit_tok), place(0, b.positions, emit_pos),
                        place(S, jnp.where(kept, b.slot_mapping, S), emit_slot), place(0, row, rows),
                        b.block_tables, jnp.clip(emitted_at, 0, N - 1), slot_of_row=b.slot_of_row,
                        first_token_of_row=jnp.clip(first + shift, 0, N - 1), writes_state=writes)


def mask_batch(ctx, mask_token_id: int, m: int, num_kv_slots: int) -> ForwardBatch:
    """m mask tokens per row at positions num_tokens .. num_tokens+m-1, row r's at r*m .. r*m+m-1; logits at every
    one. Rows that emitted nothing write no KV (their outputs are unread)."""
    R = ctx.slot.shape[0]
    rows = jnp.repeat(jnp.arange(R, dtype=jnp.int32), m)                                    # [R*m]
    positions = ctx.num_tokens[rows] + jnp.tile(jnp.arange(m, dtype=jnp.int32), R)
    valid = ctx.sample_rows[rows]
    slots = kv_slots_for(positions, rows, valid, ctx.batch.block_tables, ctx.ops.block_size, num_kv_slots)
    first = jnp.arange(R, dtype=jnp.int32) * m
    return ForwardBatch(jnp.full((R * m,), mask_token_id, jnp.int32), jnp.maximum(positions, 0), slots, rows,
                        ctx.batch.block_tables, jnp.arange(R * m, dtype=jnp.int32), slot_of_row=ctx.slot,
                        first_token_of_row=first, writes_state=valid, first_in_step=first[rows])


def build_draft_model_drafter(spec, target):
    """-> (DraftModelDrafter, draft params). `spec.model`: preset, GGUF, directory or a Model object. With
    `spec.parallel_drafting`, the mask token: `spec.mask_token_id`, else the draft model's config.json `pard_token`."""
    dtype_name = jnp.dtype(target.params["embed"].dtype).name
    draft, params = load_draft_model(spec.model, dtype_name)
    check_same_vocab(target, draft.config.vocab_size, draft.tokenizer, "the draft model")
    mask = None
    if spec.parallel_drafting:
        mask = spec.mask_token_id if spec.mask_token_id is not None else pard_token(spec.model)
        if not 0 <= mask < draft.config.vocab_size:
            raise ValueError(f"mask_token_id={mask} is outside the draft model's vocabulary of "
                             f"{draft.config.vocab_size} tokens")
    return DraftModelDrafter(draft.config, spec.draft_sampling, mask_token_id=mask), params


def pard_token(model) -> int:
    """The mask token a parallel draft model was trained with: its config.json's `pard_token` (PARD checkpoints and
    jaxspec's trainer write it); a ValueError naming what to give where there is none."""
    import json
    import os
    path = os.path.join(str(model), "config.json") if isinstance(model, (str, os.PathLike)) else None
    if path is not None and os.path.isfile(path):
        with open(path) as f:
            token = json.load(f).get("pard_token")
        if isinstance(token, int):
            return token
    raise ValueError(f"parallel_drafting needs the mask token the draft model was trained with: {model!r} has no "
                     "config.json with `pard_token`; give speculative_config's mask_token_id")
