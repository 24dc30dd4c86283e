"""Hybrid models (Gated DeltaNet + gated attention; Qwen3.5 dense and MoE, Qwen3-Next with MoE) against
transformers' own pure-torch definitions, on tiny random checkpoints written by transformers' `save_pretrained`:

  - prefill, decode and a (1+k)-token verify-shaped ragged step give transformers' logits;
  - for each accepted count a in 0..k the per-slot state the next step reads (conv window and delta-rule state)
    is plain decoding's over the same tokens;
  - greedy generation equals transformers' `generate`; with speculation (n-gram, draft model, MTP), chunked prefill
    and forced preemption, async and sync give the same tokens and counts, equal to plain greedy;
  - MTP: the head read from the checkpoint's mtp.* tensors gives a reference's logits (transformers' own layer
    inside the published MTP wiring), and after every step the device's drafts are the reference's proposals (as
    are a hybrid draft model's its dense greedy continuation);
  - prefix caching is refused for them with a reason;
  - in the GPU layout (unrolled layers, the Pallas attention interpreted), on one device and split over 2 and 4
    devices, plain decoding of the MoE hybrid and MTP drafting give transformers' tokens and logprobs and the
    reference head's drafted and accepted counts.
"""
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import hf_greedy, perturbed, randomize_
from reference import MtpReference, check_drafts_every_step, zero_centred_rms_norm
from jaxspec import LLM, SamplingParams
from jaxspec.models import load_model
from jaxspec.models.model import Model
from jaxspec.nn import Decoder, schema
from jaxspec.nn.layers import CacheShape
from jaxspec.nn.ops import ForwardBatch, Ops

# max|diff| / max|ref| of the logits; measured: <= 6.2e-6 (the ragged steps; prefill 3.1e-6, MTP head 4.5e-6)
TOLERANCE = 5e-5

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256)
HYBRIDS = {
    # Qwen3.5 dense: two Gated DeltaNet layers around a gated full-attention layer
    "qwen3_5": ("Qwen3_5TextConfig", dict(num_hidden_layers=3,
                                          layer_types=["linear_attention", "full_attention", "linear_attention"])),
    # Qwen3-Next: MoE (4 experts, top 2, renormalised) with a gated shared expert in every layer
    "qwen3_next": ("Qwen3NextConfig", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48)),
    # Qwen3.5 MoE (no dense MLP width in its config; top-k weights always renormalised)
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(num_hidden_layers=2,
                                                 layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48, intermediate_size=None)),
}
ENGINE_MODELS = ["qwen3_5", "qwen3_next"]   # through the engine (qwen3_5_moe differs from qwen3_next in loading only)


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    import torch
    import transformers
    root = tmp_path_factory.mktemp("tiny_hybrid")
    dirs = {}
    for i, (name, (cls, extra)) in enumerate(HYBRIDS.items()):
        torch.manual_seed(i)
        kwargs = {k: v for k, v in {**DIMS, **extra}.items() if v is not None}
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kwargs),
                                                              dtype=torch.float32)
        randomize_(model, i)   # O(1) weights: logits far from flat
        model.save_pretrained(str(root / name))
        dirs[name] = root / name
    return dirs


@pytest.fixture(scope="module")
def hf_models(hybrid_dirs):
    import torch
    import transformers
    return {name: transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
            for name, d in hybrid_dirs.items()}


@pytest.fixture(scope="module")
def models(hybrid_dirs):
    return {name: load_model(d, dtype="float32") for name, d in hybrid_dirs.items()}


