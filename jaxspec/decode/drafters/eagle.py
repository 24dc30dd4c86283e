"""EAGLE-1 and EAGLE-3 heads as drafters (their math is `jaxspec.nn.eagle.EagleHead`), built from the head and
params that jaxspec.models.heads reads from the published HF layouts (config.json + safetensors).

Per step, with the target's batch (T tokens, R rows):
  (a) every token x_p of the batch (p >= 1) is paired with the feature at p-1 (the previous token of the
      row, or for a row's first token the feature this slot saved last step) and written at p-1;
  (b) k single-token-per-row head forwards: the first pairs the feature at the last accepted position
      (num_tokens-2) with the emitted token, each next the head's output hidden with its own draft; or, for a
      parallel head, one forward of k tokens per row: that pair, then k-1 placeholders at the next positions.
  Each slot saves the feature at its last position whose target KV is final, for (a) of its next step.
  A step whose draft width is 0 (adaptive speculation chose plain decoding) runs (a) and saves the feature
  only: the target's features of its tokens exist in that step alone, so (a) cannot be caught up later.
The pass needs of its head `features`, `forward` (ids, feature -> output hidden fed back, KV), `logits` and its
declared params and state: the MTP drafter (mtp.py) runs it with jaxspec.nn.mtp.MtpHead.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.decode.drafters.common import (
    draft_logprobs_spec, draft_loop, grammar_next, grammar_start, kv_slots_for, one_token_batch, pick_drafts)
from jaxspec.models.heads import load_eagle_head
from jaxspec.nn.eagle import EagleHead
from jaxspec.nn.ops import ForwardBatch
from jaxspec.nn.schema import Spec


class EagleDrafter:
    needs_kv_lookahead = True
    kv_reads_next_token = True
    whole_on_each_device = False   # a head reads the target's split embedding and lm_head: split as the target is

    def __init__(self, head: EagleHead, draft_sampling: str):
        self.head, self.draft_sampling = head, draft_sampling
        self.method, self.config, self.aux_layers = head.method, head.config, head.aux_layers

    @property
    def quantization(self) -> str | None:
        """The scheme the head's params are quantized in ("fp8"), or None: the head then declares the quantized
        params (`param_schema`) that placement and sharding read."""
        return self.head.quantization

    def configured(self, quantization: str | None, whole_on_each_device: bool) -> "EagleDrafter":
        if whole_on_each_device:
            raise ValueError(f"an {self.method} head runs split as the target is, never whole on each device")
        return type(self)(dataclasses.replace(self.head, quantization=quantization), self.draft_sampling)

    def param_schema(self) -> dict:
        return self.head.param_schema()

    def state_schema(self, step_config):
        D = self.config.hidden_size
        schema = {"layers": self.head.state_schema(step_config.cache_shape),
                  "feature": Spec((step_config.num_slots + 1, D), ("slots", "embed"), "zeros")}
        if self.draft_sampling == "sample":
            schema["draft_logprobs"] = draft_logprobs_spec(step_config, self.head.target_config.vocab_size)
        return schema

    def propose(self, params, state, ctx):
        head, ops, k = self.head, ctx.ops, ctx.num_speculative_tokens
        S, b, tp = ctx.cache.num_kv_slots, ctx.batch, ctx.target_params
        kv = state["layers"]["attention"]
        T = b.token_ids.shape[0]
        feature = head.features(ops, params, ctx.hidden, ctx.aux_hidden).astype(state["feature"].dtype)   # [T, D]

        # (a) pair each token x_p with the feature at p-1, written at p-1. A request's first token in a new
        # slot after a cached prefix has no feature at p-1 here: its pair is not written (the cached block
        # keeps the one its first owner wrote, which the block shares).
        row = b.row_of_token
        is_first = jnp.arange(T) == ctx.first_token[row]
        prev_feature = jnp.where(is_first[:, None], state["feature"][ctx.slot[row]], jnp.roll(feature, 1, axis=0))
        pair_pos = b.positions - 1
        pair_valid = ctx.token_valid & (pair_pos >= 0) & ~(is_first & ctx.new_slot[row])
        slots = kv_slots_for(pair_pos, row, pair_valid, b.block_tables, ops.block_size, S)
        pair_batch = ForwardBatch(b.token_ids, jnp.maximum(pair_pos, 0), slots, row, b.block_tables,
                                  jnp.zeros((1,), jnp.int32))
        _, kv = head.forward(ops, params, tp, kv, b.token_ids, prev_feature, pair_batch)

        # The feature at each row's last position whose target KV is final (the last accepted token for
        # rows that sampled, the chunk's last token otherwise): this step's first proposal and next
        # step's pass (a) pair it with the token that follows.
        last_pos = jnp.where(ctx.sample_rows, ctx.num_tokens - 2, ctx.num_tokens - 1)           # [R]
        last_feature = feature[ctx.last_final]                                                  # [R, D]
        saved = state["feature"].at[ctx.slot].set(last_feature)

        if k == 0:   # a plain decoding step: the pairs and the saved feature only, for later steps that draft
            return dict(state, layers={"attention": kv}, feature=saved), jnp.zeros((ctx.emitted.shape[0], 0), jnp.int32)

        first_tok = jnp.take_along_axis(ctx.emitted, ctx.num_accepted[:, None], axis=1)[:, 0]  # [R]
        if head.parallel:
            kv, drafts, logprobs = self._propose_parallel(params, kv, ctx, first_tok, last_feature, last_pos)
            new_state = dict(state, layers={"attention": kv}, feature=saved)
            if self.draft_sampling == "sample":
                new_state["draft_logprobs"] = state["draft_logprobs"].at[ctx.slot, :k].set(logprobs)
            return new_state, drafts

        # (b) k single-token head forwards per row.

        def draft_one(carry, j):
            kv, feat, tok, pos, grammar_state = carry
            batch = one_token_batch(tok, pos, ctx.sample_rows, b.block_tables, ops.block_size, S, ctx.slot)
            hidden, kv = head.forward(ops, params, tp, kv, tok, feat, batch)                    # [R, D]
            draft, logprobs = pick_drafts(head.logits(ops, params, tp, hidden), ctx, j, self.draft_sampling,
                                          grammar_state)
            return ((kv, hidden.astype(feat.dtype), draft, pos + 1, grammar_next(ctx, grammar_state, draft)),
                    (draft, logprobs))

        (kv, _, _, _, _), (drafts, logprobs) = draft_loop(
            draft_one, (kv, last_feature, first_tok, last_pos, grammar_start(ctx, first_tok.shape[0])), k, ops.unroll)
        new_state = dict(state, layers={"attention": kv}, feature=saved)
        if self.draft_sampling == "sample":
            new_state["draft_logprobs"] = state["draft_logprobs"].at[ctx.slot, :k].set(jnp.swapaxes(logprobs, 0, 1))
        return new_state, drafts.T                                                             # [R, k]


    def _propose_parallel(self, params, kv, ctx, first_tok, last_feature, last_pos):
        """(b) of a parallel head: row r's k tokens (its emitted token paired with the feature at last_pos, then
        k-1 placeholders) at positions last_pos .. last_pos+k-1, in one forward; each attends to the row's pairs
        and to the group's tokens before it. The drafts are then picked in order from the k outputs (each
        after the grammar state its predecessors reached) -> (kv, drafts [R, k], logprobs [R, k, V] or None)."""
        head, ops, k, b = self.head, ctx.ops, ctx.num_speculative_tokens, ctx.batch
        R, S = first_tok.shape[0], ctx.cache.num_kv_slots
        rows = jnp.repeat(jnp.arange(R, dtype=jnp.int32), k)                                  # [R*k], row-major
        offset = jnp.tile(jnp.arange(k, dtype=jnp.int32), R)
        ids = jnp.where(offset == 0, first_tok[rows], -1)                                    # -1: a placeholder
        feature = jnp.where((offset == 0)[:, None], last_feature[rows],
                            params["mask_hidden"].astype(last_feature.dtype))
        positions = last_pos[rows] + offset
        valid = ctx.sample_rows[rows]
        slots = kv_slots_for(positions, rows, valid, b.block_tables, ops.block_size, S)
        group = ForwardBatch(ids, jnp.maximum(positions, 0), slots, rows, b.block_tables,
                             jnp.arange(R * k, dtype=jnp.int32), slot_of_row=ctx.slot,
                             first_token_of_row=jnp.arange(R, dtype=jnp.int32) * k, writes_state=valid)
        hidden, kv = head.forward(ops, params, ctx.target_params, kv, ids, feature, group)   # [R*k, D]
        logits = head.logits(ops, params, ctx.target_params, hidden).reshape(R, k, -1)

        grammar_state, drafts, logprobs = grammar_start(ctx, R), [], []
        for j in range(k):   # picking is cheap (no forward): the loop only carries the grammar's state
            draft, lp = pick_drafts(logits[:, j], ctx, j, self.draft_sampling, grammar_state)
            grammar_state = grammar_next(ctx, grammar_state, draft)
            drafts.append(draft)
            logprobs.append(lp)
        return kv, jnp.stack(drafts, 1), (jnp.stack(logprobs, 1) if self.draft_sampling == "sample" else None)


# ---- building ---------------------------------------------------------------------------------------------

def build_eagle_drafter(spec, target):
    """-> (EagleDrafter, head params) for method "eagle" (EAGLE-1) or "eagle3", from a head directory."""
    method = spec.method
    if hasattr(spec.model, "params"):
        raise ValueError(f"method {method!r} needs an EAGLE head directory (config.json + safetensors), not a Model")
    head, params = load_eagle_head(spec.model, target.config, target.params["embed"].dtype)
    if head.method != method:
        is3 = head.method == "eagle3"
        raise ValueError(f"{spec.model!r} holds an {'EAGLE-3' if is3 else 'EAGLE-1'} head, but the speculative "
                         f"method is {method!r}; use method={head.method!r}")
    return EagleDrafter(head, spec.draft_sampling), params
