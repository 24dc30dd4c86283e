"""EAGLE-3 training (jaxspec.train): ShareGPT conversations rendered with SmolLM2's chat template, answered by the
target itself, train a head that the engine then runs: it is accepted far more than an untrained one, stays
lossless, reloads the same from its HF layout and its orbax checkpoint, and a resumed run continues the loss
curve. The target is a small random model with SmolLM2's tokenizer and vocabulary: SmolLM2-135M itself costs
~1 s per training step and ~3 s per target pass of 4 x 128 tokens on this CPU, too slow for
the suite's budget."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from conftest import random_model
from jaxspec import LLM, SamplingParams
from jaxspec.train import TrainConfig, load_sharegpt, regenerate, render, save_regenerated, train, train_eagle3
from jaxspec.decode.drafters.eagle import load_eagle_head
from jaxspec.nn.eagle import EagleHead
from jaxspec.train.eagle3 import draft_vocabulary, estimated_acceptance_length, head_config, init_head, save_head

SEQ_LEN, STEPS = 112, 160
CONFIG = dict(batch_size=4, draft_vocab_size=1024, ttt_steps=3, warmup_steps=10, learning_rate=3e-3,
              cache_target_outputs=True)


@pytest.fixture(scope="module", autouse=True)
def optimized_training_steps():
    """The trainer's steps compiled with LLVM's optimisation (jaxspec.train.eagle3.COMPILER_OPTIONS), which the suite
    otherwise leaves out (conftest): they run hundreds of times and cost more to run than to compile."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jaxspec.train.eagle3.COMPILER_OPTIONS", {"xla_backend_optimization_level": 2})
        yield


@pytest.fixture(scope="module")
def target(smollm2_model):
    model = random_model(11, vocab_size=smollm2_model.config.vocab_size, hidden_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, intermediate_size=128, attn_gain=0.3)
    model.tokenizer = smollm2_model.tokenizer
    return model


CODE_PROMPTS = ['def add(a, b):\n    """Return a + b."""\n', 'import os\n\ndef home():\n    """The home directory."""\n']


@pytest.fixture(scope="module")
def regenerating_llm(target):
    return LLM(target, max_num_seqs=48, max_model_len=96, max_num_batched_tokens=256, warmup=False)


@pytest.fixture(scope="module")
def data(target, regenerating_llm):
    """ShareGPT first turns answered by the target (self-distillation), rendered: 40 to train on, 8 held out."""
    convs = [c for c in load_sharegpt(150) if len(target.tokenizer.encode(c[0]["content"])) <= 40][:48]
    regen = regenerate(regenerating_llm, convs, 32)
    examples = render(target.tokenizer, regen, SEQ_LEN)
    return examples.split(8), [c[:1] for c in convs[-8:]]


def test_raw_text_prompts_are_continued_without_a_template(target, regenerating_llm, tmp_path):
    """A dataset item {"prompt": TEXT} (a code prompt, served as raw text) is regenerated from the text itself, not
    from a chat rendering of it, and rendered as the prompt's tokens (masked out) followed by the continuation."""
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps([{"prompt": CODE_PROMPTS[0]},
                                {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                                {"prompt": CODE_PROMPTS[1], "completion": "    return os.environ['HOME']\n"}]))
    items = load_sharegpt(3, str(path))
    assert [[m["role"] for m in c] for c in items] == [["text"], ["user", "assistant"], ["text", "assistant"]]
    regen = regenerate(regenerating_llm, [items[0]], 12)
    greedy = regenerating_llm.generate([CODE_PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12),
                                       use_tqdm=False)[0].token_ids
    assert regen[0][1]["token_ids"] == list(greedy)
    examples = render(target.tokenizer, regen + items[2:], SEQ_LEN)
    # regeneration apart from training: the file written keeps each answer's own tokens, and reads back the same
    save_regenerated(regen + items[1:2], str(tmp_path / "regenerated.json"))
    again = load_sharegpt(2, str(tmp_path / "regenerated.json"))
    assert again[0][1]["token_ids"] == list(greedy) and "token_ids" not in again[1][1]
    back = render(target.tokenizer, again[:1] + items[2:], SEQ_LEN)
    assert (back.ids == examples.ids).all() and (back.mask == examples.mask).all()
    for row, (prompt, answer) in enumerate([(CODE_PROMPTS[0], list(greedy)),
                                            (CODE_PROMPTS[1], None)]):
        prompt_ids = target.tokenizer.encode(prompt, add_special_tokens=True)
        if answer is None:   # a dataset completion: its own tokens after the prompt's
            answer = target.tokenizer.encode(items[2][1]["content"])
        n, m = len(prompt_ids), len(answer)
        assert examples.ids[row, :n + m].tolist() == prompt_ids + answer
        assert examples.mask[row].tolist() == [0.0] * n + [1.0] * m + [0.0] * (SEQ_LEN - n - m)


