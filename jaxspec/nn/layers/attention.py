"""The attention layer (Llama, Mistral, Qwen2, Qwen3) and the blocks every kind and the EAGLE heads build from:
grouped q/k/v over the paged KV pool (rotary, q/k norms, biases, a sliding window, attention sinks where the weights
or the config have them) and the SwiGLU MLP."""
from __future__ import annotations

import jax.numpy as jnp

from jaxspec.nn import kernels
from jaxspec.nn.layers.base import CacheShape
from jaxspec.nn.ops import (ForwardBatch, Ops, apply_rope, rms_norm, rope_attention_scale, rope_cos_sin,
                            rope_inv_freq)
from jaxspec.nn.schema import Spec
from jaxspec.pallas.common import to_kv_dtype


def attention_params(c, in_dim: int | None = None) -> dict[str, Spec]:
    """q/k/v as one grouped matrix: for each kv head, its G query heads, then its k and v head (rows of hd),
    so one matmul reads them and a split by kv head keeps each group whole. `in_dim`: the attention input's
    width (2D for EAGLE-3's midlayer)."""
    D, hd, Hq, Hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
    qkv_rows = Hkv * (Hq // Hkv + 2) * hd
    p = {"attn_norm": Spec((D,), ("embed",), "ones"),
         "qkv_proj": Spec((qkv_rows, in_dim or D), ("kv_heads", "embed")),
         "o_proj": Spec((D, Hq * hd), ("embed", "heads"))}
    if c.qkv_bias:
        p["qkv_bias"] = Spec((qkv_rows,), ("kv_heads",), "zeros")
    if c.qk_norm:
        p["q_norm"] = Spec((hd,), ("head_dim",), "ones")
        p["k_norm"] = Spec((hd,), ("head_dim",), "ones")
    return p


def mlp_params(c) -> dict[str, Spec]:
    """gate and up interleaved per MLP unit ([F, 2, D]): one matmul, and a split of F keeps pairs together."""
    D, F = c.hidden_size, c.intermediate_size
    return {"mlp_norm": Spec((D,), ("embed",), "ones"),
            "gate_up_proj": Spec((F, 2, D), ("mlp", None, "embed")),
            "down_proj": Spec((D, F), ("embed", "mlp"))}


def kv_state(c, cache: CacheShape) -> dict[str, Spec]:
    pool = Spec((cache.num_kv_slots, c.num_kv_heads, c.head_dim), ("kv_slots", "kv_heads", "head_dim"), "zeros",
                cache.kv_dtype)
    return {"k": pool, "v": pool}


def project_qkv(c, ops: Ops, lp, x, positions):
    """x [T, Din] (already normed) -> q [T, Hq, hd], k and v [T, Hkv, hd], q and k rotated to `positions`."""
    return split_qkv(c, lp, ops.linear(x, lp, "qkv_proj"), positions)


def split_qkv(c, lp, qkv, positions, inv_freq=None):
    """The q/k/v projection qkv [T, Hkv*(G+2)*hd] -> q [T, Hq, hd], k and v [T, Hkv, hd], q and k rotated (by
    `inv_freq`, the layer's rotary frequencies; None: the model's)."""
    T, hd, Hq, Hkv = qkv.shape[0], c.head_dim, c.num_heads, c.num_kv_heads
    G = Hq // Hkv
    if "qkv_bias" in lp:
        qkv = qkv + lp["qkv_bias"]
    qkv = qkv.reshape(T, Hkv, G + 2, hd)
    q, k, v = qkv[:, :, :G].reshape(T, Hq, hd), qkv[:, :, G], qkv[:, :, G + 1]   # [T, Hq, hd], [T, Hkv, hd] x2
    if "q_norm" in lp:
        q, k = rms_norm(q, lp["q_norm"], c.rms_norm_eps), rms_norm(k, lp["k_norm"], c.rms_norm_eps)
    inv_freq, scale = rope_inv_freq(c) if inv_freq is None else inv_freq, rope_attention_scale(c)
    return apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale), v


def attention(c, ops: Ops, lp, x, kv: dict, i, batch: ForwardBatch):
    """x [T, Din] (already normed) -> (attention output after o_proj [T, D], kv with this step's k/v written
    into layer i of the pools)."""
    out, kv = attend_qkv(c, ops, lp, ops.linear(x, lp, "qkv_proj"), kv, i, batch)   # [T, Hq*hd]
    return ops.linear(out.astype(x.dtype), lp, "o_proj"), kv


