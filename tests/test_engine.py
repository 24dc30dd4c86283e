"""Engine tests: parity with transformers, async == sync, preemption and chunked prefill, stops, aborts,
sampling statistics, logprobs, host-buffer hazards, input validation.

CPU, float32 (but one test: the bfloat16 engine in the GPU layout). LLM instances are module-scoped and shared:
each distinct engine config compiles its step once per token bucket (a few seconds each), so the configs here are
few and the budgets small.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import jax
import numpy as np
import pytest

from conftest import optimize_steps
import jaxspec
import jaxspec.decode.inputs as inputs_mod
from jaxspec import LLM, SamplingParams
from jaxspec.decode.step import StepVariant
from jaxspec.nn import Decoder
from jaxspec.sched.warmup import WARM_VARIANTS

MAX_MODEL_LEN = 128                      # the tiny model's max_position_embeddings
TINY = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)

# A batch of mixed prompt lengths and max_tokens (two prompts longer than the chunked engine's budget
# of 8 several times over; one request of max_tokens=1).
_rng = np.random.default_rng(1234)
LENS = [3, 9, 17, 26, 40, 5, 33, 12]
MAXT = [4, 12, 7, 20, 9, 16, 1, 24]
PROMPTS = [_rng.integers(3, 256, n).tolist() for n in LENS]


def greedy_params(maxt=MAXT, **kw):
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, **kw) for m in maxt]


def penalized_params(maxt=MAXT):
    return seeded_params(maxt, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)


def seeded_params(maxt=MAXT, **kw):
    return [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=1000 + i, max_tokens=m,
                           ignore_eos=True, **kw) for i, m in enumerate(maxt)]


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert_idle(llm)
    return [o.token_ids for o in outs]


def assert_idle(llm):
    """No request left, every KV block and every slot back in the pool."""
    e = llm.engine
    assert not e.has_unfinished()
    assert e.blocks.num_free_blocks == e.blocks.num_blocks
    assert sorted(e.blocks.free_slots) == list(range(e.config.max_num_seqs))


_scorers = {}


def ref_logits(model, ids, length=MAX_MODEL_LEN):
    """Dense causal logits [len(ids), V] (jitted once per model; zero padding after the sequence)."""
    fn = _scorers.get(id(model))
    if fn is None:
        fn = _scorers[id(model)] = functools.partial(Decoder(model.config).score)
    padded = np.zeros(length, np.int32)
    padded[:len(ids)] = ids
    return np.asarray(fn(model.params, padded), np.float64)[:len(ids)]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def chi2_threshold(df: int, z: float = 3.72) -> float:
    """Upper quantile of chi-square(df) at p ~ 1e-4 (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(samples, probs):
    """Pearson chi-square of integer samples against `probs`; categories with expected count < 5 are
    pooled into one bin. Returns (statistic, degrees of freedom)."""
    n = len(samples)
    observed = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    expected = n * probs
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:   # the pooled bin itself too small: merge it into the smallest big one
        assert obs[-1] <= 3 * max(exp[-1], 1), "tokens the distribution (almost) never draws were drawn"
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


# ---- engines ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_llama_model):
    return tiny_llama_model


@pytest.fixture(scope="module")
def llm_async(tiny):
    return LLM(tiny, async_scheduling=True, **TINY)


@pytest.fixture(scope="module")
def llm_sync(tiny):
    return LLM(tiny, async_scheduling=False, **TINY)


@pytest.fixture(scope="module")
def llm_preempt(tiny):
    """6 blocks x 16 tokens for 8 requests that together need far more: preemption is forced."""
    return LLM(tiny, async_scheduling=True, max_num_seqs=8, max_num_batched_tokens=32,
               max_model_len=MAX_MODEL_LEN, num_kv_blocks=6, warmup=False)   # compiles the variants it runs


@pytest.fixture(scope="module")
def llm_preempt_sync(tiny):
    """The same tiny pool, scheduled synchronously."""
    return LLM(tiny, async_scheduling=False, max_num_seqs=8, max_num_batched_tokens=32,
               max_model_len=MAX_MODEL_LEN, num_kv_blocks=6, warmup=False)


@pytest.fixture(scope="module")
def llm_chunked(tiny):
    """A token budget of 8: every prompt longer than 8 is prefilled in chunks."""
    return LLM(tiny, async_scheduling=True, **{**TINY, "max_num_batched_tokens": 8}, warmup=False)


@pytest.fixture(scope="module")
def reference(llm_sync):
    """Each request of the mixed batch alone on the sync engine (budget 64 > every prompt: no chunking,
    no preemption): {"greedy": [...], "seeded": [...]}."""
    return {kind: [run(llm_sync, [p], [sp])[0] for p, sp in zip(PROMPTS, make())]
            for kind, make in (("greedy", greedy_params), ("seeded", seeded_params),
                               ("penalized", penalized_params))}


# ---- async == sync == alone; preemption and chunked prefill change nothing -------------------------
@pytest.mark.parametrize("kind", ["greedy", "seeded", "penalized"])
def test_async_equals_sync(llm_async, llm_sync, reference, kind):
    make = {"greedy": greedy_params, "seeded": seeded_params, "penalized": penalized_params}[kind]
    out_async = run(llm_async, PROMPTS, make())
    out_sync = run(llm_sync, PROMPTS, make())
    assert [len(t) for t in out_async] == MAXT
    assert out_async == out_sync
    assert out_sync == reference[kind]   # batching does not change a request's tokens


def test_seeded_sampling_is_random_and_seed_dependent(llm_async, reference):
    assert reference["seeded"] != reference["greedy"]
    other = run(llm_async, PROMPTS, [SamplingParams(**{**vars(sp), "seed": sp.seed + 7}) for sp in seeded_params()])
    assert other != reference["seeded"]
    assert run(llm_async, PROMPTS, seeded_params()) == reference["seeded"]   # same seeds, same tokens


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("kind", ["greedy", "seeded", "penalized"])
def test_forced_preemption_same_tokens(llm_preempt, llm_preempt_sync, reference, kind, mode):
    llm = llm_preempt if mode == "async" else llm_preempt_sync
    before = llm.stats()["num_preemptions"]
    make = {"greedy": greedy_params, "seeded": seeded_params, "penalized": penalized_params}[kind]
    outs = llm.generate(PROMPTS, make(), use_tqdm=False)
    assert llm.stats()["num_preemptions"] > before
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert [o.token_ids for o in outs] == reference[kind]
    assert all(o.finish_reason == "length" for o in outs)
    assert_idle(llm)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_chunked_prefill_same_tokens(llm_chunked, reference, kind):
    assert max(LENS) > 4 * llm_chunked.engine.config.max_num_batched_tokens
    make = greedy_params if kind == "greedy" else seeded_params
    assert run(llm_chunked, PROMPTS, make()) == reference[kind]


def test_recompiles_zero_after_several_buckets(llm_async, monkeypatch):
    used = []
    runner = llm_async.engine.runner
    orig = runner.bucket_for
    monkeypatch.setattr(runner, "bucket_for", lambda n: used.append(orig(n)) or used[-1])
    compiled = runner.num_compiled()
    for params in (greedy_params(), [SamplingParams(temperature=0.7, seed=i, max_tokens=m) for i, m in enumerate(MAXT)]):
        run(llm_async, [[t ^ 1 for t in p] for p in PROMPTS], params)   # prompts the prefix cache has not seen
    assert len(set(used)) >= 3, used
    assert runner.num_compiled() == compiled   # greedy and plain sampling: warmed at start-up
    assert llm_async.stats()["compiled_steps"] >= len(WARM_VARIANTS) * len(llm_async.stats()["token_buckets"])


def test_step_variant_follows_the_sampling_params():
    """The host picks the compiled step from the rows' SamplingParams; the device never branches."""
    def of(*params):
        return StepVariant.union([StepVariant.of(p) for p in params])
    assert of(SamplingParams(temperature=0), SamplingParams(temperature=1e-6)) == StepVariant()
    assert of(SamplingParams(temperature=0), SamplingParams(temperature=0.5)) == StepVariant(sample=True)
    assert of(SamplingParams(temperature=0, top_k=5)) == StepVariant()    # top-k of a greedy row: no sort
    assert of(SamplingParams(temperature=1, top_p=0.9)) == StepVariant(sample=True, top_k_top_p=True)
    assert of(SamplingParams(temperature=0, presence_penalty=0.1)) == StepVariant(penalties=True)
    assert of(SamplingParams(temperature=0, logprobs=2)) == StepVariant(logprobs=True)
    assert of() == StepVariant()


# ---- hazard 1: host staging buffers --------------------------------------------------------------
def aligned_copy(a, align=64):
    raw = np.empty(a.nbytes + align, np.uint8)
    off = -raw.ctypes.data % align
    out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % align == 0
    return out


HOST_STAGING = ("token_matrix", "int_rows", "float_rows", "stop_ids", "block_tables")


@pytest.mark.parametrize("which", ["async", "sync"])
def test_scribbling_host_buffers_after_dispatch(llm_async, llm_sync, reference, monkeypatch, which):
    """The host may reuse every array it staged a step's inputs in as soon as the step is dispatched."""
    llm = llm_async if which == "async" else llm_sync
    runner = llm.engine.runner
    orig_new, orig_run = runner.new_inputs, runner.run

    def aligned_inputs(num_tokens):
        # 64-byte aligned, like a pinned staging pool: the CPU backend may then alias them zero-copy
        inputs = orig_new(num_tokens)
        for name in HOST_STAGING:
            setattr(inputs, name, aligned_copy(getattr(inputs, name)))
        return inputs

    rng = np.random.default_rng(0)
    scribbled = [0]
    busy_x = jax.numpy.ones((768, 768), jax.numpy.float32)
    busy = jax.jit(lambda x: (x @ x @ x @ x).sum())
    busy(busy_x).block_until_ready()

    def scribbling_run(inputs, variant, *rest):
        # Keep the device busy (as step N is when the host dispatches step N+1 on a real accelerator),
        # so this step's input transfer queues behind it and a lazy transfer would see the garbage.
        busy(busy_x)
        out = orig_run(inputs, variant, *rest)
        for name in HOST_STAGING:
            buf = getattr(inputs, name)
            buf[...] = rng.integers(-3, 300, buf.shape) if buf.dtype.kind == "i" else rng.normal(size=buf.shape)
            scribbled[0] += 1
        return out

    monkeypatch.setattr(runner, "new_inputs", aligned_inputs)
    monkeypatch.setattr(runner, "run", scribbling_run)
    params = [g if i % 2 else s for i, (g, s) in enumerate(zip(greedy_params(), seeded_params()))]
    got = run(llm, PROMPTS, params)
    assert scribbled[0] > 0
    want = [reference["greedy"][i] if i % 2 else reference["seeded"][i] for i in range(len(PROMPTS))]
    assert got == want


# ---- lengths and stops -------------------------------------------------------------------------------
def test_max_tokens_exact_async(llm_async):
    prompt = PROMPTS[2]
    outs = llm_async.generate([prompt] * 4, greedy_params([1, 2, 3, 5]), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [1, 2, 3, 5]
    assert all(o.finish_reason == "length" for o in outs)
    longest = outs[-1].token_ids
    assert all(o.token_ids == longest[:len(o.token_ids)] for o in outs)
    for m in (1, 2, 3, 5):   # alone too (no batch neighbours to keep the loop going)
        (o,) = llm_async.generate([prompt], greedy_params([m]), use_tqdm=False)
        assert o.token_ids == longest[:m] and o.finish_reason == "length"
    assert_idle(llm_async)


def test_near_max_model_len_finishes_with_length(llm_async, llm_sync):
    prompt = (PROMPTS[4] * 4)[:MAX_MODEL_LEN - 2]
    for llm in (llm_async, llm_sync):
        (o,) = llm.generate([prompt], greedy_params([16]), use_tqdm=False)
        assert len(o.token_ids) == 2 and o.finish_reason == "length"
        assert_idle(llm)


def test_stop_token_ids_and_min_tokens(llm_async, llm_sync):
    prompt = PROMPTS[3]
    (free,) = run(llm_sync, [prompt], greedy_params([12]))
    t = free[0]
    for llm in (llm_async, llm_sync):
        (o,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[t]),
                            use_tqdm=False)
        assert o.token_ids == [t] and o.finish_reason == "stop"
        (o,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[t],
                                                     min_tokens=3), use_tqdm=False)
        assert len(o.token_ids) >= 3
        assert t not in o.token_ids[:3]                 # masked until min_tokens
        if o.finish_reason == "stop":
            assert o.token_ids[-1] == t and t not in o.token_ids[:-1]
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == 12
    # a stop id later in the output truncates right after it
    later = free[5]
    first = free.index(later)
    (o,) = llm_async.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[later],
                                                       ignore_eos=True), use_tqdm=False)
    assert o.token_ids == free[:first + 1] and o.finish_reason == "stop"
    assert_idle(llm_async)


