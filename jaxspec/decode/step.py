"""The whole device side of one engine iteration: `state, out = step(params, drafter_params, state, inputs)`.

target forward over the scheduled tokens (prefill chunks, decode tokens, drafts to verify)
  -> penalties and sampling / rejection against the drafts -> the drafter proposes the next drafts
  -> state updated.
Positions, input ids and the KV slot mapping come from the device's own counts, so the host can plan a
step before it knows the previous step's accepted tokens.

The step never branches on device data: on a GPU each data-dependent branch makes the host wait for the
device in the middle of launching a step. What the rows need beyond greedy decoding (random draws,
top-k/top-p, penalties, logprobs) the host knows from their SamplingParams; it is a `StepVariant`, and
each variant in use is its own compiled step.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.decode import sampling
from jaxspec.decode.rejection import rejection_sample
from jaxspec.decode.state import (
    DecodeState, StepConfig, StepInputs, unpack_inputs, ROW_SLOT, ROW_NUM_NEW, ROW_START, ROW_NUM_DRAFTS, ROW_FIRST_TOKEN,
    ROW_SAMPLE, ROW_PROMPT_LEN, ROW_SEED, ROW_SEED_HI, ROW_TOP_K, ROW_MIN_TOKENS, ROW_TEMPERATURE, ROW_TOP_P,
    ROW_MIN_P, ROW_PRESENCE, ROW_FREQUENCY, ROW_REPETITION)
from jaxspec.models.llama import ForwardBatch, forward
from jaxspec.pallas.paged_attention import attention_fn_for
from jaxspec.pallas.slot_mapping import slot_mapping
from jaxspec.sampling_params import MAX_LOGPROBS


@dataclasses.dataclass(frozen=True)
class StepVariant:
    """Work a step does beyond greedy decoding, decided on the host from the scheduled rows."""
    sample: bool = False        # some row draws at random (temperature > 0)
    top_k_top_p: bool = False   # some random row truncates by top-k or top-p (a vocabulary sort)
    penalties: bool = False     # some row has presence / frequency / repetition penalties
    logprobs: bool = False      # some row asks for logprobs

    @staticmethod
    def of(p) -> "StepVariant":
        """What one request's SamplingParams need."""
        random = sampling.is_random(p.temperature)
        return StepVariant(
            sample=random, top_k_top_p=random and (p.top_k > 0 or p.top_p < 1.0),
            penalties=p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1,
            logprobs=p.logprobs is not None)

    @staticmethod
    def union(variants) -> "StepVariant":
        """The variant covering all of these (a step's, from the rows that sample in it)."""
        flags = [dataclasses.astuple(v) for v in variants]
        return StepVariant(*(any(f) for f in zip(*flags))) if flags else StepVariant()


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What a drafter sees of this step (all device arrays; R rows, T tokens, K drafts)."""
    batch: ForwardBatch        # the target's batch: ids, positions, slot mapping, rows, block tables
    token_valid: Any           # bool[T]
    hidden: Any                # [T, D] target hidden states after the final norm
    aux_hidden: Any            # [n, T, D] residual stream after the drafter's chosen layers, or None
    history: Any               # i32[slots+1, H] after this step's tokens were appended
    slot: Any                  # i32[R]
    num_tokens: Any            # i32[R] tokens of each row's sequence after this step
    emitted: Any               # i32[R, K+1] tokens emitted this step (-1 padded)
    num_accepted: Any          # i32[R]
    sample_rows: Any           # bool[R] rows that emitted tokens (the ones that need drafts)
    first_token: Any           # i32[R] index in T of each row's first token
    num_new: Any               # i32[R]
    sampling: sampling.SamplingTensors
    keys: Any                  # [R, K] PRNG keys of the draft positions, for drafts drawn by sampling
    variant: StepVariant = StepVariant()


def _sampling_tensors(inp: StepInputs) -> sampling.SamplingTensors:
    f = inp.rows_f
    return sampling.SamplingTensors(
        temperature=f[ROW_TEMPERATURE], top_k=inp.rows[ROW_TOP_K], top_p=f[ROW_TOP_P], min_p=f[ROW_MIN_P],
        presence_penalty=f[ROW_PRESENCE], frequency_penalty=f[ROW_FREQUENCY],
        repetition_penalty=f[ROW_REPETITION])


def _penalize(logits, history, slot, prompt_len, base, draft_ids, st, vocab_size):
    """Presence/frequency/repetition penalties from the device history: position j of a row also
    counts the drafts before it (the tokens it would follow if they are accepted)."""
    R, K1, V = logits.shape
    rows_hist = history[slot]                                                       # [R, H]
    output_counts = sampling.token_counts(rows_hist, prompt_len, base, vocab_size)  # [R, V]
    prompt_mask = sampling.token_counts(rows_hist, jnp.zeros_like(base), prompt_len, vocab_size) > 0
    counts = jnp.broadcast_to(output_counts[:, None], (R, K1, V))
    if K1 > 1:
        ok = (draft_ids >= 0) & (draft_ids < V)
        onehot = jax.nn.one_hot(jnp.where(ok, draft_ids, 0), V, dtype=jnp.int32) * ok[..., None]
        before = jnp.cumsum(onehot, axis=1)                                         # [R, K, V]
        counts = counts + jnp.concatenate([jnp.zeros_like(before[:, :1]), before], axis=1)
    idx = jnp.repeat(jnp.arange(R), K1)
    out = sampling.apply_penalties(logits.reshape(R * K1, V), counts.reshape(R * K1, V),
                                   prompt_mask[idx], st.take(idx))
    return out.reshape(R, K1, V)


def step(model_config, step_config: StepConfig, drafter, params, drafter_params, state: DecodeState,
         inp: StepInputs, variant: StepVariant):
    c, sc = model_config, step_config
    K = sc.num_spec_tokens
    V = c.vocab_size
    num_kv_slots = sc.num_blocks * sc.block_size
    H = sc.history_len
    rows = inp.rows
    slot, num_new, num_drafts = rows[ROW_SLOT], rows[ROW_NUM_NEW], rows[ROW_NUM_DRAFTS]
    sample_rows = rows[ROW_SAMPLE] > 0
    prompt_len = rows[ROW_PROMPT_LEN]
    host_ids, token_row, offset = inp.tokens[0], inp.tokens[1], inp.tokens[2]
    R, T = slot.shape[0], host_ids.shape[0]

    # Positions from the device's own counts: decode rows (start -1) continue where the last step ended.
    start = jnp.where(rows[ROW_START] >= 0, rows[ROW_START], state.num_computed[slot])       # [R]
    valid = offset >= 0
    tslot = slot[token_row]
    pos = start[token_row] + offset                                                          # [T]
    known = valid & (host_ids >= 0)
    history = state.history.at[tslot, jnp.where(known, pos, H)].set(host_ids, mode="drop")
    # Input ids: the history for prefill and the last emitted token, this slot's drafts after it.
    first_draft = (num_new - num_drafts)[token_row]
    is_draft = valid & (offset >= first_draft)
    draft_ids = state.drafts[slot][:, :K] if K else jnp.zeros((R, 0), jnp.int32)            # [R, K]
    ids = jnp.where(is_draft, state.drafts[tslot, jnp.clip(offset - first_draft, 0, max(K - 1, 0))],
                    history[tslot, jnp.clip(pos, 0, H - 1)])
    ids = jnp.where(valid & (ids >= 0) & (ids < V), ids, 0)   # padding and invalid drafts never embed
    kv_slots = slot_mapping(pos, token_row, valid, inp.block_tables, sc.block_size, num_kv_slots)
    kv_slots = jnp.where((kv_slots >= 0) & (kv_slots < num_kv_slots), kv_slots, num_kv_slots)

    # Logits at each row's last non-draft token and at every draft: [R, K+1].
    last_real = inp.rows[ROW_FIRST_TOKEN] + num_new - 1 - num_drafts
    logits_idx = jnp.clip(last_real[:, None] + jnp.arange(K + 1)[None, :], 0, T - 1)
    batch = ForwardBatch(ids, pos, kv_slots, token_row, inp.block_tables, logits_idx.reshape(-1))
    aux_layers = tuple(getattr(drafter, "aux_layers", ()))
    logits, hidden, aux, kv = forward(c, params, state.kv, batch, block_size=sc.block_size,
                                      aux_layers=aux_layers, attention_fn=attention_fn_for(sc.attention))
    raw_logits = logits.reshape(R, K + 1, V)

    # Sampling / verification.
    st = _sampling_tensors(inp)
    base = start + num_new - num_drafts            # position of the first token this step emits
    if variant.penalties:
        logits = _penalize(raw_logits, history, slot, prompt_len, base, draft_ids, st, V)
    else:
        logits = raw_logits
    # min_tokens: stop ids cannot be drawn while the output is shorter.
    generated = base[:, None] + jnp.arange(K + 1)[None, :] - prompt_len[:, None]            # [R, K+1]
    too_short = generated < rows[ROW_MIN_TOKENS][:, None]
    stop_ok = (inp.stop_ids >= 0) & (inp.stop_ids < V)
    stop_hit = jnp.zeros((R, V), bool).at[jnp.arange(R)[:, None], jnp.where(stop_ok, inp.stop_ids, V)].set(
        True, mode="drop")
    logits = jnp.where(too_short[..., None] & stop_hit[:, None, :], -jnp.inf, logits)
    # One PRNG key per emitted position (seed, position): a position draws the same noise in any step.
    j1 = jnp.arange(K + 1, dtype=jnp.int32)[None, :]
    keys = sampling.row_keys(jnp.repeat(rows[ROW_SEED], K + 1), (base[:, None] + j1).ravel(),
                             jnp.repeat(rows[ROW_SEED_HI], K + 1)).reshape(R, K + 1, -1)
    if variant.sample:
        idx = jnp.repeat(jnp.arange(R), K + 1)
        logprobs = sampling.processed_logprobs(logits.reshape(R * (K + 1), V), st.take(idx),
                                               variant.top_k_top_p).reshape(R, K + 1, V)
    else:   # every sampling row is greedy: the argmax of the logits is all that is needed
        logprobs = logits
    if K == 0:
        if variant.sample:
            emitted = sampling.sample(logprobs[:, 0], st.is_greedy, keys[:, 0])[:, None]
        else:
            emitted = jnp.argmax(logprobs[:, 0], axis=-1).astype(jnp.int32)[:, None]
        num_accepted = jnp.zeros((R,), jnp.int32)
    else:
        emitted, num_accepted = rejection_sample(
            logprobs, st.is_greedy, draft_ids, _draft_logprobs(state, slot, drafter), num_drafts, keys,
            all_greedy=not variant.sample)
    emitted = jnp.where(sample_rows[:, None], emitted, -1)

    # Authoritative counts: accepted drafts extend the KV; emitted tokens extend the history.
    num_accepted = jnp.where(sample_rows, num_accepted, 0)
    new_computed = jnp.where(sample_rows, base + num_accepted, start + num_new)
    new_tokens = jnp.where(sample_rows, base + num_accepted + 1, start + num_new)
    j = jnp.arange(K + 1)[None, :]
    write = sample_rows[:, None] & (j <= num_accepted[:, None])
    history = history.at[slot[:, None], jnp.where(write, base[:, None] + j, H)].set(emitted, mode="drop")

    # One array back to the host per step: emitted tokens and the accepted count in the last column.
    out = {"tokens": jnp.concatenate([emitted, num_accepted[:, None]], axis=1)}
    if variant.logprobs:
        out.update(_logprobs(raw_logits, emitted))

    drafts, drafter_state = state.drafts, state.drafter
    if K:
        ctx = DraftContext(batch=batch, token_valid=valid, hidden=hidden, aux_hidden=aux, history=history,
                           slot=slot, num_tokens=new_tokens, emitted=emitted, num_accepted=num_accepted,
                           sample_rows=sample_rows, first_token=inp.rows[ROW_FIRST_TOKEN], num_new=num_new,
                           sampling=st, keys=_draft_keys(rows[ROW_SEED], rows[ROW_SEED_HI], new_tokens, K), variant=variant)
        drafter_state, new_drafts = drafter.propose(drafter_params, drafter_state, ctx)
        drafts = drafts.at[slot].set(new_drafts.astype(jnp.int32))

    state = state.replace(kv=kv, history=history, drafts=drafts, drafter=drafter_state,
                          num_tokens=state.num_tokens.at[slot].set(new_tokens),
                          num_computed=state.num_computed.at[slot].set(new_computed))
    return state, out


def _draft_keys(seed, seed_hi, num_tokens, k: int):
    """Keys [R, k] for sampled drafts: draft j is for position num_tokens + j; folded away from the noise
    the target draws at that position (the draft and the verification must be independent)."""
    R = seed.shape[0]
    pos = num_tokens[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    keys = sampling.row_keys(jnp.repeat(seed, k), pos.ravel(), jnp.repeat(seed_hi, k))
    return jax.vmap(jax.random.fold_in, (0, None))(keys, 2).reshape(R, k, -1)


def _draft_logprobs(state, slot, drafter):
    """Draft distributions saved by a sampling drafter (None when drafts are argmax: a point mass)."""
    if getattr(drafter, "draft_sampling", "argmax") != "sample":
        return None
    return state.drafter["draft_logprobs"][slot]


def _logprobs(raw_logits, emitted):
    R, K1, V = raw_logits.shape
    tok_lp, top_ids, top_lp = sampling.topn_logprobs(raw_logits.reshape(R * K1, V), emitted.reshape(-1),
                                                     MAX_LOGPROBS)
    return {"logprob": tok_lp.reshape(R, K1), "top_ids": top_ids.reshape(R, K1, MAX_LOGPROBS),
            "top_logprobs": top_lp.reshape(R, K1, MAX_LOGPROBS)}


def make_step(model_config, step_config: StepConfig, drafter, num_tokens: int, num_rows: int,
              variant: StepVariant = StepVariant()):
    """The jitted step of one bucket and variant, taking the packed host buffer; the state is donated
    (the KV pool is updated in place)."""
    def packed_step(params, drafter_params, state, buf):
        inp = unpack_inputs(buf, num_tokens, num_rows, step_config.max_blocks_per_seq)
        return step(model_config, step_config, drafter, params, drafter_params, state, inp, variant)
    return jax.jit(packed_step, donate_argnums=(2,))
