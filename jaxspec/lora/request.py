"""A request's LoRA adapter, by vLLM's names."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with: `lora_name` (how it is listed and chosen: the OpenAI server's `model`),
    `lora_int_id` (a positive id, unique per adapter) and `lora_path` (a PEFT adapter directory)."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest lora_int_id={self.lora_int_id!r} is invalid; give a positive int, one "
                             "per adapter")
        if not self.lora_name:
            raise ValueError("LoRARequest needs a lora_name")