@pytest.fixture(scope="module")
def trained(target, data, tmp_path_factory):
    (training, held_out), _ = data
    out = tmp_path_factory.mktemp("head")
    result = train(target, training, out, TrainConfig(steps=STEPS, save_every=STEPS // 2, **CONFIG),
                   held_out=held_out, progress=False)
    untrained = tmp_path_factory.mktemp("untrained")   # the same head as initialised, before any step
    head, params = load_eagle_head(out, target.config, "float32")
    d2t = np.asarray(params["draft_to_target"])
    save_head(untrained, head, init_head(head, target.params, d2t, seed=0), d2t)
    return out, untrained, result


# Engines compile the steps they run only (greedy: no sampling variant), in three token buckets.
ENGINE = dict(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=32, warmup=False)


def acceptance(target, head_dir, prompts, async_scheduling=True):
    llm = LLM(target, **ENGINE, async_scheduling=async_scheduling,
              speculative_config=dict(method="eagle3", model=str(head_dir), num_speculative_tokens=3))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    return llm.stats()["spec"], [o.token_ids for o in outs]


def test_training_lowers_the_loss_and_the_head_is_accepted(target, data, trained):
    out, untrained, result = trained
    _, prompts = data
    assert result.first_step == 0 and len(result.losses) == STEPS
    early, late = np.mean(result.losses[:10]), np.mean(result.losses[-10:])
    assert late < 0.6 * early, (early, late)     # ~0.52 measured (float32 reductions vary with the CPU)
    assert result.accuracies[-10:, 0].mean() > 0.6, result.accuracies[-10:].mean(0)   # ~0.8 measured
    spec, tokens = acceptance(target, out, prompts)
    base, base_tokens = acceptance(target, untrained, prompts)
    assert base["mean_acceptance_length"] < 1.1, base
    # ~1.73 and 0.38 / 0.21 / 0.15 per position measured; an untrained head accepts nothing
    assert spec["mean_acceptance_length"] > 1.45 and spec["per_position_acceptance"][2] > 0.05, spec
    # the held-out prompts are the engine's (their answers are the target's own, whole within SEQ_LEN): training's
    # replay of greedy speculation over them is what the engine measured (equal on this CPU; the per-step
    # accuracies' product, ~1.84 here, overstates it: chains start after rejections, at hard positions)
    held = result.held_out
    assert held["acceptance_length_k4"] == pytest.approx(spec["mean_acceptance_length"], abs=0.02), (held, spec)
    np.testing.assert_allclose(held["per_position_acceptance_k4"], spec["per_position_acceptance"], atol=0.02)
    # lossless: the same tokens as plain greedy decoding, with a head that drafts well and one that drafts badly
    plain = LLM(target, **ENGINE).generate(
        prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert tokens == base_tokens == [o.token_ids for o in plain]
    # async == sync: tokens and counts (not chosen_k, which counts steps: an async step can hold a row whose
    # request ended at EOS in the step before, so the two schedules may batch prefill chunks differently)
    sync_spec, sync_tokens = acceptance(target, out, prompts, async_scheduling=False)
    drop = lambda s: {k: v for k, v in s.items() if k != "chosen_k"}   # noqa: E731
    assert sync_tokens == tokens and drop(sync_spec) == drop(spec)


def test_the_head_written_is_the_head_trained(target, trained):
    """The HF layout reloads to the checkpoint's params (every tensor, d2t/t2d), in the published names."""
    import orbax.checkpoint as ocp
    from safetensors.numpy import load_file
    out, _, _ = trained
    head, params = load_eagle_head(out, target.config, "float32")
    manager = ocp.CheckpointManager(out / "checkpoints")
    assert manager.latest_step() == STEPS and sorted(manager.all_steps()) == [STEPS // 2, STEPS]
    saved = manager.restore(STEPS, args=ocp.args.StandardRestore())["params"]
    flat_saved = dict(jax.tree_util.tree_flatten_with_path(saved)[0])
    flat_loaded = dict(jax.tree_util.tree_flatten_with_path({k: v for k, v in params.items()
                                                             if k != "draft_to_target"})[0])
    assert flat_saved.keys() == flat_loaded.keys()
    for path, value in flat_saved.items():
        np.testing.assert_array_equal(np.asarray(flat_loaded[path]), np.asarray(value), err_msg=str(path))
    tensors = load_file(str(out / "model.safetensors"))
    d2t = np.asarray(params["draft_to_target"])
    assert np.array_equal(np.nonzero(tensors["t2d"])[0], np.sort(d2t))
    assert np.array_equal(np.arange(len(d2t)) + tensors["d2t"], d2t)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == len(d2t)
    # no aux layer ids: vLLM (top level, id j = output of layer j-1) and SGLang (eagle_config, id j = output of
    # layer j) number them differently and both default to the layers the head reads
    assert head.method == "eagle3" and "eagle_aux_hidden_state_layer_ids" not in json.dumps(config)


def test_a_head_naming_other_target_layers_is_refused(target, trained, tmp_path):
    """Ids in either project's numbering load when they are the engine's layers; others are refused by name."""
    import shutil
    out, _, _ = trained
    head, _ = load_eagle_head(out, target.config, "float32")
    ours = list(head.aux_layers)
    config = json.loads((out / "config.json").read_text())
    for extra, ok in (({"eagle_aux_hidden_state_layer_ids": [i + 1 for i in ours]}, True),
                      ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ours}}, True),
                      ({"eagle_aux_hidden_state_layer_ids": ours}, False),
                      ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in ours]}}, False)):
        d = tmp_path / f"head{len(list(tmp_path.iterdir()))}"
        shutil.copytree(out, d, ignore=shutil.ignore_patterns("checkpoints"))
        (d / "config.json").write_text(json.dumps({**config, **extra}))
        if ok:
            assert load_eagle_head(d, target.config, "float32")[0].aux_layers == head.aux_layers
        else:
            with pytest.raises(ValueError, match="names other target layers"):
                load_eagle_head(d, target.config, "float32")


