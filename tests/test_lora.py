"""LoRA adapters (jaxspec.lora) against transformers + peft: a tiny Qwen2 base (GQA, q/k/v biases) and two random
adapters written by peft, one on every projection (rank 8) and one on q/v alone with rsLoRA (rank 4)."""
import numpy as np
import pytest

from conftest import make_tiny_hf_model

PROMPTS = [[3, 17, 42, 9, 100, 7, 64, 5, 12, 200, 31, 8, 77, 150, 2, 99, 45, 61, 33, 14],
           [250, 11, 6, 90, 128, 4, 57]]
NEW_TOKENS = 12


def _write_adapter(base_dir, out, seed, **lora_kwargs):
    """A peft LoRA adapter of random A and B (B nonzero: the adapter changes the model) saved at `out`."""
    import peft
    import torch
    import transformers
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def lora_case(tmp_path_factory):
    """(base directory, {name: adapter directory})."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_hf_model("qwen2", root / "base", seed=3)
    every = _write_adapter(base, root / "every", 1, r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    qv = _write_adapter(base, root / "qv", 2, r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"])
    return base, {"every": every, "qv": qv}


def _merged_greedy(base_dir, adapter_dir, prompt, n):
    """peft's merged model's greedy tokens and its logits over the prompt (None: the base model)."""
    import peft
    import torch
    import transformers
    from conftest import hf_greedy
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].numpy()
    return (hf_greedy(model, prompt, n) if n else []), logits


@pytest.fixture(scope="module")
def lora_llm(lora_case):
    from jaxspec import LLM
    base, _ = lora_case
    return LLM(str(base), dtype="float32", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32,
               enable_lora=True, max_loras=2, max_lora_rank=8, warmup=False)


def test_adapter_weights_in_the_base_layout_give_peft_logits(lora_case):
    """The adapter read into the fused q/k/v and gate/up layout, added by Ops.linear's lora_delta in a dense forward,
    gives peft's merged model's logits; slot 0 (no adapter) gives the base model's."""
    import jax.numpy as jnp

    from jaxspec.lora.peft import load_adapter
    from jaxspec.lora.slots import with_adapter_slots
    from jaxspec.models.loader import load_model
    from jaxspec.nn.decoder import Decoder
    from jaxspec.nn.ops import LORA_A, LORA_B, ForwardBatch
    base, adapters = lora_case
    model = load_model(str(base), dtype="float32")
    params = with_adapter_slots(model.params, model.config, max_loras=2, max_rank=8)
    for slot, name in ((1, "every"), (2, "qv")):
        adapter = load_adapter(adapters[name], model.config, 8)
        for kind, names in adapter.items():
            for w, (a, b) in names.items():
                stacks = params["layers"][kind]
                stacks[w + LORA_A] = stacks[w + LORA_A].at[:, slot].set(a)
                stacks[w + LORA_B] = stacks[w + LORA_B].at[:, slot].set(b)
    prompt = PROMPTS[0]
    T = len(prompt)
    dec = Decoder(model.config)
    for slot, name in ((0, None), (1, "every"), (2, "qv")):
        _, want = _merged_greedy(base, adapters.get(name), prompt, 0)
        import dataclasses
        dense = dataclasses.replace(dec, ops=dataclasses.replace(dec.ops, attention="dense", block_size=T))
        from jaxspec.nn.layers import CacheShape
        from jaxspec.nn.schema import initialize
        state = initialize(dense.state_schema(CacheShape(num_kv_slots=T, num_slots=1)), jnp.float32)
        idx = jnp.arange(T, dtype=jnp.int32)
        zero = jnp.zeros((1,), jnp.int32)
        batch = ForwardBatch(jnp.asarray(prompt, jnp.int32), idx, idx, jnp.zeros(T, jnp.int32),
                             jnp.zeros((1, 1), jnp.int32), idx, slot_of_row=zero, first_token_of_row=zero,
                             lora_of_token=jnp.full((T,), slot, jnp.int32))
        logits = np.asarray(dense.forward(params, state, batch)[0])
        np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4, err_msg=f"adapter {name}")