def test_eos_is_masked_until_min_tokens(tiny, llm_sync):
    """A model whose EOS is the token greedy decoding emits first: without min_tokens the request stops at
    once; with min_tokens=3 the EOS cannot be drawn before the third token, and the output follows the
    masked distribution (the argmax among the other tokens)."""
    prompt = PROMPTS[3]
    (free,) = run(llm_sync, [prompt], greedy_params([1]))
    eos = free[0]
    model = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, eos_token_ids=(eos,)))
    llm = LLM(model, async_scheduling=True, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN,
              num_kv_blocks=16, warmup=False)   # compiles the greedy steps it runs only
    (o,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert o.token_ids == [eos] and o.finish_reason == "stop"
    (o,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, min_tokens=3), use_tqdm=False)
    assert eos not in o.token_ids[:3]
    logits = ref_logits(tiny, prompt)[-1]
    logits[eos] = -np.inf
    assert o.token_ids[0] == int(np.argmax(logits))
    assert_idle(llm)


# ---- aborts ------------------------------------------------------------------------------------------
def test_abort_mid_flight_frees_blocks_and_slot(llm_async, reference):
    llm, e = llm_async, llm_async.engine
    params = greedy_params([20] * 4)
    alone = [run(llm, [p], [sp])[0] for p, sp in zip(PROMPTS[:4], params)]
    reqs = [e.add_request(p, sp) for p, sp in zip(PROMPTS[:4], params)]
    # one more than there are slots, aborted while still waiting
    extra = [e.add_request(PROMPTS[0], greedy_params([20])[0]) for _ in range(5)]
    victim = reqs[1]
    while len(victim.output_token_ids) < 2:
        e.step()
    slot, nblocks, free_before = victim.slot, len(victim.block_ids), e.blocks.num_free_blocks
    assert slot is not None and nblocks > 0
    e.abort(victim.request_id)
    assert victim.finished and victim.finish_reason == "abort"
    assert slot in e.blocks.free_slots and victim.slot is None
    assert e.blocks.num_free_blocks == free_before + nblocks
    waiting = [r for r in extra if r.slot is None]
    assert waiting, "expected a request still waiting for a slot"
    e.abort(waiting[-1].request_id)
    n_victim = len(victim.output_token_ids)
    while e.has_unfinished():
        e.step()
    assert len(victim.output_token_ids) == n_victim   # its in-flight result was dropped
    assert waiting[-1].output_token_ids == [] and waiting[-1].finish_reason == "abort"
    for r, want in zip(reqs, alone):
        if r is not victim:
            assert r.output_token_ids == want and r.finish_reason == "length"
    for r in extra:
        if r is not waiting[-1]:
            assert r.output_token_ids == alone[0] and r.finish_reason == "length"
    assert_idle(llm)


