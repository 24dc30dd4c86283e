"""Where jaxspec keeps what it builds once and reuses: assembled preset weights, compiled step programs, XLA's
autotuning results and compilation cache. Standard library only: every layer may ask."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$JAXSPEC_CACHE`, else `$XDG_CACHE_HOME/jaxspec`, else `~/.cache/jaxspec`."""
    if os.environ.get("JAXSPEC_CACHE"):
        return Path(os.environ["JAXSPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "jaxspec"