def test_each_adapter_and_a_mixed_batch_give_peft_tokens(lora_case, lora_llm):
    """Greedy tokens per adapter equal peft's merged model's, alone and with rows of adapter 1, adapter 2 and none
    in one batch (one compiled step, each row its own slot); the adapters change the output."""
    from jaxspec import LoRARequest, SamplingParams
    base, adapters = lora_case
    requests = {"every": LoRARequest("every", 1, str(adapters["every"])),
                "qv": LoRARequest("qv", 2, str(adapters["qv"]))}
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = {(name, i): _merged_greedy(base, adapters.get(name), p, NEW_TOKENS)[0]
            for name in (None, "every", "qv") for i, p in enumerate(PROMPTS)}
    assert want[("every", 0)] != want[(None, 0)] and want[("qv", 0)] != want[(None, 0)]
    for name in ("every", "qv"):
        outs = lora_llm.generate(PROMPTS, params, use_tqdm=False, lora_request=requests[name])
        assert [list(o.outputs[0].token_ids) for o in outs] == [want[(name, i)] for i in range(len(PROMPTS))], name
    mixed = [(None, 0), ("every", 1), ("qv", 0), ("every", 0)]
    outs = lora_llm.generate([PROMPTS[i] for _, i in mixed], params, use_tqdm=False,
                             lora_request=[requests.get(name) for name, _ in mixed])
    assert [list(o.outputs[0].token_ids) for o in outs] == [want[key] for key in mixed]
    stats = lora_llm.engine.stats()["lora"]
    assert stats["loads"] == 2 and sorted(stats["resident"]) == ["every", "qv"]
    assert all(not n for n in lora_llm.engine.adapters.holders.values())   # every request gave its slot back


def test_the_prefix_cache_keys_blocks_by_adapter(lora_case, lora_llm):
    """A prompt cached under one adapter is no hit for another (its KV differs): the second adapter's tokens are
    still peft's."""
    from jaxspec import LoRARequest, SamplingParams
    base, adapters = lora_case
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = PROMPTS[0] + [5, 6, 7, 8, 9, 10, 11, 12]
    lora_llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("every", 1, str(adapters["every"])))
    (out,) = lora_llm.generate([prompt], params, use_tqdm=False,
                               lora_request=LoRARequest("qv", 2, str(adapters["qv"])))
    assert list(out.outputs[0].token_ids) == _merged_greedy(base, adapters["qv"], prompt, NEW_TOKENS)[0]


