"""Speculative decoding end to end, for every drafter (draft model, EAGLE-1, EAGLE-3, n-gram).

Tiny float32 models built in-process. The target's attention is damped (attn_gain) so that the next token
depends mostly on the current one: drafters can predict it, and every method runs in the partial-acceptance
regime (drafts accepted at several positions, and rejected). EAGLE heads are fitted to the target in seconds
(tests/eagle_heads.py) and written in the published HF layouts. What the engine drafts, accepts and emits is
checked against tests/reference.py, written from the published definitions. Every tiny engine shares one
shape configuration, so steps that differ only in their params or in async/sync scheduling hit the persistent
compilation cache set up in conftest. Here: lossless greedy speculation through chunked prefill and preemption,
async against sync, requests at max_model_len, and the helpers and fixtures of the files beside it (split so
that the suite's two workers share the speculation tests: test_spec_reference.py, the dense references step by
step; test_spec_sampling.py, distributions, seeds, penalties and logprobs; test_spec_layouts.py, the GPU layout
and real models).
"""
import numpy as np
import pytest
from conftest import spec_config

from jaxspec import LLM, SamplingParams
from jaxspec.nn import Decoder

VOCAB = 128   # conftest.SPEC_VOCAB
# Chunked prefill (8 tokens a step) and a 16-block pool: four long requests do not fit at once.
ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=48, max_num_batched_tokens=8, block_size=4,
              num_kv_blocks=16)
METHODS = ("draft_model", "eagle", "eagle3", "ngram")
# The draft model drafting in parallel (conftest.spec_config), in the cases where its own path can go wrong: the
# mask tokens' KV, written past the row's tokens and rewritten by the next step's pass, and drafts 2..k from one
# forward (their distributions, their keys), through async scheduling, preemption and prefix caching.
PARALLEL = "draft_model_parallel"


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
             warmup=False, draft_tensor_parallel_size=None, **engine):
    """An engine that compiles the steps it runs when it first runs them (warmup=True: every bucket and warm
    variant at start-up, as a server does; what the recompile count checks)."""
    spec = spec_config(method, drafters, k, draft_sampling=draft_sampling,
                       draft_tensor_parallel_size=draft_tensor_parallel_size)
    if draft is not None:
        spec["model"] = draft
    return LLM(target, **{**ENGINE, "warmup": warmup, **engine}, async_scheduling=async_scheduling,
               speculative_config=spec)


def assert_greedy_lossless(model, prompts, outputs, compiler_options=None):
    """Every output token is the target's argmax given the tokens before it (up to 1e-5 in logit). (Each
    sequence is scored zero-padded to a multiple of 64 tokens: the attention is causal, so the padding changes
    no logit of the sequence, and one compilation scores many lengths.) `compiler_options` are XLA's for that
    compilation (a real model's dense forward runs long enough to want LLVM's optimisation, which the suite
    otherwise leaves out)."""
    decoder = Decoder(model.config)
    scorers = {}
    for prompt, out in zip(prompts, outputs):
        ids = np.array(prompt + list(out.token_ids), np.int32)
        padded = np.zeros(-(-len(ids) // 64) * 64, np.int32)
        padded[:len(ids)] = ids
        if len(padded) not in scorers:
            scorers[len(padded)] = Decoder.score.lower(decoder, model.params, padded).compile(compiler_options)
        logits = np.asarray(scorers[len(padded)](model.params, padded))[:len(ids)]          # [n, V]
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


def test_a_draft_model_of_other_widths_drafts_losslessly(target, drafters):
    """A draft model of twice the target's hidden size, heads, KV heads and MLP width (conftest.widened: it computes
    what the target computes), with its own KV pool of its own shapes: lossless, and its drafts accepted as the target's
    own would be, through chunked prefill and preemption."""
    from conftest import widened
    draft = widened(target)
    prompts = [prompt_of(n, seed) for seed, n in enumerate([3, 9, 15, 20])]
    llm = make_llm(target, drafters, "draft_model", 3, draft=draft)
    outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert_greedy_lossless(target, prompts, outs)
    state = llm.engine.runner.state
    kv, draft_kv = state.layers["attention"]["k"], state.drafter["layers"]["attention"]["k"]
    assert draft_kv.shape[-2] == 2 * kv.shape[-2]   # twice the KV heads, in a pool of its own
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert min(stats["spec"]["per_position_acceptance"]) > 0.9, stats["spec"]


# Per request (drafted, accepted) and accepted per draft position of the greedy k=3 run below, recorded with the
# unfolded draft model (a pass over the step's tokens, then k single-token forwards): folding the pass into the
# first proposal is the same math in one forward fewer, so the same drafts are accepted. (Async's fourth request
# drafts 39, not the 38 recorded then: near max_model_len its drafts now wait for the true count before they are cut.)
UNFOLDED_COUNTS = {True: ([(60, 5), (33, 10), (42, 9), (39, 8)], [22, 7, 3]),
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


# (The parallel draft model with sampled drafts: drafts 2..k drawn from one forward's distributions with keys 2..k,
# the distributions the next step's verification reads, and the mask KV rewritten by a step async plans ahead of.)
ASYNC_CASES = [("draft_model", "argmax"), ("draft_model", "sample"), ("eagle", "argmax"), ("eagle3", "argmax"),
               ("ngram", "argmax"), (PARALLEL, "sample")]


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


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_drafts_cut_near_max_model_len_are_the_same_async_and_sync(target, drafters, method):
    """A request nearing max_model_len has its drafts cut to the room left. Async plans while its last step is in
    flight, from the count that assumes every draft accepted: cut from that count, async drafted fewer than sync
    (54 draft tokens against 60 here, and accepted another). The tokens and the drafted and accepted counts are the
    same in both."""
    prompts = [prompt_of(25, 43), [5, 6, 7, 8, 9] * 5]
    results = {}
    for mode in (True, False):
        llm = make_llm(target, drafters, method, 3, async_scheduling=mode, num_kv_blocks=64)
        outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=100))
        assert llm.stats()["num_preemptions"] == 0
        assert all(len(p) + len(o.token_ids) == ENGINE["max_model_len"] for p, o in zip(prompts, outs))
        results[mode] = [(o.token_ids, o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs]
    assert results[True] == results[False]
    assert sum(r[2] for r in results[True]) > 0
