"""GPT-OSS (issue #39): a tiny random checkpoint written by transformers, its two layers a sliding-window one (8 keys,
shorter than the prompts) and a full one, YaRN rotary, nonzero attention sinks and biases, 4 experts (2 per token)
whose gate/up weights are large enough that the clamped SwiGLU's clamps bite. Logits within float32 rounding of
transformers' (the dense prefill; the engine's prefill, decode and verify through logprobs); greedy generation equal
to transformers' `generate`; draft-model and n-gram speculation lossless, async == sync; MXFP4 experts dequantized
bit for bit as transformers does, and an MXFP4 checkpoint loading to transformers' logits."""
import json
import shutil

import numpy as np
import pytest

from conftest import hf_greedy, perturbed, randomize_
from jaxspec import LLM, SamplingParams
from jaxspec.models import load_model

WINDOW = 8
# max |jaxspec - transformers| / max |transformers| of the dense logits: 9.6e-7 measured; max |jaxspec - transformers|
# of a logprob through the engine: 1.6e-6 measured (prefill and decode), 1.1e-6 (verify).
TOLERANCE = 2e-6
LOGPROB_TOLERANCE = 5e-6
PROMPTS = [[(7 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate((5, 13, 21))]
MAX_TOKENS = 10
ENGINE = dict(dtype="float32", max_num_seqs=3, max_model_len=64, max_num_batched_tokens=16, block_size=4,
              warmup=False)
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
              max_position_embeddings=128, layer_types=["sliding_attention", "full_attention"],
              rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                   original_max_position_embeddings=32, rope_theta=150000.0))


