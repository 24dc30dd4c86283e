"""Qwen3 (model_type "qwen3"): Llama's layers with q and k RMSNormed per head, and Qwen's sliding-window rule."""
from __future__ import annotations

from typing import Any

from jaxspec.models.families.base import (Architecture, refuse_attention_bias, refuse_partial_rotary,
                                          refuse_soft_capping, refuse_unless_swiglu)
from jaxspec.models.families.qwen2 import Qwen2

QWEN3_ARCHITECTURE = Architecture("qwen3", qk_norm=True)


class Qwen3(Qwen2):
    name = "qwen3"
    display_name = "Qwen3"
    architecture = QWEN3_ARCHITECTURE
    model_types = ("qwen3",)

    def refuse_unimplemented(self, hf: dict[str, Any], model_type: str) -> None:
        refuse_unless_swiglu(hf)
        refuse_attention_bias(hf, model_type)
        refuse_soft_capping(hf)
        refuse_partial_rotary(hf, model_type)
        self.sliding_window(hf, model_type)


QWEN3 = Qwen3()
