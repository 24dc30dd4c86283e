"""Gemma 3 (issue #39): a tiny random checkpoint written by transformers' Gemma3ForCausalLM, three layers (local,
global, local) whose differences all bite: an 8-key window shorter than the prompts on the local layers, a local
rotary base (1e3) apart from the global one (1e5, linear scaling 4), query_pre_attn_scalar 24 against head_dim 16,
the (1 + w) norms with weights away from zero. Logits within the float32 rounding measured against transformers
(the dense path, and paged prefill chunks, a decode token and a verify segment); greedy generation through the
engine equal to transformers' `generate` (scanned layers on the reference attention, unrolled ones on the fused
Pallas kernel); draft-model and n-gram speculation lossless, drafts accepted, async == sync; the vision-language
`gemma3` checkpoint's text model (both of its tensor layouts); the 4B/12B shapes; the refused fields."""
import dataclasses
import json

import numpy as np
import pytest

from conftest import TINY_DIMS, hf_greedy, perturbed, randomize_
from jaxspec import LLM, SamplingParams
from jaxspec.models import load_model
from jaxspec.models.config import ModelConfig
from jaxspec.models.errors import UnsupportedModelError

# Measured on the CPU (float32): 2.1e-7 of the largest logit, dense and paged; five times that.
TOLERANCE = 1e-6
WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
PROMPTS = [[(7 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate((5, 13))] + [[3, 4, 5, 6, 7] * 4]
MAX_TOKENS = 12
ENGINE = dict(dtype="float32", max_num_seqs=3, max_model_len=64, max_num_batched_tokens=16, block_size=4,
              warmup=False)


def tiny_config():
    import transformers
    dims = {**TINY_DIMS, "num_hidden_layers": len(LAYER_TYPES)}
    return transformers.Gemma3TextConfig(
        **dims, head_dim=16, sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=24,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})


def relative_error(got, ref) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def hf_logits(hf, token_ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return hf(torch.tensor([list(token_ids)])).logits[0].double().numpy()


def tiny_model():
    """transformers' Gemma3ForCausalLM of `tiny_config`, random weights (float32)."""
    import torch
    import transformers
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(tiny_config())
    randomize_(hf, 0)
    with torch.no_grad():   # Gemma's norms scale by (1 + w): w around 0, as trained ones are
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers' model loaded back from it, its greedy continuations of PROMPTS)."""
    import torch
    import transformers
    path = tmp_path_factory.mktemp("gemma3")
    tiny_model().save_pretrained(str(path), safe_serialization=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf, [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint[0], dtype="float32")


def test_config_reads_each_layers_window_and_rotary(model):
    c = model.config
    assert c.arch == "gemma3" and c.layer_types == ("gemma3_attention",) * 3 and c.tie_word_embeddings
    assert c.sliding_window == WINDOW and c.sliding_layers == (True, False, True)
    assert c.local_rope_layers == (True, False, True) and c.local_rope_theta == 1000.0
    assert c.rope_theta == 100000.0 and c.rope_scaling_dict == {"rope_type": "linear", "factor": 4.0}
    assert c.query_pre_attn_scalar == 24.0 and c.hidden_act == "gelu_pytorch_tanh"
    assert model.params["final_norm"].dtype == np.float32   # 1 + w, as transformers computes it


def test_logits_match_transformers_and_each_difference_bites(checkpoint, model):
    _, hf, _ = checkpoint
    token_ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 30)
    ref = hf_logits(hf, token_ids)
    error = relative_error(model.score(token_ids), ref)
    print(f"gemma3 dense logits: max |error| / max |logit| = {error:.2e}")
    assert error <= TOLERANCE
    c = model.config
    for wrong in (dict(sliding_window=None, sliding_layers=None),          # no window
                  dict(local_rope_layers=None, local_rope_theta=None),      # the global rotary everywhere
                  dict(query_pre_attn_scalar=None)):                        # scores scaled by head_dim ** -0.5
        changed = dataclasses.replace(model, config=dataclasses.replace(c, **wrong))
        assert relative_error(changed.score(token_ids), ref) > 1e-3, wrong


# ---- paged steps straight through the decoder: prefill chunks, a decode token, a verify segment -----------------

BS, MB, SLOTS = 4, 8, 3   # block size, blocks per slot, request slots


def ragged_batch(rows, num_tokens: int = 24):
    """rows: [(slot, start position, token ids)], each row's tokens contiguous, then padding that writes no KV
    (`first_in_step` set: the fused kernel reads the step's own keys from the step)."""
    import jax.numpy as jnp
    from jaxspec.nn.ops import ForwardBatch
    ids, pos, kv, row_of, first, slot_of = [], [], [], [], [], []
    for r, (slot, start, tokens) in enumerate(rows):
        first.append(len(ids))
        slot_of.append(slot)
        ids += tokens
        pos += range(start, start + len(tokens))
        kv += range(slot * MB * BS + start, slot * MB * BS + start + len(tokens))
        row_of += [r] * len(tokens)
    real, pad = len(ids), num_tokens - len(ids)
    in_step = [first[r] for r in row_of] + list(range(real, num_tokens))
    ids, pos, kv, row_of = ids + [0] * pad, pos + [0] * pad, kv + [SLOTS * MB * BS] * pad, row_of + [len(rows)] * pad
    first.append(real)
    slot_of.append(SLOTS)
    tables = np.array([np.arange(s * MB, (s + 1) * MB) if s < SLOTS else np.zeros(MB, int) for s in slot_of])
    i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)   # noqa: E731
    return ForwardBatch(i32(ids), i32(pos), i32(kv), i32(row_of), i32(tables), i32(np.arange(num_tokens)),
                        slot_of_row=i32(slot_of), first_token_of_row=i32(first),
                        writes_state=jnp.arange(num_tokens) < real, first_in_step=i32(in_step))


@pytest.mark.parametrize("attention,unroll", [("reference", False), ("pallas", True)])
def test_paged_prefill_decode_and_verify_logits_match_transformers(checkpoint, model, attention, unroll):
    """Ragged steps over the paged KV: prefill chunks across the window's edge, a decode token, a verify segment
    of 1 + 3 drafts, all transformers' logits. Scanned layers pick their window and rotary by index; unrolled ones
    see them static, and the fused Pallas kernel (interpreted) reads the float32 q/k norms with the query scale
    folded in."""
    import jax
    import jax.numpy as jnp
    from jaxspec.nn import schema
    from jaxspec.nn.decoder import Decoder
    from jaxspec.nn.layers import CacheShape
    from jaxspec.nn.ops import Ops
    _, hf, _ = checkpoint
    decoder = Decoder(model.config, Ops(attention=attention, block_size=BS, unroll=unroll))
    assert decoder.ops.fuses_kv_write(ragged_batch([])) == (attention == "pallas")
    forward = jax.jit(decoder.forward)
    state = schema.initialize(decoder.state_schema(CacheShape(SLOTS * MB * BS, SLOTS + 1, 3)), jnp.float32)
    rng = np.random.default_rng(1)
    a, b = [int(t) for t in rng.integers(0, 256, 20)], [int(t) for t in rng.integers(0, 256, 10)]
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)

    def step(state, rows):
        logits, _, _, state = forward(model.params, state, ragged_batch(rows))
        return np.asarray(logits, np.float64), state

    errors = []
    logits, state = step(state, [(0, 0, a[:12]), (2, 0, b[:6])])                  # prefill chunks
    errors += [relative_error(logits[:12], ref_a[:12]), relative_error(logits[12:18], ref_b[:6])]
    logits, state = step(state, [(0, 12, a[12:19]), (2, 6, b[6:10])])            # a chunk; a verify segment
    errors += [relative_error(logits[:7], ref_a[12:19]), relative_error(logits[7:11], ref_b[6:10])]
    logits, state = step(state, [(0, 19, a[19:])])                                # decode
    errors.append(relative_error(logits[:1], ref_a[19:]))
    print(f"gemma3 paged logits ({attention}; prefill, chunk, verify, decode): max error {max(errors):.2e}")
    assert max(errors) <= TOLERANCE, errors


