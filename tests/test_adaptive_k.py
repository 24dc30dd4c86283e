"""Speculation length chosen per step (`SpeculativeConfig(adaptive=True)`, jaxspec/sched/adaptive.py).

The chooser alone (host arithmetic), then engines on the tiny float32 models of tests/test_spec.py (the same
shapes, so their steps hit the persistent compilation cache): the chosen k follows acceptance, and every
sequence of choices is exact (greedy and seeded tokens equal fixed k and plain decoding; async equals sync in
tokens, counts and choices; the drafters' own state survives k = 0 steps).
"""
import numpy as np
import pytest

from conftest import random_model
from jaxspec import LLM, SamplingParams
from jaxspec.sched import adaptive
from jaxspec.sched.adaptive import KChooser
from test_spec import ENGINE, VOCAB, drafters, prompt_of, references, target  # noqa: F401 (fixtures)

K = 3


def buckets(n: int) -> int:
    return max(8, 1 << (n - 1).bit_length())


def gpu_like(k: int, T: int) -> float:
    """A step-time model: a fixed cost, a cost per token, a cost per draft forward."""
    return 1.0 + 0.05 * T + 0.1 * k


def feed(chooser, first_step: int, steps: int, rows):
    """Steps whose rows verified 4 drafts each and accepted `rows` [(count of rows, accepted), ...]."""
    for s in range(first_step, first_step + steps):
        chooser.observe(s, [(4, a) for n, a in rows for _ in range(n)], (4, 8, None))


# ---- the chooser -------------------------------------------------------------------------------------------

def test_chooser_follows_acceptance_and_falls_back_at_large_batch():
    c = KChooser(4, 512, buckets)
    c.time_model = gpu_like
    # conditional acceptance 0.7 at every position: 30% of rows accept 0, 21% 1, 15% 2, 10% 3, 24% all 4
    feed(c, 0, 20, [(30, 0), (21, 1), (15, 2), (10, 3), (24, 4)])
    assert c.choose(21, 1) == 4
    assert np.allclose(c.acceptance(), 0.7, atol=0.02)
    # the same acceptance at larger batches: the step time grows with its tokens, and k falls back to 0
    assert [c.choose(22 + i, b) for i, b in enumerate([1, 16, 64, 256])] == [4, 1, 0, 0]
    feed(c, 20, 40, [(100, 4)])        # every draft accepted: speculation pays at a larger batch again
    assert c.choose(61, 16) == 3
    feed(c, 60, 300, [(100, 0)])       # nothing accepted any more
    assert c.choose(361, 1) == 0
    assert c.acceptance()[0] < 0.05 and c.expected_tokens(4) < 1.1


def test_chooser_sees_a_step_two_steps_later_and_measures_times():
    """What step s observed is used from step s+2 on (async reads s after dispatching s+1; sync waits as
    long, so both choose alike). Without a time model, each (k, bucket) is explored smallest k first and kept
    until measured; then the measured times decide."""
    c = KChooser(2, 64, buckets)
    assert [c.choose(s, 1) for s in range(4)] == [0, 0, 0, 0]   # exploring k=0 (bucket 8)
    for s in range(3):
        c.observe(s, [], (0, 8, 1.0))
    assert c.choose(4, 1) == 1                                    # k=0 measured: explore k=1
    for s in range(3, 9):
        c.observe(s, [(2, 2)] * 4, (1, 8, 1.2) if s < 6 else (2, 8, 1.3))
    for s in range(5, 11):
        c.choose(s, 1)
    assert c.times == {(0, 8): 1.0, (1, 8): 1.2, (2, 8): 1.3}
    assert c.choose(10, 1) == 2                                   # all accepted: 3 tokens in 1.3
    before = c.acceptance().copy()
    c.observe(9, [(2, 0)] * 400, (2, 8, 1.1))                    # step 9: nothing accepted, many rows
    c.choose(10, 1)
    assert (c.acceptance() == before).all()                       # not yet at step 10 ...
    c.choose(11, 1)
    assert c.acceptance()[0] < 0.2 * before[0]                    # ... at step 11
    assert c.choose(12, 1) == 0
    c.observe(10, [], (0, 8, 100.0))                              # one outlier (a host pause) among three ...
    c.choose(13, 1)
    assert c.times[(0, 8)] == 1.0                                 # ... leaves the median where it was
    c.observe(11, [], (0, 8, 100.0))
    c.observe(12, [], (0, 8, 100.0))
    c.choose(15, 1)
    assert c.times[(0, 8)] == 100.0                               # three of five: the step is that slow now


