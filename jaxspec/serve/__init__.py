"""`jaxspec serve`: an OpenAI-compatible HTTP server over one LLM (jaxspec/serve/app.py)."""
from jaxspec.serve.app import build_app

__all__ = ["build_app"]
