"""Structured outputs: constraints (`StructuredOutputsParams`) compiled on the host into token automata
(`compiler`), laid out in one table the device step reads (`table`; the device side is jaxspec.decode.grammar)."""
from jaxspec.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