def test_plain_decodings_time_is_measured_again_while_another_k_is_chosen():
    """k = 0 timed slow at the start of a run (2.0, under other load) and never picked again would keep that time:
    every REMEASURE_STEPS steps of another k, k = 0 runs for a few steps, its new time replaces the old one (no
    average with it), and the chooser goes back to plain decoding now that it is faster (1.0 against k = 1's 1.3
    tokens in 1.5)."""
    c = KChooser(1, 64, buckets)
    chosen = []
    for s in range(3 * adaptive.REMEASURE_STEPS):
        k = c.choose(s, 1)
        chosen.append(k)
        t = {0: 2.0 if s < 10 else 1.0, 1: 1.5}[k]
        c.observe(s, [(1, 0)] * 7 + [(1, 1)] * 3 if k else [], (k, 8, t))
    first = chosen.index(1)
    assert first < 10 and set(chosen[first:adaptive.REMEASURE_STEPS]) == {1}        # k = 0 looked slow
    back = chosen.index(0, first)
    assert adaptive.REMEASURE_STEPS < back < adaptive.REMEASURE_STEPS + 20            # measured again ...
    assert set(chosen[back:]) == {0} and c.times[(0, 8)] == pytest.approx(1.0)     # ... and kept


def test_a_host_pause_while_plain_decoding_is_measured_again_is_dropped():
    """As above, but the re-measure's first timed step is a host pause (4 times a plain step: what two H200s showed
    on 2026-11-28, plain decoding timed at 4.7 ms where its steps took ~2). A time that the first sample dominates
    would keep plain decoding priced above k = 1 for another REMEASURE_STEPS steps; the median of the re-measure's
    samples drops the pause, and the chooser goes back to plain decoding at once."""
    c = KChooser(1, 64, buckets)
    chosen, paused = [], False
    for s in range(3 * adaptive.REMEASURE_STEPS):
        k = c.choose(s, 1)
        chosen.append(k)
        t = {0: 2.0 if s < 10 else 1.0, 1: 1.5}[k]
        if k == 0 and s > adaptive.REMEASURE_STEPS and not paused:
            t, paused = 4.0, True
        c.observe(s, [(1, 0)] * 7 + [(1, 1)] * 3 if k else [], (k, 8, t))
    back = chosen.index(0, chosen.index(1))
    assert paused and adaptive.REMEASURE_STEPS < back < adaptive.REMEASURE_STEPS + 20
    assert set(chosen[back:]) == {0} and c.times[(0, 8)] == pytest.approx(1.0)


# ---- bucket edges (issue #37): vLLM's batch-size k table fell from 232 to 24-157 tokens/s past a threshold -------

EDGE_BUCKETS = [8, 16, 32, 64, 128, 256, 512]
# A GPU's step: flat within a token bucket, a jump at each edge (memory-bound up to 64 tokens, then compute-bound:
# twice the tokens, twice the time), plus a draft forward per drafted position.
EDGE_BASE = {8: 10.0, 16: 10.4, 32: 11.2, 64: 12.8, 128: 24.0, 256: 48.0, 512: 96.0}


def edge_bucket(n: int) -> int:
    return next(b for b in EDGE_BUCKETS if b >= n)


def edge_time(k: int, T: int) -> float:
    return EDGE_BASE[T] + 0.6 * k


