"""Model configuration shared by every decoder family and loader.

The params every loader produces are declared once, in `jaxspec.nn` (`Decoder.param_schema` and each layer
kind's `params`): embed [V, D], final_norm [D], lm_head [V, D] (absent when tied), and per layer kind its
weights stacked on a leading axis (`layers.attention.qkv_proj` [L, Hkv*(G+2)*hd, D], ...).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.models.errors import UnsupportedModelError
from jaxspec.models.fp8_checkpoint import checkpoint_format, quantization_config_of

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_next", "qwen3_5", "gemma3", "gpt_oss")
# Hybrids: Gated DeltaNet ("linear_attention") and gated full-attention layers, zero-centred RMSNorms.
HYBRID_ARCHITECTURES = ("qwen3_next", "qwen3_5")

# HF `model_type` / `architectures` values mapped to our families.
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "qwen3_moe": "qwen3",
                   "gpt_oss": "gpt_oss", "qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5", "qwen3_5": "qwen3_5",
                   "qwen3_5_moe_text": "qwen3_5", "qwen3_5_moe": "qwen3_5", "gemma3_text": "gemma3", "gemma3": "gemma3"}
# Vision-language checkpoints whose text model's config is nested under `text_config` (the vision tower is not loaded).
_WRAPPER_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "gemma3")
# HF `layer_types` entries of the hybrids -> jaxspec layer kinds (jaxspec.nn.layers.LAYER_KINDS).
_HF_LAYER_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "gated_attention"}

# What a config may ask for, where jaxspec does not implement everything transformers does: anything else is refused
# at load (`_refuse_unimplemented`), naming the field, never run as something else.
# Rope scaling types the rotary code implements (jaxspec.nn.ops.rope_inv_freq; "default": plain rope). The hybrids'
# partial rotary (jaxspec.nn.layers.partial_rope) implements none.
ROPE_TYPES = ("default", "llama3", "yarn")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# YaRN's fields jaxspec implements (transformers' _compute_yarn_parameters): those it needs, and those with a default.
# Its other fields (attention_factor, mscale, mscale_all_dim: other ways to set the attention scale) are refused.
_YARN_REQUIRED_KEYS = ("factor", "original_max_position_embeddings")
_YARN_OPTIONAL_KEYS = ("beta_fast", "beta_slow", "truncate")
YARN_ARCHITECTURES = ("gpt_oss",)
# An EAGLE-3 head's config.json (one Llama layer) carries its target's global rotary whatever the target's family
# (jaxspec.train.eagle3.save_head): Gemma 3's linear scaling, Llama 3's, GPT-OSS's YaRN. The head loader reads each as
# the target's loader does (jaxspec.nn.ops.rope_inv_freq computes them for any layer).
DRAFT_HEAD_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys of a rope dict that name no scaling (a dict of only these, without a type, is plain rope). mrope_*: Qwen3.5's
# multimodal sections, the same rotation for text (every section gets the same position).
_PLAIN_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
# The MLP activations jaxspec computes: SwiGLU, silu(gate) * up (transformers' ACT2FN: "swish" is SiLU too).
HIDDEN_ACTS = ("silu", "swish")
# Gemma 3's gated MLP: act(gate) * up with the tanh approximation of GELU (its `hidden_activation`).
GEMMA3_HIDDEN_ACTS = ("gelu_pytorch_tanh",)
# Gemma 3's rotary per layer type (`rope_parameters[layer type]`): plain, or linear scaling (positions divided by
# `factor`) on the full-attention layers, as the 4B/12B/27B configs have it.
GEMMA3_ROPE_TYPES = {"full_attention": ("default", "linear"), "sliding_attention": ("default",)}
# transformers' Gemma3TextConfig defaults: the vision-language checkpoints' `text_config` names only what differs.
_GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                             hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072, rms_norm_eps=1e-6,
                             eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, query_pre_attn_scalar=256,
                             sliding_window=4096)
# model_types whose transformers model adds the q/k/v/o projection biases when attention_bias is true, as the hybrids
# do (Qwen2's q/k/v biases are unconditional and implemented; transformers' Mistral has none whatever the config says).
_ATTENTION_BIAS_TYPES = ("llama", "qwen3", "gemma3_text")


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
        if self.hidden_act not in ("silu", *GEMMA3_HIDDEN_ACTS):
            raise ValueError(f"hidden_act={self.hidden_act!r} is unknown; valid: silu, {', '.join(GEMMA3_HIDDEN_ACTS)}")
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
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2" or self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "gemma3", *HYBRID_ARCHITECTURES)

    @property
    def plus_one_norms(self) -> bool:
        """Gemma 3's RMSNorm scales by (1 + w), computed in float32: its norm weights are declared float32 and hold
        1 + w (jaxspec.models.weights.plus_one), so every norm, fused or not, multiplies by them as by any weight."""
        return self.arch == "gemma3"

    @property
    def embed_scale(self) -> float | None:
        """The factor the token embeddings are multiplied by (Gemma 3: sqrt(hidden_size)), or None."""
        return self.hidden_size ** 0.5 if self.arch == "gemma3" else None

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

    @property
    def rope_type(self) -> str:
        """"default" (plain rope), "llama3" or "yarn" (a scaling without a type is llama3's, as GGUF-era configs
        stored it)."""
        scaling = self.rope_scaling_dict
        return "default" if not scaling else scaling.get("rope_type", "llama3")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], draft_head: bool = False) -> "ModelConfig":
        """Build from a HF config.json dict; a missing required field raises a ValueError naming it, and a field
        asking for something jaxspec does not implement (a sliding window that bites, a rope scaling type other than
        llama3 or GPT-OSS's yarn, biases it would ignore, soft-capping, ...: `_refuse_unimplemented`) an UnsupportedModelError.
        draft_head: the config of an EAGLE head, whose rotary may be any of DRAFT_HEAD_ROPE_TYPES (its target's)."""
        quantized = quantization_config_of(hf)
        if quantized and not is_mxfp4(quantized):   # its tensors are not all the weights: an FP8 format, or refused
            checkpoint_format(quantized)
        model_type = hf.get("model_type")
        if model_type in _WRAPPER_MODEL_TYPES and (isinstance(hf.get("text_config"), dict) or model_type == "gemma3"):
            # a vision-language checkpoint (Qwen3.5, Gemma 3): its text model's config is nested (Gemma 3's may be
            # absent: transformers' defaults)
            outer = hf
            hf = {**(hf.get("text_config") or {})}
            hf.setdefault("tie_word_embeddings", outer.get("tie_word_embeddings", model_type == "gemma3"))
            for key in ("bos_token_id", "eos_token_id"):   # Gemma 3's generation reads the outer config's
                if outer.get(key) is not None and (model_type == "gemma3" or key not in hf):
                    hf[key] = outer[key]
            model_type = hf.get("model_type", model_type + "_text")
        if model_type == "gemma3_text":
            hf = {**_GEMMA3_TEXT_DEFAULTS, **hf}
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
        arch = _HF_MODEL_TYPES[model_type]
        _refuse_unimplemented(hf, model_type, arch)
        extra: dict[str, Any] = {}
        if model_type == "gemma3_text":   # rotary per layer type
            extra = _gemma3_fields(hf)
            rope_theta, rope_scaling = extra.pop("rope_theta"), extra.pop("rope_scaling")
        else:
            rope_scaling = _rope_scaling(hf, arch, draft_head)
            rope_theta = hf.get("rope_theta")
            if rope_theta is None and isinstance(hf.get("rope_parameters"), dict):
                rope_theta = hf["rope_parameters"].get("rope_theta")
        if arch in HYBRID_ARCHITECTURES:
            extra = _hybrid_fields(hf, arch)
        else:
            extra["sliding_window"], extra["sliding_layers"] = _sliding_window(hf, model_type)
        if model_type == "qwen3_moe":
            extra.update(_qwen3_moe_fields(hf))
        if model_type == "gpt_oss":
            extra.update(_gpt_oss_fields(hf))
        if quantized and is_mxfp4(quantized) and model_type != "gpt_oss":
            raise UnsupportedModelError(f"quantization_config quant_method='mxfp4' is not supported for "
                                        f"model_type={model_type!r}; supported: model_type 'gpt_oss' (its experts)")
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


def _gemma3_layer_types(hf: dict[str, Any]) -> list[str]:
    """Gemma 3's layer types: `layer_types`, else every `sliding_window_pattern`-th layer full attention and the
    others sliding (transformers' rule; older configs name the pattern only, default 6)."""
    if hf.get("layer_types") is not None:
        return list(hf["layer_types"])
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(hf["num_hidden_layers"])]


def _gemma3_rope(hf: dict[str, Any]) -> dict[str, dict]:
    """{layer type: its rope parameters} as transformers reads a Gemma 3 config: `rope_parameters` keyed by layer
    type, or the older spelling (rope_scaling and rope_theta for the full-attention layers, rope_local_base_freq for
    the sliding ones); bases default to 1e6 (full) and 1e4 (sliding)."""
    given = hf.get("rope_parameters") or {}
    stray = sorted(set(given) - set(GEMMA3_ROPE_TYPES)) if isinstance(given, dict) else [repr(given)]
    if stray:
        raise UnsupportedModelError(f"rope_parameters={given!r} for model_type='gemma3_text' has {', '.join(stray)}; "
                                    f"supported: a dict keyed by layer type ({', '.join(GEMMA3_ROPE_TYPES)})")
    full = {"rope_type": "default", **(given.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    sliding = {"rope_type": "default", **(given.get("sliding_attention") or {})}
    sliding.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    rope = {"full_attention": full, "sliding_attention": sliding}
    for layer_type, params in rope.items():
        kind = params.get("rope_type", params.get("type"))
        if kind not in GEMMA3_ROPE_TYPES[layer_type]:
            raise UnsupportedModelError(
                f"rope_parameters[{layer_type!r}] rope_type={kind!r} is not supported for model_type='gemma3_text'; "
                f"supported: {', '.join(GEMMA3_ROPE_TYPES[layer_type])}")
        if kind == "linear" and not params.get("factor"):
            raise UnsupportedModelError(f"rope_parameters[{layer_type!r}] is linear without a factor: {params!r}")
    return rope


def _gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's text model: every layer `gemma3_attention`, the sliding window on the layers `layer_types` marks,
    their local rotary base, the full-attention layers' base and scaling, the attention scale, the activation."""
    types = _gemma3_layer_types(hf)
    rope = _gemma3_rope(hf)
    full = rope["full_attention"]
    scaling = (("factor", float(full["factor"])), ("rope_type", "linear")) if full["rope_type"] == "linear" else None
    local = tuple(t == "sliding_attention" for t in types)
    return dict(layer_types=("gemma3_attention",) * len(types), hidden_act=hf["hidden_activation"],
                query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
                rope_theta=float(full["rope_theta"]), rope_scaling=scaling,
                local_rope_theta=float(rope["sliding_attention"]["rope_theta"]) if any(local) else None,
                local_rope_layers=local if any(local) else None)


def _qwen3_moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE: layer i is sparse (`attention_moe`) unless it is in `mlp_only_layers` or (i + 1) is not a multiple
    of `decoder_sparse_step` (transformers' rule); the experts' shapes and routing."""
    n = hf["num_hidden_layers"]
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    experts = hf.get("num_experts", hf.get("num_local_experts", 0))   # (the latter: transformers 5's name)
    kinds = tuple("attention_moe" if experts > 0 and i not in dense and (i + 1) % step == 0 else "attention"
                  for i in range(n))
    return dict(layer_types=kinds, num_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok", 0),
                moe_intermediate_size=hf.get("moe_intermediate_size", 0),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def is_mxfp4(quantization_config) -> bool:
    """Whether config.json's quantization_config is MXFP4 (GPT-OSS's experts: dequantized on load,
    jaxspec.models.dequant.dequantize_mxfp4)."""
    return isinstance(quantization_config, dict) and quantization_config.get("quant_method") == "mxfp4"


def _gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS: every layer the `gpt_oss` kind (attention with sinks, then its mixture of experts, each expert
    intermediate_size wide), q/k/v/o biases unless attention_bias is false, the experts' clamped SwiGLU."""
    return dict(layer_types=("gpt_oss",) * hf["num_hidden_layers"], num_experts=hf["num_local_experts"],
                num_experts_per_tok=hf["num_experts_per_tok"], moe_intermediate_size=hf["intermediate_size"],
                attention_bias=bool(hf.get("attention_bias", True)),
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)))


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


def _rope_scaling(hf: dict[str, Any], arch: str, draft_head: bool = False) -> tuple | None:
    """The config's rope scaling as ModelConfig.rope_scaling (None: plain rope); a type jaxspec does not implement
    (dynamic, linear, longrope, ...; yarn outside YARN_ARCHITECTURES) is refused, naming it. An EAGLE head's
    (`draft_head`) may be any of DRAFT_HEAD_ROPE_TYPES."""
    supported = DRAFT_HEAD_ROPE_TYPES if draft_head else ROPE_TYPES
    field, scaling = "rope_scaling", hf.get("rope_scaling") or None
    if scaling is None and isinstance(hf.get("rope_parameters"), dict):   # transformers >= 5 spelling
        field, scaling = "rope_parameters", hf["rope_parameters"]
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise UnsupportedModelError(f"{field}={scaling!r} is not a dict; expected null or a dict with a rope_type "
                                    f"(supported: {', '.join(ROPE_TYPES)})")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind is None:   # no type: plain rope only if it names nothing that scales (a bare factor would be ignored)
        scales = sorted(set(scaling) - _PLAIN_ROPE_KEYS)
        if scales:
            raise UnsupportedModelError(f"{field}={scaling!r} names no rope_type but sets {', '.join(scales)}; "
                                        f"supported: no scaling, or rope_type in {', '.join(ROPE_TYPES)}")
        kind = "default"
    if kind not in supported:
        raise UnsupportedModelError(f"unsupported rope scaling type {kind!r} ({field}={scaling!r}); supported: "
                                    f"{', '.join(supported)}")
    if kind == "default":
        return None
    if arch in HYBRID_ARCHITECTURES:
        raise UnsupportedModelError(f"{field} type {kind!r} is not supported for {arch} (its partial rotary applies "
                                    "no rope scaling); supported: rope_type 'default'")
    if kind == "linear":   # (a draft head's: Gemma 3's global layers)
        return _linear_scaling(field, scaling)
    if kind == "yarn":
        if arch not in YARN_ARCHITECTURES and not draft_head:   # tested against transformers for GPT-OSS only
            raise UnsupportedModelError(f"unsupported rope scaling type 'yarn' for {arch} ({field}={scaling!r}); "
                                        f"supported: default, llama3 (yarn: {', '.join(YARN_ARCHITECTURES)})")
        return _yarn_scaling(hf, field, scaling)
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in scaling]
    if missing:
        raise UnsupportedModelError(f"{field} type 'llama3' lacks {', '.join(missing)}; it needs "
                                    f"{', '.join(_LLAMA3_ROPE_KEYS)}")
    return tuple(sorted((k, scaling[k]) for k in _LLAMA3_ROPE_KEYS))


