"""Sliding-window attention (issue #39). Mistral's: a tiny random Mistral checkpoint written by transformers with an
8-key window, shorter than the prompts, so that the window bites. Logits (the dense path) within the float32
rounding of transformers', and far from them without the window; greedy generations through the engine, with the
reference attention and with the Pallas kernels (fused and unfused, interpreted), equal to transformers' `generate`
across the window's edge, with chunked prefill; draft-model speculation gives the same tokens (its drafts accepted
and rejected)."""
import dataclasses

import numpy as np
import pytest

from conftest import TINY_DIMS, hf_greedy, optimize_steps, perturbed, randomize_
from jaxspec import LLM, SamplingParams
from jaxspec.models import load_model

WINDOW = 8
TOLERANCE = 2e-6   # test_model_parity's for the tiny checkpoints
PROMPTS = [[(7 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate((5, 13, 21))]
MAX_TOKENS = 12
ENGINE = dict(dtype="float32", max_num_seqs=3, max_model_len=64, max_num_batched_tokens=16, block_size=4,
              warmup=False)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    import torch
    import transformers
    path = tmp_path_factory.mktemp("mistral")
    config = transformers.MistralConfig(**TINY_DIMS, sliding_window=WINDOW)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, 0)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def hf_model(mistral_dir):
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(str(mistral_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy_refs(hf_model):
    return [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]


def relative_error(got, ref) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def test_logits_match_transformers_and_the_window_bites(mistral_dir, hf_model):
    import torch
    model = load_model(mistral_dir, dtype="float32")
    assert model.config.sliding_window == WINDOW
    token_ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 30)
    with torch.no_grad():
        ref = hf_model(torch.tensor([token_ids.tolist()])).logits[0].double().numpy()
    assert relative_error(model.score(token_ids), ref) <= TOLERANCE
    whole = dataclasses.replace(model, config=dataclasses.replace(model.config, sliding_window=None))
    assert relative_error(whole.score(token_ids), ref) > 1e-2


def generate(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("attention,fused", [("reference", True), ("pallas", True), ("pallas", False)])
def test_greedy_generation_equals_transformers(mistral_dir, greedy_refs, monkeypatch, attention, fused):
    monkeypatch.setenv("JAXSPEC_FUSED_ATTENTION", "1" if fused else "0")
    llm = LLM(str(mistral_dir), **ENGINE, attention=attention)
    ops = llm.engine.runner.ops
    assert ops.attention == attention and ops.fused_attention == fused
    if attention == "pallas" and fused:   # the interpreted fused kernel runs ~1 s a step without LLVM's optimisation
        optimize_steps(llm)
    assert generate(llm) == greedy_refs


def test_draft_model_speculation_is_lossless(mistral_dir, greedy_refs):
    """A perturbed copy of the model drafts k = 3 (its attention windowed too); the verify step's windowed
    attention over the drafts gives the greedy tokens."""
    target = load_model(mistral_dir, dtype="float32")
    spec = {"method": "draft_model", "model": perturbed(target, 0.05, 1), "num_speculative_tokens": 3}
    llm = LLM(target, **ENGINE, speculative_config=spec)
    assert generate(llm) == greedy_refs
    s = llm.stats()["spec"]
    assert 0 < s["accepted_tokens"] < s["draft_tokens"]   # drafts accepted and rejected: both paths ran


LONG = 36   # generated tokens: the window moves well past the prompts


@pytest.fixture(scope="module")
def long_refs(hf_model):
    return [hf_greedy(hf_model, p, LONG) for p in PROMPTS]


def test_blocks_behind_the_window_are_released_and_tokens_stay_exact(mistral_dir, long_refs):
    """Each request holds a bounded number of blocks however long it runs (those wholly before the window of the
    next position it computes go back to the pool), with a pool too small for the three requests' whole
    contexts: requests are preempted and recomputed (chunked prefill across the window's edge), and every token
    is still transformers'."""
    from jaxspec.sched.block_manager import RELEASED
    bs = ENGINE["block_size"]
    llm = LLM(str(mistral_dir), **{**ENGINE, "num_kv_blocks": 8, "max_num_batched_tokens": 8})
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in PROMPTS]
    most_held = 0
    while engine.has_unfinished():
        engine.step()
        held = [sum(b != RELEASED for b in r.block_ids) for r in reqs
                if r.status.value == "running" and not r.prefilling and r.output_token_ids]
        most_held = max([most_held, *held])
    engine.flush()
    assert [r.output_token_ids for r in reqs] == long_refs
    # decoding: the window's keys, this step's token and one planned ahead, rounded out to whole blocks
    assert most_held <= -(-(WINDOW + 2) // bs) + 1, most_held
    assert llm.stats()["num_preemptions"] > 0
    # without the release a request would hold a block per bs positions: (21 + 36) / 4 of them
    assert max(len(r.prompt_token_ids) + LONG for r in reqs) // bs > 2 * most_held


# ---- Qwen2's window on some layers only ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen2_mixed(tmp_path_factory):
    """A tiny Qwen2 with use_sliding_window: layer 0 attends over the whole context, layer 1 within 8 keys."""
    import torch
    import transformers
    path = tmp_path_factory.mktemp("qwen2_mixed")
    config = transformers.Qwen2Config(**TINY_DIMS, use_sliding_window=True, sliding_window=WINDOW,
                                      max_window_layers=1, tie_word_embeddings=False)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, 1)
    model.save_pretrained(str(path), safe_serialization=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        refs = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
        token_ids = np.random.default_rng(1).integers(0, 256, 30)
        logits = hf(torch.tensor([token_ids.tolist()])).logits[0].double().numpy()
    return path, refs, token_ids, logits


def test_a_window_on_some_layers_matches_transformers(qwen2_mixed, monkeypatch):
    """Each layer its own window (scanned layers pick it by index, unrolled ones see it static): logits, and greedy
    tokens with the reference attention and the fused Pallas kernel. A layer reads the whole context: no block is
    released."""
    path, refs, token_ids, logits = qwen2_mixed
    model = load_model(path, dtype="float32")
    assert model.config.sliding_window == WINDOW and model.config.sliding_layers == (False, True)
    assert relative_error(model.score(token_ids), logits) <= TOLERANCE
    every = dataclasses.replace(model, config=dataclasses.replace(model.config, sliding_layers=None))
    assert relative_error(every.score(token_ids), logits) > 1e-2      # which layers have it matters
    for attention, unroll in (("reference", True), ("pallas", False)):
        llm = LLM(model, **ENGINE, attention=attention, unroll_layers=unroll)
        if attention == "pallas":   # the interpreted fused kernel runs ~1 s a step without LLVM's optimisation
            optimize_steps(llm)
        assert llm.engine.scheduler.kv_window is None
        assert generate(llm) == refs, attention


def test_ngram_speculation_is_lossless_and_async_equals_sync(mistral_dir, greedy_refs):
    """n-gram drafts (matched down to one token: a random model repeats little) verified through the windowed
    attention: plain greedy's tokens, and the same drafted and accepted counts async and sync."""
    target = load_model(mistral_dir, dtype="float32")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    counts = {}
    for mode in (True, False):
        llm = LLM(target, **ENGINE, speculative_config=spec, async_scheduling=mode)
        assert generate(llm) == greedy_refs
        s = llm.stats()["spec"]
        counts[mode] = (s["draft_tokens"], s["accepted_tokens"])
    assert counts[True] == counts[False] and counts[True][0] > 0, counts