def edge_rate(B: int, k: int, alpha: float, budget: int) -> float:
    """Expected tokens/s of B decoding rows at k drafts each, chain acceptance alpha at every position: the rows
    that fit the budget, each emitting 1 + alpha + ... + alpha^k tokens, in the step time of their bucket."""
    rows = min(B, budget // (1 + k))
    return rows * sum(alpha ** j for j in range(k + 1)) / edge_time(k, edge_bucket(rows * (1 + k)))


def chain_rows(k: int, p: int, q: int) -> list[tuple[int, int]]:
    """(k, accepted) rows of k drafts at chain acceptance exactly p/q: q^k rows, p^j (q-p) q^(k-j-1) of them
    accepting j < k, p^k accepting all k."""
    counts = [p ** j * (q - p) * q ** (k - j - 1) for j in range(k)] + [p ** k]
    return [(k, j) for j, n in enumerate(counts) for _ in range(n)]


def check_sweep(batches, chosen, alpha, K, budget):
    """The chosen k's expected rate at each batch is the best k's (its estimates are the true ones to ~1e-4) and
    never below plain decoding's; from one batch to the next it falls no more than the best rate does."""
    prev = None
    for B, k in zip(batches, chosen):
        rates = [edge_rate(B, j, alpha, budget) for j in range(K + 1)]
        got, best = rates[k], max(rates)
        assert got >= rates[0] * (1 - 1e-9), f"batch {B}: k={k} loses to plain decoding, {got:.4f} < {rates[0]:.4f}"
        assert got >= best * (1 - 1e-3), f"batch {B}: k={k} gives {got:.4f}, k={rates.index(best)} {best:.4f}"
        if prev is not None:   # no collapse: a drop only as large as the optimum's own
            assert got / prev[0] >= best / prev[1] * (1 - 1e-3), f"batch {prev[2]} -> {B}"
        prev = (got, best, B)


@pytest.mark.parametrize("p,q", [(4, 5), (1, 2)])
def test_chosen_rate_never_drops_across_bucket_edges(p, q):
    """Fixed step times per (draft width, token bucket), chain acceptance p/q observed through `observe`: the
    batch swept over every size 1..64 (rows*(1+k) crosses each edge at a different batch for each k) up, down and
    up again, the k chosen at each batch (its first choice there) is the best one and never below k = 0."""
    K, budget, alpha = 4, 512, p / q
    c = KChooser(K, budget, edge_bucket)
    c.time_model = edge_time
    for s in range(20):
        c.observe(s, chain_rows(K, p, q), (K, 8, None))
    step, k = 20, K
    batches = [*range(1, 65), *range(64, 0, -1), *range(1, 65)]
    chosen = []
    for B in batches:
        # what the engine reports of step `step`: its rows verified the k chosen before it
        c.observe(step, chain_rows(k, p, q) if k else [], (k, edge_bucket(B * (1 + k)), None))
        k = c.choose(step, B)
        chosen.append(k)
        step += 1
    assert np.allclose(c.acceptance(), alpha, atol=1e-3)
    check_sweep(batches, chosen, alpha, K, budget)
    assert len(set(chosen)) >= 3   # the sweep does move k (speculation pays at small batches, not at large ones)


@pytest.mark.parametrize("batch", [2, 6, 12])
def test_a_step_with_prefill_chunks_is_priced_with_them(batch):
    """Decode rows beside prefill chunks: the chunks take their share of the budget and move the step's bucket,
    so the k chosen at each prefill load is the best one for the step as it will be (the chunks' tokens priced
    in), which at some loads is not the best one for the decode rows alone."""
    K, budget, alpha = 4, 64, 0.8
    c = KChooser(K, budget, edge_bucket)
    c.time_model = edge_time
    for s in range(20):
        c.observe(s, chain_rows(K, 4, 5), (K, 8, None))

    def rate(k, prefill):
        rows = min(batch, (budget - prefill) // (1 + k))
        if rows == 0:
            return 0.0
        return rows * sum(alpha ** j for j in range(k + 1)) / edge_time(k, edge_bucket(rows * (1 + k) + prefill))
    differs = 0
    for step, prefill in enumerate(range(0, budget - batch, 3), start=20):
        c.choose(step, batch, prefill)   # (a first choice may keep the current k: MARGIN)
        k = c.choose(step, batch, prefill)
        rates = [rate(j, prefill) for j in range(K + 1)]
        assert rates[k] >= max(rates) / (1 + adaptive.MARGIN), (prefill, k, rates)
        alone = [rate(j, 0) for j in range(K + 1)]
        differs += rates[alone.index(max(alone))] < max(rates) * (1 - 1e-3)
    assert differs   # pricing the decode rows alone would have chosen worse somewhere


def test_measured_times_settle_on_the_best_k_across_bucket_edges():
    """No time model: the step times are measured as the engine measures them (each step: its draft width, the
    bucket of the drafts it verifies, its time from the fixed table), so each new (k, bucket) a batch reaches is
    explored first. After a few steps at each batch of the sweep the choice is the best k's."""
    K, budget, (p, q) = 3, 512, (4, 5)
    c = KChooser(K, budget, edge_bucket)
    prev_k, step, batches, chosen = K, 0, [*range(1, 65), *range(64, 0, -1)], []
    for B in batches:
        for _ in range(12):
            k = c.choose(step, B)
            width, T = max(k, prev_k), edge_bucket(B * (1 + prev_k))
            c.observe(step, chain_rows(prev_k, p, q) if prev_k else [], (width, T, edge_time(width, T)))
            prev_k, step = k, step + 1
        chosen.append(k)
    check_sweep(batches, chosen, p / q, K, budget)


def test_a_held_k_never_loses_to_plain_decoding():
    """MARGIN keeps the current k against a slightly better one (noise), but never against plain decoding: as
    the acceptance estimate drifts from 0.3 to 0.23, k = 1 (1 + a tokens in 1.25) is given up for k = 0 the step
    its estimated rate falls below plain decoding's, not 3% later."""
    c = KChooser(1, 64, edge_bucket)
    c.time_model = lambda k, T: 1 + 0.25 * k
    for s in range(10):
        c.observe(s, chain_rows(1, 3, 10), (1, 8, None))
    k, chosen = c.choose(10, 1), []
    assert k == 1
    for s in range(11, 300):
        c.observe(s, chain_rows(k, 23, 100) if k else [], (k, 8, None))
        k = c.choose(s, 1)
        chosen.append(k)
        if (1 + c.acceptance()[0]) / 1.25 < 1:
            assert k == 0, f"step {s}: a = {c.acceptance()[0]:.4f}"
    assert chosen[-1] == 0 and 1 in chosen


def test_the_rows_context_prices_their_attention():
    """Each query token's attention grows with its row's context (engine.pricing.time_steps times it: `context_cost`), and a
    step of width k has k + 1 query tokens a row: at short contexts speculation pays, at long ones the drafts'
    attention costs more than they bring and plain decoding wins. At every context of the sweep the choice is within
    MARGIN of the best rate with the attention priced in; without it, speculation would be chosen throughout."""
    K, budget, batch, alpha = 3, 64, 8, 0.5
    c = KChooser(K, budget, edge_bucket)
    for T in (8, 16, 32, 64):
        for k in range(K + 1):
            c.calibrated[(k, T)] = 1.0 + 0.1 * k + 0.002 * T
            c.context_cost[(k, T)] = 1e-4
    for s in range(20):
        c.observe(s, chain_rows(K, 1, 2), (K, 8, None))

    def rate(k, context, attention=True):   # (the acceptance folded in by the first choice, then fixed)
        rows = min(batch, budget // (1 + k))
        T = edge_bucket(rows * (1 + k))
        t = c.calibrated[(k, T)] + (1e-4 * rows * (1 + k) * context if attention else 0.0)
        return rows * c.expected_tokens(k) / t
    chosen = []
    for step, context in enumerate(range(0, 3001, 100), start=20):
        c.choose(step, batch, 0, context)   # (a first choice may keep the current k: MARGIN)
        k = c.choose(step, batch, 0, context)
        rates = [rate(j, context) for j in range(K + 1)]
        assert rates[k] >= max(rates) / (1 + adaptive.MARGIN), (context, k, rates)
        assert c.snapshot()["context"] == context
        chosen.append(k)
    assert chosen[0] > 0 and chosen[-1] == 0
    assert all(max(range(K + 1), key=lambda j: rate(j, L, attention=False)) > 0 for L in (0, 3000))


def test_adaptive_is_validated():
    from jaxspec.spec import SpeculativeConfig
    with pytest.raises(ValueError, match="adaptive"):
        SpeculativeConfig("ngram", adaptive="yes")
    assert SpeculativeConfig.coerce({"method": "ngram", "adaptive": True}).adaptive


# ---- engines -----------------------------------------------------------------------------------------------

def never_matching(target):  # noqa: F811
    """The target with a zero lm_head: every logit 0, so it always drafts token 0."""
    from jaxspec.models.model import Model
    from jaxspec.models.weights import params_from_hf_tensors
    t = dict(target.hf_tensors, **{"lm_head.weight": np.zeros_like(target.hf_tensors["lm_head.weight"])})
    return Model(target.config, params_from_hf_tensors(target.config, t.__getitem__, "float32"), tokenizer=None,
                 name="never-matching")


def spec_llm(target, method, model=None, *, adaptive_k=True, k=K, async_scheduling=True, time_model=None,  # noqa: F811
             schedule=None, **engine):
    spec = dict(method=method, num_speculative_tokens=k, adaptive=adaptive_k)
    if model is not None:
        spec["model"] = model
    llm = LLM(target, **{**ENGINE, "num_kv_blocks": 40, "warmup": False, **engine},
              async_scheduling=async_scheduling, speculative_config=spec)
    chooser = llm.engine.k_chooser
    if time_model is not None:
        chooser.time_model = time_model
    if schedule is not None:   # a forced sequence of choices, by step number
        chooser.choose = lambda step, rows, prefill_tokens=0, context=0.0: schedule[step % len(schedule)]
    return llm


def results(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs]


def plain_tokens(target, prompts, params):  # noqa: F811
    return [o.token_ids for o in LLM(target, **{**ENGINE, "num_kv_blocks": 40, "warmup": False}).generate(
        prompts, params, use_tqdm=False)]


CHOSEN_PROMPTS = [prompt_of(5, 90), prompt_of(9, 91)]
CHOSEN_PARAMS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def chosen_plain(target):  # noqa: F811
    """Plain decoding of the test below's requests, run once for its three drafters."""
    return plain_tokens(target, CHOSEN_PROMPTS, CHOSEN_PARAMS)


@pytest.mark.parametrize("drafter", ["never_matching", "target", "perturbed"])
def test_chosen_k_follows_acceptance(target, drafters, chosen_plain, drafter):  # noqa: F811
    """A drafter that never matches drives k to 0, the target drafting for itself drives it to K, a drafter in
    between to a k in between; the tokens are those of fixed k and of plain decoding; async and sync make the
    same choices and counts."""
    model = {"never_matching": never_matching(target), "target": target,
             "perturbed": drafters["draft_model"]}[drafter]
    prompts, params, plain = CHOSEN_PROMPTS, CHOSEN_PARAMS, chosen_plain
    fixed = results(spec_llm(target, "draft_model", model, adaptive_k=False), prompts, params)
    runs = {}
    for mode in (True, False):
        llm = spec_llm(target, "draft_model", model, async_scheduling=mode, time_model=lambda k, T: 1 + 0.3 * k)
        runs[mode] = (results(llm, prompts, params), llm.stats()["spec"]["chosen_k"])
        assert [r[0] for r in runs[mode][0]] == plain == [r[0] for r in fixed]
    assert runs[True] == runs[False]
    chosen = np.asarray(runs[True][1])
    share, last = chosen / chosen.sum(), llm.engine.k_chooser.current
    if drafter == "never_matching":
        assert all(r[2] == 0 for r in fixed)
        assert share[0] >= 0.7 and last == 0, chosen
    elif drafter == "target":   # (the prior, 0.6 at each position, starts it at k=1)
        assert share[K] >= 0.7 and last == K, chosen
    else:
        assert 0 < llm.stats()["spec"]["acceptance_rate"] < 1
        assert share[1:K].sum() >= 0.5 and 0 < last < K, chosen


# Forced choices, by step number: every transition between 0, 1, 2 and 3.
SCHEDULE = [3, 0, 0, 2, 1, 3, 3, 0, 1, 2, 2, 0, 3, 1, 1]


EXACT_PROMPTS = [prompt_of(6, 20), prompt_of(11, 21), [5, 6, 7, 8] * 3]
EXACT_PARAMS = [SamplingParams(temperature=0, max_tokens=20),
                SamplingParams(temperature=0.7, top_k=8, seed=7, max_tokens=20),
                SamplingParams(temperature=0, max_tokens=20)]


@pytest.fixture(scope="module")
def exact_plain(target):  # noqa: F811
    """Plain decoding of the test below's requests, run once for its four cases."""
    return plain_tokens(target, EXACT_PROMPTS, EXACT_PARAMS)


@pytest.mark.parametrize("method,draft_sampling", [("draft_model", "argmax"), ("draft_model", "sample"),
                                                   ("eagle3", "argmax"), ("ngram", "argmax")])
def test_every_sequence_of_k_is_exact(target, drafters, exact_plain, method, draft_sampling):  # noqa: F811
    """k forced through every transition (0 after K, K after 0, ...): greedy and seeded tokens equal plain
    decoding (argmax drafts); async equals sync in tokens, drafted and accepted counts and chosen k."""
    prompts, params = EXACT_PROMPTS, EXACT_PARAMS
    runs = {}
    for mode in (True, False):
        llm = LLM(target, **{**ENGINE, "num_kv_blocks": 40, "warmup": False}, async_scheduling=mode,
                  speculative_config=dict(method=method, model=drafters[method], num_speculative_tokens=K,
                                          draft_sampling=draft_sampling, adaptive=True))
        llm.engine.k_chooser.choose = lambda step, rows, prefill_tokens=0, context=0.0: SCHEDULE[step % len(SCHEDULE)]
        runs[mode] = (results(llm, prompts, params), llm.stats()["spec"]["chosen_k"])
        assert llm.stats()["num_preemptions"] == 0
        assert all(n > 0 for n in runs[mode][1]), runs[mode][1]
        assert llm.stats()["spec"]["accepted_tokens"] > 0
        got = [r[0] for r in runs[mode][0]]
        want = exact_plain
        if draft_sampling == "argmax":
            assert got == want, f"async={mode}"
        else:   # sampled drafts keep the distribution, not the draws: the greedy rows must match
            assert [got[0], got[2]] == [want[0], want[2]], f"async={mode}"
    assert runs[True] == runs[False]


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "ngram"])
def test_drafts_after_plain_steps_match_a_dense_reference(target, drafters, references, method):  # noqa: F811
    """Steps with k = 0 run no proposal, yet the drafter keeps its own state (its KV, EAGLE's saved feature):
    after every step the drafts the device holds for the next step are the reference's greedy proposals over
    the sequence so far, and each step verifies exactly the k drafts proposed for it and accepts the longest
    prefix of them that the target's greedy continuation agrees with."""
    llm = spec_llm(target, method, drafters[method], async_scheduling=False, schedule=[0, 0, 2, 0, 3, 1, 0, 0, 3])
    engine = llm.engine
    prompt = prompt_of(9, 50) if method != "ngram" else [5, 6, 7, 8, 9] * 4
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24))
    checked, held = 0, []
    while not req.finished:
        before = (len(req.output_token_ids), req.num_draft_tokens, req.num_accepted_tokens)
        engine.step()
        if before[0] and held is not None:   # a decode step: it verified `held`, the drafts proposed for it
            new = req.output_token_ids[before[0]:]
            accepted = next((j for j, (d, t) in enumerate(zip(held, new)) if d != t), min(len(held), len(new)))
            if not req.finished:
                assert (req.num_draft_tokens - before[1], req.num_accepted_tokens - before[2]) == (len(held), accepted)
        held = None
        k = req.num_proposed
        if req.output_token_ids and not req.finished:
            held = np.asarray(engine.runner.state.drafts)[req.slot, :k].tolist()
            seq = req.prompt_token_ids + req.output_token_ids
            assert held == references["propose"][method](seq, K)[:k], f"after {len(seq)} tokens"
            checked += k > 0
    assert checked >= 4
    assert llm.stats()["spec"]["accepted_tokens"] > 0


