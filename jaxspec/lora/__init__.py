"""LoRA adapters over one base model (vLLM's `LoRARequest`, PEFT checkpoints): `peft` reads an adapter into the base
model's weight layout, `slots` keeps the resident ones on the device, where each step's rows pick theirs."""
from jaxspec.lora.request import LoRARequest

__all__ = ["LoRARequest"]
