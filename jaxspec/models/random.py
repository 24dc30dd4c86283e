"""Models with a real architecture's shapes and random weights: for benchmarks and tests that need the
shapes (step time, memory traffic) but not the checkpoint."""
from __future__ import annotations

from pathlib import Path

from jaxspec.models.config import ModelConfig
from jaxspec.models.model import Model

_LLAMA3_ROPE = tuple(sorted(dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192).items()))
_GPT_OSS_YARN = tuple(sorted(dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                  original_max_position_embeddings=4096).items()))


def _gemma3_shapes(hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
                   num_kv_heads: int) -> ModelConfig:
    """A Gemma 3 text model of google/gemma-3-*-it's shapes: every 6th layer global (the whole context, rope base
    1e6 with linear scaling 8), the others local (a 1024-key window, base 1e4); head_dim 256, scores scaled by
    256 ** -0.5, tied embeddings."""
    local = tuple((i + 1) % 6 != 0 for i in range(num_layers))
    return ModelConfig(
        arch="gemma3", vocab_size=262208, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=(("factor", 8.0), ("rope_type", "linear")), tie_word_embeddings=True,
        max_position_embeddings=131072, bos_token_id=2, eos_token_ids=(1, 106), sliding_window=1024,
        sliding_layers=local, layer_types=("gemma3_attention",) * num_layers, hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=256.0, local_rope_theta=10000.0, local_rope_layers=local)


# The presets' shapes, as their GGUF headers give them, and (for multi-GPU runs, no checkpoint needed) the
# shapes of Llama 3.1 8B and of Llama 3.2 1B, a draft of the same family and vocabulary, of Mistral 7B, of
# Qwen3-30B-A3B, of Gemma 3 4B and 12B and of GPT-OSS-20B.
KNOWN_SHAPES = {
    "llama-3.1-8b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072),
    "llama-3.2-1b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        tie_word_embeddings=True, max_position_embeddings=131072),
    "mistral-7b": ModelConfig(   # Mistral-7B-v0.1: a 4096-key sliding window on every layer
        arch="llama", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32768,
        sliding_window=4096),
    "qwen3-30b-a3b": ModelConfig(   # every layer 128 experts, 8 per token
        arch="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        layer_types=("attention_moe",) * 48, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True),
    "gemma-3-4b": _gemma3_shapes(hidden_size=2560, intermediate_size=10240, num_layers=34, num_heads=8,
                                 num_kv_heads=4),
    "gemma-3-12b": _gemma3_shapes(hidden_size=3840, intermediate_size=15360, num_layers=48, num_heads=16,
                                  num_kv_heads=8),
    "gpt-oss-20b": ModelConfig(   # sliding (128 keys) and full attention alternating, sinks, 32 experts, 4 per token
        arch="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_layers=24, num_heads=64,
        num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=150000.0, rope_scaling=_GPT_OSS_YARN,
        max_position_embeddings=131072, sliding_window=128, sliding_layers=(True, False) * 12,
        layer_types=("gpt_oss",) * 24, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=2880,
        attention_bias=True),
    "smollm2-135m-instruct": ModelConfig(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        max_position_embeddings=8192),
    "qwen2.5-coder-0.5b-instruct": ModelConfig(
        arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        max_position_embeddings=32768),
    "qwen2.5-coder-1.5b-instruct": ModelConfig(
        arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
        num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        max_position_embeddings=32768),
}


def random_params(config: ModelConfig, dtype="bfloat16", seed: int = 0, scale: float = 0.02) -> dict:
    """Params declared by the model's schema, drawn on the device: weights N(0, scale), norm weights ones."""
    import jax   # here, not at module level: KNOWN_SHAPES is read by the command lines' checks, before JAX starts
    import jax.numpy as jnp

    from jaxspec.nn import schema
    from jaxspec.nn.decoder import Decoder
    return schema.initialize(Decoder(config).param_schema(), jnp.dtype(dtype), jax.random.PRNGKey(seed), scale)


def random_model(spec, dtype="bfloat16", seed: int = 0) -> Model:
    """`spec`: a ModelConfig, a preset name, or anything `load_model` takes (its config is used)."""
    import jax.numpy as jnp

    if isinstance(spec, ModelConfig):
        config = spec
    elif spec in KNOWN_SHAPES:
        config = KNOWN_SHAPES[spec]
    elif (Path(spec) / "config.json").is_file():   # an HF directory: its config.json alone (weights not needed)
        from jaxspec.models.hf_loader import read_config
        config = read_config(spec)
    else:
        from jaxspec.models.loader import load_model
        config = load_model(spec, dtype="float32").config
    return Model(config, random_params(config, dtype, seed), tokenizer=None, name=f"random:{spec}",
                 dtype=str(jnp.dtype(dtype)))
