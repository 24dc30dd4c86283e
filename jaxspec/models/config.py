"""Model configuration shared by every decoder family and loader.

The params every loader produces are declared once, in `jaxspec.nn` (`Decoder.param_schema` and each layer
kind's `params`): embed [V, D], final_norm [D], lm_head [V, D] (absent when tied), and per layer kind its
weights stacked on a leading axis (`layers.attention.qkv_proj` [L, Hkv*(G+2)*hd, D], ...).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.models.fp8_checkpoint import checkpoint_format, quantization_config_of

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_next", "qwen3_5")
# Hybrids: Gated DeltaNet ("linear_attention") and gated full-attention layers, zero-centred RMSNorms.
HYBRID_ARCHITECTURES = ("qwen3_next", "qwen3_5")

# HF `model_type` / `architectures` values mapped to our families.
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama",
                   "qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5", "qwen3_5": "qwen3_5",
                   "qwen3_5_moe_text": "qwen3_5", "qwen3_5_moe": "qwen3_5"}
# HF `layer_types` entries of the hybrids -> jaxspec layer kinds (jaxspec.nn.layers.LAYER_KINDS).
_HF_LAYER_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "gated_attention"}


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
    # Hybrids (Qwen3-Next, Qwen3.5): rotary on the first partial_rotary_factor * head_dim dims of each head;
    # the Gated DeltaNet layers' heads and causal conv width.
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Mixture of experts (0: dense MLP): experts, experts per token, each expert's MLP width, whether the top-k
    # weights are renormalised, the gated shared expert's width (0: none).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0

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
        return self.arch in ("qwen3", *HYBRID_ARCHITECTURES)

    @property
    def hybrid(self) -> bool:
        return self.arch in HYBRID_ARCHITECTURES

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a HF config.json dict; a missing required field raises a ValueError naming it."""
        quantized = quantization_config_of(hf)
        if quantized:   # its tensors are not all the weights themselves: an FP8 format it names, or refused
            checkpoint_format(quantized)
        model_type = hf.get("model_type")
        if model_type in ("qwen3_5", "qwen3_5_moe") and isinstance(hf.get("text_config"), dict):
            # a Qwen3.5 checkpoint (vision-language): its text model's config is nested
            outer = hf
            hf = {**hf["text_config"]}
            hf.setdefault("tie_word_embeddings", outer.get("tie_word_embeddings", False))
            model_type = hf.get("model_type", model_type + "_text")
        if model_type not in _HF_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture model_type={model_type!r}; supported: {', '.join(sorted(_HF_MODEL_TYPES))}")
        moe_only = hf.get("num_experts") and _HF_MODEL_TYPES[model_type] in HYBRID_ARCHITECTURES
        if "intermediate_size" not in hf and moe_only:   # every layer MoE (Qwen3.5 MoE): no dense MLP width
            hf = {**hf, "intermediate_size": hf.get("moe_intermediate_size", 0)}
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
        arch = _HF_MODEL_TYPES[model_type]
        extra: dict[str, Any] = {}
        if arch in HYBRID_ARCHITECTURES:
            extra = _hybrid_fields(hf, arch)
        return cls(
            arch=arch,
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
            **extra,
        )


def _hybrid_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5 fields: layer kinds, partial rotary, the Gated DeltaNet shapes, MoE."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        interval = hf.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - set(_HF_LAYER_KINDS))
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; supported: {', '.join(_HF_LAYER_KINDS)}")
    rp = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    fields: dict[str, Any] = dict(
        layer_types=tuple(_HF_LAYER_KINDS[t] for t in types),
        partial_rotary_factor=float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
        linear_num_key_heads=hf["linear_num_key_heads"], linear_num_value_heads=hf["linear_num_value_heads"],
        linear_key_head_dim=hf["linear_key_head_dim"], linear_value_head_dim=hf["linear_value_head_dim"],
        linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4))
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; supported: silu")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for hybrid models")
    if hf.get("num_experts", 0):
        sparse_step = hf.get("decoder_sparse_step", 1)
        if hf.get("mlp_only_layers") or sparse_step != 1:
            raise ValueError("a mix of MoE and dense MLP layers (mlp_only_layers, decoder_sparse_step != 1) is not "
                             "supported; every layer must be MoE or every layer dense")
        fields.update(num_experts=hf["num_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                      moe_intermediate_size=hf["moe_intermediate_size"],
                      norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                      shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0))
    return fields
