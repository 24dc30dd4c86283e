"""`Model`: a config, a params pytree and a tokenizer, as every loader returns it."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxspec.models.config import ModelConfig


@dataclasses.dataclass
class Model:
    config: ModelConfig
    params: dict  # pytree of jax arrays, declared by jaxspec.nn.decoder.Decoder.param_schema
    tokenizer: Any = None  # jaxspec.models.tokenizer.Tokenizer, or None for a weights-only model
    name: str = ""
    dtype: str = "float32"
    source: str | None = None  # the HF directory it was loaded from (MTP drafting reads its mtp.* tensors there)
    quantization: str | None = None  # "fp8": the layers' projections are e4m3 with scales (jaxspec.nn.quant)
    # How quantized weights came to be, where the checkpoint stored them so (jaxspec.models.fp8_checkpoint: its
    # format and scale layout); None: quantized on load by the engine, or not quantized.
    quantization_detail: str | None = None

    def score(self, token_ids) -> np.ndarray:
        """Logits [T, vocab] of a dense causal forward over `token_ids` (no KV cache)."""
        from jaxspec.nn.decoder import Decoder
        return np.asarray(Decoder(self.config).score(self.params, np.asarray(token_ids, np.int32)))