def hf_logits(hf, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return hf(torch.tensor([list(ids)])).logits[0].double().numpy()


def relative_error(got, ref) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_prefill_matches_transformers(models, hf_models, name):
    ids = np.random.default_rng(0).integers(0, DIMS["vocab_size"], 24)
    assert relative_error(models[name].score(ids), hf_logits(hf_models[name], ids)) <= TOLERANCE


def test_nested_qwen3_5_checkpoint_loads_the_same_params(hybrid_dirs, models, tmp_path):
    """A Qwen3.5 vision-language checkpoint: config.json nests the text model's config under `text_config`, its
    tensors are `model.language_model.*` (vision and `mtp.*` tensors beside them are not read)."""
    from safetensors.numpy import load_file, save_file
    src = hybrid_dirs["qwen3_5"]
    text = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": False,
         "text_config": text, "vision_config": {"depth": 1}}))
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors["model.visual.patch_embed.proj.weight"] = np.zeros((2, 2), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    nested = load_model(tmp_path, dtype="float32")
    assert nested.config == models["qwen3_5"].config
    jax.tree_util.tree_map(np.testing.assert_array_equal, nested.params, models["qwen3_5"].params)


# ---- ragged steps straight through the decoder ------------------------------------------------------------

BS, MB, SLOTS, K_SPEC = 4, 8, 3, 3   # block size, blocks per slot, request slots (+1 trash slot), drafts per step
CACHE = CacheShape(num_kv_slots=SLOTS * MB * BS, num_slots=SLOTS + 1, num_speculative_tokens=K_SPEC)


def ragged_batch(rows, num_tokens: int = 16) -> ForwardBatch:
    """rows: [(slot, start position, token ids)], each row's tokens contiguous, then padding (a row on the trash
    slot that writes no KV and no per-slot state) -> a batch with logits at every token."""
    ids, pos, kv, row_of, first, slot_of = [], [], [], [], [], []
    for r, (slot, start, tokens) in enumerate(rows):
        first.append(len(ids))
        slot_of.append(slot)
        for j, t in enumerate(tokens):
            ids.append(t)
            pos.append(start + j)
            kv.append(slot * MB * BS + start + j)
            row_of.append(r)
    real, pad = len(ids), num_tokens - len(ids)
    first.append(len(ids))
    slot_of.append(SLOTS)
    ids += [0] * pad
    pos += [0] * pad
    kv += [CACHE.num_kv_slots] * pad
    row_of += [len(rows)] * pad
    tables = np.array([np.arange(s * MB, (s + 1) * MB) if s < SLOTS else np.zeros(MB, int) for s in slot_of])
    i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)   # noqa: E731
    return ForwardBatch(i32(ids), i32(pos), i32(kv), i32(row_of), i32(tables), i32(np.arange(num_tokens)),
                        slot_of_row=i32(slot_of), first_token_of_row=i32(first),
                        writes_state=jnp.arange(num_tokens) < real)


class Stepper:
    """Decoder.forward on a paged state, as the step runs it."""

    def __init__(self, model: Model):
        self.decoder = Decoder(model.config, Ops(attention="reference", block_size=BS))
        self.params = model.params
        self.fwd = jax.jit(self.decoder.forward)

    def init(self):
        return schema.initialize(self.decoder.state_schema(CACHE), jnp.float32)

    def __call__(self, state, rows):
        """-> (logits [T, V], state after the step)."""
        logits, _, _, state = self.fwd(self.params, state, ragged_batch(rows))
        return np.asarray(logits, np.float64), state


def state_read_by_step_at(state, slot: int, start: int, K: int) -> dict:
    """What a step whose row starts at position `start` reads of the slot, every Gated DeltaNet layer: the conv
    inputs of positions start-K+1..start-1 and the delta-rule state after position start-1 (their ring
    entries, position % ring size)."""
    conv, ssm = state["gated_deltanet"]["conv"], state["gated_deltanet"]["ssm"]
    inputs = [(start - lag) % conv.shape[2] for lag in range(K - 1, 0, -1)]
    return {"conv": np.asarray(conv[:, slot, np.array(inputs)]),
            "ssm": np.asarray(ssm[:, slot, (start - 1) % ssm.shape[2]])}


