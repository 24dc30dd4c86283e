"""Qwen3-MoE (issue #39): a tiny random checkpoint written by transformers, layer 0 dense (`mlp_only_layers`) and
layer 1 a mixture of 4 experts, 2 per token. Logits within float32 rounding of transformers'; greedy generation
through the engine equal to transformers' `generate`, plainly and with a draft model (drafts accepted and
rejected)."""

import numpy as np
import pytest

from conftest import TINY_DIMS, hf_greedy, perturbed, randomize_
from jaxspec import LLM, SamplingParams
from jaxspec.models import load_model

TOLERANCE = 2e-6
PROMPTS = [[(5 * i + 11 * j) % 250 + 2 for j in range(n)] for i, n in enumerate((4, 9, 15))]
MAX_TOKENS = 10
ENGINE = dict(dtype="float32", max_num_seqs=3, max_model_len=64, max_num_batched_tokens=16, block_size=4,
              warmup=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch
    import transformers
    path = tmp_path_factory.mktemp("qwen3_moe")
    config = transformers.Qwen3MoeConfig(**TINY_DIMS, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=True,
                                         tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(hf, 0)
    with torch.no_grad():   # the experts' fused [E, rows, in] weights: unit gain, as randomize_ gives matrices
        for name, p in hf.named_parameters():
            if p.ndim == 3:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) / p.shape[-1] ** 0.5)
    hf.save_pretrained(str(path), safe_serialization=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        refs = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
        token_ids = np.random.default_rng(2).integers(0, 256, 24)
        logits = hf(torch.tensor([token_ids.tolist()])).logits[0].double().numpy()
    return path, refs, token_ids, logits


def test_logits_match_transformers(checkpoint):
    path, _, token_ids, logits = checkpoint
    model = load_model(path, dtype="float32")
    c = model.config
    assert c.arch == "qwen3" and c.layer_types == ("attention", "attention_moe") and c.num_experts == 4
    got = model.score(token_ids)
    assert float(np.abs(np.asarray(got, np.float64) - logits).max() / np.abs(logits).max()) <= TOLERANCE


@pytest.mark.parametrize("speculation,grouped_matmul", [(False, "xla"), (True, "xla"), (True, "pallas")])
def test_greedy_generation_equals_transformers(checkpoint, speculation, grouped_matmul, monkeypatch):
    """Plain and speculative (accepted and rejected drafts), the experts as XLA's ragged_dot and as the
    grouped-matmul kernel (interpreted here) that a GPU runs."""
    path, refs, _, _ = checkpoint
    target = load_model(path, dtype="float32")
    spec = ({"method": "draft_model", "model": perturbed(target, 0.05, 1), "num_speculative_tokens": 3}
            if speculation else None)
    monkeypatch.setenv("JAXSPEC_GROUPED_MATMUL", grouped_matmul)
    llm = LLM(target, **ENGINE, speculative_config=spec)
    assert llm.engine.runner.ops.grouped_matmul == grouped_matmul
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == refs
    if speculation:
        s = llm.stats()["spec"]
        assert 0 < s["accepted_tokens"] < s["draft_tokens"]


def test_use_sliding_window_windows_every_layer_as_transformers_does(checkpoint, tmp_path):
    """use_sliding_window with an 8-key window over 24 tokens: transformers windows every layer (dense and sparse);
    so does jaxspec, within the same tolerance (with the window ignored the test fails on the logits)."""
    import json
    import shutil

    import torch
    import transformers
    path, _, token_ids, _ = checkpoint
    windowed = tmp_path / "windowed"
    shutil.copytree(path, windowed)
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 8}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(windowed), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids.tolist()])).logits[0].double().numpy()
    model = load_model(windowed, dtype="float32")
    assert model.config.sliding_window == 8 and model.config.sliding_layers is None
    got = np.asarray(model.score(token_ids), np.float64)
    assert float(np.abs(got - logits).max() / np.abs(logits).max()) <= TOLERANCE


def test_ngram_speculation_is_lossless_and_async_equals_sync(checkpoint):
    """n-gram drafts (matched down to one token: a random model repeats little) verified through the MoE layer:
    transformers' greedy tokens, and the same drafted and accepted counts async and sync."""
    path, refs, _, _ = checkpoint
    target = load_model(path, dtype="float32")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    counts = {}
    for mode in (True, False):
        llm = LLM(target, **ENGINE, speculative_config=spec, async_scheduling=mode)
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == refs
        s = llm.stats()["spec"]
        counts[mode] = (s["draft_tokens"], s["accepted_tokens"])
    assert counts[True] == counts[False] and counts[True][0] > 0, counts


@pytest.mark.parametrize("grouped_matmul", ["xla", "pallas"])
def test_tokens_not_routed_cost_no_expert_and_keep_their_input(checkpoint, grouped_matmul):
    """A step's padding tokens (writes_state false) are routed to no expert: the experts' groups count only the
    routed tokens' pairs (so the grouped matmul reads no expert for padding), the routed tokens' outputs are those
    of routing every token, and the others get their input back (finite, though their rows of the grouped matmul
    are never written)."""
    import dataclasses

    import jax.numpy as jnp

    from jaxspec.nn.layers import moe, route_by_expert
    from jaxspec.nn.ops import Ops
    path, _, _, _ = checkpoint
    model = load_model(path, dtype="float32")
    c = model.config
    lp = {name: w[0] for name, w in model.params["layers"]["attention_moe"].items()}
    ops = dataclasses.replace(Ops.for_backend(block_size=4), grouped_matmul=grouped_matmul)
    h = jnp.asarray(np.random.default_rng(3).standard_normal((8, c.hidden_size)), jnp.float32)
    routed = jnp.asarray([True, False, True, True, False, False, True, False])
    top_e = jnp.asarray(np.random.default_rng(4).integers(0, c.num_experts, (8, c.num_experts_per_tok)))
    assert int(route_by_expert(top_e, c.num_experts, routed).group_sizes.sum()) == 4 * c.num_experts_per_tok
    every = np.asarray(moe(c, ops, lp, h))
    some = np.asarray(moe(c, ops, lp, h, routed))
    r = np.asarray(routed)
    np.testing.assert_allclose(some[r], every[r], rtol=0, atol=1e-6)
    assert (some[~r] == np.asarray(h)[~r]).all() and not np.allclose(every[~r], np.asarray(h)[~r])