def test_a_third_adapter_evicts_the_least_recently_used(lora_case, lora_llm, tmp_path):
    """With max_loras=2 a third adapter takes the slot of the least recently used one no request holds; its tokens
    are peft's, and the evicted adapter loads again when asked for."""
    from jaxspec import LoRARequest, SamplingParams
    base, adapters = lora_case
    third = _write_adapter(base, tmp_path / "third", 7, r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    before = lora_llm.engine.adapters.stats()["loads"]
    (out,) = lora_llm.generate([PROMPTS[1]], params, use_tqdm=False, lora_request=LoRARequest("third", 3, str(third)))
    assert list(out.outputs[0].token_ids) == _merged_greedy(base, third, PROMPTS[1], NEW_TOKENS)[0]
    assert len(lora_llm.engine.adapters.stats()["resident"]) == 2
    for name, i in (("every", 1), ("qv", 2)):
        (out,) = lora_llm.generate([PROMPTS[1]], params, use_tqdm=False,
                                   lora_request=LoRARequest(name, i, str(adapters[name])))
        assert list(out.outputs[0].token_ids) == _merged_greedy(base, adapters[name], PROMPTS[1], NEW_TOKENS)[0]
    assert lora_llm.engine.adapters.stats()["loads"] == before + 3   # the third, then each of the other two again


def test_bad_adapters_are_refused_by_name_and_disturb_nothing(lora_case, lora_llm, tmp_path):
    """A rank above max_lora_rank, a module the base has no weight for, shapes of another base, an engine without
    enable_lora: each a ValueError naming the fault; the engine serves the next request as before."""
    import json

    from jaxspec import LoRARequest, SamplingParams
    base, adapters = lora_case
    big = _write_adapter(base, tmp_path / "big", 3, r=16, lora_alpha=16, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="rank r=16, above max_lora_rank=8"):
        lora_llm.generate([PROMPTS[0]], use_tqdm=False, lora_request=LoRARequest("big", 9, str(big)))
    embed = _write_adapter(base, tmp_path / "embed", 3, r=4, lora_alpha=4, target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match="embed_tokens"):
        lora_llm.generate([PROMPTS[0]], use_tqdm=False, lora_request=LoRARequest("embed", 10, str(embed)))
    other = make_tiny_hf_model("llama", tmp_path / "other_base", seed=5)
    cfg = json.loads((other / "config.json").read_text())
    cfg.update(hidden_size=32, intermediate_size=64)
    (other / "config.json").write_text(json.dumps(cfg))
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    import shutil
    shutil.copy(adapters["every"] / "adapter_config.json", wrong / "adapter_config.json")
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(adapters["every"] / "adapter_model.safetensors"))
    save_file({k: np.ascontiguousarray(v[:, :32] if "lora_A" in k else v) for k, v in tensors.items()},
              str(wrong / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="this base model needs A"):
        lora_llm.generate([PROMPTS[0]], use_tqdm=False, lora_request=LoRARequest("wrong", 11, str(wrong)))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters["qv"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True, which jaxspec does not implement"):
        lora_llm.generate([PROMPTS[0]], use_tqdm=False, lora_request=LoRARequest("dora", 12, str(dora)))
    assert all(not n for n in lora_llm.engine.adapters.holders.values())
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (out,) = lora_llm.generate([PROMPTS[0]], params, use_tqdm=False,
                               lora_request=LoRARequest("qv", 2, str(adapters["qv"])))
    assert list(out.outputs[0].token_ids) == _merged_greedy(base, adapters["qv"], PROMPTS[0], NEW_TOKENS)[0]


def test_speculation_with_an_adapter_is_lossless(lora_case):
    """n-gram drafts (the drafter knows no adapter) verified by the target with the row's adapter: the greedy tokens
    are the adapter model's, and some drafts are accepted."""
    from jaxspec import LLM, LoRARequest, SamplingParams
    base, adapters = lora_case
    llm = LLM(str(base), dtype="float32", max_num_seqs=2, max_model_len=96, max_num_batched_tokens=32,
              enable_lora=True, max_loras=1, max_lora_rank=8, warmup=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    prompt = PROMPTS[0] * 2   # repeats: n-gram matches
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False,
                          lora_request=LoRARequest("every", 1, str(adapters["every"])))
    assert list(out.outputs[0].token_ids) == _merged_greedy(base, adapters["every"], prompt, 24)[0]
    spec, served = llm.engine.stats()["spec"], llm.engine.stats()["lora"]["per_adapter"]["every"]
    assert spec["draft_tokens"] > 0 and served["requests"] == 1 and served["output_tokens"] == 24
    assert (served["draft_tokens"], served["accepted_tokens"]) == (spec["draft_tokens"], spec["accepted_tokens"])


def test_the_server_serves_adapters_by_name_and_loads_and_unloads_them(lora_case, tmp_path):
    """`--lora-modules`: /v1/models lists the base model and each adapter (its parent the base); a completion whose
    `model` names an adapter is that adapter's tokens and says its name; /v1/load_lora_adapter adds one at run time,
    /v1/unload_lora_adapter removes it (then its name is a 404); bad names and adapters are 400s and 404s."""
    from fastapi.testclient import TestClient

    from jaxspec import LLM
    from jaxspec.serve import build_app
    from jaxspec.serve.options import ServeOptions
    base, adapters = lora_case
    llm = LLM(str(base), dtype="float32", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32,
              enable_lora=True, max_loras=1, max_lora_rank=8, warmup=False)
    app = build_app(llm, "base", options=ServeOptions(lora_modules=(("every", str(adapters["every"])),)))

    def complete(client, model):
        r = client.post("/v1/completions", json={"model": model, "prompt": PROMPTS[1], "max_tokens": NEW_TOKENS,
                                                 "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
        return r
    with TestClient(app) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("base", None), ("every", "base")]
        r = complete(client, "every")
        assert r.status_code == 200 and r.json()["model"] == "every"
        assert r.json()["choices"][0]["token_ids"] == _merged_greedy(base, adapters["every"], PROMPTS[1], NEW_TOKENS)[0]
        assert complete(client, "base").json()["choices"][0]["token_ids"] == _merged_greedy(
            base, None, PROMPTS[1], NEW_TOKENS)[0]
        assert complete(client, "qv").status_code == 404
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(adapters["qv"])})
        assert r.status_code == 200, r.text
        r = complete(client, "qv")   # max_loras=1: "every" leaves its slot to it
        assert r.json()["choices"][0]["token_ids"] == _merged_greedy(base, adapters["qv"], PROMPTS[1], NEW_TOKENS)[0]
        bad = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        taken = client.post("/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": str(adapters["qv"])})
        assert taken.status_code == 400 and "taken" in taken.json()["error"]["message"]
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 200
        assert complete(client, "qv").status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 400
        assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["base", "every"]
        metrics = client.get("/metrics").text   # vLLM's LoRA gauge: nothing runs or waits now
        assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
        assert 'jaxspec:lora_requests_waiting{model_name="base"} 0.0' in metrics


