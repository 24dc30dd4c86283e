"""Pieces shared by the drafters that run a model of their own (draft model, EAGLE heads).

R rows, V target vocabulary, k drafts; S = num_blocks * block_size flat KV slots (S itself is the
sentinel slot that KV writes drop).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspec.decode import sampling
from jaxspec.nn.ops import ForwardBatch
from jaxspec.nn.schema import Spec
from jaxspec.pallas.slot_mapping import slot_mapping


def check_same_vocab(target, vocab_size: int, tokenizer, what: str):
    """A drafter must propose ids of the target's vocabulary: equal size and, when both have tokenizers,
    the same token -> id mapping."""
    tv = target.config.vocab_size
    if vocab_size != tv:
        raise ValueError(f"{what} has vocab_size={vocab_size} but the target has {tv}: the drafter must share "
                         "the target's tokenizer and vocabulary")
    if tokenizer is not None and target.tokenizer is not None and tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"{what} has a different tokenizer vocabulary than the target: the drafter must share the "
                         "target's tokenizer")


# DraftContext fields that are not device arrays (passed to a drafter on each device as they are)
_STATIC_CONTEXT = ("ops", "num_speculative_tokens", "cache", "variant")


def on_each_device(propose, params, state, ctx):
    """`propose(params, state, ctx)` run whole by every device of the engine's mesh, on its own copy of the
    drafter's params and state, with no collective: a draft model kept whole on each device
    (SpeculativeConfig.draft_tensor_parallel_size=1). Every input it reads is replicated already (the step's
    inputs, the history, the emitted tokens); the target's split weights and hidden states, which a draft model
    does not read, are left out so that nothing is gathered. Each device computes the same drafts."""
    tp = ctx.ops.tp
    static = {name: getattr(ctx, name) for name in _STATIC_CONTEXT}
    static["ops"] = dataclasses.replace(ctx.ops, tp=None)   # inside, every array is whole: one device's kernels
    arrays = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx) if f.name not in _STATIC_CONTEXT}
    arrays.update(target_params=None, hidden=None, aux_hidden=None)

    def local(params, state, arrays):
        return propose(params, state, type(ctx)(**static, **arrays))
    return jax.shard_map(local, mesh=tp.mesh, in_specs=P(), out_specs=P(), check_vma=False)(params, state, arrays)


def kv_slots_for(positions, row_of_token, valid, block_tables, block_size: int, num_kv_slots: int):
    """Flat KV slots i32[T] of tokens at `positions` of rows `row_of_token`; invalid or unmapped -> the
    sentinel S (as the target's step does)."""
    slots = slot_mapping(positions, row_of_token, valid, block_tables, block_size, num_kv_slots)
    return jnp.where((slots >= 0) & (slots < num_kv_slots), slots, num_kv_slots)


def one_token_batch(ids, positions, valid, block_tables, block_size: int, num_kv_slots: int, slot) -> ForwardBatch:
    """A ForwardBatch of one token per row (row r's token is token r); logits for every row.
    Invalid rows write no KV; their positions are clamped to >= 0 so their attention stays finite."""
    R = ids.shape[0]
    rows = jnp.arange(R, dtype=jnp.int32)
    slots = kv_slots_for(positions, rows, valid, block_tables, block_size, num_kv_slots)
    return ForwardBatch(ids, jnp.maximum(positions, 0), slots, rows, block_tables, rows, slot_of_row=slot,
                        first_token_of_row=rows, writes_state=valid, first_in_step=rows)


def pick_drafts(logits, ctx, j, draft_sampling: str, grammar_state=None):
    """Row-wise drafts from draft logits f32[R, V] at draft position j -> (i32[R], logprobs f32[R, V] or None).

    "argmax": the drafter's argmax (q is a point mass). "sample": a draw from the processed distribution
    (temperature, top-k/top-p/min-p of each row's request) with the key of draft position j; greedy rows
    take the argmax. The draw's log-probabilities are returned for the rejection sampler.
    With structured outputs (ctx.grammar) the logits are first masked by each row's automaton state
    `grammar_state` [R], as the target's are where it verifies: drafts stay inside the grammar and a sampled
    draft's q is the masked distribution, so rejection sampling stays exact. A logit bias (ctx.logit_bias) is
    added first, as the target's is: the drafts follow it, and a sampled draft's q includes it.
    """
    if ctx.logit_bias is not None:
        logits = sampling.add_logit_bias(logits, *ctx.logit_bias)
    if ctx.grammar is not None:
        logits = ctx.grammar.constrain(logits, grammar_state)
    if draft_sampling == "argmax":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    logprobs = sampling.processed_logprobs(logits, ctx.sampling, ctx.variant.top_k_top_p)  # [R, V]
    keys = ctx.keys[:, j] if isinstance(j, int) else jax.lax.dynamic_index_in_dim(ctx.keys, j, axis=1, keepdims=False)
    return sampling.sample(logprobs, ctx.sampling.is_greedy, keys), logprobs


def grammar_start(ctx, num_rows: int):
    """Each row's automaton state where its first draft is proposed (zeros, unread, without a grammar)."""
    return ctx.grammar.state if ctx.grammar is not None else jnp.zeros((num_rows,), jnp.int32)


def grammar_next(ctx, state, draft):
    """The automaton state after a draft (unchanged without a grammar)."""
    return ctx.grammar.advance(state, draft) if ctx.grammar is not None else state


def draft_loop(body, carry, k: int, unroll: bool):
    """`jax.lax.scan(body, carry, arange(k))`, or the same k iterations unrolled (Ops.unroll: on a GPU a
    scanned body re-slices the stacked weights it indexes every iteration, a copy of each; unrolled, every
    index is static and each matmul reads its weights in place). -> (carry, stacked outputs)."""
    if not unroll:
        return jax.lax.scan(body, carry, jnp.arange(k, dtype=jnp.int32))
    outputs = []
    for j in range(k):
        carry, out = body(carry, j)
        outputs.append(out)
    return carry, jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *outputs)


def draft_logprobs_spec(step_config, vocab_size: int) -> Spec:
    """f32[slots+1, k, V]: the distributions the drafts of each slot were drawn from."""
    return Spec((step_config.num_slots + 1, step_config.num_speculative_tokens, vocab_size),
                ("slots", "draft", "vocab"), "zeros", jnp.float32)