def _linear_scaling(field: str, scaling: dict) -> tuple:
    """Linear scaling (positions divided by `factor`) as ModelConfig.rope_scaling, the form Gemma 3's loader gives
    its global layers'; a field other than factor that would scale is refused, naming it."""
    unknown = sorted(set(scaling) - _PLAIN_ROPE_KEYS - {"factor"})
    if unknown or "factor" not in scaling:
        raise UnsupportedModelError(f"{field} type 'linear' needs factor and nothing else that scales ({field}="
                                    f"{scaling!r}); supported: factor")
    return (("factor", float(scaling["factor"])), ("rope_type", "linear"))


def _yarn_scaling(hf: dict[str, Any], field: str, scaling: dict) -> tuple:
    """YaRN's fields as ModelConfig.rope_scaling, with transformers' defaults (beta_fast 32, beta_slow 1, truncate
    true; no factor: max_position_embeddings / original_max_position_embeddings); a field it does not implement is
    refused, naming it."""
    unknown = sorted(set(scaling) - _PLAIN_ROPE_KEYS - set(_YARN_REQUIRED_KEYS) - set(_YARN_OPTIONAL_KEYS))
    if unknown:
        raise UnsupportedModelError(f"{field} type 'yarn' sets {', '.join(unknown)}, which jaxspec does not implement "
                                    f"({field}={scaling!r}); supported: "
                                    f"{', '.join(_YARN_REQUIRED_KEYS + _YARN_OPTIONAL_KEYS)}")
    missing = [k for k in _YARN_REQUIRED_KEYS if k not in scaling]
    if missing:
        raise UnsupportedModelError(f"{field} type 'yarn' lacks {', '.join(missing)}; it needs "
                                    f"{', '.join(_YARN_REQUIRED_KEYS)}")
    original = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]
    if factor is None:
        factor = hf.get("max_position_embeddings", 4096) / original
    yarn = dict(rope_type="yarn", factor=float(factor), original_max_position_embeddings=int(original),
                beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
                truncate=bool(scaling.get("truncate", True)))
    return tuple(sorted(yarn.items()))


