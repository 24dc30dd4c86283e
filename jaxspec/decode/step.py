"""The whole device side of one engine iteration, `state, out = step(...)`, read top to bottom:

    tokens    <- the device's own counts: ids, positions and KV slots of the scheduled tokens
    forward   <- the target over prefill chunks, decode tokens and the drafts to verify
    grammar   <- structured outputs: each row's automaton state at each verified position (after the drafts
                 before it) and the tokens it allows there
    logprobs  <- the processed distribution at each row's last real token and at every draft (logit bias,
                 penalties, grammar mask, ...)
    emitted   <- sampled, or the drafts verified by rejection sampling
    state     <- committed: accepted counts, history, the automaton state after the emitted tokens (accepted
                 drafts and the correction or bonus, never a rejected draft); per-slot layer state was kept
                 by the forward
    drafts    <- the drafter proposes the next k per row (inside the grammar, for drafters that have logits)
    prompt    <- prompt_logprobs steps: each token's log-softmax, read at the token after it, and the top-n

Positions, input ids and the KV slot mapping come from the device's own counts, so the host can plan a step
before it knows the previous step's accepted tokens. The step never branches on device data (on a GPU each
data-dependent branch makes the host wait mid-launch): what rows need beyond greedy decoding (random draws,
top-k/top-p, penalties, logprobs) the host knows from their SamplingParams; it is a `StepVariant`, and each
variant in use is its own compiled step. Shapes: R rows, T tokens, K drafts, V vocabulary, H history length.

K is the step's draft width: it verifies up to K drafts per row and the drafter proposes K for the next step.
It is `StepConfig.num_speculative_tokens` unless the variant names a smaller one (`StepVariant.drafts`, chosen
per step on the host under adaptive speculation): fewer draft forwards and fewer logits per row. K = 0 is a
plain decoding step; a drafter with state of its own still runs its pass over the step's tokens (its KV, a
saved feature), so that a later step drafting again proposes exactly what it would have.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.decode import grammar as grammar_lib
from jaxspec.decode import sampling
from jaxspec.decode.inputs import DeviceInputs, unpack
from jaxspec.decode.rejection import rejection_sample
from jaxspec.decode.state import DecodeState, StepConfig
from jaxspec.nn.ops import ForwardBatch, Ops
from jaxspec.pallas.slot_mapping import slot_mapping
from jaxspec.sampling_params import MAX_LOGPROBS


@dataclasses.dataclass(frozen=True)
class StepVariant:
    """Work a step does beyond greedy decoding, decided on the host from the scheduled rows."""
    sample: bool = False        # some row draws at random (temperature > 0)
    top_k_top_p: bool = False   # some random row truncates by top-k or top-p (a vocabulary sort)
    penalties: bool = False     # some row has presence / frequency / repetition penalties
    logprobs: bool = False      # some row asks for logprobs
    grammar: bool = False       # some row's output is constrained (structured outputs): reads the automata table
    logit_bias: bool = False    # some row has a logit bias: reads the logit-bias table
    # some prefill row asks for its prompt's logprobs: logits at every token of the step, not only the sampled
    # ones (set by the step builder from the prefill rows, not by `of`)
    prompt_logprobs: bool = False
    drafts: int | None = None   # draft width (verified and proposed per row); None: StepConfig's K

    @staticmethod
    def of(p) -> "StepVariant":
        """What one request's SamplingParams need."""
        random = sampling.is_random(p.temperature)
        variant = StepVariant(
            sample=random, top_k_top_p=random and (p.top_k > 0 or p.top_p < 1.0),
            penalties=p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1,
            logprobs=p.logprobs is not None, grammar=p.structured_outputs is not None,
            logit_bias=bool(p.logit_bias))
        return _INTERNED.setdefault(variant, variant)   # requests that need the same share one object

    @staticmethod
    def union(variants) -> "StepVariant":
        """The variant covering all of these (a step's, from the rows that sample in it)."""
        names = ("sample", "top_k_top_p", "penalties", "logprobs", "grammar", "logit_bias")
        variants = list({id(v): v for v in variants}.values())   # a step's rows share a few (interned by `of`)
        return StepVariant(**{n: any(getattr(v, n) for v in variants) for n in names})

    def draft_width(self, sc: StepConfig) -> int:
        return sc.num_speculative_tokens if self.drafts is None else self.drafts

    def name(self) -> str:
        """'greedy', 'sample', or the work it adds joined by '+' ('sample+logprobs'); '/k2': draft width 2."""
        extras = [f.name for f in dataclasses.fields(self) if f.name != "drafts" and getattr(self, f.name)]
        return ("+".join(extras) or "greedy") + ("" if self.drafts is None else f"/k{self.drafts}")