def first_examples(examples, n: int):
    """The first n examples: 3 batches, for the runs that train a few steps (each run passes the target over all
    its examples first, for its draft vocabulary)."""
    return examples.split(len(examples) - n)[0]


def test_a_resumed_run_continues_the_loss_curve(target, data, tmp_path):
    """Half the steps, stopped, then resumed from the orbax checkpoint after the output directory moved (as it does
    to another machine): the same losses as one run straight. (Three batches an epoch: step 4 resumes mid-way
    through the second epoch's batches.)"""
    (training, _), _ = data
    training = first_examples(training, 12)
    small = dict(CONFIG, cache_target_outputs=False)
    straight = train(target, training, tmp_path / "straight", TrainConfig(steps=8, save_every=4, **small),
                     progress=False)
    # the schedule is the full run's: a run resumed with steps=8 picks up at step 4 of the same curve
    first = train(target, training, tmp_path / "resumed2", TrainConfig(steps=8, save_every=4, **small),
                  progress=False)
    assert first.losses == straight.losses
    import shutil
    shutil.rmtree(tmp_path / "resumed2" / "checkpoints" / "8")
    shutil.move(tmp_path / "resumed2", tmp_path / "elsewhere")
    resumed = train(target, training, tmp_path / "elsewhere", TrainConfig(steps=8, save_every=4, **small),
                    progress=False)
    assert resumed.first_step == 4 and len(resumed.losses) == 4
    np.testing.assert_allclose(resumed.losses, straight.losses[4:], rtol=1e-5)


def test_a_time_budget_cuts_the_steps_and_the_schedule_with_them(target, data, tmp_path):
    """max_seconds: once the first 25 steps are timed, the run is cut to what fits (here nothing more), it still
    saves the head and a checkpoint at its last step, and training.json records the steps actually run."""
    (training, _), _ = data
    training = first_examples(training, 12)
    result = train(target, training, tmp_path / "budget",
                   TrainConfig(steps=40, save_every=100, max_seconds=1e-3, **dict(CONFIG, cache_target_outputs=False)),
                   progress=False)
    assert len(result.losses) == 25
    assert json.loads((tmp_path / "budget" / "training.json").read_text())["steps"] == 25
    assert (tmp_path / "budget" / "checkpoints" / "25").is_dir() and (tmp_path / "budget" / "config.json").is_file()


