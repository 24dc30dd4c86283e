"""Qwen2 (model_type "qwen2"): Llama's layers with q/k/v biases, and Qwen's sliding-window rule."""
from __future__ import annotations

from typing import Any

from jaxspec.models.families.base import (DENSE_REFUSALS, Architecture, attention_layer_types, marked_sliding,
                                          sliding_window_fields)
from jaxspec.models.families.llama import Llama

# transformers' Qwen2 has q/k/v biases whatever attention_bias says (and no o_proj bias).
QWEN2_ARCHITECTURE = Architecture("qwen2", qkv_bias=True)


class Qwen2(Llama):
    name = "qwen2"
    display_name = "Qwen2"
    architecture = QWEN2_ARCHITECTURE
    model_types = ("qwen2",)

    refusals = DENSE_REFUSALS

    def sliding_window(self, hf: dict[str, Any], model_type: str) -> tuple[int | None, tuple[bool, ...] | None]:
        """transformers' rule: a window only when `use_sliding_window` is true (`sliding_window`, absent: 4096), on
        the layers `layer_types` marks sliding_attention (absent: layers i >= `max_window_layers`, default 28)."""
        types = attention_layer_types(hf.get("layer_types"), model_type)
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        n = hf["num_hidden_layers"]
        sliding = marked_sliding(types) if types is not None else list(range(hf.get("max_window_layers", 28) or 0, n))
        return sliding_window_fields(hf, window, sliding)


QWEN2 = Qwen2()
