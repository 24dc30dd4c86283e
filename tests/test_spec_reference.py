"""Speculative decoding against the independent dense references (tests/reference.py), step by step: the EAGLE
heads' logits, the drafts the device holds after every step, EAGLE-1's draft distributions, each request's drafted
and accepted counts recomputed on the host; and drafters that do not fit the target refused. The tiny target,
drafters and helpers are tests/test_spec.py's."""
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_model
from eagle_heads import write_eagle1_head, write_eagle3_head
from reference import greedy_spec_counts
from test_spec import (ENGINE, METHODS, PARALLEL, VOCAB, assert_partial_acceptance, drafters,  # noqa: F401
                       log_softmax, make_llm, prompt_of, references, run, target)
from jaxspec import SamplingParams
from jaxspec.nn import CacheShape, Decoder, ForwardBatch, Ops, schema


def dense_batch(ids, positions, size: int) -> ForwardBatch:
    """One row whose single block of `size` slots holds position p at slot p (plain causal attention)."""
    positions = jnp.asarray(positions, jnp.int32)
    return ForwardBatch(jnp.asarray(ids, jnp.int32), positions, positions, jnp.zeros(len(positions), jnp.int32),
                        jnp.zeros((1, 1), jnp.int32), jnp.arange(len(positions), dtype=jnp.int32))


def engine_head_pair_logits(target, drafter, dparams, ids):
    """The engine's EAGLE head on every pair (feature p, token p+1) of `ids`, run as one dense sequence."""
    ids = jnp.asarray(ids, jnp.int32)
    N = ids.shape[0]
    dense = Ops(attention="dense", block_size=N)
    model, head = Decoder(target.config, dense), drafter.head
    state = schema.initialize(model.state_schema(CacheShape(num_kv_slots=N, num_slots=1)), jnp.float32)
    _, hidden, aux, _ = model.forward(target.params, state, dense_batch(ids, jnp.arange(N), N),
                                         drafter.aux_layers)
    kv = schema.initialize(head.state_schema(CacheShape(num_kv_slots=N, num_slots=1)), jnp.float32)["attention"]
    feature = head.features(dense, dparams, hidden, aux)[:-1]
    out, _ = head.forward(dense, dparams, target.params, kv, ids[1:], feature,
                          dense_batch(ids[1:], jnp.arange(N - 1), N))
    return head.logits(dense, dparams, target.params, out)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_head_logits_match_the_published_forward(target, drafters, references, method):
    """The engine's head (loaded from the HF layout) gives the logits of the published EAGLE forward, written
    independently in tests/reference.py, on every pair of a sequence (float32, to rounding)."""
    from jaxspec.spec import SpeculativeConfig, build_drafter
    drafter, drafter_params = build_drafter(SpeculativeConfig(method, model=str(drafters[method]),
                                                              num_speculative_tokens=3), target)   # as the engine
    ids = prompt_of(8, 60) + references["target"].next_tokens(prompt_of(8, 60), 24)
    got = np.asarray(engine_head_pair_logits(target, drafter, drafter_params, ids))
    ref = np.asarray(references["heads"][method].pair_logits(jnp.asarray(ids)))
    finite = np.isfinite(ref)
    assert (np.isfinite(got) == finite).all()     # EAGLE-3: the same draft vocabulary
    err = np.abs(got[finite] - ref[finite]).max() / np.abs(ref[finite]).max()
    assert err < 2e-6, err


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_drafts_match_a_dense_reference(target, drafters, references, method):
    """After every step, the drafts the device holds for the next step are the drafter's greedy proposals
    computed densely over the sequence so far by the independent reference (chunked prefill, paging and
    step boundaries included)."""
    k = 3
    llm = make_llm(target, drafters, method, k, async_scheduling=False)
    engine = llm.engine
    req = engine.add_request(prompt_of(9, 50), SamplingParams(temperature=0, max_tokens=20))
    checked = 0
    while not req.finished:
        engine.step()
        if req.output_token_ids and not req.finished:
            drafts = np.asarray(engine.runner.state.drafts)[req.slot].tolist()
            seq = req.prompt_token_ids + req.output_token_ids
            assert drafts == references["propose"][method](seq, k), f"after {len(seq)} tokens"
            checked += 1
    assert checked >= 3
    assert_partial_acceptance(llm.stats()["spec"], 2)


def test_eagle1_draft_distributions_match_a_dense_reference(target, drafters, references):
    """EAGLE-1's paged history (the pairs every step writes into the head's KV) as its drafts read it: with
    sampled drafts the device keeps the distribution q of each draft, for a greedy request the log-softmax of the
    head's logits. After every step it is the independent reference's, run densely over the sequence so far along
    the same drafts (float32: measured <= 5.3e-6 nats). The drafts alone (the test above) miss what moves these
    logits without changing their argmax: with the history's keys one position off, this fitted head's logits
    moved by 0.2-0.3 nats and none of its drafts."""
    k = 3
    llm = make_llm(target, drafters, "eagle", k, draft_sampling="sample", async_scheduling=False)
    engine = llm.engine
    req = engine.add_request(prompt_of(9, 50), SamplingParams(temperature=0, max_tokens=20))
    worst, checked = 0.0, 0
    while not req.finished:
        engine.step()
        if req.output_token_ids and not req.finished:
            seq = req.prompt_token_ids + req.output_token_ids
            drafts, logits = references["heads"]["eagle"].greedy_drafts_and_logits(seq, k)
            assert np.asarray(engine.runner.state.drafts)[req.slot].tolist() == drafts, f"after {len(seq)} tokens"
            q = np.asarray(engine.runner.state.drafter["draft_logprobs"])[req.slot]             # [k, V]
            worst = max(worst, float(np.abs(q - log_softmax(logits.astype(np.float64))).max()))
            checked += 1
    assert checked >= 3
    assert worst <= 4e-5, worst
    assert_partial_acceptance(llm.stats()["spec"], 2)


@pytest.mark.parametrize("method", METHODS + (PARALLEL,))
def test_spec_counts_recomputed_on_host(target, drafters, references, method):
    """Greedy runs in the partial-acceptance regime: each request's drafted and accepted counts, and the
    engine's accepted count per draft position, equal a step-by-step host recomputation from the reference
    drafts and the target's greedy continuation; async and sync alike."""
    k, max_tokens = 3, 16
    prompts = [prompt_of(5, 70), prompt_of(12, 71), [5, 6, 7, 8] * 3]
    expected = []
    for p in prompts:
        continuation = p + references["target"].next_tokens(p, max_tokens + k + 1)
        expected.append(greedy_spec_counts(continuation, len(p), max_tokens, ENGINE["max_model_len"], k,
                                           lambda seq: references["propose"][method](seq, k)))
    for mode in (True, False):
        llm = make_llm(target, drafters, method, k, async_scheduling=mode, num_kv_blocks=40)
        outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        assert llm.stats()["num_preemptions"] == 0
        got = [(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs]
        assert got == [(e["draft_tokens"], e["accepted_tokens"]) for e in expected], f"async={mode}"
        spec = llm.stats()["spec"]
        assert spec["drafts"] == sum(e["steps"] for e in expected)
        per_position = np.round(np.asarray(spec["per_position_acceptance"]) * spec["drafts"]).astype(int)
        assert per_position.tolist() == np.sum([e["per_position"] for e in expected], axis=0).tolist()
        assert_partial_acceptance(spec, 2)


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
