"""Exceptions raised by the model loaders; each message names the bad value and what would be valid."""
from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The file is readable but holds something jaxspec cannot run (architecture, quantization, rope type)."""


class CorruptModelFileError(ValueError):
    """The file is truncated, is not the format its name claims, or its contents are inconsistent."""


class UnknownPresetError(ValueError):
    """A name that is neither a known preset nor an existing path."""


class PresetPackageMissingError(FileNotFoundError):
    """A preset's data lives in pip packages that are not installed; the message gives the pip command."""


class ChecksumMismatchError(ValueError):
    """An assembled preset file does not have the pinned sha256; nothing is left in the cache."""