@pytest.mark.parametrize("name", ["qwen3_5"])   # the MoE changes nothing here (qwen3_next: prefill, generate)
def test_prefill_decode_and_verify_steps_keep_each_accepted_counts_state(models, hf_models, name):
    """Ragged steps of two rows (prefill chunks longer than the rings, a decode token, a 1+k verify segment) give
    transformers' logits at every token; after the verify step, for each accepted count a (0..k), what a next
    step starting after the a-th draft reads of the slot is plain decoding's state over the same tokens, and
    that next step gives transformers' logits. Per slot and layer the state is k+1 delta-rule states and K-1+k
    conv inputs, whatever the step's token count."""
    hf, stepper, k = hf_models[name], Stepper(models[name]), K_SPEC
    c = models[name].config
    K, n_gdn = c.linear_conv_kernel_dim, c.layer_types.count("gated_deltanet")
    rng = np.random.default_rng(1)
    a_seq, b_seq = [int(t) for t in rng.integers(0, 128, 11)], [int(t) for t in rng.integers(0, 128, 5)]
    drafts = [int(t) for t in rng.integers(0, 128, k)]
    ref_a = hf_logits(hf, a_seq)
    # step 1: prefill chunks of both rows (A's first chunk, longer than either ring; B's prompt but its last token)
    state = stepper.init()
    gdn = state["gated_deltanet"]
    C = gdn["conv"].shape[-1]
    assert gdn["conv"].shape == (n_gdn, SLOTS + 1, K - 1 + k, C)
    assert gdn["ssm"].shape == (n_gdn, SLOTS + 1, k + 1, c.linear_num_value_heads, c.linear_key_head_dim,
                                c.linear_value_head_dim)
    logits, state = stepper(state, [(0, 0, a_seq[:7]), (2, 0, b_seq[:4])])
    assert relative_error(logits[:7], ref_a[:7]) <= TOLERANCE
    assert relative_error(logits[7:11], hf_logits(hf, b_seq[:4])) <= TOLERANCE
    # step 2: A's second chunk (reads its slot's conv inputs and delta-rule state), B verifies [its token + k drafts]
    logits, after = stepper(state, [(0, 7, a_seq[7:10]), (2, 4, b_seq[4:5] + drafts)])
    assert relative_error(logits[:3], ref_a[7:10]) <= TOLERANCE
    ref_b = hf_logits(hf, b_seq + drafts)
    assert relative_error(logits[3:3 + k + 1], ref_b[4:]) <= TOLERANCE
    # step 3: A decodes one token
    logits, _ = stepper(after, [(0, 10, a_seq[10:])])
    assert relative_error(logits[:1], ref_a[10:]) <= TOLERANCE
    for accepted in range(k + 1):
        seq = b_seq + drafts[:accepted]          # B's tokens when the step accepted `accepted` drafts
        _, plain = stepper(stepper.init(), [(1, 0, seq)])              # plain decoding of the same tokens
        want, got = state_read_by_step_at(plain, 1, len(seq), K), state_read_by_step_at(after, 2, len(seq), K)
        for field in want:
            np.testing.assert_allclose(got[field], want[field], rtol=1e-5, atol=1e-5, err_msg=f"{field} a={accepted}")
        # the next step starts after the accepted drafts (its KV past them rewritten) and continues exactly
        nxt = int(rng.integers(0, 128))
        logits, _ = stepper(after, [(2, len(seq), [nxt])])
        assert relative_error(logits[:1], hf_logits(hf, seq + [nxt])[-1:]) <= TOLERANCE


# ---- through the engine -------------------------------------------------------------------------------------

PROMPTS = [[5, 9, 17, 3, 5, 9, 17, 3, 5], [100, 2, 60], [7, 7, 8, 7, 7, 8, 7, 7, 8, 7, 7], [33, 44, 55, 66, 77],
           [1, 2, 3, 4, 1, 2, 3]]
MAX_TOKENS = [14, 9, 12, 6, 11]   # requests finish at different steps: rows move, new requests join
ENGINE = dict(max_num_seqs=3, max_model_len=48, block_size=4)


@pytest.fixture(scope="module")
def greedy_refs(hf_models):
    return {name: [hf_greedy(hf_models[name], p, n) for p, n in zip(PROMPTS, MAX_TOKENS)] for name in ENGINE_MODELS}


def run(llm) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("name", ENGINE_MODELS)
def test_greedy_generation_equals_transformers_generate(models, greedy_refs, name):
    llm = LLM(models[name], **ENGINE, max_num_batched_tokens=32, warmup=False)
    assert run(llm) == greedy_refs[name]
    pc = llm.stats()["prefix_cache"]
    assert pc["enabled"] is False and "gated_deltanet" in pc["disabled_reason"] and "recurrent" in pc["disabled_reason"]


# ---- MTP drafting: the mtp.* head written into copies of the tiny checkpoints ---------------------------------

MTP_K = 3


def mtp_layer_model(hybrid_dir, seed: int, gain: float = 1.0):
    """transformers' own base model of the checkpoint's family with a single full-attention layer and O(1) random
    weights: the MTP layer (its layers.0) and the MTP norm (its final norm). `gain` scales the layer's output
    projections (attention and MLP/experts): below 1 the layer moves its input less."""
    import torch
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(str(hybrid_dir))
    cfg.num_hidden_layers, cfg.layer_types = 1, ["full_attention"]
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                p.mul_(gain)
    return model.eval()


