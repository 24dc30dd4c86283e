"""Training a parallel draft model (jaxspec.train.pard): its training forward computes, at every anchor at once, the
drafts the engine's parallel drafting computes (a dense reference's logits after the sequence and j mask tokens,
packed rows included); a few dozen steps on text with structure make its drafts accepted far more; the HF directory
it writes loads as a parallel draft model and serves losslessly; a resumed run continues the saved one exactly."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_model
from jaxspec import LLM, SamplingParams
from jaxspec.nn.decoder import Decoder
from jaxspec.train.config import PardConfig
from jaxspec.train.data import Examples
from jaxspec.train.pard import default_mask_token, evaluate, pard_logits, pard_loss, pard_steps, train

VOCAB, MASK, K = 128, 127, 4
SEQ_LEN = 32
CONFIG = dict(batch_size=8, num_drafts=K, learning_rate=3e-2, warmup_steps=5, mask_token_id=MASK, seed=0)


@pytest.fixture(scope="module", autouse=True)
def optimized_training_steps():
    """The trainer's steps compiled with LLVM's optimisation (as tests/test_train.py does for EAGLE-3's)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jaxspec.train.eagle3.COMPILER_OPTIONS", {"xla_backend_optimization_level": 2})
        yield


def small_model(seed: int = 1):
    return random_model(seed, vocab_size=VOCAB, hidden_size=32, num_layers=2, intermediate_size=64,
                        max_position_embeddings=128)


def counting(rng, length: int) -> list[int]:
    """Text with structure: a run x, x+d, x+2d, ... over the ids 1..96 (d in 1..3, fixed per text), so that once
    two tokens are seen every later one follows."""
    x, d = int(rng.integers(1, 97)), int(rng.integers(1, 4))
    return [(x - 1 + i * d) % 96 + 1 for i in range(length)]


def corpus(n: int, seed: int) -> Examples:
    """n rows of one counting text each, of 12..SEQ_LEN tokens, every token trained (plain text)."""
    rng = np.random.default_rng(seed)
    ids, mask = np.zeros((n, SEQ_LEN), np.int32), np.zeros((n, SEQ_LEN), np.float32)
    for r in range(n):
        length = int(rng.integers(12, SEQ_LEN + 1))
        ids[r, :length], mask[r, :length] = counting(rng, length), 1.0
    return Examples(ids, mask)


def test_the_training_forward_gives_the_inference_drafts_at_every_anchor():
    """A packed row of two texts: the training forward's block j at position n+j-1 of each text is the dense
    reference's logits after the text's first n tokens then j mask tokens (what parallel drafting computes for
    draft j+1), for every anchor n and j (the first text alone in a row too); and the batch loss is the reference's cross-entropies over the trained
    targets (a loss mask over part of the tokens), draft j+1 weighted 0.8 ** j."""
    from reference import Greedy
    model = small_model()
    greedy = Greedy(model.hf_tensors, model.config, length=16)
    rng = np.random.default_rng(3)
    lengths = (7, 5)
    texts = [[int(t) for t in rng.integers(1, MASK, n)] for n in lengths]
    ids = np.asarray(texts[0] + texts[1] + [0, 0], np.int32)
    segments = np.asarray([1] * 7 + [2] * 5 + [0, 0], np.int32)
    loss_mask = np.asarray(rng.random(len(ids)) < 0.7, np.float32) * (segments > 0)
    forward = jax.jit(lambda p, i, s: pard_logits(Decoder(model.config), p, i, s, MASK, K))
    logits = np.asarray(forward(model.params, ids, segments))                          # [K, T, V]
    alone = np.asarray(forward(model.params, ids[:7], np.ones(7, np.int32)))          # one text, no padding
    np.testing.assert_allclose(alone, logits[:, :7], rtol=1e-4, atol=1e-4)
    ce, count = np.zeros(K), np.zeros(K)
    start = 0
    for text in texts:
        for n in range(1, len(text) + 1):
            for j in range(K):
                p = n + j - 1              # the position of the j-th mask (j = 0: the text's last token)
                if p >= len(text):
                    continue
                ref = greedy.logits(text[:n] + [MASK] * j)[-1]
                np.testing.assert_allclose(logits[j, start + p], ref, rtol=1e-4, atol=1e-4,
                                           err_msg=f"anchor n={n}, draft {j + 1}, text at {start}")
                if p + 1 < len(text) and loss_mask[start + p + 1]:
                    lse = np.log(np.sum(np.exp(ref - ref.max()))) + ref.max()
                    ce[j] += lse - ref[text[p + 1]]
                    count[j] += 1
        start += len(text)
    want = float(np.sum(0.8 ** np.arange(K) * ce / count))
    loss, (per_loss, _, counts, _) = jax.jit(lambda p: pard_loss(Decoder(model.config), p, ids[None],
                                                                 loss_mask[None], segments[None], MASK, K, 0.8))(
        model.params)
    np.testing.assert_allclose(np.asarray(counts), count)
    np.testing.assert_allclose(np.asarray(per_loss), ce / count, rtol=1e-4)
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)