def attend_qkv(c, ops: Ops, lp, qkv, kv: dict, i, batch: ForwardBatch, inv_freq=None):
    """The q/k/v projection qkv [T, Hkv*(G+2)*hd] -> (attention output [T, Hq*hd] before o_proj, kv with this
    step's k/v written into layer i): bias, q/k norms and rotary (`inv_freq`: the layer's frequencies; None: the
    model's), the KV write and the attention, in one kernel where `ops.fuses_kv_write`
    (jaxspec.pallas.paged_attention), else as separate operations. A layer with attention sinks (`sinks` [Hq]
    among its weights: GPT-OSS) gives them to the attention."""
    inv_freq = rope_inv_freq(c) if inv_freq is None else inv_freq
    sinks = lp.get("sinks")
    if ops.fuses_kv_write(batch):
        cos, sin = rope_cos_sin(batch.positions, inv_freq, rope_attention_scale(c))        # [T, hd/2]
        out, k_pool, v_pool = kernels.fused_attention_fn(c, lp, qkv, cos, sin, kv["k"], kv["v"], i, batch,
                                                         ops.block_size, window=layer_window(c, i), sinks=sinks)
        return out, {**kv, "k": k_pool, "v": v_pool}
    q, k, v = split_qkv(c, lp, qkv, batch.positions, inv_freq)
    kv = write_kv(kv, i, batch, k, v)
    return ops.attend(q, kv["k"], kv["v"], i, batch, window=layer_window(c, i), sinks=sinks), kv


# A window no position is that far from: a layer without one, where layers with and without share one program.
NO_WINDOW = 1 << 30


def layer_window(c, i):
    """Layer i's sliding window: None (the whole context, every layer), the window (a Python int: every layer
    has it, or i is static: unrolled layers), or an i32 scalar picked from the layers' windows (scanned layers)."""
    if c.sliding_window is None:
        return None
    if c.sliding_layers is None:
        return c.sliding_window
    if isinstance(i, int):
        return c.layer_window(i)
    return jnp.asarray([c.sliding_window if s else NO_WINDOW for s in c.sliding_layers], jnp.int32)[i]


def write_kv(kv: dict, i, batch: ForwardBatch, k, v) -> dict:
    """The pools with this step's k/v [T, Hkv, hd] written into layer i at the batch's slot mapping (slots past
    the pool, padding, write nothing)."""
    return {**kv, "k": kv["k"].at[i, batch.slot_mapping].set(to_kv_dtype(k, kv["k"].dtype), mode="drop"),
            "v": kv["v"].at[i, batch.slot_mapping].set(to_kv_dtype(v, kv["v"].dtype), mode="drop")}


def mlp(c, ops: Ops, lp, h, lora=None):
    """h + down(silu(gate) * up) of the normed h [T, D]; `lora`: each token's adapter slot (`Ops.linear`)."""
    act = ops.linear(h, lp, "gate_up_proj", norm="mlp_norm", eps=c.rms_norm_eps, lora=lora)      # [T, F]
    return ops.linear(act, lp, "down_proj", residual=h, lora=lora)

class Attention:
    """The Llama / Qwen2 / Qwen3 decoder layer: RMSNorm -> grouped-query attention over the paged KV -> residual
    -> RMSNorm -> SwiGLU MLP -> residual. Each norm, SwiGLU and residual add is an argument of the projection next
    to it (`Ops.linear`), so that a kernel that runs the projection can hold it too."""
    name = "attention"

    def params(self, c):
        return {**attention_params(c), **mlp_params(c)}

    def state(self, c, cache):
        return kv_state(c, cache)

    def __call__(self, c, ops, lp, h, state, i, batch):
        lora = batch.lora_of_token      # each token's LoRA adapter slot, or None (no adapters)
        qkv = ops.linear(h, lp, "qkv_proj", norm="attn_norm", eps=c.rms_norm_eps, lora=lora)   # [T, Hkv*(G+2)*hd]
        out, state = attend_qkv(c, ops, lp, qkv, state, i, batch)                               # [T, Hq*hd]
        h = ops.linear(out.astype(h.dtype), lp, "o_proj", residual=h, lora=lora)                # h + attention
        return mlp(c, ops, lp, h, lora), state
