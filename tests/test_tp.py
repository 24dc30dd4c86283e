"""Tensor parallelism on four CPU devices (conftest sets XLA_FLAGS): the model split over 2 or 4 devices by its
declared logical axes emits the tokens and logprobs of one device, for each layout, under chunked prefill,
preemption, speculation (every method), async and sync; and in the configuration a GPU runs (unrolled layers, the
Pallas attention interpreted) it emits the dense reference's tokens and logprobs (the hybrids: tests/test_hybrid.py)."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import optimize_steps, random_model
from test_prefix_cache import RECURRING
from reference import Greedy
from test_spec import (ENGINE, METHODS, drafters, logprob_errors, make_llm, prompt_of, references, target)  # noqa: F401
from test_spec_layouts import GPU_LAYOUT, LOGPROB_TOLERANCE, check_greedy_speculation
from jaxspec import LLM, SamplingParams

# chunked prefill, and a pool too small for the batch: preemption; each engine compiles only the step variant
# it runs (greedy with logprobs, not the warm-up's greedy and sampling variants)
TP_ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=48, max_num_batched_tokens=8, block_size=4,
                 num_kv_blocks=14, warmup=False)
PROMPTS = [prompt_of(n, 200 + n) for n in (3, 11, 17, 22)]
TP_ENGINE_SPEC = dict(TP_ENGINE, num_kv_blocks=32)


def tokens_and_logprobs(llm, prompts, **params):
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, logprobs=2, **params), use_tqdm=False)
    return [o.token_ids for o in outs], np.array([e["logprob"] for o in outs for e in o.logprobs])


def test_four_devices_are_there():
    assert len(jax.devices()) == 4


@pytest.mark.parametrize("arch,sizes", [("llama", (2, 4)), ("qwen2", (4,)), ("qwen3", (2,))])
def test_tensor_parallel_matches_one_device(arch, sizes):
    model = random_model(3, arch=arch, num_heads=8, num_kv_heads=4, hidden_size=64, intermediate_size=128)
    ids, lps = {}, {}
    for tp in (1, *sizes):
        llm = LLM(model, **TP_ENGINE, tensor_parallel_size=tp)
        ids[tp], lps[tp] = tokens_and_logprobs(llm, PROMPTS, temperature=0)
        assert llm.stats()["num_preemptions"] > 0
        if tp > 1:
            qkv = llm.engine.runner.params["layers"]["attention"]["qkv_proj"]
            assert qkv.sharding.spec == P(None, "tp") and len(qkv.sharding.device_set) == tp
            assert llm.engine.runner.state.layers["attention"]["k"].sharding.spec == P(None, None, "tp")
    for tp in sizes:
        assert ids[tp] == ids[1], f"tp={tp}"
        assert np.abs(lps[tp] - lps[1]).max() < 1e-4


def test_the_roofline_counts_the_bytes_each_device_reads(target):
    """The bench's HBM bound under tensor parallelism is one device's bytes: its shard of each split weight and
    every replicated weight whole (the embedding, norms; attention too when KV heads are fewer than devices), and
    its share of the KV pool; at TP = 1 all of it."""
    from jaxspec.bench.measure import decode_bytes
    model = random_model(3, num_heads=8, num_kv_heads=4, hidden_size=64, intermediate_size=128)
    for tp in (1, 2, 4):
        runner = LLM(model, **TP_ENGINE, tensor_parallel_size=tp).engine.runner
        leaves = jax.tree_util.tree_leaves(runner.params)
        split = {id(a) for a in leaves if any(axis is not None for axis in getattr(a.sharding, "spec", ()))}
        assert bool(split) == (tp > 1) and len(split) < len(leaves)   # the embedding and norms stay whole
        want = sum(a.nbytes // (tp if id(a) in split else 1) for a in leaves)
        assert runner.weight_bytes(per_device=True) == want and runner.weight_bytes() == sum(a.nbytes for a in leaves)
        assert runner.kv_bytes_per_token(per_device=True) * tp == runner.kv_bytes_per_token()   # 4 KV heads split
        engine = type("E", (), {"runner": runner})
        assert decode_bytes(engine, 2, 10) == want + 20 * runner.kv_bytes_per_token() // tp


def test_kv_heads_fewer_than_devices_are_replicated(target):
    """The test target has 2 KV heads: with 4 devices attention stays whole on each, the MLP is split."""
    with pytest.warns(UserWarning, match="attention .* is replicated"):
        llm = LLM(target, **TP_ENGINE, tensor_parallel_size=4)
    params = llm.engine.runner.params["layers"]["attention"]
    assert params["qkv_proj"].sharding.spec == P() and params["gate_up_proj"].sharding.spec == P(None, "tp")
    one = LLM(target, **TP_ENGINE)
    assert tokens_and_logprobs(llm, PROMPTS, temperature=0)[0] == tokens_and_logprobs(one, PROMPTS, temperature=0)[0]


@pytest.mark.parametrize("method", METHODS)
def test_speculation_under_tensor_parallelism(target, drafters, method):
    """Two devices (the target's 2 KV heads split), each drafter split as the target is (a draft model's default,
    whole on each device, is tested below): seeded sampling with argmax drafts and greedy decoding give one
    device's tokens and draft counts (async; sync too for two of the methods)."""
    params = [SamplingParams(temperature=0.7, seed=50 + i, max_tokens=16) for i in range(2)] + [
        SamplingParams(temperature=0, max_tokens=16)]
    prompts = [prompt_of(n, 210 + n) for n in (4, 9)] + [RECURRING]
    results = {}
    configs = [(1, True), (2, True)] + ([(2, False)] if method in ("draft_model", "eagle3") else [])
    for tp, mode in configs:
        llm = make_llm(target, drafters, method, 3, async_scheduling=mode, num_kv_blocks=32,
                       tensor_parallel_size=tp, draft_tensor_parallel_size=tp if method == "draft_model" else None)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[tp, mode] = [(o.token_ids, o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"])
                             for o in outs]
        assert llm.stats()["spec"]["accepted_tokens"] > 0 and llm.stats()["num_preemptions"] == 0
    assert all(r == results[1, True] for r in results.values())


def all_reduces(llm) -> int:
    """The all-reduces in the compiled greedy step of the engine's smallest token bucket."""
    import re
    runner = llm.engine.runner
    text = runner.lower(runner.token_buckets[0]).compile().as_text()
    return len(re.findall(r"= \S+ all-reduce(?:-start)?\(", text))


def test_a_draft_model_whole_on_each_device(target, drafters):
    """draft_tensor_parallel_size=1 over two devices: the draft model's params and KV pages whole on each device,
    its forwards free of collectives (the step has the all-reduces of an n-gram step, whose drafter has no model,
    and fewer than with the draft model split), and one device's tokens and draft counts, greedy and seeded
    sampling with sampled drafts (their q kept whole on each device for the rejection sampler), with drafts
    accepted (async and sync)."""
    params = [SamplingParams(temperature=0.7, seed=60 + i, max_tokens=16) for i in range(2)] + [
        SamplingParams(temperature=0, max_tokens=16)]
    prompts = [prompt_of(n, 230 + n) for n in (5, 10)] + [RECURRING]
    whole = dict(speculative_config=dict(method="draft_model", model=drafters["draft_model"], num_speculative_tokens=3,
                                         draft_sampling="sample", draft_tensor_parallel_size=1))
    results = {}
    for tp, mode in [(1, True), (2, True), (2, False)]:
        llm = LLM(target, **TP_ENGINE_SPEC, tensor_parallel_size=tp, async_scheduling=mode, **whole)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[tp, mode] = [(o.token_ids, o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"])
                             for o in outs]
        assert llm.stats()["spec"]["accepted_tokens"] > 0
    assert results[2, True] == results[1, True] and results[2, False] == results[1, True]
    runner = llm.engine.runner
    assert all(a.sharding.is_fully_replicated for a in jax.tree_util.tree_leaves(runner.drafter_params))
    assert all(a.sharding.is_fully_replicated for a in jax.tree_util.tree_leaves(runner.state.drafter))
    assert runner.params["layers"]["attention"]["gate_up_proj"].sharding.spec == P(None, "tp")   # the target split
    split = LLM(target, **TP_ENGINE_SPEC, tensor_parallel_size=2, speculative_config=dict(
        method="draft_model", model=drafters["draft_model"], num_speculative_tokens=3, draft_tensor_parallel_size=2))
    ngram = LLM(target, **TP_ENGINE_SPEC, tensor_parallel_size=2, speculative_config=dict(
        method="ngram", num_speculative_tokens=3))
    assert all_reduces(llm) == all_reduces(ngram) < all_reduces(split)


def test_a_whole_draft_model_in_the_gpu_layout(target, drafters, references):
    """draft_tensor_parallel_size=1 over two devices in the GPU layout: inside shard_map the draft model runs one
    device's kernels (the fused Pallas attention, interpreted) on its whole KV pages; check_greedy_speculation's
    tokens, logprobs and draft counts against the dense references (the perturbed draft model is accepted at the
    first position on these prompts, never at the second: the counts per position are checked all the same)."""
    whole = LLM(target, **{**ENGINE, "num_kv_blocks": 40, "warmup": False}, tensor_parallel_size=2, **GPU_LAYOUT,
                speculative_config=dict(method="draft_model", model=drafters["draft_model"],
                                        num_speculative_tokens=3, draft_tensor_parallel_size=1))
    assert whole.engine.runner.drafter.whole_on_each_device and whole.engine.runner.ops.attention == "pallas"
    check_greedy_speculation(optimize_steps(whole), references, "draft_model", accepted_positions=1)


def test_draft_placements_that_are_not_offered_are_refused(target, drafters):
    for spec, tp, message in [
            (dict(method="draft_model", draft_tensor_parallel_size=3), 2,
             r"draft_tensor_parallel_size=3 is invalid with tensor_parallel_size=2; give 1 .* or 2 \(split"),
            (dict(method="eagle3", draft_tensor_parallel_size=1), 2,
             r"draft_tensor_parallel_size=1 is implemented for method 'draft_model' only, not 'eagle3'"),
            (dict(method="draft_model", draft_tensor_parallel_size=0), 1,
             r"draft_tensor_parallel_size=0 is invalid; give 1")]:
        with pytest.raises(ValueError, match=message):
            LLM(target, **TP_ENGINE_SPEC, tensor_parallel_size=tp,
                speculative_config=dict(spec, model=drafters[spec["method"]], num_speculative_tokens=3))


def test_unset_a_small_draft_model_runs_whole_a_large_one_and_a_head_split(target, drafters, monkeypatch):
    """draft_tensor_parallel_size unset: a draft model whole on each device where its added weight reads cost less
    than the all-reduces it saves (Llama-3.2-1B's 2.5 GB and 16 layers at TP=2 and 4, and the test's tiny one), split
    where they cost more (Llama-3.1-8B's 16 GB and 32 layers as a draft); an EAGLE-3 head split as the target is (it
    reads the target's split embedding and lm_head)."""
    from jaxspec.decode.drafters import placement
    assert placement.draft_runs_whole(2_471_000_000, 16, 2) and placement.draft_runs_whole(2_471_000_000, 16, 4)
    assert not placement.draft_runs_whole(16_060_000_000, 32, 2)
    for method, whole in [("draft_model", True), ("eagle3", False)]:
        llm = LLM(target, **TP_ENGINE_SPEC, tensor_parallel_size=2, speculative_config=dict(
            method=method, model=drafters[method], num_speculative_tokens=3))
        assert getattr(llm.engine.runner.drafter, "whole_on_each_device", False) is whole, method
    monkeypatch.setattr(placement, "DRAFT_HBM_BYTES_PER_S", 1.0)   # weight reads that cost more than any all-reduce
    llm = LLM(target, **TP_ENGINE_SPEC, tensor_parallel_size=2, speculative_config=dict(
        method="draft_model", model=drafters["draft_model"], num_speculative_tokens=3))
    assert not llm.engine.runner.drafter.whole_on_each_device


def test_invalid_tensor_parallel_sizes_are_refused(target):
    for size, why in [(8, "only 4 device"), (3, "the MLP width"), (True, "the MLP width")]:
        with pytest.raises(ValueError, match=rf"tensor_parallel_size={size!r} is invalid \({why}.*valid sizes here: \[1, 2, 4\]"):
            LLM(target, **TP_ENGINE, tensor_parallel_size=size)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 is invalid; it must be >= 1"):   # the engine's own check
        LLM(target, **TP_ENGINE, tensor_parallel_size=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_gpu_layout_under_tensor_parallelism_matches_the_dense_reference(tp):
    """A dense model whose 4 KV heads split over 2 and 4 devices, in the GPU layout, through chunked prefill and
    preemption: its greedy tokens are the dense reference's (tests/reference.py, one device, no paging) and its
    logprobs (the token's and the top 2) the reference's log-softmax. Every layer attends to its own KV pool: a
    layer reading another's changes the tokens."""
    model = random_model(3, num_heads=8, num_kv_heads=4, hidden_size=64, intermediate_size=128)
    llm = LLM(model, **TP_ENGINE, tensor_parallel_size=tp, **GPU_LAYOUT)
    ops = llm.engine.runner.ops
    assert ops.unroll and ops.attention == "pallas" and ops.tp.size == tp and ops.tp.shard_attention
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, logprobs=2), use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    reference = Greedy(model.hf_tensors, model.config)
    assert [o.token_ids for o in outs] == [reference.next_tokens(p, 12) for p in PROMPTS]
    assert logprob_errors(PROMPTS, outs, reference.log_probs).max() < LOGPROB_TOLERANCE


@pytest.mark.parametrize("tp", [2, 4])
def test_eagle3_in_the_gpu_layout_under_tensor_parallelism(target, drafters, references, tp):
    """EAGLE-3 drafting for the speculation tests' target in the GPU layout, split over 2 devices (its 2 KV heads
    one per device, the Pallas attention under shard_map) and over 4 (attention replicated, as for Qwen2.5-1.5B's
    2 KV heads; the MLP and vocabulary split): test_spec.check_greedy_speculation's tokens, logprobs and counts,
    against the dense references."""
    if tp == 4:
        with pytest.warns(UserWarning, match="attention .* is replicated"):
            llm = make_llm(target, drafters, "eagle3", 3, num_kv_blocks=40, tensor_parallel_size=tp, **GPU_LAYOUT)
    else:
        llm = make_llm(target, drafters, "eagle3", 3, num_kv_blocks=40, tensor_parallel_size=tp, **GPU_LAYOUT)
    ops = llm.engine.runner.ops
    assert ops.unroll and ops.attention == "pallas" and ops.tp.size == tp and ops.tp.shard_attention == (tp == 2)
    check_greedy_speculation(llm, references, "eagle3")