def test_draft_vocabulary_and_the_acceptance_estimate():
    ids = np.array([[5, 5, 5, 7, 7, 9, 1, 1]], np.int32)
    mask = np.array([[0, 1, 1, 1, 1, 1, 0, 0]], np.float32)
    assert draft_vocabulary(ids, mask, 12, 2).tolist() == [5, 7]      # 5 x2, 7 x2 (where the weight is > 0)
    assert draft_vocabulary(ids, mask, 12, 3).tolist() == [5, 7, 9]
    assert draft_vocabulary(ids, mask, 12, 4).tolist() == [0, 5, 7, 9]   # then unseen ids, lowest first
    assert estimated_acceptance_length([1.0, 1.0, 1.0, 1.0], 4) == 5.0
    assert estimated_acceptance_length([0.5, 0.5, 0.0, 1.0], 4) == pytest.approx(1 + 0.5 + 0.25)


def test_bad_input_is_refused(target, data, trained, tmp_path):
    no_template = random_model(1)
    (training, _), _ = data
    narrower = random_model(2, vocab_size=target.config.vocab_size, hidden_size=32)
    with pytest.raises(ValueError, match="hidden_size=64"):   # resuming a checkpoint made for another target
        train(narrower, training, trained[0], TrainConfig(steps=STEPS + 1, **CONFIG), progress=False)
    with pytest.raises(ValueError, match="no chat template"):
        render(None, [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]], 32)
    with pytest.raises(ValueError, match="nothing to train on"):
        render(target.tokenizer, [[{"role": "user", "content": "hi " * 50}, {"role": "assistant", "content": "a"}]], 16)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_sharegpt(4, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="another tokenizer"):   # ids past a 128-token target's vocabulary
        train(no_template, training, tmp_path / "x", TrainConfig(steps=1), progress=False)
    with pytest.raises(ValueError, match="steps=0"):
        TrainConfig(steps=0)


