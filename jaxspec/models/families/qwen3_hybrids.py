"""The Gated DeltaNet hybrids, Qwen3-Next (model_type "qwen3_next") and Qwen3.5 (its text models, and the
vision-language checkpoints' text model): linear-attention layers (`gated_deltanet`) and gated full-attention layers
(`gated_attention`) as `layer_types` says, a dense MLP or a mixture of experts with a shared expert in every layer,
zero-centred RMSNorms, rotary on part of each head. The two differ in how the linear attention's input projection is
stored."""
from __future__ import annotations

from typing import Any

import numpy as np

from jaxspec.models.errors import UnsupportedModelError
from jaxspec.models.families.base import (Architecture, Family, nested_text_config, refuse_attention_bias,
                                          refuse_soft_capping, refuse_unless_swiglu)
from jaxspec.models.families.qwen3_moe import QWEN_EXPERT_TENSORS
from jaxspec.models.families.rope import given_rope_scaling, rope_theta
from jaxspec.models.families.tensors import (ATTN, TOP_TENSORS_ZERO_CENTRED_NORM, TensorRule, combine, concat_rows,
                                             interleave_gate_up, plus_one)

# HF `layer_types` entries -> jaxspec layer kinds (jaxspec.nn.layers.LAYER_KINDS).
HYBRID_LAYER_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "gated_attention"}


@combine(by_rows=True)
def group_gated_qkv(c, q, k, v):
    """HF q_proj [Hq * 2hd, D] (each head's q then its gate), k/v [Hkv*hd, D] -> rows grouped per kv head:
    [its G q heads, its G gate heads, its k, its v]."""
    Hkv, hd = c.num_kv_heads, c.head_dim
    G = c.num_heads // Hkv
    qg = q.reshape(Hkv, G, 2, hd, -1)
    parts = [qg[:, :, 0], qg[:, :, 1], k.reshape(Hkv, 1, hd, -1), v.reshape(Hkv, 1, hd, -1)]
    return np.concatenate(parts, axis=1).reshape(-1, q.shape[-1])


@combine(by_rows=True)
def qwen3_next_in_proj(c, qkvz, ba):
    """Qwen3-Next's in_proj_qkvz (per key head: q, k, its G value heads' v, their z) and in_proj_ba (per key head:
    its G b, its G a) -> Qwen3.5's order [q | k | v | z | b | a]."""
    Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    G = Hv // Hk
    D = qkvz.shape[-1]
    w = qkvz.reshape(Hk, 2 * dk + 2 * G * dv, D)
    q, k = w[:, :dk], w[:, dk:2 * dk]
    v, z = w[:, 2 * dk:2 * dk + G * dv], w[:, 2 * dk + G * dv:]
    ba = ba.reshape(Hk, 2 * G, D)
    return np.concatenate([x.reshape(-1, D) for x in (q, k, v, z, ba[:, :G], ba[:, G:])], axis=0)


@combine(by_rows=False)
def conv_kernel(c, w):
    """HF depthwise conv1d weight [C, 1, K] -> [K, C]."""
    return w[:, 0, :].T