def _refuse_unimplemented(hf: dict[str, Any], model_type: str, arch: str) -> None:
    """UnsupportedModelError naming the field (its value, and what is supported) when the config asks for something
    transformers would apply and jaxspec does not implement, rather than run the model as something else."""
    if model_type == "gemma3_text":   # its own field, read by transformers' Gemma 3 alone
        act = hf.get("hidden_activation")
        if act not in GEMMA3_HIDDEN_ACTS:
            raise UnsupportedModelError(f"unsupported hidden_activation {act!r} for model_type='gemma3_text'; "
                                        f"supported: {', '.join(GEMMA3_HIDDEN_ACTS)}")
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention=true is not supported (jaxspec's attention is "
                                        "causal); supported: use_bidirectional_attention false")
        _gemma3_rope(hf)
    else:
        act = hf.get("hidden_act", "silu")
        if act not in HIDDEN_ACTS:
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}; supported: {', '.join(HIDDEN_ACTS)} "
                                        "(the MLP is SwiGLU)")
    if hf.get("attention_bias") and (model_type in _ATTENTION_BIAS_TYPES or arch in HYBRID_ARCHITECTURES):
        raise UnsupportedModelError(f"attention_bias=true is not supported for model_type={model_type!r} (its q/k/v/o "
                                    "projection biases would be ignored); supported: attention_bias false")
    if hf.get("mlp_bias") and model_type == "llama":
        raise UnsupportedModelError("mlp_bias=true is not supported (the gate/up/down projection biases would be "
                                    "ignored); supported: mlp_bias false")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(field) is not None:
            raise UnsupportedModelError(f"{field}={hf[field]!r} is not supported (logit soft-capping is not "
                                        f"implemented); supported: {field} null")
    if arch not in HYBRID_ARCHITECTURES:   # the hybrids' partial rotary: ModelConfig.partial_rotary_factor
        rope = [hf] + [hf[k] for k in ("rope_scaling", "rope_parameters") if isinstance(hf.get(k), dict)]
        if model_type == "gemma3_text":
            rope += list(_gemma3_rope(hf).values())
        factor = next((d["partial_rotary_factor"] for d in rope if d.get("partial_rotary_factor") is not None), 1.0)
        if float(factor) != 1.0:
            raise UnsupportedModelError(f"partial_rotary_factor={factor!r} is not supported for "
                                        f"model_type={model_type!r} (rotary covers the whole head); supported: 1.0")
        _sliding_window(hf, model_type)