def test_stream_close_aborts_and_engine_recovers(llm_async, reference, monkeypatch):
    streamed, submit = [], llm_async.engine.submit
    monkeypatch.setattr(llm_async.engine, "submit", lambda group: (submit(group), streamed.extend(group)))
    gen = llm_async.stream(PROMPTS[:3], greedy_params([20] * 3))
    first = next(gen)
    assert not first.finished and len(first.token_ids) >= 1
    gen.close()
    assert first.request_id in {r.request_id for r in streamed} and len(streamed) == 3
    assert all(r.finished and r.finish_reason == "abort" for r in streamed)
    assert not llm_async.engine.requests          # finished requests are forgotten
    assert_idle(llm_async)
    assert run(llm_async, PROMPTS, greedy_params()) == reference["greedy"]


def test_stream_deltas_concatenate(llm_async, reference):
    params = seeded_params()
    toks = {}
    finals = {}
    for d in llm_async.stream(PROMPTS, params):
        toks.setdefault(d.request_id, []).extend(d.token_ids)
        assert d.request_id not in finals, "a delta after the final one"
        if d.finished:
            finals[d.request_id] = d.finish_reason
    assert len(finals) == len(PROMPTS) and set(finals.values()) == {"length"}
    ordered = [toks[k] for k in sorted(toks, key=int)]
    assert ordered == reference["seeded"]
    assert_idle(llm_async)