def test_warmup_times_every_width_and_the_chooser_prices_by_those_times(target, drafters):  # noqa: F811
    """The warm-up compiles every draft width and times each (draft width, bucket) on blank steps
    (engine.pricing.time_steps), so choosing k never compiles and the chooser prices by device times from the first step:
    with plain decoding priced cheapest by far it runs k = 0 throughout, no width explored, nothing measured again
    (the loop's period, which carries every host pause, no longer sets a price). The tokens are plain decoding's."""
    prompts = [prompt_of(6, 20), prompt_of(11, 21)]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM(target, **{**ENGINE, "num_kv_blocks": 40, "warmup": False}).generate(prompts, params, use_tqdm=False)
    llm = spec_llm(target, "ngram", warmup=True)
    assert llm.engine.wait_compiled(300)   # the narrower widths compile in the background
    chooser = llm.engine.k_chooser
    pairs = {(k, T) for T in llm.engine.runner.token_buckets for k in range(K + 1)}
    assert set(chooser.calibrated) == pairs and all(t > 0 for t in chooser.calibrated.values())
    assert set(chooser.context_cost) == pairs and all(c >= 0 for c in chooser.context_cost.values())
    chooser.calibrated = {(k, T): 1.0 if k == 0 else 100.0 for k, T in pairs}
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = llm.stats()
    assert stats["recompiles"] == 0
    chosen = stats["spec"]["chosen_k"]
    assert chosen[0] >= 10 and sum(chosen[1:]) == 0, chosen
    # stats() shows what it chose from: the device times (ms), and the loop's periods it measured beside them
    view = stats["spec"]["chooser"]
    assert view["calibrated_ms"] == [[k, T, 1e3 * chooser.calibrated[k, T]] for k, T in sorted(pairs)]
    assert [(k, T) for k, T, _, _ in view["step_ms"]] == sorted(chooser.times)
    assert all(ms == pytest.approx(1e3 * chooser.times[k, T]) and 0 <= at < stats["steps"]
               for k, T, ms, at in view["step_ms"])
    assert view["acceptance"] == pytest.approx(chooser.acceptance().tolist())


