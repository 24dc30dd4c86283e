"""`jaxspec serve`: an OpenAI-compatible HTTP server over one LLM (jaxspec/serve/app.py)."""
import importlib

__all__ = ["ServeOptions", "build_app"]
# Imported on first use (PEP 562): `jaxspec serve` reads its flags through jaxspec.serve.options before anything
# imports JAX (a bad flag is answered in a fraction of a second).
_PUBLIC = {"build_app": "jaxspec.serve.app", "ServeOptions": "jaxspec.serve.options"}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_PUBLIC[name]), name)
    return value