def bounded_steps(monkeypatch, engine, limit: int = 300):
    """Fail (rather than hang) if the engine loop runs more than `limit` steps."""
    orig, count = engine.step, [0]

    def step():
        count[0] += 1
        assert count[0] <= limit, "the engine loop is spinning: a stream never ended"
        return orig()
    monkeypatch.setattr(engine, "step", step)


def test_stream_ends_when_another_call_finishes_its_request(llm_async, reference, monkeypatch):
    bounded_steps(monkeypatch, llm_async.engine)
    gen = llm_async.stream([PROMPTS[1]], greedy_params([MAXT[1]]))
    first = next(gen)
    # another call drives the loop past the streamed request's end
    other = run(llm_async, [PROMPTS[3]], greedy_params([MAXT[3]]))
    assert other == [reference["greedy"][3]]
    rest = list(gen)
    assert rest and rest[-1].finished and rest[-1].finish_reason == "length"
    assert first.token_ids + sum((d.token_ids for d in rest), []) == reference["greedy"][1]
    assert_idle(llm_async)


def test_stream_ends_when_its_request_is_aborted(llm_async, monkeypatch):
    bounded_steps(monkeypatch, llm_async.engine)
    gen = llm_async.stream([PROMPTS[1]], greedy_params([40]))
    first = next(gen)
    llm_async.abort(first.request_id)
    rest = list(gen)
    assert len(rest) == 1 and rest[0].finished and rest[0].finish_reason == "abort"
    assert_idle(llm_async)


def test_abandoned_stream_blocks_nobody(llm_async, reference, monkeypatch):
    """A live stream nobody reads: other calls finish their own requests (advancing the stream's request
    as part of the batch), and the stream, resumed later, yields the rest of its request and ends."""
    bounded_steps(monkeypatch, llm_async.engine)
    gen = llm_async.stream([PROMPTS[2]], greedy_params([MAXT[2]]))
    first = next(gen)
    steps = llm_async.engine.counters["steps"]
    (o,) = llm_async.generate([PROMPTS[0]], greedy_params([MAXT[0]]), use_tqdm=False)
    assert o.token_ids == reference["greedy"][0]
    assert llm_async.engine.counters["steps"] - steps <= MAXT[0] + 2   # nobody waited for the stream
    (o,) = llm_async.generate([PROMPTS[5]], greedy_params([MAXT[5]]), use_tqdm=False)
    assert o.token_ids == reference["greedy"][5]
    rest = list(gen)
    assert first.token_ids + sum((d.token_ids for d in rest), []) == reference["greedy"][2]
    assert rest[-1].finish_reason == "length"
    assert_idle(llm_async)