def test_tiered_warmup_times_every_width_once_its_compiles_end(target):  # noqa: F811
    """A GPU's default warm-up compiles in the background while serving: every (draft width, bucket) gets its
    device time once the compiles end (at each program's best tier)."""
    engine = spec_llm(target, "ngram", warmup="tiered").engine
    assert engine.wait_compiled(300)
    assert set(engine.k_chooser.calibrated) == {(k, T) for T in engine.runner.token_buckets for k in range(K + 1)}


def test_timing_steps_mid_run_leaves_live_requests_untouched(target, drafters):  # noqa: F811
    """engine.pricing.time_steps runs blank steps on the live state (with the tiered warm-up of a GPU it runs when the
    background compiles end, between live steps, one step in flight): their writes go to the trash slot, so the
    requests get the same tokens and the same drafts accepted as without it (the EAGLE-3 head's own KV and saved
    feature untouched)."""
    def run(time_mid: bool):
        llm = spec_llm(target, "eagle3", drafters["eagle3"], schedule=[3, 1, 0, 2, 3])
        engine = llm.engine
        reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=20))
                for p in (prompt_of(9, 50), prompt_of(5, 51))]
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if time_mid and steps in (3, 6):
                engine.pricing.time_steps()
        if time_mid:
            assert len(engine.k_chooser.calibrated) == (K + 1) * len(engine.runner.token_buckets)
        return [(r.output_token_ids, r.num_draft_tokens, r.num_accepted_tokens) for r in reqs]
    untimed = run(False)
    assert run(True) == untimed
    assert sum(accepted for _, _, accepted in untimed) >= 4


