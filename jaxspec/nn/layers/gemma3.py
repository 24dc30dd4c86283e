"""Gemma 3's decoder layer: four norms a layer, local (sliding-window, own rotary base) and global attention."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.nn.kernels import LayerWeights
from jaxspec.nn.layers.attention import attend_qkv, attention_params, kv_state, mlp_params
from jaxspec.nn.ops import rms_norm, rope_inv_freq
from jaxspec.nn.schema import Spec

# Gemma 3's norms, declared float32: they hold 1 + w (ModelConfig.plus_one_norms), as its RMSNorm computes in float32.
GEMMA3_NORMS = ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")


def layer_inv_freq(c, i):
    """Layer i's rotary frequencies [hd/2]: the local ones (`local_rope_theta`) where `local_rope_layers` marks it,
    else the model's; picked by index when i is traced (scanned layers), as `layer_window` picks the window."""
    if c.local_rope_layers is None:
        return rope_inv_freq(c)
    if isinstance(i, int):
        return rope_inv_freq(c, local=c.local_rope_layers[i])
    return jnp.where(jnp.asarray(c.local_rope_layers)[i], rope_inv_freq(c, local=True), rope_inv_freq(c))


def with_query_scale(c, lp):
    """lp with q_norm times sqrt(head_dim / query_pre_attn_scalar): every attention path (the Pallas kernels too)
    scales scores by head_dim ** -0.5, and q's norm is q's last scaling before them (rotary is linear), so the
    scores come out scaled by query_pre_attn_scalar ** -0.5. Unchanged where the two are equal (Gemma 3 4B/12B)."""
    if not c.query_pre_attn_scalar or c.query_pre_attn_scalar == c.head_dim:
        return lp
    factor = (c.head_dim / c.query_pre_attn_scalar) ** 0.5
    if isinstance(lp, LayerWeights):   # the kernels read the whole stack
        return lp.replacing({"q_norm": lp.stacks["q_norm"] * factor})
    return {**lp, "q_norm": lp["q_norm"] * factor}


class Gemma3Attention:
    """Gemma 3's decoder layer, local (a sliding window, the local rotary base) or global (the whole context, the
    global base with its scaling) as the config marks layer i:

        h = h + post_attn_norm(o_proj(attention(attn_norm(h))))         q and k RMSNormed per head
        h = h + post_mlp_norm(down(gelu_tanh(gate) * up of mlp_norm(h)))

    Every RMSNorm scales by (1 + w) in float32 (its weights hold 1 + w, float32); scores are scaled by
    query_pre_attn_scalar ** -0.5. The input norms ride on the projections after them (`Ops.linear`), as the
    Attention layer's; the post norms stand between a projection and its residual, so those adds are apart."""
    name = "gemma3_attention"

    def params(self, c):
        D = c.hidden_size
        p = {**attention_params(c), **mlp_params(c),
             "post_attn_norm": Spec((D,), ("embed",), "ones"), "post_mlp_norm": Spec((D,), ("embed",), "ones")}
        return {name: dataclasses.replace(spec, dtype=jnp.float32) if name in GEMMA3_NORMS else spec
                for name, spec in p.items()}

    def state(self, c, cache):
        return kv_state(c, cache)

    def __call__(self, c, ops, lp, h, state, i, batch):
        lp = with_query_scale(c, lp)
        qkv = ops.linear(h, lp, "qkv_proj", norm="attn_norm", eps=c.rms_norm_eps)
        out, state = attend_qkv(c, ops, lp, qkv, state, i, batch, inv_freq=layer_inv_freq(c, i))
        attn = ops.linear(out.astype(h.dtype), lp, "o_proj")
        h = h + rms_norm(attn, lp["post_attn_norm"], c.rms_norm_eps)
        act = ops.linear(h, lp, "gate_up_proj", norm="mlp_norm", eps=c.rms_norm_eps, activation=c.hidden_act)
        return h + rms_norm(ops.linear(act, lp, "down_proj"), lp["post_mlp_norm"], c.rms_norm_eps), state