# ---- the engine ---------------------------------------------------------------------------------------------

def generate(llm, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_greedy_generation_equals_transformers(checkpoint, model):
    """Across the window's edge, with chunked prefill (the 20-token prompt over 16-token steps)."""
    assert generate(LLM(model, **ENGINE)) == checkpoint[2]


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculation_is_lossless_and_async_equals_sync(checkpoint, model, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = perturbed(model, 0.05, 1)
    runs = {}
    for async_scheduling in (True, False):
        llm = LLM(model, **ENGINE, speculative_config=spec, async_scheduling=async_scheduling)
        runs[async_scheduling] = (generate(llm), llm.stats()["spec"])
    (tokens, counts), (sync_tokens, sync_counts) = runs[True], runs[False]
    assert tokens == checkpoint[2] == sync_tokens
    assert 0 < counts["accepted_tokens"] <= counts["draft_tokens"], counts
    assert (counts["accepted_tokens"], counts["draft_tokens"]) == (sync_counts["accepted_tokens"],
                                                                    sync_counts["draft_tokens"])


# ---- the vision-language checkpoint's text model -----------------------------------------------------------------

@pytest.mark.parametrize("layout", ["model.language_model.", "language_model.model."])
def test_vision_language_checkpoint_loads_its_text_model(checkpoint, model, tmp_path, layout):
    """config.json with the text model's config nested in `text_config` (and the vision tower's beside it), the
    text model's tensors under the language model's prefix (transformers 5's, or the published checkpoints'), a
    vision tower's tensors that are not read: the same logits."""
    from safetensors.numpy import load_file, save_file
    path, hf, _ = checkpoint
    text = json.loads((path / "config.json").read_text())
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
              "text_config": text, "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16},
              "mm_tokens_per_image": 4, "tie_word_embeddings": True}
    tensors = {layout + name[len("model."):]: value for name, value in load_file(path / "model.safetensors").items()}
    vision = "model.vision_tower." if layout.startswith("model.") else "vision_tower."
    tensors[vision + "vision_model.encoder.layers.0.layer_norm1.weight"] = np.ones(16, np.float32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, tmp_path / "model.safetensors")
    wrapped = load_model(tmp_path, dtype="float32")
    assert dataclasses.replace(wrapped.config, eos_token_ids=model.config.eos_token_ids) == model.config
    assert wrapped.config.eos_token_ids == (1, 106)
    token_ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 30)
    np.testing.assert_array_equal(wrapped.score(token_ids), model.score(token_ids))


