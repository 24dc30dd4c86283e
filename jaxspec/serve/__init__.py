"""`jaxspec serve`: an OpenAI-compatible HTTP server over one LLM (jaxspec/serve/app.py)."""
from jaxspec.serve.app import build_app
from jaxspec.serve.options import ServeOptions

__all__ = ["ServeOptions", "build_app"]
