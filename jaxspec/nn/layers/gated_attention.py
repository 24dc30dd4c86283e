"""The hybrids' (Qwen3-Next, Qwen3.5) full-attention layer: output gated per head, q/k normed, partial rotary."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.nn.layers.attention import kv_state, write_kv
from jaxspec.nn.layers.moe import ffn, ffn_params
from jaxspec.nn.ops import apply_rope, rms_norm
from jaxspec.nn.schema import Spec


def partial_rope(x, positions, c):
    """Rotary embedding on the first `c.rotary_dim` dims of each head (rotate-half layout), the rest kept."""
    rd = c.rotary_dim
    inv_freq = 1.0 / (c.rope_theta ** (jnp.arange(0, rd, 2, dtype=jnp.float32) / rd))
    return jnp.concatenate([apply_rope(x[..., :rd], positions, inv_freq), x[..., rd:]], axis=-1)


class GatedAttention:
    """Qwen3-Next / Qwen3.5 full attention: q_proj gives [q | gate] per head, RMSNorm over each head's q and k,
    rotary on a part of each head, output * sigmoid(gate) before o_proj; then the dense MLP or the MoE.
    q/gate/k/v are one grouped matrix: per kv head, its G q heads, its G gate heads, its k and v head."""
    name = "gated_attention"

    def params(self, c):
        D, hd, Hq, Hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
        rows = Hkv * (2 * (Hq // Hkv) + 2) * hd
        return {"attn_norm": Spec((D,), ("embed",), "ones"),
                "qkv_proj": Spec((rows, D), ("kv_heads", "embed")),
                "q_norm": Spec((hd,), ("head_dim",), "ones"), "k_norm": Spec((hd,), ("head_dim",), "ones"),
                "o_proj": Spec((D, Hq * hd), ("embed", "heads")), **ffn_params(c)}

    def state(self, c, cache):
        return kv_state(c, cache)

    def __call__(self, c, ops, lp, h, state, i, batch):
        T, hd, Hq, Hkv = h.shape[0], c.head_dim, c.num_heads, c.num_kv_heads
        G = Hq // Hkv
        qkv = ops.linear(h, lp, "qkv_proj", norm="attn_norm", eps=c.rms_norm_eps).reshape(T, Hkv, 2 * G + 2, hd)
        q, gate = qkv[:, :, :G].reshape(T, Hq, hd), qkv[:, :, G:2 * G].reshape(T, Hq * hd)
        k, v = qkv[:, :, 2 * G], qkv[:, :, 2 * G + 1]
        q, k = rms_norm(q, lp["q_norm"], c.rms_norm_eps), rms_norm(k, lp["k_norm"], c.rms_norm_eps)
        q, k = partial_rope(q, batch.positions, c), partial_rope(k, batch.positions, c)
        state = write_kv(state, i, batch, k, v)
        out = ops.attend(q, state["k"], state["v"], i, batch).astype(h.dtype)          # [T, Hq*hd]
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(h.dtype)
        h = ops.linear(out, lp, "o_proj", residual=h)
        return ffn(c, ops, lp, h, batch.writes_state), state