def test_the_default_mask_token_is_the_first_spare_row_or_refused():
    assert default_mask_token(151665, 151936) == 151665
    with pytest.raises(ValueError, match="no spare embedding row"):
        default_mask_token(128, 128)
    with pytest.raises(ValueError, match="mask_token_id"):
        default_mask_token(None, 128)
    with pytest.raises(ValueError, match="num_drafts"):
        PardConfig(num_drafts=1)


@pytest.mark.parametrize("field,value,message", [("steps", 0, "it must be >= 1"), ("warmup_steps", -1, ">= 0"),
                                                  ("learning_rate", 1.5, r"in \(0, 1\)"),
                                                  ("max_seconds", 0, "a positive number")])
def test_both_trainers_refuse_the_same_bad_run_settings(field, value, message):
    """TrainConfig and PardConfig check the settings every run has with one rule (config.check_run)."""
    from jaxspec.train.config import TrainConfig
    for config in (TrainConfig, PardConfig):
        with pytest.raises(ValueError, match=f"{field}={value}.*{message}"):
            config(**{field: value})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small model trained 120 steps on counting texts (packed), 16 held out: (model, result, held-out, out)."""
    out = tmp_path_factory.mktemp("pard")
    model = small_model()
    training, held_out = corpus(96, seed=0), corpus(16, seed=1)
    result = train(model, training, out, PardConfig(steps=120, save_every=1000, **CONFIG), held_out=held_out,
                   progress=False)
    return model, result, held_out, out


def test_a_trained_model_drafts_held_out_text_far_better(trained):
    """Before training a random model's drafts are almost never right; after 120 steps its drafts 1..4 each are
    right most of the time, and greedy speculation at k=4 replayed over the held-out text accepts over one more
    token a step. The report is in training.json too."""
    model, result, held_out, out = trained
    before = evaluate(model.params, held_out, pard_steps(model.config, PardConfig(**CONFIG), MASK),
                      PardConfig(**CONFIG))
    after = result.held_out
    assert before["acceptance_length_k4"] < 1.2
    assert after["acceptance_length_k4"] > before["acceptance_length_k4"] + 1.0, (before, after)
    assert min(after["accuracy"]) > 0.5, after
    assert result.losses[-1] < 0.5 * result.losses[0]
    report = json.loads((out / "training.json").read_text())
    assert report["held_out"]["acceptance_length_k4"] == after["acceptance_length_k4"]
    assert report["config"]["num_drafts"] == K and report["steps"] == 120


def test_the_written_model_serves_as_a_parallel_draft_model_losslessly(trained):
    """The output directory (config.json with pard_token, model.safetensors) loads back to the trained weights and
    serves as a parallel draft model (its mask token read from config.json): greedy outputs with speculation equal
    plain decoding's, and its mask drafts are accepted (more than one draft accepted per step on average). The
    target is the trained model itself, loaded from the same directory."""
    from jaxspec.models.loader import load_model
    out = trained[3]
    assert json.loads((out / "config.json").read_text())["pard_token"] == MASK
    loaded = load_model(str(out), "float32")
    engine = dict(dtype="float32", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, block_size=4,
                  num_kv_blocks=64, warmup=False)
    rng = np.random.default_rng(5)
    prompts = [counting(rng, n) for n in (3, 5, 8)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(loaded, **engine).generate(prompts, params, use_tqdm=False)
    llm = LLM(loaded, **engine, speculative_config={"method": "draft_model", "model": str(out),
                                                    "parallel_drafting": True, "num_speculative_tokens": K})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == [list(o.token_ids) for o in plain]
    spec = llm.stats()["spec"]
    assert spec["parallel_drafting"] and spec["accepted_tokens"] > 1.5 * spec["drafts"], spec


def test_a_resumed_run_continues_from_its_checkpoint(tmp_path):
    """A run of 30 steps checkpointed at 20 and 30, its last checkpoint removed, resumes at step 20 and trains what
    the unbroken run did from there: the same losses and the same weights, the mask token's row moved."""
    import shutil

    from jaxspec.models.loader import load_model
    model, training = small_model(), corpus(48, seed=0)
    config = PardConfig(steps=30, save_every=20, **CONFIG)
    unbroken = train(model, training, tmp_path, config, progress=False)
    assert unbroken.first_step == 0 and len(unbroken.losses) == 30
    first = load_model(str(tmp_path), "float32").params
    shutil.rmtree(tmp_path / "checkpoints" / "30")
    resumed = train(model, training, tmp_path, config, progress=False)
    assert resumed.first_step == 20 and len(resumed.losses) == 10
    np.testing.assert_allclose(resumed.losses, unbroken.losses[20:], rtol=1e-4)
    again = load_model(str(tmp_path), "float32").params
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5),
                           first, again)
    assert not np.allclose(np.asarray(again["embed"][MASK]), np.asarray(model.params["embed"][MASK]))


