"""The core's shape: a handful of argument buffers per step whatever the depth, models built from the declared
schema alone, a new layer kind added through the public layer table (with per-slot state rolled back past
rejected drafts), and the engine loop running on a thread of its own with per-request output queues."""
import dataclasses
import queue

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_model
from jaxspec import LLM, SamplingParams
from jaxspec.models.checkpoint import restore_params, save_params
from jaxspec.models.config import ModelConfig
from jaxspec.models.model import Model
from jaxspec.nn import LAYER_KINDS, Decoder, Spec, schema
from jaxspec.nn.layers import Attention, read_ring, snapshot_spec, write_ring
from jaxspec.nn.ops import rms_norm

MAX_ARGUMENT_BUFFERS = 48   # a target plus a draft model, whatever their depth


def step_argument_buffers(llm) -> int:
    """Buffers JAX's own lowering of a live step receives (not our count of them)."""
    runner = llm.engine.runner
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    T, (variant, _) = next(iter(runner.last_inputs.items()))
    lowered = runner.lower(T, variant)
    return len(jax.tree_util.tree_leaves(lowered.args_info))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_step_passes_a_handful_of_buffers_whatever_the_depth(arch):
    counts = []
    for layers in (2, 12):
        target = random_model(0, arch=arch, num_layers=layers)
        draft = random_model(1, arch=arch, num_layers=layers // 2 + 1)
        llm = LLM(target, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=8, block_size=4, warmup=False,
                  speculative_config=dict(method="draft_model", model=draft, num_speculative_tokens=2))
        counts.append(step_argument_buffers(llm))
        assert counts[-1] == llm.stats()["argument_buffers"]
    assert counts[0] == counts[1] <= MAX_ARGUMENT_BUFFERS, counts


def test_model_from_schema_alone_round_trips_through_orbax(tmp_path):
    """Random params from the declaration (every weight declared once with shape and logical axes) save and
    restore through orbax, and the model runs."""
    config = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    declared = Decoder(config).param_schema()
    params = schema.initialize(declared, jnp.float32, jax.random.PRNGKey(3))
    schema.check(declared, params)
    axes = schema.logical_axes(declared)
    assert axes["layers"]["attention"]["qkv_proj"] == ("layers", "kv_heads", "embed")
    assert axes["embed"] == ("vocab", "embed")
    assert all(len(a) == len(s) for a, s in zip(jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(x, tuple)),
                                               jax.tree_util.tree_leaves(schema.shapes(declared),
                                                                         is_leaf=lambda x: isinstance(x, tuple))))
    save_params(tmp_path / "ckpt", params, config)
    restored, restored_config = restore_params(tmp_path / "ckpt")
    assert restored_config == config
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, params)
    model = Model(config, restored, name="from-schema")
    out = LLM(model, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, block_size=4, warmup=False).generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    logits = np.asarray(model.score(np.array([5, 6, 7] + out.token_ids[:-1], np.int32)))
    assert out.token_ids == logits[2:].argmax(-1).tolist()


# ---- a new layer kind through the public table -----------------------------------------------------------

class RunningMean:
    """A toy recurrent layer: each slot keeps the running sum of its normed inputs; a token adds
    tanh(mean so far) @ proj to the residual. Its state cannot be overwritten later as KV is: the step must
    keep each slot's sum after its last accepted token."""
    name = "running_mean"

    def params(self, c):
        D = c.hidden_size
        return {"norm": Spec((D,), ("embed",), "ones"), "proj": Spec((D, D), ("embed", "embed"))}

    def state(self, c, cache):
        return {"sum": snapshot_spec(cache, (c.hidden_size,), ("embed",))}

    def __call__(self, c, ops, lp, h, state, i, batch):
        x = rms_norm(h, lp["norm"], c.rms_norm_eps).astype(jnp.float32)                  # [T, D]
        csum = jnp.cumsum(x, axis=0)
        first = batch.first_token_of_row[batch.row_of_token]                             # [T]
        before = jnp.where((first > 0)[:, None], csum[jnp.maximum(first - 1, 0)], 0.0)   # up to the row's start
        # the slot's sum after the position before its row's first token (zeros at position 0)
        start = read_ring(state["sum"], i, batch.slot_of_row[batch.row_of_token], batch.positions[first] - 1)
        total = start.astype(jnp.float32) + csum - before                                # [T, D]
        mean = total / (batch.positions[:, None] + 1).astype(jnp.float32)
        out = h + (jnp.tanh(mean).astype(h.dtype) @ lp["proj"].T)
        return out, {**state, "sum": write_ring(state["sum"], i, batch, total)}


@pytest.fixture
def running_mean_kind(monkeypatch):
    monkeypatch.setitem(LAYER_KINDS, "running_mean", RunningMean())
    return "running_mean"


