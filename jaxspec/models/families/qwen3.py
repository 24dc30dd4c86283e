"""Qwen3 (model_type "qwen3"): Llama's layers with q and k RMSNormed per head, and Qwen's sliding-window rule."""
from __future__ import annotations


from jaxspec.models.families.base import (Architecture, refuse_attention_bias, refuse_partial_rotary,
                                          refuse_soft_capping, refuse_unless_swiglu)
from jaxspec.models.families.qwen2 import Qwen2

QWEN3_ARCHITECTURE = Architecture("qwen3", qk_norm=True)


class Qwen3(Qwen2):
    name = "qwen3"
    display_name = "Qwen3"
    architecture = QWEN3_ARCHITECTURE
    model_types = ("qwen3",)

    refusals = (refuse_unless_swiglu, refuse_attention_bias, refuse_soft_capping, refuse_partial_rotary)


QWEN3 = Qwen3()