def mtp_tensors(layer_model, tmp_dir, seed: int) -> dict:
    """The mtp.* tensors of a checkpoint: the layer model's layer and final norm (named as save_pretrained writes
    them), a random fc [D, 2D] and the two pre-fc norms (zero-centred weights)."""
    from safetensors.numpy import load_file
    layer_model.save_pretrained(str(tmp_dir))
    saved = load_file(str(tmp_dir / "model.safetensors"))
    tensors = {"mtp." + k: v for k, v in saved.items() if k.startswith(("layers.0.", "norm."))}
    D = layer_model.config.hidden_size
    rng = np.random.default_rng(seed)
    tensors["mtp.fc.weight"] = (rng.standard_normal((D, 2 * D)) / np.sqrt(2 * D)).astype(np.float32)
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        tensors[name] = (0.2 * rng.standard_normal(D)).astype(np.float32)
    return tensors


def checkpoint_with(src, dst, tensors: dict, drop: tuple = ()):
    """A copy of the checkpoint directory `src` at `dst`, `tensors` added to its safetensors and `drop` left out."""
    import shutil
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    merged = {k: v for k, v in {**load_file(str(dst / "model.safetensors")), **tensors}.items() if k not in drop}
    save_file(merged, str(dst / "model.safetensors"))
    return dst


def fit_fc_to_the_targets_tokens(reference: MtpReference, sequences) -> np.ndarray:
    """An fc [D, 2D] under which the head predicts the token two ahead on `sequences` (the target's greedy runs):
    least squares from each pair's normed input z_p = [norm(embed(t_{p+1})); norm(h_p)] to the lm_head row of
    t_{p+2}. With the layer damped the head's output points near that row, so many first drafts are the target's
    own tokens and later ones often are not: partial acceptance."""
    import torch
    z, want = [], []
    lm_head = reference.target.get_output_embeddings().weight.detach()
    t = reference.t
    for seq in sequences:
        h = reference.target_hidden(seq)
        with torch.no_grad():
            emb = reference.target.get_input_embeddings()(torch.as_tensor(seq))
        pair = torch.cat([zero_centred_rms_norm(emb[1:], t["mtp.pre_fc_norm_embedding.weight"], reference.eps),
                          zero_centred_rms_norm(h[:-1], t["mtp.pre_fc_norm_hidden.weight"], reference.eps)], -1)
        z.append(pair[:-1].numpy())
        want.append(lm_head[torch.as_tensor(seq[2:])].numpy())
    fc, *_ = np.linalg.lstsq(np.concatenate(z), np.concatenate(want), rcond=None)
    return np.ascontiguousarray(fc.T, np.float32)   # C order: safetensors writes the buffer as it lies


@pytest.fixture(scope="module")
def mtp_checkpoints(hybrid_dirs, hf_models, greedy_refs, tmp_path_factory):
    """name -> (directory, MtpReference): "qwen3_5" and "qwen3_next" with a random MTP head at full gain (the
    forward check), "qwen3_5_fitted" with a damped layer and an fc fitted to the target's greedy runs of PROMPTS
    (drafts accepted, some)."""
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for i, (name, gain) in enumerate([("qwen3_5", 1.0), ("qwen3_next", 1.0), ("qwen3_5_fitted", 0.1)]):
        family = name.removesuffix("_fitted")
        layer_model = mtp_layer_model(hybrid_dirs[family], seed=10 + i, gain=gain)
        tensors = mtp_tensors(layer_model, root / f"{name}-layer", seed=20 + i)
        reference = MtpReference(hf_models[family], layer_model, tensors)
        if name.endswith("_fitted"):
            runs = [p + g for p, g in zip(PROMPTS, greedy_refs[family])]
            tensors["mtp.fc.weight"] = fit_fc_to_the_targets_tokens(reference, runs)
            reference = MtpReference(hf_models[family], layer_model, tensors)
        out[name] = (checkpoint_with(hybrid_dirs[family], root / name, tensors), reference)
    return out


