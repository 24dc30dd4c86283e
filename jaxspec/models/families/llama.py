"""Llama (model_type "llama"): every layer `attention` (RMSNorm, grouped-query attention, SwiGLU MLP), no window."""
from __future__ import annotations

from typing import Any

from jaxspec.models.errors import UnsupportedModelError
from jaxspec.models.families.base import (Architecture, Family, attention_layer_types, marked_sliding,
                                          refuse_attention_bias, refuse_mlp_bias, refuse_partial_rotary,
                                          refuse_soft_capping, refuse_unless_swiglu, window_bites)
from jaxspec.models.families.tensors import ATTN, TensorRule, group_qkv, interleave_gate_up

LLAMA_ARCHITECTURE = Architecture("llama")

# The `attention` layer kind's weights (jaxspec.nn.layers.attention): those its schema declares for a config are read
# (qkv_bias where the architecture has biases, q_norm and k_norm where it norms q and k).
ATTENTION_TENSORS: dict[str, TensorRule] = {
    "attn_norm": TensorRule(("input_layernorm.weight",)),
    "qkv_proj": TensorRule((ATTN + "q_proj.weight", ATTN + "k_proj.weight", ATTN + "v_proj.weight"), group_qkv),
    "qkv_bias": TensorRule((ATTN + "q_proj.bias", ATTN + "k_proj.bias", ATTN + "v_proj.bias"), group_qkv),
    "q_norm": TensorRule((ATTN + "q_norm.weight",)),
    "k_norm": TensorRule((ATTN + "k_norm.weight",)),
    "o_proj": TensorRule((ATTN + "o_proj.weight",)),
    "mlp_norm": TensorRule(("post_attention_layernorm.weight",)),
    "gate_up_proj": TensorRule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), interleave_gate_up),
    "down_proj": TensorRule(("mlp.down_proj.weight",)),
}


class Llama(Family):
    name = "llama"
    display_name = "Llama"
    architecture = LLAMA_ARCHITECTURE
    model_types = ("llama",)
    layer_tensors = {"attention": ATTENTION_TENSORS}

    refusals = (refuse_unless_swiglu, refuse_attention_bias, refuse_mlp_bias, refuse_soft_capping,
                refuse_partial_rotary)

    def sliding_window(self, hf: dict[str, Any], model_type: str) -> tuple[int | None, tuple[bool, ...] | None]:
        """(None, None): transformers' Llama applies no window (a `sliding_window` key is ignored there), unless
        `layer_types` marks sliding layers: a window that then bites is refused."""
        types = attention_layer_types(hf.get("layer_types"), model_type)
        window, sliding = hf.get("sliding_window"), marked_sliding(types)
        if not window_bites(hf, window, sliding):
            return None, None
        layers = f"layers {sliding[0]}..{sliding[-1]}" if sliding == list(range(sliding[0], sliding[-1] + 1)) else \
            f"layers {sliding}"
        raise UnsupportedModelError(
            f"sliding_window={window} is not supported for model_type={model_type!r}: it applies to {layers} "
            f"(layer_types marks them sliding_attention) and jaxspec applies sliding windows to Mistral, Qwen2, Qwen3, "
            f"Gemma 3 and GPT-OSS only, so the model would decode wrongly past {window} tokens; supported: "
            f"sliding_window null, or a window of at least max_position_embeddings="
            f"{hf.get('max_position_embeddings', 4096)}")

    def family_fields(self, hf: dict[str, Any], model_type: str) -> dict[str, Any]:
        window, layers = self.sliding_window(hf, model_type)
        return dict(sliding_window=window, sliding_layers=layers)


LLAMA = Llama()