def test_published_sparse_text_config_takes_transformers_defaults():
    """The published gemma-3-4b-it config.json names only what differs from transformers' defaults: the rest
    (heads, head_dim, the local base, the window pattern, query_pre_attn_scalar) comes from them, as the shapes of
    `--random-weights gemma-3-4b` have it."""
    from jaxspec.models.random import KNOWN_SHAPES
    published = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                 "eos_token_id": [1, 106], "text_config": {
                     "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                     "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                     "sliding_window": 1024}, "vision_config": {"model_type": "siglip_vision_model"}}
    assert ModelConfig.from_hf(published) == KNOWN_SHAPES["gemma-3-4b"]


@pytest.mark.parametrize("name,billions", [("gemma-3-4b", 3.9), ("gemma-3-12b", 11.8)])
def test_preset_shapes_declare_their_params(name, billions):
    """The random-weights shapes: every layer gemma3_attention, every 6th global; the param count (abstract, nothing
    allocated) that of the published text model."""
    import math
    from jaxspec.models.random import KNOWN_SHAPES
    from jaxspec.nn.decoder import Decoder
    from jaxspec.nn.schema import tree_map
    import jax
    c = KNOWN_SHAPES[name]
    assert c.layer_window(5) is None and c.layer_window(4) == 1024 and not c.local_rope_layers[11]
    shapes = jax.tree_util.tree_leaves(tree_map(lambda s: s.shape, Decoder(c).param_schema()),
                                       is_leaf=lambda x: isinstance(x, tuple))
    assert sum(map(math.prod, shapes)) / 1e9 == pytest.approx(billions, abs=0.1)


# ---- refused fields ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,message", [
    ("final_logit_softcapping", 30.0, r"final_logit_softcapping=30.0 is not supported .*supported: "
                                      r"final_logit_softcapping null"),
    ("attn_logit_softcapping", 50.0, r"attn_logit_softcapping=50.0 is not supported"),
    ("use_bidirectional_attention", True, r"use_bidirectional_attention=true is not supported"),
    ("hidden_activation", "gelu", r"unsupported hidden_activation 'gelu' .*supported: gelu_pytorch_tanh"),
    ("attention_bias", True, r"attention_bias=true is not supported for model_type='gemma3_text'"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 8.0}},
     r"rope_parameters\['full_attention'\] rope_type='yarn' is not supported .*supported: default, linear"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "linear", "factor": 2.0}},
     r"rope_parameters\['sliding_attention'\] rope_type='linear' is not supported .*supported: default"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0},
     r"rope_parameters=.* has rope_theta, rope_type; supported: a dict keyed by layer type"),
])
def test_unimplemented_fields_are_refused_by_name(field, value, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf({"model_type": "gemma3_text", "num_hidden_layers": 2, field: value})
