"""Mistral (model_type "mistral"): Llama's model, with a sliding window on every layer."""
from __future__ import annotations

from typing import Any

from jaxspec.models.families.base import DENSE_REFUSALS, attention_layer_types, sliding_window_fields
from jaxspec.models.families.llama import Llama


class Mistral(Llama):
    """transformers' Mistral has no attention or MLP biases whatever the config says: those fields are not refused."""
    name = "mistral"
    display_name = "Mistral"
    model_types = ("mistral",)

    refusals = DENSE_REFUSALS

    def sliding_window(self, hf: dict[str, Any], model_type: str) -> tuple[int | None, tuple[bool, ...] | None]:
        """`sliding_window` (absent: transformers' default, 4096) on every layer."""
        attention_layer_types(hf.get("layer_types"), model_type)
        return sliding_window_fields(hf, hf.get("sliding_window", 4096), list(range(hf["num_hidden_layers"])))


MISTRAL = Mistral()
