"""Gemma 3 (its text model, model_type "gemma3_text", and the vision-language checkpoints' text model): every layer
`gemma3_attention`, local (a sliding window, its own rotary base) or global as `layer_types` says; four norms a layer,
each (1 + w) in float32; GELU (tanh) gated MLP; scores scaled by query_pre_attn_scalar; embeddings times
sqrt(hidden_size)."""
from __future__ import annotations

from typing import Any

from jaxspec.models.errors import UnsupportedModelError
from jaxspec.models.families.base import (Architecture, Family, attention_layer_types, marked_sliding,
                                          nested_text_config, refuse_attention_bias, refuse_partial_rotary,
                                          refuse_soft_capping, sliding_window_fields)
from jaxspec.models.families.tensors import (ATTN, TOP_TENSORS_ZERO_CENTRED_NORM, TensorRule, group_qkv,
                                             interleave_gate_up, plus_one)

GEMMA3_ARCHITECTURE = Architecture("gemma3", qk_norm=True, plus_one_norms=True, scaled_embedding=True)

# Its gated MLP: act(gate) * up with the tanh approximation of GELU (its `hidden_activation`).
GEMMA3_HIDDEN_ACTS = ("gelu_pytorch_tanh",)
# Its rotary per layer type (`rope_parameters[layer type]`): plain, or linear scaling (positions divided by `factor`)
# on the full-attention layers, as the 4B/12B/27B configs have it.
GEMMA3_ROPE_TYPES = {"full_attention": ("default", "linear"), "sliding_attention": ("default",)}
# transformers' Gemma3TextConfig defaults: the vision-language checkpoints' `text_config` names only what differs.
_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                      max_position_embeddings=131_072, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2,
                      tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096)

# Four norms a layer, each weight w applied as (1 + w) in float32 (`plus_one`; declared float32).
GEMMA3_ATTENTION_TENSORS: dict[str, TensorRule] = {
    "attn_norm": TensorRule(("input_layernorm.weight",), plus_one),
    "qkv_proj": TensorRule((ATTN + "q_proj.weight", ATTN + "k_proj.weight", ATTN + "v_proj.weight"), group_qkv),
    "q_norm": TensorRule((ATTN + "q_norm.weight",), plus_one),
    "k_norm": TensorRule((ATTN + "k_norm.weight",), plus_one),
    "o_proj": TensorRule((ATTN + "o_proj.weight",)),
    "post_attn_norm": TensorRule(("post_attention_layernorm.weight",), plus_one),
    "mlp_norm": TensorRule(("pre_feedforward_layernorm.weight",), plus_one),
    "gate_up_proj": TensorRule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), interleave_gate_up),
    "down_proj": TensorRule(("mlp.down_proj.weight",)),
    "post_mlp_norm": TensorRule(("post_feedforward_layernorm.weight",), plus_one),
}


class Gemma3(Family):
    name = "gemma3"
    display_name = "Gemma 3"
    architecture = GEMMA3_ARCHITECTURE
    model_types = ("gemma3_text",)
    wrapper_model_types = ("gemma3",)
    # transformers 5 writes model.language_model.*; the published checkpoints have language_model.model.* (and
    # language_model.lm_head.* where untied).
    text_model_prefixes = {"model.language_model.embed_tokens.weight": (("model.", "model.language_model."),),
                           "language_model.model.embed_tokens.weight": (("model.", "language_model.model."),
                                                                        ("lm_head.", "language_model.lm_head."))}
    layer_tensors = {"gemma3_attention": GEMMA3_ATTENTION_TENSORS}
    top_tensors = TOP_TENSORS_ZERO_CENTRED_NORM

    def text_model_config(self, hf: dict[str, Any], model_type: str) -> tuple[dict[str, Any], str] | None:
        """Always nested (`text_config` absent: all transformers' defaults); embeddings tied unless it says not;
        bos/eos ids the outer config's, which its generation reads."""
        return nested_text_config(hf, model_type, tie_by_default=True, outer_ids_win=True)

    def with_defaults(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {**_TEXT_DEFAULTS, **hf}

    def refuse_unimplemented(self, hf: dict[str, Any], model_type: str) -> None:
        act = hf.get("hidden_activation")   # its own field, read by transformers' Gemma 3 alone
        if act not in GEMMA3_HIDDEN_ACTS:
            raise UnsupportedModelError(f"unsupported hidden_activation {act!r} for model_type={model_type!r}; "
                                        f"supported: {', '.join(GEMMA3_HIDDEN_ACTS)}")
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention=true is not supported (jaxspec's attention is "
                                        "causal); supported: use_bidirectional_attention false")
        rope = layer_type_rope(hf)
        refuse_attention_bias(hf, model_type)
        refuse_soft_capping(hf)
        refuse_partial_rotary(hf, model_type, tuple(rope.values()))
        self.sliding_window(hf, model_type)

    def sliding_window(self, hf: dict[str, Any], model_type: str) -> tuple[int | None, tuple[bool, ...] | None]:
        """`sliding_window` on the layers its layer types mark sliding_attention."""
        types = attention_layer_types(layer_types(hf), model_type)
        return sliding_window_fields(hf, hf.get("sliding_window"), marked_sliding(types))

    def rope(self, hf: dict[str, Any], draft_head: bool) -> tuple[float, tuple | None]:
        """The full-attention layers' base and scaling (ModelConfig.rope_theta, rope_scaling); the local ones'
        base is `family_fields`'."""
        full = layer_type_rope(hf)["full_attention"]
        if full["rope_type"] != "linear":
            return float(full["rope_theta"]), None
        return float(full["rope_theta"]), (("factor", float(full["factor"])), ("rope_type", "linear"))

    def family_fields(self, hf: dict[str, Any], model_type: str) -> dict[str, Any]:
        """Every layer `gemma3_attention`, the sliding window on the layers `layer_types` marks, their local rotary
        base, the attention scale, the activation."""
        types = layer_types(hf)
        local = tuple(t == "sliding_attention" for t in types)
        window, sliding_layers = self.sliding_window(hf, model_type)
        return dict(layer_types=("gemma3_attention",) * len(types), hidden_act=hf["hidden_activation"],
                    query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
                    local_rope_theta=float(layer_type_rope(hf)["sliding_attention"]["rope_theta"]) if any(local)
                    else None,
                    local_rope_layers=local if any(local) else None,
                    sliding_window=window, sliding_layers=sliding_layers)


def layer_types(hf: dict[str, Any]) -> list[str]:
    """Its layer types: `layer_types`, else every `sliding_window_pattern`-th layer full attention and the others
    sliding (transformers' rule; older configs name the pattern only, default 6)."""
    if hf.get("layer_types") is not None:
        return list(hf["layer_types"])
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(hf["num_hidden_layers"])]


def layer_type_rope(hf: dict[str, Any]) -> dict[str, dict]:
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


GEMMA3 = Gemma3()