# ---- penalties ---------------------------------------------------------------------------------------
PEN = dict(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.4)


def host_penalized_greedy(model, prompt, n, repetition_penalty, presence_penalty, frequency_penalty):
    V = model.config.vocab_size
    seq, out = list(prompt), []
    for _ in range(n):
        logits = ref_logits(model, seq)[-1]
        counts = np.bincount(np.asarray(out, np.int64), minlength=V)
        seen = counts > 0
        seen[prompt] = True
        logits = np.where(seen, np.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty),
                          logits)
        logits = logits - frequency_penalty * counts - presence_penalty * (counts > 0)
        tok = int(np.argmax(logits))
        out.append(tok)
        seq.append(tok)
    return out


def test_penalties(llm_async, llm_sync, tiny, reference):
    # a repetitive prompt: penalties have something to push against
    prompts = [PROMPTS[i] * 2 for i in range(4)] + PROMPTS[4:]
    maxt = [16, 12, 20, 20, 9, 16, 3, 24]
    g = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **PEN) for m in maxt]
    s = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=m, ignore_eos=True, **PEN) for i, m in enumerate(maxt)]
    plain_g = run(llm_sync, prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in maxt])
    plain_s = run(llm_sync, prompts, [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=m, ignore_eos=True)
                                      for i, m in enumerate(maxt)])
    # mixed in one batch with unpenalized rows too
    mixed = [g[i] if i % 2 else SamplingParams(temperature=0, max_tokens=maxt[i], ignore_eos=True)
             for i in range(len(prompts))]
    for params, plain in ((g, plain_g), (s, plain_s), (mixed, None)):
        a = run(llm_async, prompts, params)
        b = run(llm_sync, prompts, params)
        assert a == b
        if plain is not None:
            assert sum(x != y for x, y in zip(a, plain)) >= 2, "penalties changed nothing"
        if params is g:
            for p, m, got in zip(prompts[:4], maxt, a):
                assert got == host_penalized_greedy(tiny, p, m, **PEN)
        if params is mixed:
            for i in range(0, len(prompts), 2):
                assert a[i] == plain_g[i]   # unpenalized neighbours are untouched


# ---- sampling statistics, logprobs -------------------------------------------------------------------
STAT_PROMPT = [17, 99, 4, 230, 61, 8]


def _one_token_samples(llm, n, **kw):
    params = [SamplingParams(max_tokens=1, ignore_eos=True, seed=s, **kw) for s in range(n)]
    outs = llm.generate([STAT_PROMPT] * n, params, use_tqdm=False)
    assert all(len(o.token_ids) == 1 for o in outs)
    return np.array([o.token_ids[0] for o in outs])


def test_sampling_follows_model_distribution(llm_async, tiny):
    T = 0.7
    logits = ref_logits(tiny, STAT_PROMPT)[-1] / T
    p = np.exp(log_softmax(logits))
    assert p.max() < 0.5 and (p > 0.01).sum() >= 10, "the test needs a spread-out distribution"
    x = _one_token_samples(llm_async, 3000, temperature=T)
    stat, df = chi2_stat(x, p)
    assert stat < chi2_threshold(df), (stat, df)
    # a wrong temperature is detected: the test has power
    p_wrong = np.exp(log_softmax(logits * T / 1.0))
    stat_w, df_w = chi2_stat(x, p_wrong)
    assert stat_w > chi2_threshold(df_w), (stat_w, df_w)


def test_top_k_and_min_p_masking(llm_async, tiny):
    T = 1.0
    logits = ref_logits(tiny, STAT_PROMPT)[-1] / T
    order = np.argsort(-logits)
    top5 = order[:5]
    x = _one_token_samples(llm_async, 1500, temperature=T, top_k=5)
    assert set(x.tolist()) <= set(top5.tolist())
    masked = np.full_like(logits, -np.inf)
    masked[top5] = logits[top5]
    p = np.exp(log_softmax(masked))
    stat, df = chi2_stat(x, p)
    assert df >= 3 and stat < chi2_threshold(df), (stat, df)
    # min_p: only tokens with p >= min_p * p_max
    full = np.exp(log_softmax(logits))
    x = _one_token_samples(llm_async, 600, temperature=T, min_p=0.3)
    keep = np.nonzero(full >= 0.3 * full.max())[0]
    assert set(x.tolist()) <= set(keep.tolist()) and len(set(x.tolist())) >= min(2, len(keep))


LOGPROB_TOLERANCE = 1.5e-5   # nats, float32 engine against the dense scoring pass (measured: <= 1.7e-6)


