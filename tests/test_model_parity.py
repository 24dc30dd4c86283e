"""`Model.score` against transformers float32 logits on the same weights, max|diff| / max|ref| within a few
times the float32 rounding each model really shows (measured on the CPU: 3-6e-7 for the tiny checkpoints,
4.5e-6 for SmolLM2-135M's 30 layers, 1.6e-6 for Qwen2.5-Coder-0.5B), so a wrong epsilon or rope base fails."""
import dataclasses

import numpy as np
import pytest

from conftest import transformers_from_gguf
from gguf_testing import gguf_from_hf_dir
from jaxspec.models import load_model

TOLERANCE = 2e-6           # tiny random checkpoints
SMOLLM2_TOLERANCE = 1e-5
QWEN_TOLERANCE = 5e-6


def relative_error(got, ref) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def transformers_logits(model, token_ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].double().numpy()


@pytest.mark.parametrize("kind", ["llama", "llama3_tied", "llama_sharded", "qwen2", "qwen3"])
def test_tiny_hf_models_match_transformers(tiny_hf_dirs, kind):
    import torch
    import transformers
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_hf_dirs[kind]), dtype=torch.float32)
    model = load_model(tiny_hf_dirs[kind], dtype="float32")
    # 40 tokens: beyond llama3_tied's original_max_position_embeddings=16, so the scaled rope band matters.
    token_ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 40)
    ref = transformers_logits(ref_model.eval(), token_ids)
    got = model.score(token_ids)
    assert got.shape == ref.shape
    assert relative_error(got, ref) <= TOLERANCE


@pytest.mark.parametrize("kind", ["llama3_tied", "llama_linear"])
def test_rope_scaled_llama_gguf_matches_transformers(tiny_hf_dirs, tmp_path, kind):
    """llama.cpp-style GGUFs of rope-scaled llamas (llama3: a rope_freqs tensor; linear: rope.scaling.type/factor)
    score like transformers on the HF checkpoint, over 40 positions (past original_max_position_embeddings=16)."""
    import torch
    import transformers
    path = gguf_from_hf_dir(tiny_hf_dirs[kind], tmp_path / f"{kind}.gguf", "llama")
    model = load_model(path, dtype="float32")
    assert model.config.rope_scaling is None and model.config.rope_freq_factors is not None
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_hf_dirs[kind]), dtype=torch.float32)
    token_ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 40)
    ref = transformers_logits(ref_model.eval(), token_ids)
    got = model.score(token_ids)
    assert got.shape == ref.shape
    assert relative_error(got, ref) <= TOLERANCE
    # The scaling is what makes it match: plain rope on the same weights is far off.
    plain = dataclasses.replace(model, config=dataclasses.replace(model.config, rope_freq_factors=None))
    assert relative_error(plain.score(token_ids), ref) > 100 * TOLERANCE


@pytest.mark.parametrize("change", [dict(rms_norm_eps=10), dict(rope_theta=1.01)])
def test_parity_sees_a_small_config_error(tiny_hf_dirs, change):
    """The tolerance is tight enough that a 10x rms_norm_eps or a 1% rope base is a failure."""
    import torch
    import transformers
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_hf_dirs["llama"]), dtype=torch.float32)
    model = load_model(tiny_hf_dirs["llama"], dtype="float32")
    token_ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 40)
    ref = transformers_logits(ref_model.eval(), token_ids)
    assert relative_error(model.score(token_ids), ref) <= TOLERANCE
    (field, factor), = change.items()
    wrong = dataclasses.replace(model.config, **{field: getattr(model.config, field) * factor})
    assert relative_error(dataclasses.replace(model, config=wrong).score(token_ids), ref) > TOLERANCE


def test_smollm2_gguf_matches_transformers(smollm2_model, smollm2_hf_model):
    """conftest's session models: jaxspec's float32 load of the SmolLM2 GGUF and transformers' own."""
    model = smollm2_model
    token_ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog because it wanted to see")
    assert 12 <= len(token_ids) <= 20
    ref = transformers_logits(smollm2_hf_model, token_ids)
    got = model.score(token_ids)
    assert relative_error(got, ref) <= SMOLLM2_TOLERANCE
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.slow
def test_qwen_coder_0_5b_preset_matches_transformers(qwen_0_5b_gguf_path):
    model = load_model("qwen2.5-coder-0.5b-instruct", dtype="float32")
    assert model.config.arch == "qwen2" and model.config.qkv_bias
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "def fib(n):"}])
    token_ids = model.tokenizer.encode(prompt)
    ref = transformers_logits(transformers_from_gguf(qwen_0_5b_gguf_path), token_ids)
    got = model.score(token_ids)
    assert relative_error(got, ref) <= QWEN_TOLERANCE
    assert (got.argmax(-1) == ref.argmax(-1)).all()
