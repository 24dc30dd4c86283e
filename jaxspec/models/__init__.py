"""Llama / Qwen2 / Qwen3 decoders as pure functions over a params pytree, and their loaders."""
from jaxspec.models.config import ModelConfig
from jaxspec.models.loader import load_model
from jaxspec.models.model import Model

__all__ = ["Model", "ModelConfig", "load_model"]