def test_training_unrolls_the_head_as_the_engine_drafts(target, data, trained):
    """The training-time test computes what inference does: for a sequence followed by the reference head's own
    k greedy drafts (tests/reference.py, checked against the engine in test_spec.py), the unrolled head's chain
    from the last real position predicts exactly those drafts at every step."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file
    from reference import EagleReference
    from jaxspec.models.config import ModelConfig
    from jaxspec.nn.eagle import eagle3_aux_layers
    from jaxspec.train.eagle3 import make_target_fn, unrolled_logits
    out, _, _ = trained
    (_, held_out), _ = data
    head, params = load_eagle_head(out, target.config, "float32")
    tensors = load_file(str(out / "model.safetensors"))
    ref = EagleReference("eagle3", tensors, ModelConfig.from_hf({"model_type": "llama", **json.loads(
        (out / "config.json").read_text())}), target.hf_tensors, target.config)
    k, n = 3, 30
    # compiled once for the three rows (as training runs them: under jit)
    target_fn = make_target_fn(target.config, eagle3_aux_layers(target.config.num_layers))
    unrolled = jax.jit(unrolled_logits, static_argnums=(0, 5, 6))
    for row in held_out.ids[:3]:
        drafts = ref.greedy_drafts(row[:n].tolist(), k)
        seq = np.concatenate([row[:n], drafts]).astype(np.int32)[None]
        aux, _, _ = target_fn(target.params, jnp.asarray(seq), params["draft_to_target"])
        logits = unrolled(head, {k_: v for k_, v in params.items() if k_ != "draft_to_target"},
                          target.params["embed"], jnp.asarray(seq), aux, k, jnp.float32)
        d2t = np.asarray(params["draft_to_target"])
        got = [int(d2t[np.argmax(np.asarray(logits[j])[0, n - 2])]) for j in range(k)]
        assert got == drafts, (got, drafts)
        # the GPU's bf16 matmuls (f32 params cast inside) keep the same drafts on this sequence
        logits16 = unrolled(head, {k_: v for k_, v in params.items() if k_ != "draft_to_target"},
                            target.params["embed"], jnp.asarray(seq), aux, k, jnp.bfloat16)
        assert all(l16.dtype == jnp.float32 for l16 in logits16)
        got16 = [int(d2t[np.argmax(np.asarray(logits16[j])[0, n - 2])]) for j in range(k)]
        assert got16 == drafts, (got16, drafts)


def test_one_bf16_training_step_runs_and_matches_float32(tmp_path):
    """One step of the trainer as a GPU runs it (the target's weights in bfloat16, the head's matmuls in bfloat16
    over float32 master weights and optimizer state), on a tiny random target and random token sequences: its loss
    is finite and within bf16 rounding of the same step's in float32 (the same data, the same initial head, the
    whole vocabulary as draft vocabulary so both runs train the same outputs), and the step moves every weight of
    the head it writes."""
    import dataclasses

    import jax.numpy as jnp
    from jaxspec.train import Examples
    target = random_model(11, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, attn_gain=0.3)
    target16 = dataclasses.replace(target, params=jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16),
                                                                         target.params))
    rng = np.random.default_rng(0)
    mask = np.zeros((4, 32), np.float32)
    mask[:, 8:] = 1.0
    examples = Examples(rng.integers(0, target.config.vocab_size, (4, 32)).astype(np.int32), mask)
    config = dict(steps=1, batch_size=4, draft_vocab_size=target.config.vocab_size, ttt_steps=2, learning_rate=1e-2)
    runs = {dtype: train(model, examples, tmp_path / dtype, TrainConfig(compute_dtype=dtype, **config), progress=False)
            for dtype, model in (("float32", target), ("bfloat16", target16))}
    loss16, loss32 = runs["bfloat16"].losses[0], runs["float32"].losses[0]
    assert np.isfinite(loss16) and abs(loss16 - loss32) < 5e-4 * loss32   # ~5e-5 measured
    head, trained = load_eagle_head(tmp_path / "bfloat16", target.config, "float32")
    d2t = np.asarray(trained.pop("draft_to_target"))
    initial = init_head(head, target16.params, d2t, seed=0)
    for path, before in jax.tree_util.tree_flatten_with_path(initial)[0]:
        after = np.asarray(trained[path[0].key] if len(path) == 1 else
                           trained[path[0].key][path[1].key][path[2].key])
        assert not np.allclose(after, np.asarray(before)), f"{jax.tree_util.keystr(path)} did not move"


def test_a_saved_head_keeps_its_targets_rope_scaling(target, tmp_path):
    """A head trained for a target with llama3 rope scaling (Llama-3.1) is written with the scaling's type, so that
    it loads back with the same rotary embedding (the loader refuses a scaling whose type it cannot tell)."""
    llama3 = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
              ("original_max_position_embeddings", 64))
    tc = dataclasses.replace(target.config, rope_scaling=llama3)
    d2t = np.arange(64)
    head = EagleHead("eagle3", head_config(tc), tc, draft_vocab_size=len(d2t))
    save_head(tmp_path, head, init_head(head, target.params, d2t, seed=0), d2t)
    loaded, _ = load_eagle_head(tmp_path, tc, "float32")
    assert loaded.config.rope_scaling == llama3


@pytest.mark.parametrize("parallel", [False, True])
def test_a_heads_bfloat16_copy_loads_to_the_same_bfloat16_weights(tmp_path, parallel):
    """benchmarks/end_to_end/head_transfer.py (heads carried off the GPU machine in bfloat16): a bfloat16 engine
    loads the copy to exactly the weights it loads from the float32 head."""
    import subprocess
    import sys
    from pathlib import Path
    import jax.numpy as jnp
    target = random_model(seed=0)
    d2t = np.arange(0, target.config.vocab_size, 2, dtype=np.int32)
    head = EagleHead("eagle3", head_config(target.config), target.config, draft_vocab_size=len(d2t),
                     parallel=parallel)
    params = init_head(head, target.params, d2t, seed=3)
    # weights with bits below bfloat16's precision (init copies some of the target's, which are float32 too)
    params = jax.tree_util.tree_map(lambda x: x * 1.001 + 1e-4 if x.dtype == jnp.float32 else x, params)
    (tmp_path / "f32").mkdir()
    save_head(tmp_path / "f32", head, params, d2t)
    script = Path(__file__).parents[1] / "benchmarks" / "end_to_end" / "head_transfer.py"
    subprocess.run([sys.executable, str(script), "bf16", str(tmp_path / "f32"), str(tmp_path / "bf16")], check=True,
                   capture_output=True)
    assert (tmp_path / "bf16" / "config.json").read_text() == (tmp_path / "f32" / "config.json").read_text()
    want = jax.tree_util.tree_leaves_with_path(load_eagle_head(tmp_path / "f32", target.config, "bfloat16")[1])
    got = jax.tree_util.tree_leaves_with_path(load_eagle_head(tmp_path / "bf16", target.config, "bfloat16")[1])
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, w), (_, g) in zip(want, got):
        assert g.dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w)), jax.tree_util.keystr(path)
