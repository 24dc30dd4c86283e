"""Model configuration shared by every decoder family and loader.

The params every loader produces are declared once, in `jaxspec.nn` (`Decoder.param_schema` and each layer
kind's `params`): embed [V, D], final_norm [D], lm_head [V, D] (absent when tied), and per layer kind its
weights stacked on a leading axis (`layers.attention.qkv_proj` [L, Hkv*(G+2)*hd, D], ...).
"""
from __future__ import annotations

import dataclasses
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3")

# HF `model_type` / `architectures` values mapped to our three families.
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # llama3 scaling as a sorted tuple of (key, value) pairs (hashable)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-frequency rope divisors [head_dim/2] (GGUF `rope_freqs`, how llama.cpp stores llama3 scaling; a
    # linear GGUF scaling factor is folded in): inv_freq = base_inv_freq / rope_freq_factors. An alternative
    # to `rope_scaling`, never combined with it. A tuple of floats so the config stays hashable.
    rope_freq_factors: tuple[float, ...] | None = None
    # The kind of each layer (a key of jaxspec.nn.layers.LAYER_KINDS); None: every layer "attention".
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries; expected num_layers = "
                                 f"{self.num_layers}")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {', '.join(ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rope_freq_factors is not None:
            factors = tuple(float(f) for f in self.rope_freq_factors)
            object.__setattr__(self, "rope_freq_factors", factors)  # lists (e.g. from JSON) become a tuple
            if len(factors) != self.head_dim // 2:
                raise ValueError(f"rope_freq_factors has {len(factors)} entries; expected head_dim/2 = "
                                 f"{self.head_dim // 2}")
            if self.rope_scaling is not None:
                raise ValueError("rope_freq_factors and rope_scaling are alternatives; set only one")

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a HF config.json dict; a missing required field raises a ValueError naming it."""
        model_type = hf.get("model_type")
        if model_type not in _HF_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture model_type={model_type!r}; supported: {', '.join(sorted(_HF_MODEL_TYPES))}")
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"config is missing required field(s): {', '.join(missing)}")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope_scaling = hf.get("rope_scaling") or None
        if rope_scaling is None and isinstance(hf.get("rope_parameters"), dict):
            rp = hf["rope_parameters"]
            if rp.get("rope_type", "default") != "default":
                rope_scaling = rp
        rope_theta = hf.get("rope_theta")
        if rope_theta is None and isinstance(hf.get("rope_parameters"), dict):
            rope_theta = hf["rope_parameters"].get("rope_theta")
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind in (None, "default"):
                rope_scaling = None
            elif kind != "llama3":
                raise ValueError(f"unsupported rope scaling type {kind!r}; supported: llama3")
            else:
                rope_scaling = tuple(sorted((k, v) for k, v in rope_scaling.items()
                                            if k in ("factor", "low_freq_factor", "high_freq_factor",
                                                     "original_max_position_embeddings")))
        return cls(
            arch=_HF_MODEL_TYPES[model_type],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
