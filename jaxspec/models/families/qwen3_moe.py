"""Qwen3-MoE (model_type "qwen3_moe"): Qwen3's attention, and a mixture of experts in place of the MLP in its sparse
layers (`attention_moe`); the others are dense Qwen3 layers."""
from __future__ import annotations

from typing import Any

import numpy as np

from jaxspec.models.families.base import DENSE_REFUSALS, attention_layer_types, sliding_window_fields
from jaxspec.models.families.llama import ATTENTION_TENSORS
from jaxspec.models.families.qwen3 import Qwen3
from jaxspec.models.families.tensors import TensorRule, combine


@combine(by_rows=False)
def stack_expert_gate_up(c, *parts):
    """Per-expert gate/up [F, D] (all gates, then all ups) -> [E, D, F, 2]."""
    E = c.num_experts
    gate, up = np.stack(parts[:E]), np.stack(parts[E:])                                 # [E, F, D]
    return np.stack([gate, up], axis=-1).transpose(0, 2, 1, 3)


@combine(by_rows=False)
def stack_expert_down(c, *parts):
    """Per-expert down [D, F] -> [E, F, D]."""
    return np.stack(parts).transpose(0, 2, 1)


def expert_gate_up_names(c) -> tuple[str, ...]:
    return tuple(f"mlp.experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj") for e in range(c.num_experts))


def expert_down_names(c) -> tuple[str, ...]:
    return tuple(f"mlp.experts.{e}.down_proj.weight" for e in range(c.num_experts))


# The router and the experts as Qwen's MoE checkpoints store them, one tensor per expert and projection
# (jaxspec.nn.layers.moe.moe_params); the hybrids' MoE layers too.
QWEN_EXPERT_TENSORS: dict[str, TensorRule] = {
    "router": TensorRule(("mlp.gate.weight",)),
    "experts_gate_up": TensorRule(expert_gate_up_names, stack_expert_gate_up),
    "experts_down": TensorRule(expert_down_names, stack_expert_down),
}
# The sparse layers: the attention layer's tensors, and the experts where the MLP was (plain RMSNorm weights).
ATTENTION_MOE_TENSORS: dict[str, TensorRule] = {
    **{name: rule for name, rule in ATTENTION_TENSORS.items() if name not in ("gate_up_proj", "down_proj")},
    **QWEN_EXPERT_TENSORS,
}


class Qwen3Moe(Qwen3):
    """attention_bias is not refused by the config here: a checkpoint with the q/k/v/o biases it asks for is refused
    at load, the biases unread (jaxspec.models.hf_loader.refuse_unread_tensors)."""
    name = "qwen3_moe"
    display_name = "Qwen3-MoE"
    model_types = ("qwen3_moe",)
    layer_tensors = {"attention": ATTENTION_TENSORS, "attention_moe": ATTENTION_MOE_TENSORS}

    refusals = DENSE_REFUSALS

    def sliding_window(self, hf: dict[str, Any], model_type: str) -> tuple[int | None, tuple[bool, ...] | None]:
        """transformers: every layer's window when `use_sliding_window` (no per-layer rule)."""
        attention_layer_types(hf.get("layer_types"), model_type)
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        return sliding_window_fields(hf, window, list(range(hf["num_hidden_layers"])))

    def family_fields(self, hf: dict[str, Any], model_type: str) -> dict[str, Any]:
        """Layer i is sparse (`attention_moe`) unless it is in `mlp_only_layers` or (i + 1) is not a multiple of
        `decoder_sparse_step` (transformers' rule); the experts' shapes and routing."""
        n = hf["num_hidden_layers"]
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        experts = hf.get("num_experts", hf.get("num_local_experts", 0))   # (the latter: transformers 5's name)
        kinds = tuple("attention_moe" if experts > 0 and i not in dense and (i + 1) % step == 0 else "attention"
                      for i in range(n))
        return dict(**super().family_fields(hf, model_type),
                    layer_types=kinds, num_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok", 0),
                    moe_intermediate_size=hf.get("moe_intermediate_size", 0),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


QWEN3_MOE = Qwen3Moe()