def randomize_gpt_oss_(hf, seed: int):
    """conftest's randomize_, then the experts' [E, in, out] weights at 4x unit gain (so that |gate| and |up| pass the
    SwiGLU's limit of 7 often) and every bias and sink O(1) (transformers' init zeroes the experts' biases)."""
    import torch
    randomize_(hf, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.copy_(noise * (4.0 if "gate_up" in name else 1.0) / p.shape[-2] ** 0.5)
            elif name.endswith("bias") or name.endswith("sinks"):
                p.copy_(noise)


def hf_logits(hf, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return hf(torch.tensor([list(ids)])).logits[0].double().numpy()


def relative_error(got, ref) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(its directory, transformers' model loaded from it, greedy continuations of PROMPTS)."""
    import torch
    import transformers
    path = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**CONFIG), dtype=torch.float32)
    randomize_gpt_oss_(hf, 0)
    hf.save_pretrained(str(path), safe_serialization=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf, [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


def test_logits_match_transformers(checkpoint):
    path, hf, _ = checkpoint
    model = load_model(path, dtype="float32")
    c = model.config
    assert (c.arch, c.layer_types, c.sliding_window, c.sliding_layers) == ("gpt_oss", ("gpt_oss",) * 2, WINDOW,
                                                                            (True, False))
    assert c.rope_type == "yarn" and c.attention_bias and (c.num_experts, c.num_experts_per_tok) == (4, 2)
    token_ids = np.random.default_rng(0).integers(0, c.vocab_size, 30)
    error = relative_error(model.score(token_ids), hf_logits(hf, token_ids))
    print(f"GPT-OSS dense logits: max relative error {error:.2e}")
    assert error <= TOLERANCE


def generate(llm, logprobs=None):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)
    return llm.generate(PROMPTS, params, use_tqdm=False)


def logprob_error(hf, outs) -> float:
    from test_spec import logprob_errors
    return float(logprob_errors(PROMPTS, outs, lambda ids: log_softmax(hf_logits(hf, ids))).max())


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("grouped_matmul", ["xla", "pallas"])
def test_greedy_generation_and_logprobs_equal_transformers(checkpoint, grouped_matmul, monkeypatch):
    """Prefill (chunked: 16-token steps) and decode through the engine: transformers' tokens, and logprobs (the
    token's and the top 2) within float32 rounding of its log-softmax; the experts as XLA's ragged_dot and as the
    grouped-matmul kernel (interpreted here) that a GPU runs."""
    path, hf, refs = checkpoint
    monkeypatch.setenv("JAXSPEC_GROUPED_MATMUL", grouped_matmul)
    llm = LLM(str(path), **ENGINE)
    assert llm.engine.runner.ops.grouped_matmul == grouped_matmul
    outs = generate(llm, logprobs=2)
    assert [o.token_ids for o in outs] == refs
    error = logprob_error(hf, outs)
    print(f"GPT-OSS engine logprobs (prefill, decode): max error {error:.2e}")
    assert error < LOGPROB_TOLERANCE


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculation_is_lossless_and_async_equals_sync(checkpoint, method):
    """k = 3 drafts verified by the target (its sliding-window layer over the drafts too): the tokens are plain
    greedy's, logprobs transformers' (verify steps), drafts accepted; async and sync give the same tokens and drafted
    and accepted counts."""
    path, hf, refs = checkpoint
    target = load_model(path, dtype="float32")
    spec = dict(method=method, num_speculative_tokens=3)
    if method == "draft_model":
        spec["model"] = perturbed(target, 0.05, 1)
    else:   # a random model repeats little: match down to one token so that some drafts are accepted
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    counts = {}
    for mode in (True, False):
        llm = LLM(target, **ENGINE, speculative_config=spec, async_scheduling=mode)
        outs = generate(llm, logprobs=2 if mode else None)
        assert [o.token_ids for o in outs] == refs
        s = llm.stats()["spec"]
        assert s["accepted_tokens"] > 0, s
        counts[mode] = ([(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs],
                        s["per_position_acceptance"])
        if mode:
            error = logprob_error(hf, outs)
            print(f"GPT-OSS {method} verify logprobs: max error {error:.2e}")
            assert error < LOGPROB_TOLERANCE
    assert counts[True] == counts[False]


# ---- MXFP4 experts ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_dequantization_is_transformers_bit_for_bit(dtype):
    """Random blocks and every finite scale (0..254: subnormal results, overflow to infinity): the same bits as
    transformers' convert_moe_packed_tensors, in its layout [E, G*32, R]. A NaN scale (255) is refused."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jaxspec.models.dequant import dequantize_mxfp4
    from jaxspec.models.errors import CorruptModelFileError
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (2, 6, 255, 16), dtype=np.uint8)
    scales = np.broadcast_to(np.arange(255, dtype=np.uint8), (2, 6, 255)).copy()
    rng.permuted(scales, axis=-1, out=scales)
    torch_dtype = getattr(torch, dtype)
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch_dtype)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.shape == tuple(ref.shape) == (2, 255 * 32, 6)
    int_type = torch.int32 if dtype == "float32" else torch.int16
    assert np.array_equal(got.view(np.int32 if dtype == "float32" else np.int16), ref.view(int_type).numpy())
    scales[1, 2, 3] = 255
    with pytest.raises(CorruptModelFileError, match="experts.down_proj.*scale of 255"):
        dequantize_mxfp4(blocks, scales, dtype, "model.layers.0.mlp.experts.down_proj")


def test_an_mxfp4_checkpoint_loads_to_transformers_logits(checkpoint, tmp_path):
    """The checkpoint with its experts stored as MXFP4 (random blocks, scales around 2^0): jaxspec dequantizes them on
    load to the weights transformers dequantizes, and gives its logits."""
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file
    path, _, _ = checkpoint
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(4)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, K, N = tensors.pop(name).shape
        tensors[name + "_blocks"] = rng.integers(0, 256, (E, N, K // 32, 16), dtype=np.uint8)
        tensors[name + "_scales"] = rng.integers(124, 128, (E, N, K // 32), dtype=np.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    model = load_model(tmp_path, dtype="float32")
    experts = np.asarray(model.params["layers"]["gpt_oss"]["experts_down_proj"][1])
    assert np.array_equal(experts, hf.model.layers[1].mlp.experts.down_proj.detach().numpy())
    token_ids = np.random.default_rng(5).integers(0, 256, 20)
    assert relative_error(model.score(token_ids), hf_logits(hf, token_ids)) <= TOLERANCE


# ---- shapes and refusals ---------------------------------------------------------------------------------------

def test_gpt_oss_20b_shapes_declare_its_params():
    """The GPT-OSS-20B preset (`--random-weights gpt-oss-20b`): its declared weights' shapes, and ~20.9B of them,
    without allocating any."""
    import math

    from jaxspec.models.random import KNOWN_SHAPES
    from jaxspec.nn.decoder import Decoder
    from jaxspec.nn.schema import tree_map
    c = KNOWN_SHAPES["gpt-oss-20b"]
    assert c.sliding_layers == (True, False) * 12 and c.rope_type == "yarn"
    schema = Decoder(c).param_schema()
    layer = schema["layers"]["gpt_oss"]
    assert layer["experts_gate_up_proj"].shape == (24, 32, 2880, 5760)
    assert layer["experts_down_proj"].shape == (24, 32, 2880, 2880)
    assert layer["sinks"].shape == (24, 64) and layer["qkv_proj"].shape == (24, (64 + 2 * 8) * 64, 2880)
    sizes = []
    tree_map(lambda s: sizes.append(math.prod(s.shape)), schema)
    assert 20.8e9 < sum(sizes) < 21.0e9, sum(sizes)


def test_unimplemented_yarn_fields_are_refused_by_name(checkpoint):
    from jaxspec.models.config import ModelConfig
    from jaxspec.models.errors import UnsupportedModelError
    path, _, _ = checkpoint
    hf = json.loads((path / "config.json").read_text())
    for field in ("mscale", "attention_factor"):
        with pytest.raises(UnsupportedModelError, match=f"'yarn' sets {field}"):
            ModelConfig.from_hf({**hf, "rope_parameters": {**hf["rope_parameters"], field: 1.0}})
    with pytest.raises(UnsupportedModelError, match="'longrope'"):
        ModelConfig.from_hf({**hf, "rope_parameters": {**hf["rope_parameters"], "rope_type": "longrope"}})
