"""Pallas kernels (Triton backend on NVIDIA GPUs; interpret mode elsewhere, e.g. CPU tests)."""

from jaxspec.pallas.acceptance import acceptance, acceptance_reference
from jaxspec.pallas.slot_mapping import slot_mapping, slot_mapping_reference

__all__ = ["acceptance", "acceptance_reference", "slot_mapping", "slot_mapping_reference"]
