"""Sampled speculation: the joint distribution of the emitted tokens is the target's (every drafter, argmax and
sampled drafts), seeded requests give plain decoding's tokens through forced preemption, drafts draw from keys of
their own, and penalties and logprobs under every drafter equal plain penalized decoding and the dense reference.
The tiny target, drafters and helpers are tests/test_spec.py's."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import optimize_steps
from reference import target_forward
from conftest import spec_config
from test_spec import (ENGINE, METHODS, PARALLEL, assert_partial_acceptance, drafters, log_softmax,  # noqa: F401
                       make_llm, prompt_of, references, run, target)
from jaxspec import LLM, SamplingParams
from jaxspec.decode.step import StepVariant


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


# (The parallel draft model with sampled drafts: its second draft is drawn from the mask token's distribution,
# which the verification of that position must read; its argmax drafts are seeded plain decoding's tokens,
# tests/test_parallel_draft_model.py and the preemption test below.)
SAMPLED_CASES = ([(m, ds) for m in ("draft_model", "eagle", "eagle3") for ds in ("argmax", "sample")]
                 + [("ngram", "argmax"), (PARALLEL, "sample")])
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
    spec = spec_config(method, drafters, k, draft_sampling=draft_sampling)
    # the steps compiled with LLVM's optimisation (conftest.optimize_steps): 2000 requests run them far more often
    # than they compile (~1/5 less time a case; plain decoding's steps, above, run too few times to gain)
    llm = optimize_steps(LLM(target, **DIST_ENGINE, speculative_config=spec))
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


@pytest.mark.parametrize("method", METHODS + (PARALLEL,))
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