def test_a_context_step_reads_its_rows_contexts_and_writes_only_its_scratch_block(target, drafters):  # noqa: F811
    """pricing.context_inputs (what engine.pricing.time_steps times the attention over contexts with): its rows read their
    contexts' KV blocks (other KV in those blocks gives other KV written after them; KV in a block no row reads
    changes nothing), and the step writes only the scratch block's KV (the target's and the EAGLE-3 head's) and the
    trash slot's state: a live request that holds no block of it is untouched (the head writes the KV of the
    position before a row's first token, which is why a row's last context block is the scratch block too)."""
    import jax
    import jax.numpy as jnp
    from jaxspec.decode.state import DecodeState, state_schema
    from jaxspec.nn.schema import Spec
    from jaxspec.decode.step import StepVariant
    from jaxspec.sched.pricing import context_inputs, context_rows, time_step
    engine = spec_llm(target, "eagle3", drafters["eagle3"]).engine
    runner, sc = engine.runner, engine.step_config
    T, context, scratch = runner.token_buckets[0], 24, sc.num_blocks - 1
    inputs = context_inputs(runner, T, K, context, scratch)
    assert context_rows(runner, T, K) == 2 and list(inputs.rows["start"][:3]) == [context, context, 0]
    specs = DecodeState(**state_schema(runner.target, sc), drafter=runner.drafter.state_schema(sc))
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, Spec))
    scratch_slots = np.arange(scratch * sc.block_size, (scratch + 1) * sc.block_size)

    def at(spec, axis_name, index):   # the index of `index` along the spec's named axis
        return tuple(index if name == axis_name else slice(None) for name in spec.axes)

    def perturbed(host_state, block):   # the state with noise in this block's KV, as fresh device arrays
        slots = np.arange(block * sc.block_size, (block + 1) * sc.block_size)
        leaves = []
        for x, spec in zip(jax.tree_util.tree_leaves(host_state), spec_leaves):
            x = np.array(x)
            if "kv_slots" in spec.axes:
                region = at(spec, "kv_slots", slots)
                x[region] = np.random.default_rng(1 + block).normal(size=x[region].shape)
            leaves.append(jnp.asarray(x) + jnp.zeros((), x.dtype))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(host_state), leaves)

    def run(state):   # the step's runs (untimed and timed) from this state -> the state after, on the host
        runner.state = state
        time_step(runner, T, StepVariant(), runs=1, inputs=inputs)
        return jax.tree_util.tree_map(np.asarray, runner.state)

    def noised(x):   # every float of the state random: a write anywhere shows
        x = np.asarray(x)
        return np.random.default_rng(0).normal(size=x.shape).astype(x.dtype) if x.dtype.kind == "f" else x
    before = jax.tree_util.tree_map(noised, runner.state)
    after = run(perturbed(before, 30))
    kv_leaves = 0
    for b, a, spec in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after), spec_leaves):
        assert b.shape == spec.shape
        changed = b != a
        if "kv_slots" in spec.axes:
            kv_leaves += 1
            assert changed[at(spec, "kv_slots", scratch_slots)].any()
            changed[at(spec, "kv_slots", scratch_slots)] = False
            changed[at(spec, "kv_slots", np.arange(30 * sc.block_size, 31 * sc.block_size))] = False   # the noise
        if "slots" in spec.axes:
            changed[at(spec, "slots", sc.num_slots)] = False
        assert not changed.any(), spec
    assert kv_leaves >= 2   # the target's pool and the head's

    def scratch_kv(state):
        return [x[at(spec, "kv_slots", scratch_slots)] for x, spec in zip(jax.tree_util.tree_leaves(state), spec_leaves)
                if "kv_slots" in spec.axes]
    unread = scratch_kv(after)
    assert all(np.array_equal(x, y) for x, y in zip(scratch_kv(run(perturbed(before, 30))), unread))   # deterministic
    assert all(np.array_equal(x, y) for x, y in zip(scratch_kv(run(perturbed(before, 20))), unread))   # not read
    assert not all(np.array_equal(x, y) for x, y in zip(scratch_kv(run(perturbed(before, 3))), unread))  # row 0's
    assert not all(np.array_equal(x, y) for x, y in zip(scratch_kv(run(perturbed(before, 8))), unread))  # row 1's