def dense_pairs_batch(n: int) -> ForwardBatch:
    """One unpaged sequence of n tokens, position p at KV slot p."""
    positions = jnp.arange(n, dtype=jnp.int32)
    return ForwardBatch(positions, positions, positions, jnp.zeros(n, jnp.int32), jnp.zeros((1, 1), jnp.int32),
                        positions)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_mtp_head_matches_the_reference(mtp_checkpoints, name):
    """The MTP head loaded from the checkpoint's mtp.* tensors gives the reference's logits on every pair (target
    hidden p, token p+1) of a sequence: fc over the two normed inputs, the full-attention layer (dense MLP for
    Qwen3.5, MoE for Qwen3-Next), the final norm and the target's lm_head."""
    from jaxspec.decode.drafters.mtp import load_mtp_head
    path, reference = mtp_checkpoints[name]
    target = load_model(path, dtype="float32")
    head, params = load_mtp_head(path, target.config, jnp.float32)
    ids = [int(t) for t in np.random.default_rng(3).integers(0, DIMS["vocab_size"], 20)]
    n = len(ids) - 1

    @jax.jit
    def pair_logits(target_params, params, ids):
        _, hidden, _ = Decoder(target.config).dense_forward(target_params, ids)             # after the final norm
        kv = schema.initialize(head.state_schema(CacheShape(num_kv_slots=n, num_slots=1)), jnp.float32)["attention"]
        batch = dense_pairs_batch(n)._replace(token_ids=ids[1:])
        dense = Ops(attention="dense", block_size=n)
        out, _ = head.forward(dense, params, target_params, kv, ids[1:], hidden[:-1], batch)
        return head.logits(dense, params, target_params, out)

    got = pair_logits(target.params, params, jnp.asarray(ids, jnp.int32))
    assert relative_error(got, reference.pair_logits(ids)) <= TOLERANCE


def dense_greedy(model: Model, seq, n: int, length: int = ENGINE["max_model_len"]) -> list[int]:
    """The model's n greedy next tokens after `seq` by the dense forward (no paging, no steps; checked against
    transformers above), the sequence padded to `length` so that one compilation serves every prefix."""
    seq = list(seq)
    for _ in range(n):
        ids = np.zeros(length, np.int32)
        ids[:len(seq)] = seq
        seq.append(int(np.argmax(np.asarray(Decoder(model.config).score(model.params, ids))[len(seq) - 1])))
    return seq[-n:]


@pytest.mark.parametrize("method,delta_rule", [("mtp", "reference"), ("draft_model", "reference"), ("mtp", "pallas")])
def test_drafts_match_a_reference_after_every_step(models, mtp_checkpoints, method, delta_rule):
    """Two requests (a 3-token prompt, a 9-token one prefilled in chunks), sync: after every step the drafts the
    device holds for each are the reference's greedy proposals over the sequence so far, through partial
    acceptance. MTP: the reference head (its own output fed back for the later drafts), through the head's KV,
    the feature each slot saved and the target's rings. A draft model that is itself a hybrid: its dense greedy
    continuation, through its own rings (written by the folded pass and by the speculative single-token passes).
    With the Pallas delta-rule kernel (interpreted on a CPU) in place of the scan, the same."""
    if method == "mtp":
        path, reference = mtp_checkpoints["qwen3_5_fitted"]
        target, spec, propose = load_model(path, dtype="float32"), {}, reference.greedy_drafts
    else:
        target = models["qwen3_5"]
        draft = perturbed(target, 0.1, seed=5)
        spec = dict(model=draft)
        propose = functools.partial(dense_greedy, draft)
    llm = LLM(target, **ENGINE, max_num_batched_tokens=8, num_kv_blocks=13, async_scheduling=False, warmup=False,
              speculative_config=dict(method=method, num_speculative_tokens=MTP_K, **spec), delta_rule=delta_rule)
    engine = llm.engine
    # the short prompt first: its row is row 0, which also holds the batch's padding
    reqs = [engine.add_request(PROMPTS[i], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True))
            for i in (1, 0)]
    assert check_drafts_every_step(engine, reqs, lambda seq: propose(seq, MTP_K), MTP_K) >= 8
    spec = llm.stats()["spec"]
    assert 0 < spec["accepted_tokens"] < spec["draft_tokens"], spec


