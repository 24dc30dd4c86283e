"""Mixture of experts: top-k routing of each token to experts run as one grouped matmul per projection, the
Qwen3-MoE sparse layer (`AttentionMoE`), and the feed-forward half that is dense or experts by the config (`ffn`,
the hybrids')."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.nn.layers.attention import Attention, attend_qkv, attention_params, mlp, mlp_params
from jaxspec.nn.ops import Ops, rms_norm
from jaxspec.nn.schema import Spec


def ffn_params(c) -> dict[str, Spec]:
    """The feed-forward half of a hybrid layer: the dense SwiGLU MLP, or the mixture of experts."""
    return moe_params(c) if c.moe else mlp_params(c)


def ffn(c, ops: Ops, lp, h, routed=None):
    return moe(c, ops, lp, h, routed) if c.moe else mlp(c, ops, lp, h)


def moe_params(c) -> dict[str, Spec]:
    """Top-k routed experts (gate/up [E, D, F, 2], down [E, F, D]: the layouts a grouped matmul reads) and a
    shared expert whose output a sigmoid gate scales."""
    D, E, F, Fs = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    p = {"mlp_norm": Spec((D,), ("embed",), "ones"),
         "router": Spec((E, D), (None, "embed")),
         "experts_gate_up": Spec((E, D, F, 2), (None, "embed", "mlp", None)),
         "experts_down": Spec((E, F, D), (None, "mlp", "embed"))}
    if Fs:
        p.update({"shared_gate_up": Spec((Fs, 2, D), ("mlp", None, "embed")),
                  "shared_down": Spec((D, Fs), ("embed", "mlp")),
                  "shared_gate": Spec((1, D), (None, "embed"))})
    return p


def moe(c, ops: Ops, lp, h, routed=None):
    """h + MoE(normed h): softmax router, top-k experts per token (weights renormalised when norm_topk_prob),
    each token's k (token, expert) pairs sorted by expert and run as one grouped matmul (`Ops.linear` with the
    experts' group sizes), no per-expert loop; plus sigmoid(shared_gate . x) * shared expert. routed: bool[T], the
    tokens whose output is read (None: all); the others (a step's padding) are routed to no expert, so that
    they cost no expert's weights, and get h back."""
    x = rms_norm(h, lp["mlp_norm"], c.rms_norm_eps)
    probs = jax.nn.softmax(ops.linear(x, lp, "router").astype(jnp.float32), axis=-1)   # [T, E]
    top_w, top_e = jax.lax.top_k(probs, c.num_experts_per_tok)                          # [T, k]
    if c.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    routes = route_by_expert(top_e, c.num_experts, routed)
    act = ops.linear(x[routes.token], lp, "experts_gate_up", group_sizes=routes.group_sizes)   # [T*k, F]
    out = ops.linear(act.astype(x.dtype), lp, "experts_down", group_sizes=routes.group_sizes)  # [T*k, D]
    y = routes.combine(out, top_w)
    if "shared_gate_up" in lp:   # (the shared expert is dense: every token's row is computed anyway)
        shared = ops.linear(ops.linear(x, lp, "shared_gate_up"), lp, "shared_down")
        y = y + jax.nn.sigmoid(ops.linear(x, lp, "shared_gate")) * shared
    return h + y.astype(h.dtype)


class ExpertRoutes(NamedTuple):
    """Each token's k (token, expert) pairs sorted by expert, as the grouped matmul reads them: pair j belongs to
    token `token[j]` and expert `expert[j]`, and choice i of the flat [T*k] choices is at `position[i]` among the
    pairs; `group_sizes` [E] counts each expert's pairs. The pairs of tokens not routed come last, counted by no
    group (expert E): the grouped matmul leaves their rows unwritten and `combine` drops them."""
    position: jax.Array
    token: jax.Array
    expert: jax.Array
    group_sizes: jax.Array

    def combine(self, out, top_w):
        """The pairs' outputs [T*k, D] weighted by their routing weights top_w [T, k], summed per token in float32:
        [T, D]. A gather back to the choices' order, then a sum over each token's k (a scatter-add into the
        tokens would serialise on each token's k atomic adds, and add in no fixed order)."""
        T, k = top_w.shape
        routed = self.position < jnp.sum(self.group_sizes)                              # [T*k]: not sorted last
        # where, not a product: the rows of pairs not routed may hold NaN
        pairs = jnp.where(routed[:, None], out[self.position].astype(jnp.float32) * top_w.reshape(-1, 1), 0.0)
        return pairs.reshape(T, k, -1).sum(axis=1)


def route_by_expert(top_e, num_experts: int, routed=None) -> ExpertRoutes:
    """top_e i32[T, k] (each token's chosen experts) -> the pairs grouped by expert (a stable sort: no per-expert
    loop, one grouped matmul per projection). routed: bool[T] or None (all); the pairs of the other tokens go to
    expert `num_experts`, past every group."""
    k = top_e.shape[1]
    if routed is not None:
        top_e = jnp.where(routed[:, None], top_e, num_experts)
    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                                   unique_indices=True)
    return ExpertRoutes(position, order // k, flat_e[order],
                        jnp.bincount(flat_e, length=num_experts).astype(jnp.int32))



class AttentionMoE(Attention):
    """Qwen3-MoE's sparse layer: the Attention layer's attention, then the mixture of experts (`moe`: softmax router,
    top-k experts, no shared expert) where the dense MLP was."""
    name = "attention_moe"

    def params(self, c):
        return {**attention_params(c), **moe_params(c)}

    def __call__(self, c, ops, lp, h, state, i, batch):
        qkv = ops.linear(h, lp, "qkv_proj", norm="attn_norm", eps=c.rms_norm_eps)
        out, state = attend_qkv(c, ops, lp, qkv, state, i, batch)
        h = ops.linear(out.astype(h.dtype), lp, "o_proj", residual=h)
        return moe(c, ops, lp, h, batch.writes_state), state
