"""The fp8 KV cache lowered for the GPU: the per-token, prefill and fused attention kernels over e4m3 pools against
the reference reading the same pools (bf16 queries, Qwen2.5-1.5B's attention shapes), and an engine that serves with
kv_cache_dtype="fp8"."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.nn.ops import ForwardBatch, paged_attention_reference
from jaxspec.pallas.common import to_kv_dtype
from jaxspec.pallas.paged_attention import paged_attention
from jaxspec.pallas.prefill_attention import prefill_attention

pytestmark = pytest.mark.gpu
FP8 = jnp.float8_e4m3fn


def test_per_token_and_prefill_kernels_read_fp8_pools():
    rng = np.random.default_rng(0)
    Hkv, G, hd, bs, context, T = 2, 6, 128, 16, 4096, 256
    blocks = context // bs + 1
    k_pool, v_pool = (to_kv_dtype(jnp.asarray(rng.standard_normal((2, blocks * bs, Hkv, hd)) * 4, jnp.float32), FP8)
                      for _ in range(2))
    q = jnp.asarray(rng.standard_normal((T, Hkv * G, hd)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(blocks)[None, :], jnp.int32)
    positions = jnp.arange(context - T, context, dtype=jnp.int32)
    rows, first = jnp.zeros(T, jnp.int32), jnp.zeros(T, jnp.int32)
    batch = ForwardBatch(None, positions, None, rows, tables, None, first_in_step=first)
    ref = paged_attention_reference(q.astype(jnp.float32), k_pool, v_pool, 1, batch, bs)
    outs = [paged_attention(q, k_pool, v_pool, jnp.int32(1), positions, rows, tables, block_size=bs),
            prefill_attention(q, k_pool, v_pool, jnp.int32(1), positions, first, rows, tables, block_size=bs)]
    for out in outs:
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
        assert err < 3e-2


def test_an_engine_serves_with_an_fp8_kv_cache():
    """Greedy tokens of a random-weight SmolLM2 with the fp8 cache: as many as asked, and the pool holds twice the
    bf16 cache's tokens in the same bytes."""
    from jaxspec import LLM, SamplingParams
    from jaxspec.models.random import random_model
    model = random_model("smollm2-135m-instruct", dtype="bfloat16", seed=0)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kv = {}
    for dtype in ("auto", "fp8"):
        llm = LLM(model, max_num_seqs=4, max_model_len=2048, num_kv_blocks=512, warmup="fast", kv_cache_dtype=dtype)
        outs = llm.generate([{"prompt_token_ids": list(range(1, 1500))}] * 2, params, use_tqdm=False)
        assert all(len(o.token_ids) == 32 for o in outs)
        kv[dtype] = llm.engine.kv_cache()
    assert kv["fp8"]["bytes"] * 2 == kv["auto"]["bytes"]