def test_adapters_load_and_unload_while_requests_run(lora_case, lora_llm):
    """A request runs with one adapter while another is loaded into the free slot and served; unloading the running
    request's adapter is refused until it ends; both outputs are their adapters' tokens."""
    from jaxspec import LoRARequest, SamplingParams
    from jaxspec.lora.peft import AdapterError
    base, adapters = lora_case
    engine = lora_llm.engine
    for name in engine.adapters.stats()["resident"]:   # start from empty slots
        engine.adapters.remove(name)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    long = engine.add_request(PROMPTS[0], params, lora_request=LoRARequest("every", 1, str(adapters["every"])))
    for _ in range(3):
        engine.step()
    assert 0 < len(long.output_token_ids) < 30
    (short,) = lora_llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                                 use_tqdm=False, lora_request=LoRARequest("qv", 2, str(adapters["qv"])))
    assert list(short.outputs[0].token_ids) == _merged_greedy(base, adapters["qv"], PROMPTS[1], NEW_TOKENS)[0]
    assert not long.finished
    with pytest.raises(AdapterError, match="in use by 1 running request"):
        engine.adapters.remove("every")
    engine.run_until(lambda: long.finished)
    assert long.output_token_ids == _merged_greedy(base, adapters["every"], PROMPTS[0], 30)[0]
    assert engine.adapters.remove("every") and engine.adapters.stats()["resident"] == ["qv"]