def test_logprobs_match_reference(llm_async, tiny):
    """Greedy and seeded requests at temperature 0.7 (where the raw log-softmax and the distribution sampled from
    differ): each token's logprob and the top 3 are the raw log-softmax of the model at its position."""
    prompts = PROMPTS[:3]
    for params in ([SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)] * 3,
                   [SamplingParams(temperature=0.7, seed=i, max_tokens=6, ignore_eos=True, logprobs=3)
                    for i in range(3)]):
        # one neighbour without logprobs in the same batch
        outs = llm_async.generate(prompts + [PROMPTS[5]],
                                  params + [SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)
        assert outs[-1].logprobs is None
        for prompt, o in zip(prompts, outs):
            assert len(o.logprobs) == len(o.token_ids) == 6
            lp = log_softmax(ref_logits(tiny, prompt + o.token_ids[:-1])[len(prompt) - 1:])
            for j, (tok, entry) in enumerate(zip(o.token_ids, o.logprobs)):
                if params[0].temperature == 0:
                    assert tok == int(np.argmax(lp[j]))
                assert entry["logprob"] == pytest.approx(lp[j, tok], abs=LOGPROB_TOLERANCE)
                top = entry["top"]
                assert len(top) == 3
                assert [t for t, _ in top] == np.argsort(-lp[j])[:3].tolist()
                assert [v for _, v in top] == pytest.approx(np.sort(lp[j])[::-1][:3].tolist(), abs=LOGPROB_TOLERANCE)


# ---- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf), ("top_p", 0.0), ("top_p", 1.5),
    ("top_p", math.nan), ("top_k", 0), ("top_k", -2), ("top_k", 2**32 + 1), ("top_k", 2.5), ("min_p", -0.1),
    ("min_p", 1.5), ("max_tokens", 0), ("max_tokens", 2**31), ("max_tokens", 2.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.nan),
    ("presence_penalty", math.nan), ("frequency_penalty", math.inf), ("logprobs", 21), ("seed", 2**64),
    ("seed", -2**63 - 1), ("seed", 1.5), ("stop_token_ids", [2**40]), ("stop_token_ids", [-1]),
    ("stop_token_ids", list(range(9))), ("stop", [""]), ("min_tokens", -1)])
