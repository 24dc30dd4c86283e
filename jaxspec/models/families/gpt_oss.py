"""GPT-OSS (model_type "gpt_oss"): every layer `gpt_oss`, attention with q/k/v/o biases and a learned sink per
head (every other layer within a sliding window), YaRN rotary, then its mixture of experts (biases, a clamped
SwiGLU); its checkpoints store the experts in MXFP4."""
from __future__ import annotations

from typing import Any

from jaxspec.models.families.base import (DENSE_REFUSALS, Architecture, Family, attention_layer_types,
                                          marked_sliding, sliding_window_fields)
from jaxspec.models.families.llama import ATTENTION_TENSORS
from jaxspec.models.families.tensors import ATTN, TensorRule

EXPERTS = "mlp.experts."
# The attention layer's q/k/v (with biases), o_proj and its bias, the sinks; the router with its bias; the experts as
# stored ([E, D, 2F] and [E, F, D]: the grouped matmul's layout; an MXFP4 checkpoint's are dequantized by the loader,
# jaxspec.models.hf_loader).
GPT_OSS_TENSORS: dict[str, TensorRule] = {
    **{name: ATTENTION_TENSORS[name] for name in ("attn_norm", "qkv_proj", "qkv_bias", "o_proj", "mlp_norm")},
    "o_bias": TensorRule((ATTN + "o_proj.bias",)),
    "sinks": TensorRule((ATTN + "sinks",)),
    "router": TensorRule(("mlp.router.weight",)),
    "router_bias": TensorRule(("mlp.router.bias",)),
    "experts_gate_up_proj": TensorRule((EXPERTS + "gate_up_proj",)),
    "experts_gate_up_bias": TensorRule((EXPERTS + "gate_up_proj_bias",)),
    "experts_down_proj": TensorRule((EXPERTS + "down_proj",)),
    "experts_down_bias": TensorRule((EXPERTS + "down_proj_bias",)),
}


class GptOss(Family):
    name = "gpt_oss"
    display_name = "GPT-OSS"
    architecture = Architecture("gpt_oss")
    model_types = ("gpt_oss",)
    layer_tensors = {"gpt_oss": GPT_OSS_TENSORS}
    rope_types = ("default", "llama3", "yarn")   # yarn: tested against transformers for GPT-OSS
    mxfp4_experts = True

    refusals = DENSE_REFUSALS

    def sliding_window(self, hf: dict[str, Any], model_type: str) -> tuple[int | None, tuple[bool, ...] | None]:
        """`sliding_window` (absent: 128) on the layers `layer_types` marks sliding_attention; without layer_types,
        transformers alternates: layers 0, 2, 4, ... sliding."""
        types = attention_layer_types(hf.get("layer_types"), model_type)
        n = hf["num_hidden_layers"]
        sliding = marked_sliding(types) if types is not None else [i for i in range(n) if (i + 1) % 2]
        return sliding_window_fields(hf, hf.get("sliding_window", 128), sliding)

    def family_fields(self, hf: dict[str, Any], model_type: str) -> dict[str, Any]:
        """Every layer the `gpt_oss` kind (attention with sinks, then its mixture of experts, each expert
        intermediate_size wide), q/k/v/o biases unless attention_bias is false, the experts' clamped SwiGLU."""
        window, sliding_layers = self.sliding_window(hf, model_type)
        return dict(sliding_window=window, sliding_layers=sliding_layers,
                    layer_types=("gpt_oss",) * hf["num_hidden_layers"], num_experts=hf["num_local_experts"],
                    num_experts_per_tok=hf["num_experts_per_tok"], moe_intermediate_size=hf["intermediate_size"],
                    attention_bias=bool(hf.get("attention_bias", True)),
                    swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)))


GPT_OSS = GptOss()
