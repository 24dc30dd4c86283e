"""Long prompts on the CPU path (issue #62): a 3,000-token prompt prefilled in chunks decodes as transformers'
forward says (tokens and logprobs), also from a prefix cached by another request and under n-gram and draft-model
speculation; and a step's attention memory grows with its tokens times a tile of keys, not with max_model_len."""
import numpy as np
import pytest

from conftest import perturbed
from jaxspec import LLM, SamplingParams

MAX_LEN = 4096
DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=MAX_LEN, rope_theta=10000.0)
ENGINE = dict(dtype="float32", max_num_seqs=2, max_model_len=MAX_LEN, max_num_batched_tokens=512, warmup=False)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """(a tiny random Llama of 4,096 positions, as jaxspec loads it, as transformers runs it)."""
    import torch
    import transformers

    from conftest import randomize_
    from jaxspec.models.loader import load_model
    path = tmp_path_factory.mktemp("long") / "llama"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**DIMS), dtype=torch.float32)
    randomize_(hf, seed=5)
    hf.save_pretrained(str(path), safe_serialization=True)
    return load_model(str(path), dtype="float32"), hf.eval()


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, DIMS["vocab_size"], length).tolist()


def transformers_logprobs(hf, ids) -> np.ndarray:
    """transformers' log-softmax after each token of `ids` (one forward over the whole sequence) [len, V]. (Its own
    generate, decoding with its KV cache, left this forward's argmax at a 3,000-token context here: at the fourth
    token it emitted the second most likely, 0.029 behind. The forward and jaxspec agree.)"""
    import torch
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1).numpy()


@pytest.fixture(scope="module")
def prompts():
    """Two 3,000-token prompts that share their first 2,000 tokens."""
    shared = prompt(2000, 1)
    return [shared + prompt(1000, 2), shared + prompt(1000, 3)]


@pytest.fixture(scope="module")
def plain_outputs(long_model, prompts):
    """jaxspec's greedy continuations (16 tokens) with their logprobs, the second request's first 2,000 tokens from
    the prefix cache the first filled."""
    model, _ = long_model
    llm = LLM(model, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    return outs, llm.stats()


def greedy_and_logprobs(out) -> tuple[list[int], list[float]]:
    return list(out.token_ids), [lp["logprob"] for lp in out.logprobs]


def test_a_long_prompt_in_chunks_decodes_as_transformers_from_a_cached_prefix(long_model, prompts, plain_outputs):
    """Over 3,000 tokens of context, prefilled in 512-token chunks (the second request's first 2,000 tokens from the
    prefix cache the first filled), every emitted token is transformers' argmax and its logprob transformers'."""
    _, hf = long_model
    outs, stats = plain_outputs
    assert stats["prefix_cache"]["hit_tokens"] >= 1984   # the shared prefix's full blocks
    for p, out in zip(prompts, outs):
        tokens, logprobs = greedy_and_logprobs(out)
        ref = transformers_logprobs(hf, p + tokens)[len(p) - 1:-1]                 # row j: token j's distribution
        assert len(tokens) == 16
        np.testing.assert_array_less(ref.max(-1) - ref[np.arange(16), tokens], 1e-5)   # each the argmax
        np.testing.assert_allclose(logprobs, ref[np.arange(16), tokens], atol=2e-5)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_speculation_over_a_long_context_is_lossless(long_model, prompts, plain_outputs, method, tmp_path):
    """n-gram lookup, a draft model and an EAGLE-3 head (random, its config's max_position_embeddings 2,048: drafting
    at positions past it) over the same prompts: plain decoding's tokens and logprobs."""
    model, _ = long_model
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = perturbed(model, 0.05, seed=9)
    if method == "eagle3":
        from eagle_heads import write_eagle3_head
        spec["model"] = str(write_eagle3_head(tmp_path / "eagle3", model.config, seed=3))
    llm = LLM(model, **ENGINE, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True),
                        use_tqdm=False)
    for out, plain in zip(outs, plain_outputs[0]):
        tokens, logprobs = greedy_and_logprobs(out)
        want_tokens, want_logprobs = greedy_and_logprobs(plain)
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
    assert llm.stats()["spec"]["drafts"] > 0