def test_mtp_needs_the_checkpoints_mtp_weights(hybrid_dirs, models, mtp_checkpoints, tmp_path):
    """method "mtp" is refused, naming the checkpoint and what it lacks, for a checkpoint without mtp.* tensors or
    with one missing, a target not loaded from a directory, and a target that is not a hybrid; params given in
    place of a checkpoint are checked against the head's declaration."""
    from conftest import random_model
    from jaxspec.decode.drafters.mtp import random_mtp_params
    from jaxspec.spec import SpeculativeConfig, build_drafter
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=2)
    with pytest.raises(ValueError, match=f"{hybrid_dirs['qwen3_5']}.*has no MTP weights"):
        build_drafter(spec, models["qwen3_5"])
    path, _ = mtp_checkpoints["qwen3_5"]
    partial = checkpoint_with(path, tmp_path / "partial", {}, drop=("mtp.norm.weight",))
    with pytest.raises(ValueError, match=r"partial.*lacks MTP tensor\(s\) \['mtp.norm.weight'\]"):
        build_drafter(spec, load_model(partial, dtype="float32"))
    with pytest.raises(ValueError, match="was not loaded from one"):
        build_drafter(spec, dataclasses.replace(models["qwen3_5"], source=None))
    with pytest.raises(ValueError, match="needs a Qwen3-Next or Qwen3.5 target.*'llama'"):
        build_drafter(spec, random_model(0))
    # benchmarks on random weights pass the head's params; they must be the declared ones
    params = random_mtp_params(models["qwen3_5"].config, "float32")
    drafter, got = build_drafter(dataclasses.replace(spec, model=params), models["qwen3_5"])
    assert drafter.method == "mtp" and got is params
    params["layers"]["gated_attention"]["o_proj"] = params["layers"]["gated_attention"]["o_proj"][:, :4]
    with pytest.raises(ValueError, match=r"the MTP params\['layers'\]\['gated_attention'\]\['o_proj'\] has shape"):
        build_drafter(dataclasses.replace(spec, model=params), models["qwen3_5"])