def test_a_programs_first_runs_are_not_timed(target, monkeypatch):  # noqa: F811
    """The chooser gets no time for a step whose program ran fewer than UNTIMED_RUNS times before it (on a GPU its
    command buffer is recorded then: a pair measured once on such a run kept a slow time while unpicked), and the
    time of every later run."""
    from jaxspec.decode.runner import UNTIMED_RUNS
    from jaxspec.sched.pricing import StepPricing
    monkeypatch.setattr(StepPricing, "time_steps", lambda self: None)   # no blank runs: the live steps are the first
    llm = spec_llm(target, "ngram", warmup=True)
    assert llm.engine.wait_compiled(300)   # the narrower widths compile in the background
    runner, chooser = llm.engine.runner, llm.engine.k_chooser
    keys, timed = [], []   # the program of each step, by step number; (step, seconds) as the chooser got them
    run_packed, observe = runner.run_packed, chooser.observe

    def spy_run(T, variant, buf, grammar_table=None):
        keys.append(runner.program_key(T, variant, grammar_table))
        return run_packed(T, variant, buf, grammar_table)

    def spy_observe(step, rows, time):
        timed.append((step, time[2]))
        observe(step, rows, time)
    monkeypatch.setattr(runner, "run_packed", spy_run)
    monkeypatch.setattr(chooser, "observe", spy_observe)
    llm.generate([prompt_of(6, 20), prompt_of(11, 21)], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert llm.stats()["recompiles"] == 0
    first = [(step, keys[:step].count(keys[step]) < UNTIMED_RUNS) for step, _ in timed]
    assert [seconds is None for _, seconds in timed] == [f for _, f in first]
    assert sum(f for _, f in first) >= 4 and sum(not f for _, f in first) >= 10


def test_greedy_warmup_compiles_every_width_of_the_greedy_step_only(target, monkeypatch):  # noqa: F811
    """engine.warmup(sample=False) (a greedy benchmark's warm-up): every draft width of the greedy step, for every
    bucket, and no sampling step; sample=None: both."""
    llm = spec_llm(target, "ngram", warmup=False)
    engine, compiled = llm.engine, []
    monkeypatch.setattr(engine.runner, "warmup", lambda variants, tier=None: compiled.append(list(variants)))
    # the narrower widths go to the background compiles: counted with the warm-up's
    monkeypatch.setattr(engine.runner.programs, "start_background",
                        lambda jobs: compiled[-1].extend(key[1] for key, _ in jobs))
    monkeypatch.setattr(engine.runner, "warm_transfers", lambda variants: None)
    engine.warmup(sample=False)
    engine.warmup()
    greedy, both = compiled
    assert sorted(v.drafts if v.drafts is not None else K for v in greedy) == list(range(K + 1))
    assert not any(v.sample for v in greedy)
    assert {(v.drafts, v.sample) for v in both} == {(v.drafts, s) for v in greedy for s in (False, True)}
