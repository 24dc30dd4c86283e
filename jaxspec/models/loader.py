"""`load_model(spec)`: one entry point for presets, GGUF files, HF directories, orbax checkpoints, hub ids."""
from __future__ import annotations

import os
import re
from pathlib import Path

from jaxspec.models.errors import UnknownPresetError
from jaxspec.models.model import Model

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_VALID_SPECS = ("a preset name ({presets}), a .gguf file, a HF model directory (with config.json), "
                "a jaxspec checkpoint directory (made by save_params) or a Hugging Face hub id (org/name)")


def _valid_specs() -> str:
    from jaxspec.models.presets import PRESETS
    return _VALID_SPECS.format(presets=", ".join(sorted(PRESETS)))


def load_path(path: Path, dtype: str) -> Model:
    """Load an existing local file or directory, picking the loader from what it holds."""
    from jaxspec.models.checkpoint import is_checkpoint_dir, load_checkpoint
    from jaxspec.models.gguf_loader import load_gguf
    from jaxspec.models.hf_loader import load_hf_dir

    if path.is_file():
        with open(path, "rb") as f:
            is_gguf = f.read(4) == b"GGUF"
        if is_gguf or path.suffix == ".gguf":
            return load_gguf(path, dtype)
        raise ValueError(f"{str(path)!r} is a file but not a GGUF file; expected {_valid_specs()}")
    if is_checkpoint_dir(path):
        return load_checkpoint(path, dtype)
    if (path / "config.json").is_file():
        return load_hf_dir(path, dtype)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return load_gguf(ggufs[0], dtype)
    raise FileNotFoundError(f"directory {str(path)!r} has no config.json, jaxspec checkpoint or single .gguf "
                            f"file; expected {_valid_specs()}")


def download_from_hub(repo_id: str) -> Path:
    """Snapshot a hub repo's config, safetensors and tokenizer files; a clear error when that is impossible."""
    try:
        from huggingface_hub import snapshot_download
        path = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.jinja"])
    except Exception as e:
        raise FileNotFoundError(
            f"{repo_id!r} is not a local path, and downloading it as a Hugging Face hub id failed "
            f"({type(e).__name__}: {e}); expected {_valid_specs()}") from e
    return Path(path)


def load_model(spec: str | os.PathLike, dtype="bfloat16") -> Model:
    """Load a model from a preset name, a .gguf file, a HF directory, a checkpoint directory or a hub id.

    `dtype`: "bfloat16" or "float32" (or the jnp dtypes); weights are converted to it on load.
    """
    from jaxspec.models.presets import PRESETS, preset_path
    from jaxspec.models.weights import resolve_dtype   # imports JAX: not at module level (see check_model_spec)

    dtype = resolve_dtype(dtype)
    text = os.fspath(spec)
    if text in PRESETS:
        from jaxspec.models.gguf_loader import load_gguf
        model = load_gguf(preset_path(text), dtype)
        model.name = text
        return model
    path = Path(text).expanduser()
    if path.exists():
        return load_path(path, dtype)
    if _is_hub_id(text):
        return load_path(download_from_hub(text), dtype)
    raise _no_such_model(text)


def check_model_spec(spec: str | os.PathLike) -> None:
    """What `load_model` would say of `spec` without loading it (and without importing JAX): a preset whose
    packages are not installed, an unknown name or a missing path raise the same errors `load_model` would. A hub
    id is taken as it is (only downloading it tells)."""
    from jaxspec.models.presets import PRESETS, check_installed

    text = os.fspath(spec)
    if text in PRESETS:
        check_installed(PRESETS[text])
        return
    if not (Path(text).expanduser().exists() or _is_hub_id(text)):
        raise _no_such_model(text)


def _is_hub_id(text: str) -> bool:
    return bool(_HUB_ID.fullmatch(text)) and not text.endswith(".gguf")


def _no_such_model(text: str) -> Exception:
    """The error for a name that is no preset, no existing path and no hub id: a bare name is taken for a
    misspelt preset, anything path-like for a missing file."""
    from jaxspec.models.presets import PRESETS
    if "/" not in text and os.sep not in text and not text.endswith((".gguf", ".json", ".safetensors")):
        return UnknownPresetError(f"unknown preset {text!r} (and no such file); known presets: "
                                  f"{', '.join(sorted(PRESETS))}; or pass {_valid_specs()}")
    return FileNotFoundError(f"no such file or directory: {text!r}; expected {_valid_specs()}")