def test_seeded_sampling_with_an_adapter_is_the_same_with_and_without_speculation(lora_case, lora_llm):
    """Seeded sampled tokens under an adapter do not depend on speculation: n-gram drafts verified with the adapter
    (rejection sampling) give the tokens the plain engine samples."""
    from jaxspec import LLM, LoRARequest, SamplingParams
    base, adapters = lora_case
    spec = LLM(str(base), dtype="float32", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32,
               enable_lora=True, max_loras=1, max_lora_rank=8, warmup=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    adapter = LoRARequest("every", 1, str(adapters["every"]))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    prompt = PROMPTS[0][:10] * 2
    (plain,) = lora_llm.generate([prompt], params, use_tqdm=False, lora_request=adapter)
    (drafted,) = spec.generate([prompt], params, use_tqdm=False, lora_request=adapter)
    assert list(drafted.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    assert spec.engine.stats()["spec"]["draft_tokens"] > 0


def test_adapters_over_an_fp8_base_add_to_its_dequantized_weights(lora_case):
    """quantization="fp8" with an adapter: the adapter (in the compute dtype) is added to the FP8 projections'
    products, so the tokens and logprobs are those of the float32 engine over the FP8 weights dequantized, with the
    same adapter; and the adapter changes them."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxspec import LLM, LoRARequest, SamplingParams
    from jaxspec.models.loader import load_model
    from jaxspec.nn import quant
    base, adapters = lora_case
    model = load_model(str(base), dtype="float32")
    quantized = quant.quantize_params(model.params)

    def dequantized(tree):
        out = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                out[name] = dequantized(value)
            elif name.endswith(quant.SCALE):
                continue
            elif name + quant.SCALE in tree:
                out[name] = value.astype(jnp.float32) * tree[name + quant.SCALE][..., None]
            else:
                out[name] = value
        return out
    plain = dataclasses.replace(model, params=jax.tree_util.tree_map(jnp.asarray, dequantized(quantized)))
    adapter = LoRARequest("every", 1, str(adapters["every"]))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    engine = dict(dtype="float32", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32, enable_lora=True,
                  max_lora_rank=8, warmup=False)
    fp8 = LLM(model, quantization="fp8", **engine)
    assert fp8.engine.stats()["quantization"]["scheme"] == "fp8"
    (got,) = fp8.generate([PROMPTS[0]], params, use_tqdm=False, lora_request=adapter)
    (want,) = LLM(plain, **engine).generate([PROMPTS[0]], params, use_tqdm=False, lora_request=adapter)
    assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    np.testing.assert_allclose([e["logprob"] for e in got.outputs[0].logprobs],
                               [e["logprob"] for e in want.outputs[0].logprobs], atol=1e-4)
    (base_out,) = fp8.generate([PROMPTS[0]], params, use_tqdm=False)
    assert list(base_out.outputs[0].token_ids) != list(got.outputs[0].token_ids)


@pytest.fixture(scope="module")
def one_slot(lora_case):
    """An engine with one adapter slot (max_loras=1), the two adapters' LoRARequests, and peft's greedy tokens per
    (adapter, prompt) (None: the base model)."""
    from jaxspec import LLM, LoRARequest
    base, adapters = lora_case
    llm = LLM(str(base), dtype="float32", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32,
              enable_lora=True, max_loras=1, max_lora_rank=8, warmup=False)
    requests = {name: LoRARequest(name, i, str(adapters[name])) for i, name in enumerate(("every", "qv"), 1)}
    want = {(name, i, n): _merged_greedy(base, adapters.get(name), PROMPTS[i], n)[0]
            for name in (None, "every", "qv") for i, n in ((0, 30), (1, NEW_TOKENS))}
    return llm, requests, want


def _greedy(max_tokens):
    from jaxspec import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _steps_until(engine, done, limit=200):
    """Drives the engine until `done()` (at most `limit` steps: a request that never gets its slot fails, not hangs)."""
    for _ in range(limit):
        if done():
            return
        engine.step()
    raise AssertionError(f"not done after {limit} steps")


def test_requests_for_more_adapters_than_slots_wait_for_one_and_all_finish(one_slot):
    """max_loras=1, one generate() over both adapters: every request finishes with its adapter's peft tokens, those
    of the adapter not resident having waited for the slot (none is refused), and no slot stays held."""
    llm, requests, want = one_slot
    params = _greedy(NEW_TOKENS)
    before = llm.engine.stats()["lora"]["waited_for_slot"]
    names = ["every", "qv", "qv", "every"]
    outs = llm.generate([PROMPTS[1]] * 4, params, use_tqdm=False, lora_request=[requests[n] for n in names])
    assert [list(o.outputs[0].token_ids) for o in outs] == [want[(n, 1, NEW_TOKENS)] for n in names]
    stats = llm.engine.stats()["lora"]
    assert stats["waited_for_slot"] - before >= 2 and stats["waiting_for_slot"] == 0 and stats["queued"] == {}
    assert stats["running"] == [] and all(not n for n in llm.engine.adapters.holders.values())


def test_a_waiting_adapter_request_holds_back_no_base_request_and_is_not_overtaken(one_slot):
    """While "every" runs in the only slot, a "qv" request waits; a base-model request queued after it runs at once,
    but a later "every" request does not join the held slot ahead of the waiter (the slot drains for it): "qv" runs
    when the long request ends, the later "every" after that; each gives its adapter's tokens."""
    llm, requests, want = one_slot
    engine = llm.engine
    long = engine.add_request(PROMPTS[0], _greedy(30), lora_request=requests["every"])
    _steps_until(engine, lambda: len(long.output_token_ids) >= 2)
    waiter = engine.add_request(PROMPTS[1], _greedy(NEW_TOKENS), lora_request=requests["qv"])
    later = engine.add_request(PROMPTS[1], _greedy(NEW_TOKENS), lora_request=requests["every"])
    plain = engine.add_request(PROMPTS[1], _greedy(NEW_TOKENS))
    _steps_until(engine, lambda: plain.finished)
    assert not long.finished and not waiter.output_token_ids and not later.output_token_ids
    assert engine.stats()["lora"]["waiting_for_slot"] == 2
    _steps_until(engine, lambda: waiter.finished)
    assert long.finished and not later.output_token_ids
    _steps_until(engine, lambda: later.finished)
    engine.drain()
    assert long.output_token_ids == want[("every", 0, 30)]
    assert waiter.output_token_ids == want[("qv", 1, NEW_TOKENS)]
    assert later.output_token_ids == want[("every", 1, NEW_TOKENS)]
    assert plain.output_token_ids == want[(None, 1, NEW_TOKENS)]


def test_aborting_the_holder_lets_the_waiting_adapter_request_in(one_slot):
    """A "qv" request waits while "every" runs in the only slot; aborting the "every" request gives the slot to it,
    and its tokens are "qv"'s."""
    llm, requests, want = one_slot
    engine = llm.engine
    holder = engine.add_request(PROMPTS[0], _greedy(30), lora_request=requests["every"])
    _steps_until(engine, lambda: len(holder.output_token_ids) >= 2)
    waiter = engine.add_request(PROMPTS[1], _greedy(NEW_TOKENS), lora_request=requests["qv"])
    for _ in range(3):
        engine.step()
    assert not waiter.output_token_ids and engine.stats()["lora"]["waiting_for_slot"] == 1
    engine.abort(holder.request_id)
    _steps_until(engine, lambda: waiter.finished)
    engine.drain()
    assert holder.finish_reason == "abort" and len(holder.output_token_ids) < 30
    assert waiter.output_token_ids == want[("qv", 1, NEW_TOKENS)]
    assert engine.stats()["lora"]["queued"] == {} and all(not n for n in engine.adapters.holders.values())


def test_adapters_that_can_never_run_are_still_refused_when_they_would_wait(lora_case, one_slot, tmp_path):
    """With the only slot held, what could never run is refused at once by name rather than queued: a rank above
    max_lora_rank, a path with no adapter, an id given to another adapter; and an adapter on an engine without
    enable_lora. Nothing stays awaited."""
    from jaxspec import LLM, LoRARequest
    base, adapters = lora_case
    llm, requests, _ = one_slot
    engine = llm.engine
    holder = engine.add_request(PROMPTS[0], _greedy(30), lora_request=requests["every"])
    engine.step()
    big = _write_adapter(base, tmp_path / "big", 3, r=16, lora_alpha=16, target_modules=["q_proj"])
    for lora, match in ((LoRARequest("big", 9, str(big)), "above max_lora_rank=8"),
                        (LoRARequest("gone", 10, str(tmp_path / "gone")), "has no adapter_config.json"),
                        (LoRARequest("qv", 1, str(adapters["qv"])), "lora_int_id=1 is adapter 'every'")):
        with pytest.raises(ValueError, match=match):
            engine.add_request(PROMPTS[1], _greedy(NEW_TOKENS), lora_request=lora)
    assert engine.stats()["lora"]["queued"] == {} and len(engine.scheduler.waiting) == 0
    engine.abort(holder.request_id)
    engine.drain()
    plain = LLM(str(base), dtype="float32", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32, warmup=False)
    with pytest.raises(ValueError, match="needs an engine built with enable_lora=True"):
        plain.generate([PROMPTS[1]], use_tqdm=False, lora_request=requests["qv"])


def test_a_preempted_request_keeps_its_adapter_slot(lora_case, one_slot):
    """Two "every" requests and a "qv" one over 5 KV blocks of 16 tokens with one adapter slot: an "every" request
    is preempted for KV room and, queued again, still holds its slot (it is readmitted without waiting for one),
    while "qv" waits for the slot; every request gives its adapter's peft tokens."""
    from jaxspec import LLM
    base, _ = lora_case
    _, requests, want = one_slot
    llm = LLM(str(base), dtype="float32", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, num_kv_blocks=5,
              enable_lora=True, max_loras=1, max_lora_rank=8, warmup=False)
    engine = llm.engine
    names = ["every", "every", "qv"]
    reqs = [engine.add_request(PROMPTS[0], _greedy(30), lora_request=requests[n]) for n in names]
    preempted_waiting = 0
    while engine.has_unfinished():
        engine.step()
        for req in engine.scheduler.waiting:
            if req.num_preemptions:
                preempted_waiting += 1
                assert req.lora_slot and engine.adapters.holders[req.lora_slot]
    assert preempted_waiting and [r.output_token_ids for r in reqs] == [want[(n, 0, 30)] for n in names]
    stats = engine.stats()["lora"]
    assert stats["waited_for_slot"] >= 1 and stats["loads"] == 2 and stats["queued"] == {}
