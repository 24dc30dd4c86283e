"""The model math, apart from loading: declared schemas, shared operations, the layer library, the decoder and
the EAGLE heads, as pure functions over params pytrees; `kernels`, where they meet the Pallas kernels."""
from jaxspec.nn.decoder import Decoder
from jaxspec.nn.layers import LAYER_KINDS, CacheShape, LayerKind
from jaxspec.nn.ops import ForwardBatch, Ops
from jaxspec.nn.schema import Spec

__all__ = ["CacheShape", "Decoder", "ForwardBatch", "LAYER_KINDS", "LayerKind", "Ops", "Spec"]
