"""The layer library: each kind of decoder layer is one function plus the declaration of its weights and of the
state it keeps. The target's decoder, the draft model and the EAGLE heads are all built from these.

A layer kind's state is declared per layer; its axes say how the step treats it:
  - a field whose first axis is `kv_slots` is paged (the KV pool): the layer writes it in place at the
    batch's slot mapping; positions past the accepted drafts are overwritten by a later step;
  - a field whose first axis is `slots` is per request slot (a recurrent state): the layer reads the slot's
    state and returns its value after every token of the step (`slot_updates`, [T, ...]); the step then keeps,
    for each row, the value after the row's last accepted token (`Decoder.commit`). That is how a state that
    cannot be overwritten later is rolled back past rejected drafts.

`LAYER_KINDS` is the public table: a new kind registered there can be named in `ModelConfig.layer_types`,
with no edit to the decoder, the step or the engine.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from jaxspec.nn.ops import ForwardBatch, Ops, apply_rope, rms_norm, rope_inv_freq
from jaxspec.nn.schema import Spec


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """What a layer's state is sized by: flat KV slots of the paged pool, request slots (+1 trash slot)."""
    num_kv_slots: int
    num_slots: int


class LayerKind(Protocol):
    name: str

    def params(self, c) -> dict[str, Spec]:
        """One layer's weights (the decoder stacks them per kind)."""

    def state(self, c, cache: CacheShape) -> dict[str, Spec]:
        """One layer's state (first axis `kv_slots`: paged; `slots`: per request slot)."""

    def __call__(self, c, ops: Ops, lp: dict, h, state: dict, i, batch: ForwardBatch):
        """h [T, D] -> (h [T, D], state, slot_updates {field: [T, ...]}). `lp`: this layer's weights; `state`:
        every layer of this kind's state ([n, ...] per field), `i` this layer's index among them."""


# ---- blocks shared by every layer kind and the EAGLE heads -------------------------------------------------

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
    pool = Spec((cache.num_kv_slots, c.num_kv_heads, c.head_dim), ("kv_slots", "kv_heads", "head_dim"), "zeros")
    return {"k": pool, "v": pool}


def project_qkv(c, lp, x, positions):
    """x [T, Din] (already normed) -> q [T, Hq, hd], k and v [T, Hkv, hd], q and k rotated to `positions`."""
    T, hd, Hq, Hkv = x.shape[0], c.head_dim, c.num_heads, c.num_kv_heads
    G = Hq // Hkv
    qkv = x @ lp["qkv_proj"].T                                                    # [T, Hkv*(G+2)*hd]
    if "qkv_bias" in lp:
        qkv = qkv + lp["qkv_bias"]
    qkv = qkv.reshape(T, Hkv, G + 2, hd)
    q, k, v = qkv[:, :, :G].reshape(T, Hq, hd), qkv[:, :, G], qkv[:, :, G + 1]   # [T, Hq, hd], [T, Hkv, hd] x2
    if "q_norm" in lp:
        q, k = rms_norm(q, lp["q_norm"], c.rms_norm_eps), rms_norm(k, lp["k_norm"], c.rms_norm_eps)
    inv_freq = rope_inv_freq(c)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def attention(c, ops: Ops, lp, x, kv: dict, i, batch: ForwardBatch):
    """x [T, Din] (already normed) -> (attention output after o_proj [T, D], kv with this step's k/v written
    into layer i of the pools)."""
    q, k, v = project_qkv(c, lp, x, batch.positions)
    k_pool = kv["k"].at[i, batch.slot_mapping].set(k.astype(kv["k"].dtype), mode="drop")
    v_pool = kv["v"].at[i, batch.slot_mapping].set(v.astype(kv["v"].dtype), mode="drop")
    out = ops.attend(q, k_pool, v_pool, i, batch)                                 # [T, Hq*hd]
    return out.astype(x.dtype) @ lp["o_proj"].T, {**kv, "k": k_pool, "v": v_pool}


def mlp(c, lp, h):
    """h + down(silu(gate) * up) of the normed h [T, D]."""
    x = rms_norm(h, lp["mlp_norm"], c.rms_norm_eps)
    w = lp["gate_up_proj"]                                                        # [F, 2, D]
    gate_up = (x @ w.reshape(-1, w.shape[-1]).T).reshape(x.shape[0], w.shape[0], 2)  # [T, F, 2]
    return h + (jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1]) @ lp["down_proj"].T


# ---- layer kinds -------------------------------------------------------------------------------------------

class Attention:
    """The Llama / Qwen2 / Qwen3 decoder layer: RMSNorm -> grouped-query attention over the paged KV -> residual
    -> RMSNorm -> SwiGLU MLP -> residual."""
    name = "attention"

    def params(self, c):
        return {**attention_params(c), **mlp_params(c)}

    def state(self, c, cache):
        return kv_state(c, cache)

    def __call__(self, c, ops, lp, h, state, i, batch):
        attn, state = attention(c, ops, lp, rms_norm(h, lp["attn_norm"], c.rms_norm_eps), state, i, batch)
        return mlp(c, lp, h + attn), state, {}


LAYER_KINDS: dict[str, LayerKind] = {"attention": Attention()}


def per_slot_fields(state_specs: dict[str, Spec]) -> list[str]:
    """The fields of a layer kind's state that are kept per request slot (committed after acceptance)."""
    return [name for name, spec in state_specs.items() if spec.axes[0] == "slots"]


def segment_start_state(state, batch: ForwardBatch, T: int):
    """For a per-slot state [slots+1, ...]: each token's row's state at the start of this step, [T, ...]; zeros
    for rows that start their sequence (position 0: a new or re-prefilled request)."""
    row = batch.row_of_token
    prev = state[batch.slot_of_row[row]]                                          # [T, ...]
    fresh = batch.positions[batch.first_token_of_row[row]] == 0                   # [T]
    return jnp.where(fresh.reshape((T,) + (1,) * (prev.ndim - 1)), jnp.zeros_like(prev), prev)