def test_bad_sampling_params(llm_async, reference, field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    sp = SamplingParams(temperature=0, max_tokens=MAXT[1], ignore_eos=True)
    setattr(sp, field, value)       # mutated after construction: the engine checks again
    _assert_rejected(llm_async, [PROMPTS[0], PROMPTS[1]], [greedy_params()[0], sp], field, reference)


@pytest.mark.parametrize("case", ["empty", "too_long", "too_long_min_tokens", "oov_high", "oov_negative",
                                  "stop_id_oov", "float_token"])
def test_bad_prompts(llm_async, reference, case):
    prompt, sp, match = {
        "empty": ([], greedy_params([4])[0], "empty"),
        "stop_id_oov": ([5, 6], SamplingParams(max_tokens=4, stop_token_ids=[256]), "stop_token_ids"),
        "float_token": ([5, 6.0], greedy_params([4])[0], "float 6.0"),
        "too_long": ([5] * MAX_MODEL_LEN, greedy_params([4])[0], "max_model_len"),
        "too_long_min_tokens": ([5] * (MAX_MODEL_LEN - 8), SamplingParams(min_tokens=10, max_tokens=10),
                                "max_model_len"),
        "oov_high": ([5, 6, 256], greedy_params([4])[0], "vocabulary"),
        "oov_negative": ([-1, 5], greedy_params([4])[0], "vocabulary"),
    }[case]
    _assert_rejected(llm_async, [PROMPTS[0], prompt], [greedy_params()[0], sp], match, reference)


def test_seed_and_top_k_use_their_whole_range(llm_async):
    """64-bit seeds: the high word changes the draws; a top_k beyond the vocabulary is no truncation (not an
    int32 overflow)."""
    def tokens(**kw):
        return run(llm_async, [STAT_PROMPT], [SamplingParams(temperature=1.0, max_tokens=8, **kw)])[0]
    assert tokens(seed=5) != tokens(seed=5 + 2**32)
    assert tokens(seed=2**64 - 1) == tokens(seed=-1)          # the same 64 bits
    assert tokens(seed=7, top_k=2**31 - 1) == tokens(seed=7) != tokens(seed=7, top_k=1)


def test_max_model_len_beyond_the_model_is_refused(tiny):
    with pytest.raises(ValueError, match=r"max_model_len=1000000000.*max_position_embeddings=128"):
        LLM(tiny, max_model_len=10**9, warmup=False)


def test_unknown_logprobs_mode_is_refused(tiny):
    """vLLM's logprobs modes that return logits, and anything else, are refused naming the value and the valid
    ones; the serve command line passes its --logprobs-mode through."""
    from jaxspec.cli import add_engine_args, engine_kwargs
    for mode in ("raw_logits", "processed_logits", "raw", None):
        valid = "'raw_logprobs' or 'processed_logprobs'"
        with pytest.raises(ValueError, match=rf"logprobs_mode={mode!r} is invalid.*{valid}"):
            LLM(tiny, logprobs_mode=mode, warmup=False)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["logprobs_mode"] == "raw_logprobs"
    args = parser.parse_args(["--logprobs-mode", "processed_logprobs"])
    assert engine_kwargs(args)["logprobs_mode"] == "processed_logprobs"


def test_request_that_never_fits_the_pool(llm_preempt, reference):
    pool = llm_preempt.engine.blocks.num_blocks * llm_preempt.engine.blocks.block_size   # 96 tokens
    # the prompt alone is bigger than the pool
    _assert_rejected(llm_preempt, [PROMPTS[0], [7] * (pool + 4)], [greedy_params()[0]] * 2, "KV pool", reference)
    # the prompt fits, but prompt + max_tokens never can (it would fail mid-run, after other work)
    _assert_rejected(llm_preempt, [PROMPTS[0], [7] * 60], [greedy_params()[0], greedy_params([60])[0]],
                     "KV pool", reference)


def _assert_rejected(llm, prompts, params, match, reference):
    e = llm.engine
    steps, n_req = e.counters["steps"], len(e.requests)
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    # nothing was queued (not even the good request before it) and nothing ran
    assert e.counters["steps"] == steps and len(e.requests) == n_req
    assert not e.scheduler.waiting and not e.scheduler.running
    with pytest.raises(ValueError, match=match):
        e.add_request(prompts[-1], params[-1])
    assert len(e.requests) == n_req
    # the engine still works
    assert run(llm, [PROMPTS[0], PROMPTS[3]], greedy_params([MAXT[0], MAXT[3]])) == \
        [reference["greedy"][0], reference["greedy"][3]]


# ---- SmolLM2: transformers parity, stop strings, chat, stream, generate() ---------------------------
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
         "The three primary colors are", "In 1969, astronauts", "import numpy as np\n",
         "My favourite food is", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def smol(smollm2_model):
    return optimize_steps(LLM(smollm2_model, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256,
                              warmup=False))   # greedy only: the sampling steps are never compiled


def test_greedy_matches_transformers(smol, smollm2_hf_model):
    """8 prompts x 32 greedy tokens, batched together, equal transformers' greedy `generate` token for token."""
    import torch
    tok = smol.tokenizer
    ids = [tok.encode(t, add_special_tokens=True) for t in TEXTS]
    L = min(map(len, ids))
    assert L >= 4 and len(ids) >= 8
    ids = [x[:L] for x in ids]   # equal lengths: one unpadded transformers batch
    outs = smol.generate(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert_idle(smol)
    assert all(len(o.token_ids) == 32 and o.finish_reason == "length" for o in outs)
    eos = smollm2_hf_model.generation_config.eos_token_id
    smollm2_hf_model.generation_config.eos_token_id = None     # ignore_eos on both sides: 32 tokens each
    try:
        with torch.no_grad():
            gen = smollm2_hf_model.generate(torch.tensor(ids), attention_mask=torch.ones(len(ids), L, dtype=torch.long),
                                            max_new_tokens=32, do_sample=False, pad_token_id=0)
    finally:
        smollm2_hf_model.generation_config.eos_token_id = eos
    assert gen[:, L:].tolist() == [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def smol_greedy(smol):
    (o,) = smol.generate([TEXTS[2]], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert len(o.token_ids) >= 20 and len(o.text) > 40
    return o


def test_stop_string_truncates_exactly(smol, smol_greedy):
    text = smol_greedy.text
    stop = text[25:30]
    k = text.find(stop)
    assert stop.strip() and 0 < k
    (o,) = smol.generate([TEXTS[2]], SamplingParams(temperature=0, max_tokens=40, stop=[stop, "\x00never"]),
                         use_tqdm=False)
    assert o.finish_reason == "stop"
    assert o.text == text[:k]
    assert o.token_ids == smol_greedy.token_ids[:len(o.token_ids)]
    assert stop in smol.tokenizer.decode(o.token_ids)          # stopped at the token completing the string
    assert stop not in smol.tokenizer.decode(o.token_ids[:-1])
    assert_idle(smol)
    # streamed: the deltas never include text that a later stop string match takes back
    deltas = list(smol.stream([TEXTS[2]], SamplingParams(temperature=0, max_tokens=40, stop=[stop])))
    assert "".join(d.text for d in deltas) == text[:k]
    assert sum((d.token_ids for d in deltas), []) == o.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert_idle(smol)


def test_stop_token_id_text(smol, smol_greedy):
    ids = smol_greedy.token_ids
    t = ids[6]
    i = ids.index(t)
    (o,) = smol.generate([TEXTS[2]], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[t]),
                         use_tqdm=False)
    assert o.finish_reason == "stop" and o.token_ids == ids[:i + 1]
    assert o.text == smol.tokenizer.decode(ids[:i])   # the stop token is not in the text


def test_stream_text_and_ids(smol):
    sp = [SamplingParams(temperature=0, max_tokens=n) for n in (12, 20)]
    final = smol.generate(TEXTS[:2], sp, use_tqdm=False)
    text, ids = {}, {}
    for d in smol.stream(TEXTS[:2], sp):
        text[d.request_id] = text.get(d.request_id, "") + d.text
        ids.setdefault(d.request_id, []).extend(d.token_ids)
    keys = sorted(text, key=int)
    assert [text[k] for k in keys] == [o.text for o in final]
    assert [ids[k] for k in keys] == [o.token_ids for o in final]
    assert_idle(smol)


@pytest.mark.parametrize("prompts,match", [
    (5, "prompts is int 5"), ([["a", 3]], "prompt 0 has str 'a'"), ([3.5], "prompt 0 is float 3.5"),
    ("lone \ud800 surrogate", "lone surrogate"), ([[{"role": "user"}]], "message 0 .*'content'"),
    ([[{"role": "user", "content": "fine"}, {"content": "no role"}]], "message 1"),
    ([[{"role": "user", "content": "\udfff"}]], "lone surrogate")])
def test_malformed_prompts_are_named(smol, prompts, match):
    e = smol.engine
    n_req = len(e.requests)
    with pytest.raises(ValueError, match=match):
        smol.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(e.requests) == n_req and not e.scheduler.waiting


def test_chat_and_generate_function(smol):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    (c,) = smol.chat(msgs, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    prompt_text = smol.apply_chat_template(msgs)
    assert "assistant" in prompt_text and "What is the capital of France?" in prompt_text
    assert c.prompt == prompt_text and c.token_ids and c.text.strip()
    (g,) = smol.generate([{"prompt_token_ids": smol.tokenizer.encode(prompt_text)}],
                         SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert g.token_ids == c.token_ids
    assert "Paris" in c.text
    (r,) = jaxspec.generate("The capital of France is", model=smol, max_tokens=4, temperature=0, use_tqdm=False)
    assert len(r.token_ids) == 4 and r.finish_reason == "length"
    assert r.token_ids == smol.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4),
                                        use_tqdm=False)[0].token_ids
    assert_idle(smol)


# ---- the GPU defaults: bfloat16 weights and activations, unrolled layers, the Pallas attention -----------------

def test_bfloat16_engine_in_the_gpu_layout_agrees_with_float32():
    """The engine as a GPU runs it (bfloat16 weights, activations and KV; unrolled layers; the fused Pallas
    attention, interpreted), greedy with logprobs, against the float32 dense reference (tests/reference.py) over
    the engine's own outputs.

    The margin: bf16 keeps 8 significant bits, so every weight, activation and cached key rounds by up to 2^-9 of
    itself, and through the layers each log-probability moves by some e. e is measured here as the largest
    |log-softmax| difference between the same reference run in bfloat16 and in float32, over every position and
    token of the sequences (~0.07 nats). The engine's bf16 logprobs must move no more than that (~0.03 measured: its
    norms, softmaxes and logits are f32); then a top-2 gap moves by at most 2e, and wherever float32's gap between
    its two best tokens exceeds 2e the engine's greedy token is float32's argmax. Most positions are checked."""
    from conftest import random_model
    from reference import Greedy
    model = random_model(21)
    bf16 = dataclasses.replace(model, params=jax.tree_util.tree_map(lambda x: x.astype(jax.numpy.bfloat16),
                                                                    model.params))
    prompts = [np.random.default_rng(s).integers(0, 128, n).tolist() for s, n in enumerate([5, 3, 9, 6])]
    # the steps compiled with LLVM's optimisation (conftest.optimize_steps): the interpreted Pallas attention runs
    # far slower unoptimised than it compiles
    llm = optimize_steps(LLM(bf16, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=8, block_size=4,
                             warmup=False, attention="pallas", unroll_layers=True))
    assert llm.engine.runner.state.layers["attention"]["k"].dtype == jax.numpy.bfloat16
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    f32 = Greedy(model.hf_tensors, model.config)
    b16 = Greedy({k: jax.numpy.asarray(v, jax.numpy.bfloat16) for k, v in model.hf_tensors.items()}, model.config)
    e, engine_error, gaps, agree = 0.0, 0.0, [], []
    for prompt, out in zip(prompts, outs):
        seq = prompt + out.token_ids
        ref32, ref16 = f32.log_probs(seq)[len(prompt) - 1:-1], b16.log_probs(seq)[len(prompt) - 1:-1]
        e = max(e, np.abs(ref16 - ref32).max())
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            engine_error = max(engine_error, abs(entry["logprob"] - ref32[j, token]),
                               *(abs(lp - ref32[j, t]) for t, lp in entry["top"]))
            top2 = np.sort(ref32[j])[-2:]
            gaps.append(top2[1] - top2[0])
            agree.append(token == np.argmax(ref32[j]))
    assert 0 < engine_error <= e, (engine_error, e)
    checked = np.asarray(gaps) > 2 * e
    assert checked.sum() >= 0.6 * len(gaps), (checked.sum(), len(gaps), e)
    assert np.asarray(agree)[checked].all(), np.nonzero(checked & ~np.asarray(agree))
