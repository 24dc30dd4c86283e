"""Model configuration shared by every decoder family and loader.

The params every loader produces are declared once, in `jaxspec.nn` (`Decoder.param_schema` and each layer
kind's `params`): embed [V, D], final_norm [D], lm_head [V, D] (absent when tied), and per layer kind its
weights stacked on a leading axis (`layers.attention.qkv_proj` [L, Hkv*(G+2)*hd, D], ...).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.models import families
from jaxspec.models.errors import UnsupportedModelError
from jaxspec.models.families.base import Architecture
from jaxspec.models.families.rope import DRAFT_HEAD_ROPE_TYPES, ROPE_TYPES  # noqa: F401 (public here)
from jaxspec.models.fp8_checkpoint import checkpoint_format, quantization_config_of

# ModelConfig.arch values, one per model variant jaxspec computes (jaxspec.models.families: the families reading them).
ARCHITECTURES = tuple(families.ARCHITECTURES)
# The gated MLP's activations jaxspec computes (jaxspec.nn.ops.GATE_ACTIVATIONS): SwiGLU's silu, and the tanh
# approximation of GELU (Gemma 3).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
    # Sliding-window attention: a token attends to its own key and the sliding_window - 1 before it. None: the
    # whole context. In every attention layer (Mistral), or in those `sliding_layers` marks (Qwen2/Qwen3's
    # use_sliding_window: layers from max_window_layers on, or as their layer_types say).
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None
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
    # The gated MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma 3: GELU, tanh approximation).
    hidden_act: str = "silu"
    # Attention scores scaled by query_pre_attn_scalar ** -0.5 (Gemma 3); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Gemma 3's local rotary: the layers `local_rope_layers` marks (its sliding-attention layers) rotate with base
    # `local_rope_theta` and no scaling; the others with rope_theta and rope_scaling. None: every layer the latter.
    local_rope_theta: float | None = None
    local_rope_layers: tuple[bool, ...] | None = None
    # GPT-OSS: biases on the q/k/v and o projections; its experts' clamped SwiGLU, (up + 1) * gate * sigmoid(alpha *
    # gate) with gate clamped above at swiglu_limit and up to +-swiglu_limit.
    attention_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

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
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window!r} is invalid; give a number of keys >= 1, or "
                             "None for the whole context")
        if self.sliding_layers is not None:
            object.__setattr__(self, "sliding_layers", tuple(bool(x) for x in self.sliding_layers))
            if len(self.sliding_layers) != self.num_layers or self.sliding_window is None:
                raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries (one per layer: "
                                 f"{self.num_layers}) and needs sliding_window; got sliding_window="
                                 f"{self.sliding_window!r}")
        if self.rope_freq_factors is not None:
            factors = tuple(float(f) for f in self.rope_freq_factors)
            object.__setattr__(self, "rope_freq_factors", factors)  # lists (e.g. from JSON) become a tuple
            if len(factors) != self.head_dim // 2:
                raise ValueError(f"rope_freq_factors has {len(factors)} entries; expected head_dim/2 = "
                                 f"{self.head_dim // 2}")
            if self.rope_scaling is not None:
                raise ValueError("rope_freq_factors and rope_scaling are alternatives; set only one")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is unknown; valid: {', '.join(ACTIVATIONS)}")
        if self.local_rope_layers is not None:
            object.__setattr__(self, "local_rope_layers", tuple(bool(x) for x in self.local_rope_layers))
            if len(self.local_rope_layers) != self.num_layers or self.local_rope_theta is None:
                raise ValueError(f"local_rope_layers has {len(self.local_rope_layers)} entries (one per layer: "
                                 f"{self.num_layers}) and needs local_rope_theta; got local_rope_theta="
                                 f"{self.local_rope_theta!r}")
        per_layer = [name for name in ("sliding_layers", "local_rope_layers") if getattr(self, name) is not None]
        if per_layer and self.layer_types is not None and len(set(self.layer_types)) > 1:
            # a layer kind runs its layers by their index among its own kind (jaxspec.nn.decoder), and these tables
            # are by the model's layer index: with one kind the two agree
            raise UnsupportedModelError(
                f"per-layer {' and '.join(per_layer)} with layers of several kinds ({', '.join(sorted(set(self.layer_types)))}"
                f") is not supported: a model with sliding-window or local-rotary layers must have one layer kind "
                f"(e.g. a Qwen3-MoE config with use_sliding_window needs mlp_only_layers empty)")

    @property
    def kv_window(self) -> int | None:
        """The window every layer reads its KV within, or None where some layer reads the whole context."""
        if self.sliding_window is None or (self.sliding_layers is not None and not all(self.sliding_layers)):
            return None
        return self.sliding_window

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    @property
    def architecture(self) -> Architecture:
        """What this config's arch computes beyond its numbers (jaxspec.models.families)."""
        return families.architecture(self.arch)

    @property
    def qkv_bias(self) -> bool:
        return self.architecture.qkv_bias or self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.architecture.qk_norm

    @property
    def plus_one_norms(self) -> bool:
        """Gemma 3's RMSNorm scales by (1 + w), computed in float32: its norm weights are declared float32 and hold
        1 + w (jaxspec.models.families.tensors.plus_one), so every norm, fused or not, multiplies by them as by any
        weight."""
        return self.architecture.plus_one_norms

    @property
    def embed_scale(self) -> float | None:
        """The factor the token embeddings are multiplied by (Gemma 3: sqrt(hidden_size)), or None."""
        return self.hidden_size ** 0.5 if self.architecture.scaled_embedding else None

    @property
    def hybrid(self) -> bool:
        return self.architecture.hybrid

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def rope_type(self) -> str:
        """"default" (plain rope), "llama3" or "yarn" (a scaling without a type is llama3's, as GGUF-era configs
        stored it)."""
        scaling = self.rope_scaling_dict
        return "default" if not scaling else scaling.get("rope_type", "llama3")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], draft_head: bool = False) -> "ModelConfig":
        """Build from a HF config.json dict, as its model_type's family reads it (jaxspec.models.families); a missing
        required field raises a ValueError naming it, and a field asking for something jaxspec does not implement (a
        sliding window that bites, a rope scaling type the family does not take, biases it would ignore,
        soft-capping, ...: the family's `refuse_unimplemented`) an UnsupportedModelError.
        draft_head: the config of an EAGLE head, whose rotary may be any of DRAFT_HEAD_ROPE_TYPES (its target's)."""
        quantized = quantization_config_of(hf)
        if quantized and not is_mxfp4(quantized):   # its tensors are not all the weights: an FP8 format, or refused
            checkpoint_format(quantized)
        hf, model_type, family = families.text_model(hf)
        fields = family.config_fields(hf, model_type, draft_head)
        if is_mxfp4(quantized) and not family.mxfp4_experts:
            supported = ", ".join(repr(name) for f in families.FAMILIES if f.mxfp4_experts for name in f.model_types)
            raise UnsupportedModelError(f"quantization_config quant_method='mxfp4' is not supported for "
                                        f"model_type={model_type!r}; supported: model_type {supported} (its experts)")
        return cls(**fields)


def is_mxfp4(quantization_config) -> bool:
    """Whether config.json's quantization_config is MXFP4 (GPT-OSS's experts: dequantized on load,
    jaxspec.models.dequant.dequantize_mxfp4)."""
    return isinstance(quantization_config, dict) and quantization_config.get("quant_method") == "mxfp4"
