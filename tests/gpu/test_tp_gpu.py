"""Tensor parallelism on two GPUs (nvidia-h100-x2 or larger) gives one GPU's greedy tokens, float32 weights and
activations, the GPU layout (unrolled layers, the Pallas attention, the gemv kernels where they apply): plain
decoding and a draft model at k = 3 (its drafts accepted, so the verify path runs), split over the GPUs or whole on
each (draft_tensor_parallel_size=1: its forwards under shard_map with one GPU's kernels). On the CPU the same equality
is tests/test_tp.py's. Run with the other GPU checks: JAX_PLATFORMS=cuda python -m pytest -q -n 0 tests/gpu"""
import jax
import pytest

from conftest import random_model
from jaxspec import LLM, SamplingParams

pytestmark = pytest.mark.gpu

ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, warmup=False)
SHAPES = dict(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512)
PROMPTS = [[(13 * i + 7 * j) % 500 + 3 for j in range(9 + 11 * i)] for i in range(3)]


@pytest.mark.parametrize("speculation", [False, "split", "whole"])
def test_two_gpus_emit_one_gpus_tokens(speculation):
    if len(jax.devices()) < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {len(jax.devices())}")
    target = random_model(0, **SHAPES, attn_gain=0.3)
    spec = None
    if speculation:
        draft = random_model(1, **SHAPES, attn_gain=0.3, base=target, noise=0.05)
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
        if speculation == "whole":
            spec["draft_tensor_parallel_size"] = 1
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for tp in (1, 2):
        if speculation == "split":
            spec["draft_tensor_parallel_size"] = tp
        llm = LLM(target, **ENGINE, tensor_parallel_size=tp, speculative_config=spec)
        runs[tp] = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        if speculation:
            assert llm.stats()["spec"]["accepted_tokens"] > 0
        del llm
    assert runs[2] == runs[1]