LIN = "linear_attn."
# The feed-forward half of every layer (jaxspec.nn.layers.moe.ffn_params): the dense MLP, or the experts and the
# shared expert; its norm zero-centred.
_FFN_TENSORS: dict[str, TensorRule] = {
    "mlp_norm": TensorRule(("post_attention_layernorm.weight",), plus_one),
    "gate_up_proj": TensorRule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), interleave_gate_up),
    "down_proj": TensorRule(("mlp.down_proj.weight",)),
    **QWEN_EXPERT_TENSORS,
    "shared_gate_up": TensorRule(("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
                                 interleave_gate_up),
    "shared_down": TensorRule(("mlp.shared_expert.down_proj.weight",)),
    "shared_gate": TensorRule(("mlp.shared_expert_gate.weight",)),
}
GATED_ATTENTION_TENSORS: dict[str, TensorRule] = {
    "attn_norm": TensorRule(("input_layernorm.weight",), plus_one),
    "qkv_proj": TensorRule((ATTN + "q_proj.weight", ATTN + "k_proj.weight", ATTN + "v_proj.weight"), group_gated_qkv),
    "q_norm": TensorRule((ATTN + "q_norm.weight",), plus_one),
    "k_norm": TensorRule((ATTN + "k_norm.weight",), plus_one),
    "o_proj": TensorRule((ATTN + "o_proj.weight",)),
    **_FFN_TENSORS,
}
# Qwen3.5's layout of the linear attention's input projection, [q | k | v | z | b | a] (Qwen3-Next's is reordered
# into it: QWEN3_NEXT_GATED_DELTANET_TENSORS).
GATED_DELTANET_TENSORS: dict[str, TensorRule] = {
    "attn_norm": TensorRule(("input_layernorm.weight",), plus_one),
    "in_proj": TensorRule(tuple(LIN + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")), concat_rows),
    "conv_weight": TensorRule((LIN + "conv1d.weight",), conv_kernel),
    "dt_bias": TensorRule((LIN + "dt_bias",)),
    "A_log": TensorRule((LIN + "A_log",)),
    "gdn_norm": TensorRule((LIN + "norm.weight",)),
    "out_proj": TensorRule((LIN + "out_proj.weight",)),
    **_FFN_TENSORS,
}
QWEN3_NEXT_GATED_DELTANET_TENSORS: dict[str, TensorRule] = {
    **GATED_DELTANET_TENSORS,
    "in_proj": TensorRule((LIN + "in_proj_qkvz.weight", LIN + "in_proj_ba.weight"), qwen3_next_in_proj),
}


class Qwen3Next(Family):
    name = "qwen3_next"
    display_name = "Qwen3-Next"
    architecture = Architecture("qwen3_next", qk_norm=True, hybrid=True)
    model_types = ("qwen3_next",)
    layer_tensors = {"gated_attention": GATED_ATTENTION_TENSORS, "gated_deltanet": QWEN3_NEXT_GATED_DELTANET_TENSORS}
    # Every norm but the linear attention's gated one is zero-centred, the final one too.
    top_tensors = TOP_TENSORS_ZERO_CENTRED_NORM

    def with_defaults(self, hf: dict[str, Any]) -> dict[str, Any]:
        """With experts and no intermediate_size, every layer is MoE (Qwen3.5 MoE): no dense MLP width."""
        if "intermediate_size" not in hf and hf.get("num_experts"):
            return {**hf, "intermediate_size": hf.get("moe_intermediate_size", 0)}
        return hf

    refusals = (refuse_unless_swiglu, refuse_attention_bias, refuse_soft_capping)

    def rope(self, hf: dict[str, Any], draft_head: bool) -> tuple[float, tuple | None]:
        """Plain rotary on the first partial_rotary_factor of each head (jaxspec.nn.layers.gated_attention's
        partial_rope): a scaling is refused."""
        given = given_rope_scaling(hf, draft_head)
        if given is not None and given.kind != "default":
            raise UnsupportedModelError(f"{given.field} type {given.kind!r} is not supported for "
                                        f"{self.architecture.name} (its partial rotary applies no rope scaling); "
                                        "supported: rope_type 'default'")
        return rope_theta(hf), None

    def family_fields(self, hf: dict[str, Any], model_type: str) -> dict[str, Any]:
        """Layer kinds (`layer_types`, else every `full_attention_interval`-th layer full attention), partial rotary,
        the Gated DeltaNet shapes, the experts."""
        n = hf["num_hidden_layers"]
        types = hf.get("layer_types")
        if types is None:
            interval = hf.get("full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
        unknown = sorted(set(types) - set(HYBRID_LAYER_KINDS))
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown}; supported: {', '.join(HYBRID_LAYER_KINDS)}")
        rp = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        fields: dict[str, Any] = dict(
            layer_types=tuple(HYBRID_LAYER_KINDS[t] for t in types),
            partial_rotary_factor=float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
            linear_num_key_heads=hf["linear_num_key_heads"], linear_num_value_heads=hf["linear_num_value_heads"],
            linear_key_head_dim=hf["linear_key_head_dim"], linear_value_head_dim=hf["linear_value_head_dim"],
            linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4))
        if hf.get("num_experts", 0):
            sparse_step = hf.get("decoder_sparse_step", 1)
            if hf.get("mlp_only_layers") or sparse_step != 1:
                raise ValueError("a mix of MoE and dense MLP layers (mlp_only_layers, decoder_sparse_step != 1) is not "
                                 "supported; every layer must be MoE or every layer dense")
            fields.update(num_experts=hf["num_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                          moe_intermediate_size=hf["moe_intermediate_size"],
                          norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                          shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0))
        return fields


class Qwen35(Qwen3Next):
    """Qwen3.5, dense and MoE: its text models' configs, or a vision-language checkpoint's (its text model's config
    nested under `text_config`, its tensors under model.language_model.*)."""
    name = "qwen3_5"
    display_name = "Qwen3.5"
    architecture = Architecture("qwen3_5", qk_norm=True, hybrid=True)
    model_types = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
    wrapper_model_types = ("qwen3_5", "qwen3_5_moe")
    # (transformers 5's layout)
    text_model_prefixes = {"model.language_model.embed_tokens.weight": (("model.", "model.language_model."),)}
    layer_tensors = {"gated_attention": GATED_ATTENTION_TENSORS, "gated_deltanet": GATED_DELTANET_TENSORS}

    def text_model_config(self, hf: dict[str, Any], model_type: str) -> tuple[dict[str, Any], str] | None:
        """A config with a `text_config` nests its text model's (without one, it is the text model's own)."""
        if not isinstance(hf.get("text_config"), dict):
            return None
        return nested_text_config(hf, model_type, tie_by_default=False, outer_ids_win=False)


QWEN3_NEXT = Qwen3Next()
QWEN3_5 = Qwen35()
