"""A parallel draft model (SpeculativeConfig(method="draft_model", parallel_drafting=True), PARD's recipe): drafts
2..k come from one forward over k-1 mask tokens after the row's last token, against a dense reference, and
speculation with it stays lossless (greedy and seeded sampling). Its cases in the speculation matrices
(draft_model_parallel: conftest.spec_config) check the sampled distribution, async against sync, preemption and
prefix caching."""
import numpy as np
import pytest

from jaxspec import LLM, SamplingParams

VOCAB = 128   # conftest.SPEC_VOCAB
MASK = 127    # any id of the vocabulary serves an untrained model: what matters here is where it goes
K = 4
ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=48, max_num_batched_tokens=8, block_size=4,
              num_kv_blocks=24, warmup=False)


@pytest.fixture(scope="module")
def draft(spec_target):
    """A perturbed copy of the target (it agrees with the target often but not always), as conftest's spec_drafters
    makes for draft_model, without fitting that fixture's EAGLE heads."""
    from conftest import random_model
    return random_model(1, vocab_size=VOCAB, num_layers=4, base=spec_target, noise=0.15)


def prompt_of(length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB - 1, length)]


def parallel_llm(target, draft, **options):
    spec = {**dict(method="draft_model", model=draft, num_speculative_tokens=K, parallel_drafting=True,
                   mask_token_id=MASK), **options.pop("spec", {})}
    return LLM(target, **{**ENGINE, **options}, speculative_config=spec)


def test_drafts_after_every_step_are_the_mask_forward_of_a_dense_reference(spec_target, draft):
    """Sync, two requests (one prefilled in chunks): after every step the drafts each holds are the draft model's
    argmax after its sequence (the first) and after its sequence then j mask tokens (draft j + 1), through partial
    acceptance. A mask token at the wrong position, or KV a later step does not rewrite, changes some draft."""
    from reference import Greedy, check_drafts_every_step
    greedy = Greedy(draft.hf_tensors, draft.config)

    def propose(seq):
        return [int(np.argmax(greedy.logits(list(seq) + [MASK] * j)[-1])) for j in range(K)]
    llm = parallel_llm(spec_target, draft, async_scheduling=False)
    engine = llm.engine
    reqs = [engine.add_request(prompt_of(n, seed), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
            for seed, n in ((3, 3), (4, 13))]
    assert check_drafts_every_step(engine, reqs, propose, K) >= 10
    spec = llm.stats()["spec"]
    assert 0 < spec["accepted_tokens"] < spec["draft_tokens"]


def test_draft_distributions_through_prefix_cache_hits_and_preemption_are_the_dense_references(spec_target, draft):
    """Sync, four greedy requests after a shared prefix of two blocks, in a pool too small for them: they start from
    the cached blocks, are preempted and come back through their own cached blocks (prompt and outputs). With
    sampled drafts the device keeps each draft's distribution, for a greedy request the log-softmax of the draft
    model's logits: after every step each request that emitted holds the dense reference's drafts and
    distributions (float32, to 4e-5 nats), one causal forward over its sequence then K-1 mask tokens. The mask
    tokens' KV is written in the look-ahead past the row's tokens; left where a later step reads it (a block cached
    or re-prefilled with mask KV in it, an accepted draft's position the next pass does not rewrite), or a mask
    token at another position, moves these logits, which the drafts alone often miss (the tiny models' next token
    depends mostly on the current one, here a mask token). The mask token is the speculation matrices'
    (conftest.SPEC_MASK_TOKEN), under which some second drafts are accepted."""
    from conftest import SPEC_MASK_TOKEN
    from reference import Greedy
    greedy = Greedy(draft.hf_tensors, draft.config)
    shared = prompt_of(2 * ENGINE["block_size"], 19)   # (prompts whose greedy runs accept second drafts)
    prompts = [shared + prompt_of(n, 20 + i) for i, n in enumerate([1, 4, 6, 9])]
    llm = parallel_llm(spec_target, draft, async_scheduling=False, num_kv_blocks=14,
                       spec={"mask_token_id": SPEC_MASK_TOKEN, "draft_sampling": "sample"})
    engine = llm.engine
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)) for p in prompts]
    checked, worst = 0, 0.0
    while not all(r.finished for r in reqs):
        emitted = [len(r.output_token_ids) for r in reqs]
        engine.step()
        for r, before in zip(reqs, emitted):
            if len(r.output_token_ids) > before and not r.finished:
                seq = r.prompt_token_ids + r.output_token_ids
                logits = greedy.logits(seq + [SPEC_MASK_TOKEN] * (K - 1))[len(seq) - 1:]      # [K, V] causal
                state = engine.runner.state
                held = np.asarray(state.drafts)[r.slot, :K].tolist()
                assert held == np.argmax(logits, axis=-1).tolist(), f"request {r.request_id} after {len(seq)} tokens"
                q = np.asarray(state.drafter["draft_logprobs"])[r.slot, :K]
                worst = max(worst, float(np.abs(q - log_softmax(logits)).max()))
                checked += 1
    assert worst <= 4e-5, worst
    stats = llm.stats()
    assert checked >= 20 and stats["num_preemptions"] > 0, (checked, stats["num_preemptions"])
    assert stats["prefix_cache"]["hit_tokens"] > len(prompts) * len(shared) - len(shared), stats["prefix_cache"]
    spec = stats["spec"]
    assert spec["per_position_acceptance"][1] > 0 and spec["accepted_tokens"] < spec["draft_tokens"], spec


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_parallel_drafting_is_lossless_greedy_and_seeded(spec_target, draft):
    """Async. Greedy: the target's own continuation; seeded sampling (argmax drafts): the tokens plain decoding
    draws with the same seeds; with sampled drafts (their distributions kept for the rejection sampler) greedy rows
    still give the target's continuation."""
    from reference import Greedy
    prompts = [prompt_of(n, seed) for seed, n in enumerate([3, 7, 12])]
    target = Greedy(spec_target.hf_tensors, spec_target.config)
    llm = parallel_llm(spec_target, draft)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == [target.next_tokens(p, 12) for p in prompts]
    spec = llm.stats()["spec"]
    assert spec["accepted_tokens"] > 0 and spec["method"] == "draft_model" and spec["parallel_drafting"]
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)
    plain = LLM(spec_target, **ENGINE).generate(prompts, params, use_tqdm=False)
    drafted = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.token_ids) for o in drafted] == [list(o.token_ids) for o in plain]
    sampled = parallel_llm(spec_target, draft, spec={"draft_sampling": "sample"})
    (out,) = sampled.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)
    assert list(out.token_ids) == target.next_tokens(prompts[0], 12)


def test_the_mask_token_comes_from_the_draft_models_config_or_is_refused(spec_target, tmp_path):
    """`pard_token` in the draft model's config.json is the mask token; a draft model without one (and no
    mask_token_id) is refused naming the field, as is a mask token outside the vocabulary or another method."""
    from jaxspec.decode.drafters.draft_model import pard_token
    from jaxspec.spec import SpeculativeConfig
    (tmp_path / "config.json").write_text('{"pard_token": 42}')
    assert pard_token(str(tmp_path)) == 42
    with pytest.raises(ValueError, match="pard_token"):
        pard_token(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="outside the draft model's vocabulary"):
        parallel_llm(spec_target, spec_target, spec={"mask_token_id": VOCAB})
    with pytest.raises(ValueError, match="parallel_drafting and mask_token_id are draft_model's"):
        SpeculativeConfig(method="ngram", parallel_drafting=True)
