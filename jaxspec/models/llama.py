"""Llama / Qwen2 / Qwen3 decoders as pure functions over a params pytree and a paged KV cache.

One file for the three families: Qwen2 is Llama with q/k/v biases, Qwen3 is Llama with RMSNorm on each
head's q and k. Shapes: T tokens in this step (a ragged mix of prefill chunks, decode tokens and verify
segments of different requests), R request rows, MB blocks per row, S = num_blocks * block_size flat KV
slots, L layers, D model width, Hq/Hkv query/kv heads of width hd, V vocabulary.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig


class ForwardBatch(NamedTuple):
    token_ids: jax.Array      # i32[T]
    positions: jax.Array      # i32[T]   position of each token in its sequence
    slot_mapping: jax.Array   # i32[T]   flat KV slot each token's k/v is written to; >= S drops (padding)
    row_of_token: jax.Array   # i32[T]   row of block_tables the token belongs to
    block_tables: jax.Array   # i32[R, MB]
    logits_indices: jax.Array  # i32[N]  tokens whose logits are wanted


def init_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype) -> dict:
    shape = (config.num_layers, num_blocks * block_size, config.num_kv_heads, config.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    if config.rope_freq_factors is not None:  # per-frequency divisors (GGUF rope_freqs), as llama.cpp applies them
        return inv_freq / jnp.asarray(config.rope_freq_factors, jnp.float32)
    scaling = config.rope_scaling_dict
    if scaling:  # llama3: long wavelengths slowed by `factor`, a smooth ramp between the two cut-offs
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = jnp.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x, positions, inv_freq):
    """x [T, H, hd] rotated by position (the rotate-half layout of HF checkpoints)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]     # [T, hd/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :]       # [T, 1, hd]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _attend(q, k, v, mask, scale):
    """q [T, Hkv, G, hd]; k/v [T, C, Hkv, hd] (per-token context) or [C, Hkv, hd] (shared); mask [T, C]."""
    ctx = "tckd" if k.ndim == 4 else "ckd"
    s = jnp.einsum(f"tkgd,{ctx}->tkgc", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum(f"tkgc,{ctx}->tkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(q.shape[0], -1)


def paged_attention(q, k_pool, v_pool, layer, batch: ForwardBatch, block_size: int):
    """Reference paged attention: each token attends to its own row's blocks up to its position.

    q [T, Hq, hd]; k_pool/v_pool [L, S, Hkv, hd] (this step's k/v already written); layer: which layer.
    Gathers each token's context [T, MB*bs, Hkv, hd]: fine for tests and small batches. The Pallas kernel
    `jaxspec.pallas.paged_attention.paged_attention_fn` reads the pages in place instead (the
    `attention_fn` argument of `forward`).
    """
    k_cache, v_cache = k_pool[layer], v_pool[layer]
    T, Hq, hd = q.shape
    Hkv = k_cache.shape[1]
    tables = batch.block_tables[batch.row_of_token]                               # [T, MB]
    slots = (tables[:, :, None] * block_size + jnp.arange(block_size)).reshape(T, -1)  # [T, C]
    k = jnp.take(k_cache, slots, axis=0, mode="clip")                             # [T, C, Hkv, hd]
    v = jnp.take(v_cache, slots, axis=0, mode="clip")
    mask = jnp.arange(slots.shape[1])[None, :] <= batch.positions[:, None]        # [T, C]
    return _attend(q.reshape(T, Hkv, Hq // Hkv, hd), k, v, mask, 1.0 / math.sqrt(hd))


AttentionFn = Callable[..., jax.Array]


def forward(config: ModelConfig, params: dict, kv_cache: dict, batch: ForwardBatch, *,
            block_size: int, aux_layers: tuple[int, ...] = (), attention_fn: AttentionFn = paged_attention):
    """-> (logits f32[N, V] at batch.logits_indices, final hidden [T, D] (after the final norm),
           aux hidden [len(aux_layers), T, D] (residual stream after each chosen layer), new kv_cache)."""
    c = config
    T = batch.token_ids.shape[0]
    hd, Hq, Hkv = c.head_dim, c.num_heads, c.num_kv_heads
    inv_freq = rope_inv_freq(c)
    h = params["embed"][jnp.clip(batch.token_ids, 0, c.vocab_size - 1)]          # [T, D]

    def layer(h, k_cache, v_cache, i, lp):
        x = rms_norm(h, lp["attn_norm"], c.rms_norm_eps)
        if "qkv_proj" in lp:                                                       # fused: one weight read
            qkv = x @ lp["qkv_proj"].T                                             # [T, (Hq+2Hkv)*hd]
            if c.qkv_bias:
                qkv = qkv + lp["qkv_bias"]
            q, k, v = jnp.split(qkv, [Hq * hd, (Hq + Hkv) * hd], axis=-1)
        else:
            q = x @ lp["q_proj"].T                                                 # [T, Hq*hd]
            k = x @ lp["k_proj"].T                                                 # [T, Hkv*hd]
            v = x @ lp["v_proj"].T
            if c.qkv_bias:
                q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
        q, k, v = q.reshape(T, Hq, hd), k.reshape(T, Hkv, hd), v.reshape(T, Hkv, hd)
        if c.qk_norm:
            q, k = rms_norm(q, lp["q_norm"], c.rms_norm_eps), rms_norm(k, lp["k_norm"], c.rms_norm_eps)
        q, k = apply_rope(q, batch.positions, inv_freq), apply_rope(k, batch.positions, inv_freq)
        k_cache = k_cache.at[i, batch.slot_mapping].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[i, batch.slot_mapping].set(v.astype(v_cache.dtype), mode="drop")
        attn = attention_fn(q, k_cache, v_cache, i, batch, block_size)            # [T, Hq*hd]
        h = h + (attn.astype(h.dtype) @ lp["o_proj"].T)
        x = rms_norm(h, lp["mlp_norm"], c.rms_norm_eps)
        if "gate_up_proj" in lp:
            gate, up = jnp.split(x @ lp["gate_up_proj"].T, 2, axis=-1)              # [T, F] each
        else:
            gate, up = x @ lp["gate_proj"].T, x @ lp["up_proj"].T
        h = h + (jax.nn.silu(gate) * up) @ lp["down_proj"].T
        return h, k_cache, v_cache

    k_cache, v_cache = kv_cache["k"], kv_cache["v"]
    if isinstance(params["layers"], (list, tuple)):
        # One weight set per layer, unrolled: every weight is its own buffer, read in place by its matmul.
        per_layer = []
        for i, lp in enumerate(params["layers"]):
            h, k_cache, v_cache = layer(h, k_cache, v_cache, i, lp)
            per_layer.append(h)
        aux = jnp.stack([per_layer[i] for i in aux_layers]) if aux_layers else None
    else:
        # Stacked weights, scanned: one layer body to compile (fast compiles on CPU and in tests).
        def body(carry, lp):
            h, k_cache, v_cache, i = carry
            h, k_cache, v_cache = layer(h, k_cache, v_cache, i, lp)
            return (h, k_cache, v_cache, i + 1), (h if aux_layers else None)

        (h, k_cache, v_cache, _), per_layer = jax.lax.scan(
            body, (h, k_cache, v_cache, jnp.int32(0)), params["layers"])
        aux = per_layer[jnp.array(aux_layers)] if aux_layers else None
    hidden = rms_norm(h, params["final_norm"], c.rms_norm_eps)
    logits = lm_logits(params, hidden[batch.logits_indices])
    return logits, hidden, aux, {"k": k_cache, "v": v_cache}


def unstack_layers(params: dict, fuse: bool = True) -> dict:
    """Stacked layer weights [L, ...] -> a list of per-layer dicts (the unrolled forward's layout), with
    q/k/v and gate/up concatenated so each layer reads its weights in three matmuls plus o and down."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = next(iter(layers.values())).shape[0]
    out = []
    for i in range(n):
        lp = {k: v[i] for k, v in layers.items()}
        if fuse:
            lp["qkv_proj"] = jnp.concatenate([lp.pop("q_proj"), lp.pop("k_proj"), lp.pop("v_proj")], axis=0)
            lp["gate_up_proj"] = jnp.concatenate([lp.pop("gate_proj"), lp.pop("up_proj")], axis=0)
            if "q_bias" in lp:
                lp["qkv_bias"] = jnp.concatenate([lp.pop("q_bias"), lp.pop("k_bias"), lp.pop("v_bias")])
        out.append(lp)
    return {**params, "layers": out}


def lm_logits(params: dict, hidden):
    """hidden [N, D] -> f32 logits [N, V] (tied embeddings when there is no lm_head)."""
    head = params.get("lm_head", params["embed"])
    return jnp.einsum("nd,vd->nv", hidden, head, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def score(config: ModelConfig, params: dict, token_ids):
    """Dense causal forward over one sequence, no cache: f32 logits [T, V]."""
    T = token_ids.shape[0]
    positions = jnp.arange(T, dtype=jnp.int32)
    hd = config.head_dim
    kv = init_kv_cache(config, 1, T, params["embed"].dtype)

    def dense_attention(q, k_pool, v_pool, layer, batch, block_size):
        mask = positions[None, :] <= positions[:, None]                           # causal [T, T]
        q = q.reshape(T, config.num_kv_heads, -1, hd)
        return _attend(q, k_pool[layer], v_pool[layer], mask, 1.0 / math.sqrt(hd))

    batch = ForwardBatch(token_ids, positions, positions, jnp.zeros(T, jnp.int32),
                         jnp.zeros((1, 1), jnp.int32), positions)
    logits, _, _, _ = forward(config, params, kv, batch, block_size=T, attention_fn=dense_attention)
    return logits