def test_a_steps_attention_memory_grows_with_its_tokens_not_max_model_len(long_model):
    """The compiled prefill step of 4,096 tokens at a 4,096-token context: its temporary memory stays within a few
    tiles of keys per token (ops.REFERENCE_TILE_KEYS), where gathering every token's whole context would take
    T x max_model_len x KV heads x head_dim x 4 bytes for each of k and v (the 3,800-token prompt of issue #62 asked
    for 26 GB on SmolLM2)."""
    from jaxspec.nn.ops import REFERENCE_TILE_KEYS
    model, _ = long_model
    llm = LLM(model, **{**ENGINE, "max_num_batched_tokens": MAX_LEN})
    runner = llm.engine.runner
    T = runner.token_buckets[-1]
    assert T == MAX_LEN
    temp = runner.lower(T).compile().memory_analysis().temp_size_in_bytes
    c = model.config
    per_key = T * c.num_kv_heads * c.head_dim * 4           # one key (or value) of every token's context, f32
    whole_context = 2 * per_key * MAX_LEN
    assert temp < 8 * per_key * REFERENCE_TILE_KEYS < whole_context / 2, (temp, whole_context)


def test_the_kv_cache_reports_what_it_holds(long_model, capsys):
    """Engine.kv_cache(): its tokens, bytes (k and v of every layer, float32) and the requests of max_model_len tokens
    that fit at once, as the bench report prints them."""
    from jaxspec.bench.report import print_report
    llm = LLM(long_model[0], **{**ENGINE, "max_model_len": 1000}, num_kv_blocks=150, block_size=16)
    kv = llm.engine.kv_cache()
    per_token = 2 * DIMS["num_hidden_layers"] * DIMS["num_key_value_heads"] * (64 // 4) * 4
    assert kv == {"blocks": 150, "tokens": 2400, "max_model_len": 1000, "dtype": "float32", "bytes": 2400 * per_token,
                  "max_model_len_requests": 150 / 63}
    report = {"label": "x", "requests": 1, "duration_s": 1.0, "input_tokens": 1, "output_tokens": 1,
              "request_throughput": 1.0, "output_throughput": 1.0, "total_throughput": 1.0, "kv_cache": kv,
              **{name: {"mean": 1.0, "median": 1.0, "p99": 1.0} for name in ("ttft_ms", "tpot_ms", "itl_ms")}}
    print_report(report)
    out = capsys.readouterr().out
    assert "KV cache (tokens)" in out and "2,400" in out and "Requests of 1,000 tokens at once" in out and "2.38" in out


def test_an_fp8_kv_cache_holds_four_times_the_tokens_and_stays_close(long_model, prompts, plain_outputs):
    """kv_cache_dtype="fp8" (e4m3, per-tensor scale 1): the pool of the same blocks takes a quarter of the float32
    cache's bytes; over a 3,000-token prompt the emitted tokens' logprobs stay within 0.05 of the float32 cache's and
    the greedy tokens agree; n-gram speculation over the fp8 cache is lossless against plain decoding over it."""
    model, _ = long_model
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
    llm = LLM(model, **ENGINE, kv_cache_dtype="fp8")
    kv = llm.engine.kv_cache()
    assert kv["dtype"] == "float8_e4m3fn" and kv["bytes"] * 4 == plain_outputs[1]["kv_cache"]["bytes"]
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[:1]]   # (one prompt: the suite's time)
    gaps = []
    for out, plain in zip(outs, plain_outputs[0]):
        tokens, logprobs = greedy_and_logprobs(out)
        want_tokens, want_logprobs = greedy_and_logprobs(plain)
        assert tokens == want_tokens
        gaps.append(np.abs(np.asarray(logprobs) - want_logprobs).max())
    print("fp8 KV cache: largest logprob gap", max(gaps))
    assert 0 < max(gaps) < 0.05
    spec = LLM(model, **ENGINE, kv_cache_dtype="fp8", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    (out,) = spec.generate(prompts[:1], params, use_tqdm=False)   # (one prompt: the n-gram drafts over it suffice)
    assert greedy_and_logprobs(out)[0] == greedy_and_logprobs(outs[0])[0]
    np.testing.assert_allclose(greedy_and_logprobs(out)[1], greedy_and_logprobs(outs[0])[1], atol=1e-5)
    assert spec.stats()["spec"]["drafts"] > 0
