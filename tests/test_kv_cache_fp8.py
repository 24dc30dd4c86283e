"""The fp8 KV cache (kv_cache_dtype="fp8", e4m3, per-tensor scale 1): writes saturate instead of overflowing to NaN, and
every attention path reads the one-byte pool back as the reference does: the per-token kernel, the prefill kernel's
query tiles, and the fused kernel (whose KV write stores fp8, and whose own-step keys are rounded as the pool holds
them). The long-prompt accuracy against the float32 cache is tests/test_long_context.py's."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.nn.ops import paged_attention_reference
from jaxspec.pallas.common import to_kv_dtype
from jaxspec.pallas.paged_attention import paged_attention
from jaxspec.pallas.prefill_attention import prefill_attention
from test_paged_attention import _fused_case

FP8 = jnp.float8_e4m3fn


def test_values_past_the_format_saturate():
    x = jnp.asarray([1e4, -1e4, 300.0, 0.1, -0.0], jnp.float32)
    stored = np.asarray(to_kv_dtype(x, FP8).astype(jnp.float32))
    assert np.isfinite(stored).all()
    np.testing.assert_array_equal(stored[:2], [448.0, -448.0])
    np.testing.assert_allclose(stored[2:], [288.0, 0.1015625, 0.0])   # e4m3's nearest: 3 bits of mantissa
    assert to_kv_dtype(x, jnp.bfloat16).dtype == jnp.bfloat16            # other pools: a plain cast


def test_kernels_read_an_fp8_pool_as_the_reference():
    """A ragged step (a prefill chunk, a verify segment, decode rows, padding) over fp8 pools: the per-token kernel
    and the prefill kernel equal the reference reading the same pools."""
    from jaxspec.nn.kernels import LayerWeights
    from jaxspec.nn.layers import split_qkv, write_kv
    cfg, stacks, qkv, k_pool, v_pool, batch, bs = _fused_case(True, False)
    q, k, v = split_qkv(cfg, LayerWeights(stacks, 1), qkv, batch.positions)
    kv = write_kv({"k": to_kv_dtype(k_pool * 150, FP8), "v": to_kv_dtype(v_pool, FP8)}, 1, batch, k * 150, v)
    assert kv["k"].dtype == FP8 and float(jnp.abs(kv["k"].astype(jnp.float32)).max()) == 448.0   # some saturate
    live = np.asarray(batch.slot_mapping) < k_pool.shape[1]
    positions = jnp.where(live, batch.positions, -1)
    want = np.asarray(paged_attention_reference(q, kv["k"], kv["v"], 1, batch, bs))[live]
    assert np.isfinite(want).all()
    per_token = paged_attention(q, kv["k"], kv["v"], jnp.int32(1), positions, batch.row_of_token, batch.block_tables,
                                block_size=bs, interpret=True)
    tiles = prefill_attention(q, kv["k"], kv["v"], jnp.int32(1), positions, batch.first_in_step, batch.row_of_token,
                              batch.block_tables, block_size=bs, q_tile=16, interpret=True)
    for out in (per_token, tiles):
        np.testing.assert_allclose(np.asarray(out)[live], want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("num_splits", [1, None])
def test_the_fused_kernel_writes_fp8_and_reads_its_own_keys_as_stored(num_splits):
    """The fused kernel over fp8 pools: its KV write equals the unfused write's (saturated, rounded), and its output
    equals the reference reading that pool, this step's own keys included (rounded to fp8 in the kernel, where they
    come from the projection, not the pool)."""
    from jaxspec.nn.kernels import LayerWeights, fused_attention_fn
    from jaxspec.nn.layers import split_qkv, write_kv
    from jaxspec.nn.ops import rope_cos_sin, rope_inv_freq
    cfg, stacks, qkv, k_pool, v_pool, batch, bs = _fused_case(True, False)
    qkv = qkv * 150                                        # some keys past e4m3's largest value
    lp = LayerWeights(stacks, 1)
    pools = to_kv_dtype(k_pool, FP8), to_kv_dtype(v_pool, FP8)
    q, k, v = split_qkv(cfg, lp, qkv, batch.positions)
    kv = write_kv({"k": pools[0], "v": pools[1]}, 1, batch, k, v)
    live = np.asarray(batch.slot_mapping) < k_pool.shape[1]
    want = np.asarray(paged_attention_reference(q, kv["k"], kv["v"], 1, batch, bs))[live]
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(cfg))
    out, k_new, v_new = fused_attention_fn(cfg, lp, qkv, cos, sin, *pools, 1, batch, bs, num_splits)
    assert k_new.dtype == FP8 and np.isfinite(np.asarray(k_new.astype(jnp.float32))).all()
    assert float(jnp.abs(k_new.astype(jnp.float32)).max()) == 448.0                       # saturated
    np.testing.assert_array_equal(np.asarray(k_new.astype(jnp.float32)), np.asarray(kv["k"].astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(v_new.astype(jnp.float32)), np.asarray(kv["v"].astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(out)[live], want, rtol=1e-4, atol=1e-4)


def test_an_unknown_kv_cache_dtype_is_refused_by_name():
    from jaxspec.sched.config import EngineConfig
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' is not supported; choose 'auto', 'fp8'"):
        EngineConfig(kv_cache_dtype="int8").validate()


def test_an_fp8_pool_on_a_gpu_stays_clear_of_the_kernels_index_wrap(monkeypatch):
    """Between 2^31 and 2^32 one-byte elements the Triton kernels' 32-bit offsets wrap: a pool sized from free memory
    is cut below 2^31, one asked for by num_kv_blocks is refused naming the counts that work; bf16 pools and pools
    past 2^32 bytes are left as they are."""
    import jax

    from jaxspec.models.config import ModelConfig
    from jaxspec.sched.config import EngineConfig

    class GPU:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 80 * 2**30, "bytes_in_use": 0}

    monkeypatch.setattr(jax, "devices", lambda *a: [GPU()])
    mc = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=1536, intermediate_size=64, num_layers=28,
                     num_heads=12, num_kv_heads=2, head_dim=128)
    per_block = 28 * 16 * 2 * 128                              # one pool's elements per block
    config = EngineConfig(max_num_seqs=64, kv_memory_fraction=0.06)  # 4.8 GiB for k and v: 2.4 GiB each
    assert int(0.06 * 80 * 2**30) // (2 * per_block) * per_block > 2**31
    assert config.num_blocks(mc, 10**6, FP8) == (2**31 - 1) // per_block
    assert config.num_blocks(mc, 10**6, jnp.bfloat16) == int(0.06 * 80 * 2**30) // (2 * per_block * 2)
    assert EngineConfig(max_num_seqs=64, kv_memory_fraction=0.2).num_blocks(mc, 10**6, FP8) * per_block >= 2**32
    with pytest.raises(ValueError, match=r"num_kv_blocks=20000 makes each fp8 KV pool .* give at most 18724 or at "
                                         r"least 37450"):
        EngineConfig(num_kv_blocks=20000).num_blocks(mc, 100, FP8)
    assert EngineConfig(num_kv_blocks=20000).num_blocks(mc, 100, jnp.bfloat16) == 20000


def test_gpu_memory_utilization_sizes_the_pool_from_the_limit_less_weights_and_activations(monkeypatch):
    """vLLM's sizing: the pool is gpu_memory_utilization of the allocator's limit less the memory in use (the
    weights) and the activation reserve, capped at every slot at max_model_len; too little room is refused naming
    the numbers, and two ways of sizing the pool at once are refused."""
    import jax

    from jaxspec.models.config import ModelConfig
    from jaxspec.sched.config import EngineConfig

    class GPU:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 60 * 2**30, "bytes_in_use": 3 * 2**30}

    monkeypatch.setattr(jax, "devices", lambda *a: [GPU()])
    mc = ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                     num_heads=12, num_kv_heads=2, head_dim=128)
    per_block_bytes = 2 * 28 * 16 * 2 * 128 * 2                     # k and v, bf16
    config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=2048, gpu_memory_utilization=0.9)
    reserve = config.activation_reserve(mc, logit_rows=32 * 5)
    assert 2**30 < reserve < 3 * 2**30   # steps of 2,048 tokens of the 1.5B: MLP intermediates and 160 logit rows
    assert config.num_blocks(mc, 10**6, jnp.bfloat16, logit_rows=32 * 5) == \
        int((0.9 * 60 * 2**30 - 3 * 2**30 - reserve) // per_block_bytes)
    assert config.num_blocks(mc, 100, jnp.bfloat16) == 32 * 100            # every slot at max_model_len fits
    # a larger step budget keeps more back; the fraction-of-free rule is untouched
    bigger = EngineConfig(max_num_seqs=32, max_num_batched_tokens=8192, gpu_memory_utilization=0.9)
    assert bigger.activation_reserve(mc, 160) > reserve + 2 * 6144 * 2**10 * 4 * 4
    assert EngineConfig(max_num_seqs=32).num_blocks(mc, 10**6, jnp.bfloat16) == int(57 * 2**30 * 0.5) // per_block_bytes
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.05 gives the engine 3.00 GiB of the device's "
                                         r"60.00 GiB; the weights hold 3.00 GiB .* raise gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0.05).num_blocks(mc, 100, jnp.bfloat16)
    with pytest.raises(ValueError, match="kv_memory_fraction and gpu_memory_utilization both size the KV pool"):
        EngineConfig(kv_memory_fraction=0.5, gpu_memory_utilization=0.9).validate()
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5 is invalid; it must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=1.5).validate()