def _sliding_window(hf: dict[str, Any], model_type: str) -> tuple[int | None, tuple[bool, ...] | None]:
    """(the window, which layers attend within it: None for every layer), or (None, None) where none bites; a
    window on the layers of another model type is refused. transformers' rules:
    Mistral applies `sliding_window` (absent: its default 4096) to every layer, Qwen3-MoE to every layer when
    `use_sliding_window` is true; Qwen2/Qwen3 only when
    `use_sliding_window` is true, and then to the layers `layer_types` marks "sliding_attention" (absent: layers
    i >= `max_window_layers`, default 28); Llama applies none (a `sliding_window` key is ignored there too, unless
    `layer_types` marks sliding layers). A window of at least max_position_embeddings never bites: the engine caps
    max_model_len at max_position_embeddings (jaxspec.sched.config), so no query is that far from a key."""
    n = hf["num_hidden_layers"]
    max_pos = hf.get("max_position_embeddings", 4096)
    types = _gemma3_layer_types(hf) if model_type == "gemma3_text" else hf.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnsupportedModelError(f"unsupported layer_types {unknown} for model_type={model_type!r}; supported: "
                                        "full_attention (sliding_attention only with a window that never bites)")
    marked = [i for i, t in enumerate(types or ()) if t == "sliding_attention"]
    if model_type == "gpt_oss":   # without layer_types, transformers alternates: layers 0, 2, 4, ... sliding
        window, rule = hf.get("sliding_window", 128), "layer_types marks them sliding_attention"
        sliding = marked if types is not None else [i for i in range(n) if (i + 1) % 2]
    elif model_type == "mistral":
        window, sliding, rule = hf.get("sliding_window", 4096), list(range(n)), "Mistral: all layers"
    elif model_type in ("qwen2", "qwen3"):
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        sliding = marked if types is not None else list(range(hf.get("max_window_layers", 28) or 0, n))
        rule = "use_sliding_window=true"
    elif model_type == "qwen3_moe":   # transformers: every layer's window when use_sliding_window (no layer rule)
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        sliding, rule = list(range(n)), "use_sliding_window=true"
    elif model_type == "gemma3_text":
        window, sliding, rule = hf.get("sliding_window"), marked, "layer_types (or sliding_window_pattern)"
    else:
        window, sliding, rule = hf.get("sliding_window"), marked, "layer_types marks them sliding_attention"
    if window is None or window >= max_pos or not sliding:
        return None, None
    if model_type in ("mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "gpt_oss"):
        return int(window), None if len(sliding) == n else tuple(i in sliding for i in range(n))
    layers = f"layers {sliding[0]}..{sliding[-1]}" if sliding == list(range(sliding[0], sliding[-1] + 1)) else \
        f"layers {sliding}"
    raise UnsupportedModelError(
        f"sliding_window={window} is not supported for model_type={model_type!r}: it applies to {layers} ({rule}) "
        f"and jaxspec applies sliding windows to Mistral, Qwen2, Qwen3, Gemma 3 and GPT-OSS only, so the model would "
        f"decode wrongly past "
        f"{window} tokens; supported: sliding_window null"
        + f", or a window of at least max_position_embeddings={max_pos}")
