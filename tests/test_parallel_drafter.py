"""The parallel EAGLE-3 head (jaxspec.nn.eagle, `parallel`): one forward proposes all k drafts, the pair at the last
accepted position followed by k-1 learned placeholders. Trained here by jaxspec's own trainer (TrainConfig arch
"parallel") on the sequences of tests/test_spec.py's tiny target, then served: the engine's drafts after every step
are the trainer's unrolled forward's (its training math is its inference), the trained head is accepted far more
than the same head untrained, and speculation with it is lossless, async equal to sync, through chunked prefill,
preemption and prefix caching, greedy and with seeded sampled drafts."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_heads import target_sequences
from test_spec import ENGINE, assert_greedy_lossless, make_llm, prompt_of, run, target  # noqa: F401
from jaxspec import SamplingParams

K = 3


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """{"trained": dir, "untrained": dir}: a parallel head trained for 150 steps on the target's own continuations
    of random prompts (the answer: every token after the 6-token prompt), and the same head as initialised."""
    from jaxspec.decode.drafters.eagle import load_eagle_head
    from jaxspec.train import Examples, TrainConfig, train
    from jaxspec.train.eagle3 import init_head, save_head
    seqs = target_sequences(target, 48, 6, 40, seed=5)
    mask = np.zeros(seqs.shape, np.float32)
    mask[:, 6:] = 1.0
    out = tmp_path_factory.mktemp("parallel_head")
    config = TrainConfig(steps=150, batch_size=8, learning_rate=1e-2, warmup_steps=10, ttt_steps=K, arch="parallel",
                         draft_vocab_size=96, cache_target_outputs=True, save_every=150)
    result = train(target, Examples(seqs, mask), out, config, progress=False)
    assert np.mean(result.losses[-10:]) < 0.7 * np.mean(result.losses[:10]), result.losses[::15]
    head, params = load_eagle_head(out, target.config, "float32")
    assert head.parallel
    untrained = tmp_path_factory.mktemp("parallel_untrained")
    d2t = np.asarray(params["draft_to_target"])
    save_head(untrained, head, init_head(head, target.params, d2t, seed=0), d2t)
    return {"trained": out, "untrained": untrained}


def llm_with(target, head_dir, **kw):
    return make_llm(target, {}, "eagle3", K, draft=str(head_dir), **kw)


def test_the_engines_drafts_are_the_trainers_unrolled_forward(target, heads):
    """After every step the device holds, for the next step, the argmax drafts of the trainer's unrolled parallel
    forward (jaxspec.train.eagle3.unrolled_logits) over the sequence so far, at its last pair: the placeholders'
    positions, keys and residuals at inference are the ones training saw."""
    from jaxspec.decode.drafters.eagle import load_eagle_head
    from jaxspec.train.eagle3 import make_target_fn, unrolled_logits
    head, params = load_eagle_head(heads["trained"], target.config, "float32")
    d2t = np.asarray(params.pop("draft_to_target"))
    target_fn = make_target_fn(target.config, head.aux_layers)
    unrolled = jax.jit(lambda p, ids, aux: unrolled_logits(head, p, target.params["embed"], ids, aux, K))
    length = ENGINE["max_model_len"]

    def trainer_drafts(seq):
        padded = np.zeros((1, length), np.int32)   # causal: the padding reaches no chain before it
        padded[0, :len(seq)] = seq
        aux, _, _ = target_fn(target.params, jnp.asarray(padded), jnp.asarray(d2t))
        logits = unrolled(params, jnp.asarray(padded), aux)
        return [int(d2t[np.argmax(np.asarray(logits[j])[0, len(seq) - 2])]) for j in range(K)]

    llm = llm_with(target, heads["trained"], async_scheduling=False)
    engine = llm.engine
    req = engine.add_request(prompt_of(9, 50), SamplingParams(temperature=0, max_tokens=24))
    checked = 0
    while not req.finished:
        engine.step()
        if req.output_token_ids and not req.finished:
            seq = req.prompt_token_ids + req.output_token_ids
            assert np.asarray(engine.runner.state.drafts)[req.slot].tolist() == trainer_drafts(seq), len(seq)
            checked += 1
    assert checked >= 3
    assert llm.stats()["spec"]["accepted_tokens"] > 0


def test_trained_parallel_head_is_accepted_far_more_than_untrained(target, heads):
    prompts = [prompt_of(n, 60 + n) for n in (5, 8, 12)]
    length = {}
    for name in ("trained", "untrained"):
        llm = llm_with(target, heads[name], num_kv_blocks=48)
        outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert_greedy_lossless(target, prompts, outs)
        spec = llm.stats()["spec"]
        length[name] = 1 + spec["accepted_tokens"] / spec["drafts"]
        if name == "trained":   # every draft position is accepted at times: the placeholders learned
            assert all(p > 0 for p in spec["per_position_acceptance"]), spec
    assert length["trained"] > 1.5 and length["trained"] > length["untrained"] + 0.5, length


SHARED = prompt_of(13, 90)
PROMPTS = [SHARED + prompt_of(n, 91 + i) for i, n in enumerate([2, 5, 8, 11])]   # chunked 8 tokens a step


@pytest.mark.parametrize("draft_sampling", ["argmax", "sample"])
def test_async_equals_sync_through_chunks_and_prefix_caching(target, heads, draft_sampling):
    """Four requests sharing a 13-token prefix, greedy and seeded sampling: the same tokens and the same drafted and
    accepted counts per request, async and sync (a pool large enough that neither preempts: preemption moves step
    boundaries, and the counts with them); the greedy requests' tokens are the target's argmax."""
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)] * 2
    results = {}
    for mode in (True, False):
        llm = llm_with(target, heads["trained"], async_scheduling=mode, draft_sampling=draft_sampling,
                       num_kv_blocks=48)
        outs = run(llm, PROMPTS, params)
        assert_greedy_lossless(target, PROMPTS[::2], outs[::2])
        stats = llm.stats()
        assert stats["num_preemptions"] == 0 and stats["prefix_cache"]["hit_tokens"] > 0
        assert stats["spec"]["accepted_tokens"] > 0
        results[mode] = [(o.token_ids, o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs]
    assert results[True] == results[False]


def test_lossless_through_preemption(target, heads):
    """The same requests in a 16-block pool, where they preempt each other: every token the target's argmax."""
    llm = llm_with(target, heads["trained"])
    outs = run(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert_greedy_lossless(target, PROMPTS, outs)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec"]["accepted_tokens"] > 0


def test_a_head_whose_config_and_tensors_disagree_is_refused(target, heads, tmp_path):
    import shutil
    from jaxspec.decode.drafters.eagle import load_eagle_head
    bad = tmp_path / "bad"
    shutil.copytree(heads["trained"], bad, ignore=shutil.ignore_patterns("checkpoints"))
    config = json.loads((bad / "config.json").read_text())
    del config["parallel_drafting"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="parallel_drafting"):
        load_eagle_head(bad, target.config, "float32")


def test_an_unknown_arch_and_resuming_with_another_arch_are_refused(target, heads):
    from jaxspec.train import Examples, TrainConfig, train
    with pytest.raises(ValueError, match="arch='tree' is invalid; use one of 'chain', 'parallel'"):
        TrainConfig(arch="tree")
    examples = Examples(np.zeros((2, 8), np.int32), np.ones((2, 8), np.float32))
    with pytest.raises(ValueError, match="arch='parallel'.*arch='chain'"):
        train(target, examples, heads["trained"], TrainConfig(steps=1, batch_size=2, arch="chain"), progress=False)