@pytest.mark.parametrize("method", ["draft_model", "ngram", "mtp"])
def test_speculation_async_equals_sync_equals_greedy_under_preemption_and_chunked_prefill(
        models, greedy_refs, mtp_checkpoints, method):
    """Qwen3.5 hybrid target, k=3, drafts partly rejected, prefill in chunks of 8 tokens, requests finishing and
    joining every few steps (rows move): every token is plain greedy's, async and sync, and async with a KV pool
    so small that requests are preempted and recomputed. Without preemption (whose points differ between async
    and sync, and with them the steps that verify drafts) the drafted and accepted counts are equal, per request
    and per draft position. One pool size for all runs: one compilation."""
    target = models["qwen3_5"]
    spec = dict(method=method, num_speculative_tokens=3)
    if method == "mtp":   # the same target weights, its checkpoint with the fitted MTP head
        target = load_model(mtp_checkpoints["qwen3_5_fitted"][0], dtype="float32")
    elif method == "draft_model":
        spec["model"] = perturbed(target, 0.1, seed=5)
    else:   # a random model repeats little: match down to one token so that some drafts are accepted
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    counts = {}
    for which, preempted, mode in ((slice(0, 5), True, True), (slice(1, 4), False, True), (slice(1, 4), False, False)):
        llm = LLM(target, **ENGINE, max_num_batched_tokens=8, num_kv_blocks=13, async_scheduling=mode,
                  speculative_config=spec, warmup=False)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS[which]]
        outs = llm.generate(PROMPTS[which], params, use_tqdm=False)
        assert [o.token_ids for o in outs] == greedy_refs["qwen3_5"][which]
        stats = llm.stats()
        assert (stats["num_preemptions"] > 0) == preempted
        assert 0 < stats["spec"]["accepted_tokens"] < stats["spec"]["draft_tokens"], stats["spec"]
        if not preempted:
            counts[mode] = ([(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs],
                            stats["spec"]["per_position_acceptance"])
    assert counts[True] == counts[False]


def test_unsupported_hybrid_configs_are_named(hybrid_dirs):
    """What is not built is refused with the field that asks for it: a mix of MoE and dense MLP layers, an unknown
    layer type."""
    from jaxspec.models.config import ModelConfig
    hf = json.loads((hybrid_dirs["qwen3_next"] / "config.json").read_text())
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_hf({**hf, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match=r"layer_types \['sliding_attention'\]"):
        ModelConfig.from_hf({**hf, "layer_types": ["linear_attention", "sliding_attention"]})
    config = ModelConfig.from_hf({k: v for k, v in hf.items() if k != "layer_types"} | {"num_hidden_layers": 4})
    assert config.layer_types == ("gated_deltanet",) * 3 + ("gated_attention",)   # full attention every 4th


# ---- the GPU layout, on one device and split over 2 and 4 -----------------------------------------------------

def hf_log_probs(hf, ids) -> np.ndarray:
    """transformers' log-softmax after each token of `ids` [len(ids), V] (float64)."""
    logits = hf_logits(hf, ids)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


# A 3-token prompt that samples at once beside a 9-token one prefilled in two chunks: every step has a row that
# samples (an engine compiles one step variant).
GPU_PROMPTS = [PROMPTS[1], PROMPTS[0]]
GPU_MAX_TOKENS = 9
LOGPROB_TOLERANCE = 2e-5   # max |engine - transformers| of a logprob: ~4.5e-6 measured


@pytest.mark.parametrize("name,method,tp", [("qwen3_next", None, 2), ("qwen3_next", None, 4),
                                            ("qwen3_5_fitted", "mtp", 1), ("qwen3_5_fitted", "mtp", 2),
                                            ("qwen3_5_fitted", "mtp", 4)])
def test_gpu_layout_matches_transformers(hf_models, models, mtp_checkpoints, name, method, tp):
    """The GPU layout (unrolled layers, the Pallas attention interpreted) for the Qwen3-Next MoE hybrid decoding
    plainly and the Qwen3.5 hybrid drafting with its fitted MTP head, on one device and with the model split over 2
    devices (its 2 KV heads one per device, the Pallas attention under shard_map) and 4 (attention replicated; the
    MLP, experts and vocabulary split): greedy tokens are transformers' `generate`, logprobs (the token's and the
    top 2) transformers' log-softmax, and MTP's drafted and accepted counts the host's step-by-step recomputation
    from the reference head's drafts (reference.greedy_spec_counts); drafts are accepted."""
    from reference import greedy_spec_counts
    from test_spec import logprob_errors
    k = MTP_K
    hf = hf_models[name.removesuffix("_fitted")]
    target = load_model(mtp_checkpoints[name][0], dtype="float32") if method == "mtp" else models[name]
    spec = dict(method=method, num_speculative_tokens=k) if method else None
    engine = dict(ENGINE, max_num_batched_tokens=8, num_kv_blocks=13, warmup=False, speculative_config=spec,
                  tensor_parallel_size=tp, attention="pallas", unroll_layers=True)
    if tp == 4:
        with pytest.warns(UserWarning, match="attention .* is replicated"):
            llm = LLM(target, **engine)
    else:
        llm = LLM(target, **engine)
    ops = llm.engine.runner.ops
    assert ops.unroll and ops.attention == "pallas" and (ops.tp is None if tp == 1 else ops.tp.size == tp)
    if name == "qwen3_next" and tp > 1:   # every expert split by its MLP width (the Gated DeltaNet stays whole)
        experts = llm.engine.runner.params["layers"]["gated_attention"]["experts_gate_up"]   # [n, E, D, F, 2]
        assert experts.sharding.spec == jax.sharding.PartitionSpec(None, None, None, "tp")
    outs = llm.generate(GPU_PROMPTS, SamplingParams(temperature=0, max_tokens=GPU_MAX_TOKENS, ignore_eos=True,
                                                    logprobs=2), use_tqdm=False)
    continuations = [p + hf_greedy(hf, p, GPU_MAX_TOKENS + k + 1) for p in GPU_PROMPTS]
    assert [o.token_ids for o in outs] == [c[len(p):len(p) + GPU_MAX_TOKENS]
                                           for p, c in zip(GPU_PROMPTS, continuations)]
    assert logprob_errors(GPU_PROMPTS, outs, functools.partial(hf_log_probs, hf)).max() < LOGPROB_TOLERANCE
    if method == "mtp":
        reference = mtp_checkpoints[name][1]
        expected = [greedy_spec_counts(c, len(p), GPU_MAX_TOKENS, ENGINE["max_model_len"], k,
                                       lambda seq: reference.greedy_drafts(seq, k))
                    for p, c in zip(GPU_PROMPTS, continuations)]
        assert [(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs] == [
            (e["draft_tokens"], e["accepted_tokens"]) for e in expected]
        spec = llm.stats()["spec"]
        assert 0 < spec["accepted_tokens"] < spec["draft_tokens"], spec