def test_loss_weights_count_only_anchors_inside_the_segment():
    """Block j at position p trains only where the anchor p - j + 1 has a real token of p's segment: the first j
    positions of each segment train no draft j+1."""
    from jaxspec.train.pard import target_weights
    segments = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 0]])
    w = np.asarray(target_weights(jnp.ones((1, 8)) * (segments > 0), segments, 3))[:, 0]
    np.testing.assert_array_equal(w, [[1, 1, 1, 0, 1, 1, 0, 0],
                                      [0, 1, 1, 0, 0, 1, 0, 0],
                                      [0, 0, 1, 0, 0, 0, 0, 0]])


def test_the_hf_writer_writes_what_the_loader_reads_back(tmp_path):
    """A Qwen2 model (q/k/v biases) written without a source directory (config.json from its ModelConfig) loads back
    to the same config and params; written again from that directory, its config.json is kept with the extra keys
    added."""
    from jaxspec.models.hf_writer import save_hf_model
    from jaxspec.models.loader import load_model
    model = random_model(4, arch="qwen2", vocab_size=VOCAB, hidden_size=32, num_layers=2)
    save_hf_model(tmp_path / "a", model.config, model.params)
    a = load_model(str(tmp_path / "a"), "float32")
    assert a.config == model.config
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a.params,
                           model.params)
    (tmp_path / "a" / "generation_config.json").write_text("{}")
    save_hf_model(tmp_path / "b", a.config, a.params, source=a.source, extra={"pard_token": 5})
    written = json.loads((tmp_path / "b" / "config.json").read_text())
    assert written == {**json.loads((tmp_path / "a" / "config.json").read_text()), "pard_token": 5}
    assert (tmp_path / "b" / "generation_config.json").is_file()
    b = load_model(str(tmp_path / "b"), "float32")
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), b.params,
                           model.params)


def test_a_bad_flag_is_answered_before_jax_is_imported():
    from test_cli import run_command
    proc, _ = run_command("jaxspec.train.pard_cli", ["--model", "smollm2-135m-instruct", "--out", "x",
                                                     "--num-drafts", "1"])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--num-drafts" in proc.stderr, proc.stderr


def test_the_command_trains_an_hf_directory_on_plain_text(tmp_path, smollm2_gguf_path, capsys):
    """`jaxspec-train-draft` on an HF directory (a random model with SmolLM2's tokenizer and 8 spare embedding rows)
    and a .jsonl of texts: the mask token is the first spare row, the tokenizer's files are copied, and the engine
    serves the result as a parallel draft model losslessly with the mask token from its config.json."""
    from jaxspec.models.gguf_loader import hf_tokenizer_from_gguf
    from jaxspec.models.hf_writer import save_hf_model
    from jaxspec.models.loader import load_model
    from jaxspec.train.pard_cli import main
    tokenizer = hf_tokenizer_from_gguf(smollm2_gguf_path)
    model = random_model(6, vocab_size=len(tokenizer) + 8, hidden_size=32, num_layers=2)
    source = save_hf_model(tmp_path / "source", model.config, model.params)
    tokenizer.save_pretrained(str(source))
    text = tmp_path / "texts.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 3}) for i in range(12)))
    out = tmp_path / "out"
    main(["--model", str(source), "--out", str(out), "--text-path", str(text), "--steps", "3", "--batch-size", "2",
          "--seq-len", "32", "--num-drafts", "3", "--num-held-out", "2", "--warmup-steps", "1"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["steps"] == 3 and "acceptance_length_k3" in printed["held_out"]
    assert json.loads((out / "config.json").read_text())["pard_token"] == len(tokenizer)
    assert (out / "tokenizer.json").is_file()
    target = load_model(str(source), "float32")
    engine = dict(dtype="float32", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, block_size=4,
                  num_kv_blocks=64, warmup=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(target, **engine).generate(["def f(x):"], params, use_tqdm=False)
    llm = LLM(target, **engine, speculative_config={"method": "draft_model", "model": str(out),
                                                    "parallel_drafting": True, "num_speculative_tokens": 3})
    assert [o.token_ids for o in llm.generate(["def f(x):"], params, use_tqdm=False)] == [o.token_ids for o in plain]
    assert llm.stats()["spec"]["parallel_drafting"]


def test_the_acceptance_replay_reads_the_drafts_of_each_anchor():
    """The held-out replay (eagle3.simulated_acceptance over acceptance_hits) starts its first chain after the prompt
    token and the first emitted one (anchor n = 2, block j at position 1 + j): with exactly that anchor's k drafts
    right, its first step accepts all k and no later one accepts any."""
    from jaxspec.train.eagle3 import simulated_acceptance
    from jaxspec.train.pard import acceptance_hits
    k, T = 3, 12
    hits = np.zeros((k, 1, T), bool)
    for j in range(k):
        hits[j, 0, 1 + j] = True
    mask = np.ones((1, T))
    mask[0, 0] = 0
    length, per_position = simulated_acceptance(acceptance_hits(hits), mask, k)
    steps = 1 / per_position[0]
    assert per_position == [1 / steps] * k and steps > 1