_INTERNED: dict[StepVariant, StepVariant] = {}


class Tokens(NamedTuple):
    """This step's tokens, placed by the device's own counts."""
    batch: ForwardBatch   # ids, positions, KV slots, rows, block tables; logits at [R*(K+1)] tokens
    valid: Any            # bool[T]  false for padding
    history: Any          # i32[slots+1, H] with this step's host-known tokens written
    slot: Any             # i32[R]
    start: Any            # i32[R] position of each row's first token
    base: Any             # i32[R] position of the first token the row emits (after its last non-draft)
    draft_ids: Any        # i32[R, K] the drafts this step verifies


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What a drafter sees of this step (device arrays, except the static ops and k)."""
    ops: Ops                   # the engine's kernels
    num_speculative_tokens: int
    cache: Any                 # CacheShape of the KV pool
    target_params: dict        # the target's weights (EAGLE heads share its embedding and lm_head)
    batch: ForwardBatch        # the target's batch
    token_valid: Any           # bool[T]
    hidden: Any                # [T, D] target hidden states after the final norm
    aux_hidden: Any            # [n, T, D] residual stream after the drafter's chosen layers, or None
    history: Any               # i32[slots+1, H] after this step's tokens were appended
    slot: Any                  # i32[R]
    num_tokens: Any            # i32[R] tokens of each row's sequence after this step
    last_final: Any            # i32[R] index in T of each row's last token whose KV is final
    emitted: Any               # i32[R, K+1] tokens emitted this step (-1 padded)
    num_accepted: Any          # i32[R]
    sample_rows: Any           # bool[R] rows that emitted tokens (the ones that need drafts)
    new_slot: Any              # bool[R] the request's first step in its slot (what the slot kept is stale)
    first_token: Any           # i32[R] index in T of each row's first token
    sampling: sampling.SamplingTensors
    keys: Any                  # [R, K] PRNG keys of the draft positions, for drafts drawn by sampling
    variant: StepVariant = StepVariant()
    grammar: Any = None        # grammar.DraftGrammar when some row is constrained: propose inside the grammar
    logit_bias: Any = None     # (ids i32[R, B], values f32[R, B]) when some row has a logit bias: added to the
                               # draft logits as to the target's, so biased drafts are proposed (and accepted)


def step(target, drafter, sc: StepConfig, variant: StepVariant, params, drafter_params, state: DecodeState,
         inp: DeviceInputs, grammar_table=None, logit_bias_table=None):
    K, V = variant.draft_width(sc), target.config.vocab_size
    tok = tokens_from_state(sc, K, state, inp, V)
    aux_layers = drafter.aux_layers if drafter is not None else ()
    logits, hidden, aux, layers = target.forward(params, state.layers, tok.batch, aux_layers)
    raw_logits = logits.reshape(-1, K + 1, V)                                               # [R, K+1, V]
    st = sampling_tensors(inp)
    bias = row_logit_bias(logit_bias_table, tok.slot, inp) if variant.logit_bias else None
    positions = grammar_positions(grammar_table, state, tok, inp, V) if variant.grammar else None
    logprobs = target_distributions(variant, raw_logits, tok, inp, st, positions, bias)    # [R, K+1, V]
    keys = verify_keys(inp, tok.base, K + 1)                                                # [R, K+1]
    emitted, num_accepted = sample_or_verify(variant, logprobs, st, tok.draft_ids, inp.rows["num_drafts"],
                                             draft_logprobs(state, tok.slot, drafter, K), keys)
    state, emitted, num_accepted, num_tokens, last_final = commit(sc, K, state, tok, inp, emitted, num_accepted,
                                                                  layers)
    draft_grammar = None
    if variant.grammar:
        state, draft_grammar = commit_grammar(grammar_table, state, tok, inp, positions, emitted, num_accepted)
    if drafter is not None:
        ctx = DraftContext(ops=target.ops, num_speculative_tokens=K, cache=sc.cache_shape, target_params=params,
                           batch=tok.batch, token_valid=tok.valid, hidden=hidden, aux_hidden=aux,
                           history=state.history, slot=tok.slot, num_tokens=num_tokens, last_final=last_final,
                           emitted=emitted, num_accepted=num_accepted, sample_rows=inp.rows["sample"] > 0,
                           new_slot=inp.rows["new_slot"] > 0,
                           first_token=inp.rows["first_token"], sampling=st,
                           keys=draft_keys(inp, num_tokens, K) if K else None, variant=variant,
                           grammar=draft_grammar, logit_bias=bias)
        drafter_state, drafts = drafter.propose(drafter_params, state.drafter, ctx)   # K = 0: its state only
        state = state.replace(drafter=drafter_state)
        if K:   # a narrower step writes the first K of the slot's drafts
            cols = slice(None) if K == state.drafts.shape[1] else slice(0, K)
            state = state.replace(drafts=state.drafts.at[tok.slot, cols].set(drafts.astype(jnp.int32)))
    prompt = prompt_logprobs(target, params, hidden, tok, inp, sc) if variant.prompt_logprobs else None
    return state, outputs(variant, raw_logits if sc.logprobs_mode == "raw_logprobs" else logprobs, emitted,
                          num_accepted, prompt)


# ---- the phases --------------------------------------------------------------------------------------------

def tokens_from_state(sc: StepConfig, K: int, state: DecodeState, inp: DeviceInputs, vocab_size: int) -> Tokens:
    H, S = sc.history_len, sc.cache_shape.num_kv_slots
    rows, t = inp.rows, inp.tokens
    slot, num_new, num_drafts = rows["slot"], rows["num_new"], rows["num_drafts"]            # [R]
    T = t["token_id"].shape[0]
    # Decode rows (start -1) continue where the device's own count says the last step ended.
    start = jnp.where(rows["start"] >= 0, rows["start"], state.num_computed[slot])          # [R]
    valid = t["offset"] >= 0                                                                 # [T]
    tslot = slot[t["row"]]
    pos = start[t["row"]] + t["offset"]                                                      # [T]
    known = valid & (t["token_id"] >= 0)
    history = state.history.at[tslot, jnp.where(known, pos, H)].set(t["token_id"], mode="drop")
    # Input ids: the history up to the row's last emitted token, then the slot's drafts.
    first_draft = (num_new - num_drafts)[t["row"]]
    is_draft = valid & (t["offset"] >= first_draft)
    draft_ids = state.drafts[slot][:, :K]                                                    # [R, K]
    ids = jnp.where(is_draft, state.drafts[tslot, jnp.clip(t["offset"] - first_draft, 0, max(K - 1, 0))],
                    history[tslot, jnp.clip(pos, 0, H - 1)])
    ids = jnp.where(valid & (ids >= 0) & (ids < vocab_size), ids, 0)   # padding and invalid drafts never embed
    kv_slots = slot_mapping(pos, t["row"], valid, inp.block_tables, sc.block_size, S)
    kv_slots = jnp.where((kv_slots >= 0) & (kv_slots < S), kv_slots, S)
    # Logits at each row's last non-draft token and at every draft.
    last_real = rows["first_token"] + num_new - 1 - num_drafts
    logits_idx = jnp.clip(last_real[:, None] + jnp.arange(K + 1)[None, :], 0, T - 1).reshape(-1)   # [R*(K+1)]
    batch = ForwardBatch(ids, pos, kv_slots, t["row"], inp.block_tables, logits_idx, slot_of_row=slot,
                         first_token_of_row=rows["first_token"], writes_state=valid,
                         first_in_step=rows["first_token"][t["row"]], lora_of_token=rows["lora"][t["row"]])
    return Tokens(batch, valid, history, slot, start, start + num_new - num_drafts, draft_ids)


def sampling_tensors(inp: DeviceInputs) -> sampling.SamplingTensors:
    r = inp.rows
    return sampling.SamplingTensors(
        temperature=r["temperature"], top_k=r["top_k"], top_p=r["top_p"], min_p=r["min_p"],
        presence_penalty=r["presence_penalty"], frequency_penalty=r["frequency_penalty"],
        repetition_penalty=r["repetition_penalty"])


def row_logit_bias(table, slot, inp: DeviceInputs):
    """Each row's logit bias from its slot's row of the table (i32[slots+1, 2, B]: token ids, -1 padding, then the
    values' bits) -> (ids i32[R, B], values f32[R, B]). A row whose request has no bias adds zeros (its slot's row
    may be a former request's)."""
    rows = table[slot]                                                                       # [R, 2, B]
    values = jax.lax.bitcast_convert_type(rows[:, 1], jnp.float32)
    return rows[:, 0], jnp.where(inp.rows["logit_bias"][:, None] > 0, values, 0.0)


def target_distributions(variant: StepVariant, logits, tok: Tokens, inp: DeviceInputs, st, grammar=None, bias=None):
    """logits [R, K+1, V] -> what rows sample from: the logit bias (as vLLM, before the penalties), penalties,
    then the grammar (tokens its automaton state
    does not allow at that position masked), then min_tokens (stop ids masked while the output is shorter; not
    where the grammar allows nothing else), then temperature / top-k / top-p / min-p. All-greedy steps keep
    the logits (their argmax is all that is needed)."""
    R, K1, V = logits.shape
    prompt_len = inp.rows["prompt_len"]
    if bias is not None:
        logits = sampling.add_logit_bias(logits, *bias)
    if variant.penalties:
        logits = _penalize(logits, tok.history, tok.slot, prompt_len, tok.base, tok.draft_ids, st, V)
    generated = tok.base[:, None] + jnp.arange(K1)[None, :] - prompt_len[:, None]            # [R, K+1]
    too_short = generated < inp.rows["min_tokens"][:, None]
    stop_ok = (inp.stop_ids >= 0) & (inp.stop_ids < V)
    stop_hit = jnp.zeros((R, V), bool).at[jnp.arange(R)[:, None], jnp.where(stop_ok, inp.stop_ids, V)].set(
        True, mode="drop")
    blocked = too_short[..., None] & stop_hit[:, None, :]
    if grammar is not None:
        # Tokens outside the grammar are masked too, in the same pass over the logits (every state allows some
        # token and the target's logits are finite, so no row is left empty). A final state may allow only
        # EOS: there the grammar wins over min_tokens.
        allowed = grammar.allowed
        blocked = (blocked & jnp.any(allowed & ~blocked, axis=-1, keepdims=True)) | ~allowed
    logits = jnp.where(blocked, -jnp.inf, logits)
    if not variant.sample:
        return logits
    idx = jnp.repeat(jnp.arange(R), K1)
    return sampling.processed_logprobs(logits.reshape(R * K1, V), st.take(idx),
                                       variant.top_k_top_p).reshape(R, K1, V)


def _penalize(logits, history, slot, prompt_len, base, draft_ids, st, vocab_size):
    """Presence/frequency/repetition penalties from the device history: position j of a row also counts the
    drafts before it (the tokens it would follow if they are accepted)."""
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
    out = sampling.apply_penalties(logits.reshape(R * K1, V), counts.reshape(R * K1, V), prompt_mask[idx],
                                   st.take(idx))
    return out.reshape(R, K1, V)


class GrammarPositions(NamedTuple):
    """Structured outputs at this step's verified positions."""
    table: grammar_lib.GrammarTable
    base: Any       # i32[R] the row's automaton in the table (-1: unconstrained)
    states: Any     # i32[R, K+1] its state at position j: after the row's tokens and the drafts before j
    allowed: Any    # bool[R, K+1, V] the tokens that state allows


def grammar_positions(table, state: DecodeState, tok: Tokens, inp: DeviceInputs, vocab_size: int) -> GrammarPositions:
    """A prefill row starts from the state the host walked its outputs to (grammar_init: the initial state, or
    where a preempted request had got to); a decode row from its slot's state. Drafts move it along; a draft
    outside the grammar leads to no state (-1), and since that draft is masked at its own position it is
    rejected, so no position after it is emitted."""
    rows = inp.rows
    base = rows["grammar_base"]
    start = jnp.where(rows["start"] >= 0, rows["grammar_init"], state.grammar_state[tok.slot])       # [R]
    states = grammar_lib.states_along(table, base, start, tok.draft_ids)                             # [R, K+1]
    R, K1 = states.shape
    allowed = grammar_lib.allowed_tokens(table, jnp.repeat(base, K1), states.reshape(-1), vocab_size)
    return GrammarPositions(table, base, states, allowed.reshape(R, K1, vocab_size))


def commit_grammar(table, state: DecodeState, tok: Tokens, inp: DeviceInputs, positions: GrammarPositions, emitted,
                   num_accepted):
    """Each sampling row's slot keeps the state after its emitted tokens: the state at its last accepted
    position, advanced by the token emitted there. -> (state, DraftGrammar for the drafter)."""
    sample_rows = inp.rows["sample"] > 0
    at = num_accepted[:, None]
    reached = jnp.take_along_axis(positions.states, at, axis=1)[:, 0]
    after = grammar_lib.advance(table, positions.base, reached, jnp.take_along_axis(emitted, at, axis=1)[:, 0])
    where = jnp.where(sample_rows, tok.slot, state.grammar_state.shape[0])
    state = state.replace(grammar_state=state.grammar_state.at[where].set(after, mode="drop"))
    return state, grammar_lib.DraftGrammar(table, positions.base, after)


def position_keys(inp: DeviceInputs, first_position, n: int, fold: int | None = None):
    """One PRNG key per row and position first_position + j, j < n, from the request seed: [R, n]. A position
    draws the same noise in whatever step it is sampled. `fold`: a stream of its own (drafts drawn for those
    positions must be independent of the target's draw there)."""
    R = first_position.shape[0]
    pos = first_position[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    keys = sampling.row_keys(jnp.repeat(inp.rows["seed"], n), pos.ravel(), jnp.repeat(inp.rows["seed_hi"], n))
    if fold is not None:
        keys = jax.vmap(jax.random.fold_in, (0, None))(keys, fold)
    return keys.reshape(R, n, -1)


# Each position's key is the verifier's: its Gumbel noise draws the token emitted there (jaxspec.decode.rejection),
# and folded by 1 it gives the acceptance uniform. A draft sampled for the position draws from the key folded by
# DRAFT_KEY_FOLD, a stream of its own: a draft drawn with the verifier's noise would be accepted or replaced with a
# bias (the residual sample would reuse the noise that picked the draft).
DRAFT_KEY_FOLD = 2


def verify_keys(inp: DeviceInputs, base, n: int):
    """[R, n]: the keys of positions base..base+n-1, where this step samples or verifies."""
    return position_keys(inp, base, n)


def draft_keys(inp: DeviceInputs, num_tokens, n: int):
    """[R, n]: the keys the drafter samples the drafts for positions num_tokens..num_tokens+n-1 with."""
    return position_keys(inp, num_tokens, n, fold=DRAFT_KEY_FOLD)


def sample_or_verify(variant: StepVariant, logprobs, st, draft_ids, num_drafts, draft_lp, keys):
    """-> (emitted i32[R, K+1] padded with -1, num_accepted i32[R]): K = 0 samples one token per row; otherwise
    the drafts are verified (jaxspec.decode.rejection)."""
    R, K1, _ = logprobs.shape
    if K1 == 1:
        if variant.sample:
            token = sampling.sample(logprobs[:, 0], st.is_greedy, keys[:, 0])
        else:
            token = jnp.argmax(logprobs[:, 0], axis=-1).astype(jnp.int32)
        return token[:, None], jnp.zeros((R,), jnp.int32)
    return rejection_sample(logprobs, st.is_greedy, draft_ids, draft_lp, num_drafts, keys,
                            all_greedy=not variant.sample)


def draft_logprobs(state: DecodeState, slot, drafter, K: int):
    """The distributions a sampling drafter drew this step's drafts from [R, K, V] (None for argmax drafts:
    q is a point mass)."""
    if drafter is None or drafter.draft_sampling != "sample":
        return None
    return state.drafter["draft_logprobs"][slot][:, :K]


def commit(sc: StepConfig, K: int, state: DecodeState, tok: Tokens, inp: DeviceInputs, emitted, num_accepted,
           layers):
    """The device's authoritative counts: accepted drafts extend the KV, emitted tokens extend the history.
    Per-slot layer state needs no commit: the forward kept it after each of the row's last k+1 positions, and
    the next step starts from num_computed, so it reads the entry after the last accepted token.
    -> (state, emitted, num_accepted, num_tokens [R], last_final [R] index in T)."""
    H = sc.history_len
    rows = inp.rows
    sample_rows = rows["sample"] > 0
    emitted = jnp.where(sample_rows[:, None], emitted, -1)                                   # [R, K+1]
    num_accepted = jnp.where(sample_rows, num_accepted, 0)                                   # [R]
    num_computed = jnp.where(sample_rows, tok.base + num_accepted, tok.start + rows["num_new"])
    num_tokens = jnp.where(sample_rows, tok.base + num_accepted + 1, tok.start + rows["num_new"])
    j = jnp.arange(K + 1)[None, :]
    write = sample_rows[:, None] & (j <= num_accepted[:, None])
    history = tok.history.at[tok.slot[:, None], jnp.where(write, tok.base[:, None] + j, H)].set(emitted, mode="drop")
    T = tok.valid.shape[0]
    last_final = jnp.clip(rows["first_token"] + num_computed - 1 - tok.start, 0, T - 1)
    state = state.replace(layers=layers, history=history, num_tokens=state.num_tokens.at[tok.slot].set(num_tokens),
                          num_computed=state.num_computed.at[tok.slot].set(num_computed))
    return state, emitted, num_accepted, num_tokens, last_final


# Prompt logprobs are computed over this many of the step's tokens at a time: the logits of a whole step (512 tokens
# x a 150k vocabulary is 300 MB in float32) are never held at once.
PROMPT_LOGPROBS_CHUNK = 64


def prompt_logprobs(target, params, hidden, tok: Tokens, inp: DeviceInputs, sc: StepConfig) -> dict:
    """For every token of the step, the raw log-softmax of its logits read at the token after it in its sequence
    (from the device history, where the host wrote the whole prompt when the request took its slot), that token's
    rank, and the top MAX_LOGPROBS -> prompt_logprob f32[T], prompt_rank i32[T], prompt_top_ids i32[T, n],
    prompt_top_logprobs f32[T, n]. The host keeps the entries of rows that asked (prompt positions only)."""
    T, D = hidden.shape
    H = sc.history_len
    tslot = tok.slot[inp.tokens["row"]]
    next_ids = tok.history[tslot, jnp.clip(tok.batch.positions + 1, 0, H - 1)]
    next_ids = jnp.where(tok.valid, next_ids, -1)
    C = min(T, PROMPT_LOGPROBS_CHUNK)
    n = -(-T // C)
    h = jnp.pad(hidden, ((0, n * C - T), (0, 0))).reshape(n, C, D)
    ids = jnp.pad(next_ids, (0, n * C - T), constant_values=-1).reshape(n, C)

    def chunk(args):
        h, ids = args
        lp = jax.nn.log_softmax(target.logits(params, h, target.ops), axis=-1)                  # [C, V]
        ok = (ids >= 0) & (ids < lp.shape[-1])
        tok_lp = jnp.take_along_axis(lp, jnp.where(ok, ids, 0)[:, None], axis=-1)[:, 0]
        rank = 1 + jnp.sum(lp > tok_lp[:, None], axis=-1, dtype=jnp.int32)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return jnp.where(ok, tok_lp, -jnp.inf), rank, top_ids.astype(jnp.int32), top_lp

    names = ("prompt_logprob", "prompt_rank", "prompt_top_ids", "prompt_top_logprobs")
    chunks = jax.lax.map(chunk, (h, ids))
    return {name: x.reshape(n * C, *x.shape[2:])[:T] for name, x in zip(names, chunks)}


def outputs(variant: StepVariant, logits, emitted, num_accepted, prompt: dict | None = None) -> dict:
    """One array back to the host per step: the emitted tokens, the accepted count in the last column; the
    logprobs arrays when a row asked for them, the log-softmax of `logits` [R, K+1, V] at each position (the
    raw logits or the processed distribution: StepConfig.logprobs_mode); `prompt`: the prompt-logprobs arrays."""
    out = {"tokens": jnp.concatenate([emitted, num_accepted[:, None]], axis=1), **(prompt or {})}
    if variant.logprobs:
        R, K1, V = logits.shape
        tok_lp, top_ids, top_lp = sampling.topn_logprobs(logits.reshape(R * K1, V), emitted.reshape(-1),
                                                         MAX_LOGPROBS)
        out.update(logprob=tok_lp.reshape(R, K1), top_ids=top_ids.reshape(R, K1, MAX_LOGPROBS),
                   top_logprobs=top_lp.reshape(R, K1, MAX_LOGPROBS))
    return out


def output_shapes(variant: StepVariant, sc: StepConfig, num_rows: int, vocab_size: int, num_tokens: int = 0) -> dict:
    """The shapes and dtypes of a step's outputs (`outputs`) for `num_tokens` tokens, without tracing the step."""
    K1 = variant.draft_width(sc) + 1
    sds = jax.ShapeDtypeStruct
    shapes = jax.eval_shape(functools.partial(outputs, variant), sds((num_rows, K1, vocab_size), jnp.float32),
                            sds((num_rows, K1), jnp.int32), sds((num_rows,), jnp.int32))
    if variant.prompt_logprobs:
        T, n = num_tokens, MAX_LOGPROBS
        shapes.update(prompt_logprob=sds((T,), jnp.float32), prompt_rank=sds((T,), jnp.int32),
                      prompt_top_ids=sds((T, n), jnp.int32), prompt_top_logprobs=sds((T, n), jnp.float32))
    return shapes


def make_step(target, drafter, sc: StepConfig, num_tokens: int, num_rows: int, variant: StepVariant = StepVariant(),
              out_shardings=None, compiler_options: dict | None = None):
    """The jitted step of one bucket and variant: (params, drafter params, state, inbox, outbox[, grammar
    table][, logit-bias table]) -> (state, outbox). `inbox` holds the packed host inputs; `outbox` (shaped as
    `output_shapes`) receives the outputs. State and outbox are donated, so every buffer the step reads or writes
    keeps its address from call to call (the KV pool is updated in place, and a CUDA graph of the step never needs
    re-recording). `out_shardings`: (the state's, the outputs') under tensor parallelism; `compiler_options`:
    XLA options for this bucket's compile (Ops.compiler_options)."""
    def packed_step(params, drafter_params, state, inbox, outbox, *tables):
        del outbox   # only its buffers are used: the outputs are written into them (donated, aliased)
        inp = unpack(inbox, num_tokens, num_rows, sc.max_blocks_per_seq)
        tables = iter(tables)   # the variant's tables, in this order (ModelRunner._table_args)
        grammar_table = next(tables) if variant.grammar else None
        logit_bias_table = next(tables) if variant.logit_bias else None
        return step(target, drafter, sc, variant, params, drafter_params, state, inp, grammar_table,
                    logit_bias_table)
    return jax.jit(packed_step, donate_argnums=(2, 4), keep_unused=True,   # the unused outbox: aliased, not pruned
                   out_shardings=out_shardings, compiler_options=compiler_options or None)