def toy_model(seed: int, kinds, base=None, noise: float = 0.0) -> Model:
    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=len(kinds),
                         num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=64,
                         layer_types=tuple(kinds))
    params = schema.initialize(Decoder(config).param_schema(), jnp.float32, jax.random.PRNGKey(seed))
    if base is not None:
        params = jax.tree_util.tree_map(lambda b, r: b + noise * r, base.params, params)
    return Model(config, params, name=f"toy-{seed}")


def test_a_new_layer_kind_runs_under_speculation(running_mean_kind):
    """A model mixing attention and the toy recurrent kind, added through LAYER_KINDS alone: with a draft model
    of the same kinds (drafts partly rejected), chunked prefill and preemption, async and sync, every greedy
    token is the dense forward's argmax."""
    kinds = ("attention", running_mean_kind, "attention", running_mean_kind)
    target = toy_model(0, kinds)
    draft = toy_model(1, kinds, base=target, noise=0.3)
    prompts = [[int(t) for t in np.random.default_rng(s).integers(0, 64, n)] for s, n in enumerate([3, 11, 7])]
    results = []
    for mode in (True, False):
        llm = LLM(target, max_num_seqs=3, max_model_len=48, max_num_batched_tokens=8, block_size=4, num_kv_blocks=12,
                  async_scheduling=mode,
                  speculative_config=dict(method="draft_model", model=draft, num_speculative_tokens=3))
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
        stats = llm.stats()
        assert stats["num_preemptions"] > 0
        assert 0 < stats["spec"]["accepted_tokens"] < stats["spec"]["draft_tokens"]
        for p, o in zip(prompts, outs):
            ids = np.array(p + o.token_ids, np.int32)
            logits = np.asarray(target.score(ids))[len(p) - 1:-1]
            gap = logits.max(-1) - logits[np.arange(len(o.token_ids)), o.token_ids]
            assert np.all(gap <= 1e-5), np.nonzero(gap > 1e-5)
        results.append([o.token_ids for o in outs])
    assert results[0] == results[1]
    # the layer matters: with its projection zeroed the logits move
    layers = target.params["layers"]
    muted = {**layers, running_mean_kind: {**layers[running_mean_kind],
                                           "proj": jnp.zeros_like(layers[running_mean_kind]["proj"])}}
    ids = np.array(prompts[1], np.int32)
    assert np.abs(target.score(ids) - dataclasses.replace(target, params={**target.params, "layers": muted}).score(ids)).max() > 0.1


def test_unknown_layer_kind_is_named():
    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, layer_types=("mamba",))
    with pytest.raises(ValueError, match=r"layer types \['mamba'\].*attention"):
        Decoder(config).param_schema()
    assert isinstance(LAYER_KINDS["attention"], Attention)


# ---- the loop on its own thread ------------------------------------------------------------------------------

def test_engine_loop_on_its_own_thread_serves_queues():
    """Started on its own thread, the engine serves requests added from another thread; each request's deltas
    arrive on its output queue and add up to what a driven `generate` returns; LLM.generate and LLM.stream
    work unchanged meanwhile."""
    target = random_model(0, num_layers=2)
    llm = LLM(target, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, block_size=4)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5], [1, 2]]
    params = [SamplingParams(temperature=0, max_tokens=9), SamplingParams(temperature=0.9, seed=4, max_tokens=7),
              SamplingParams(temperature=0, max_tokens=5)]
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.engine
    engine.start()
    try:
        queues = [queue.SimpleQueue() for _ in prompts]
        reqs = [engine.add_request(p, sp, outputs=q) for p, sp, q in zip(prompts, params, queues)]
        got = []
        for q in queues:
            tokens, delta = [], None
            while delta is None or not delta.finished:
                delta = q.get(timeout=60)
                tokens += delta.token_ids
            got.append(tokens)
            assert delta.finish_reason == "length"
        assert got == want and all(r.finished for r in reqs)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        streamed = {}
        for d in llm.stream(prompts, params):
            streamed.setdefault(d.request_id, []).extend(d.token_ids)
        assert list(streamed.values()) == want
    finally:
        engine.stop()
    assert not engine.running_on_thread and not engine.has_unfinished()

    # A loop that fails ends every request (its reader is not left waiting) and refuses new ones.
    def broken_step(timings=None):
        raise RuntimeError("device lost")
    engine.step = broken_step
    engine.start()
    try:
        q = queue.SimpleQueue()
        req = engine.add_request(prompts[0], params[0], outputs=q)
        assert q.get(timeout=60).finish_reason == "abort" and req.finished
        assert isinstance(engine.failure, RuntimeError)
        with pytest.raises(RuntimeError, match="engine loop stopped after an error"):
            engine.add_request(prompts[0], params[0])
    finally:
        engine.stop()
