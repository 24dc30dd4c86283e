"""Llama / Qwen2 / Qwen3 decoders as pure functions over a params pytree, and their loaders."""
import importlib

# Imported on first use (PEP 562): the command-line tools check a model's name against the presets
# (jaxspec.models.presets, jaxspec.models.loader.check_model_spec) before anything imports JAX.
_PUBLIC = {"Model": "jaxspec.models.model", "ModelConfig": "jaxspec.models.config", "load_model": "jaxspec.models.loader"}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_PUBLIC[name]), name)
    return value


__all__ = ["Model", "ModelConfig", "load_model"]
