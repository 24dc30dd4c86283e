"""What a model family declares, and the readers of config.json fields that several families share.

A family is one module (jaxspec/models/families/<name>.py) holding a `Family`: the HF `model_type`s it reads, how
their config.json fields map onto ModelConfig's, what it refuses (a field asking for something jaxspec does not
implement, refused by name with what is valid, rather than run as another model) and the HF tensors each of its layer
kinds' weights is read from. The registry, jaxspec.models.families, lists the families; no other module names one.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxspec.models.errors import UnsupportedModelError
from jaxspec.models.families.rope import rope_scaling, rope_theta
from jaxspec.models.families.tensors import TOP_TENSORS, TensorRule


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What jaxspec's model of one `ModelConfig.arch` computes beyond the config's numbers (ModelConfig's properties
    of the same names read these). Families whose models differ only in config fields share one: Mistral runs as
    Llama, Qwen3-MoE as Qwen3."""
    name: str
    qkv_bias: bool = False          # q/k/v projection biases whatever attention_bias says (Qwen2)
    qk_norm: bool = False           # an RMSNorm over each head's q and k
    plus_one_norms: bool = False    # every norm (1 + w) in float32: its weights declared float32, holding 1 + w
    scaled_embedding: bool = False  # the token embeddings times sqrt(hidden_size)
    hybrid: bool = False            # Gated DeltaNet layers (per-slot recurrent state) beside attention


class Family:
    """A model family, as its module declares it: subclass, set the class attributes, and override the hooks whose
    defaults do not fit. `config_fields` is the whole mapping of a config.json onto ModelConfig's fields."""
    name: str                           # the registry's name for it, e.g. "qwen3_moe"
    display_name: str                   # how messages name it, e.g. "Qwen3-MoE"
    architecture: Architecture          # ModelConfig.arch of its configs, and what that arch computes
    model_types: tuple[str, ...]        # the config.json `model_type`s it reads
    # Vision-language checkpoints' model_types whose text model is this family's, its config nested under
    # `text_config` (`text_model_config`); their vision tower is not loaded.
    wrapper_model_types: tuple[str, ...] = ()
    # Where such a checkpoint keeps its text model's tensors: the name of the text model's embedding there ->
    # (prefix of the text model's HF names, the checkpoint's prefix) pairs (jaxspec.models.hf_loader).
    text_model_prefixes: dict[str, tuple[tuple[str, str], ...]] = {}
    # Per layer kind its configs' layers may be (jaxspec.nn.layers.LAYER_KINDS): declared weight -> its HF tensors.
    layer_tensors: dict[str, dict[str, TensorRule]]
    # embed, final_norm, lm_head -> their HF tensors.
    top_tensors: dict[str, TensorRule] = TOP_TENSORS
    # The rope scaling types (jaxspec.models.families.rope.ROPE_TYPES) its configs may ask for.
    rope_types: tuple[str, ...] = ("default", "llama3")
    # Whether its checkpoints may store experts in MXFP4 (dequantized on load, jaxspec.models.dequant).
    mxfp4_experts: bool = False

    def text_model_config(self, hf: dict[str, Any], model_type: str) -> tuple[dict[str, Any], str] | None:
        """A vision-language config (`model_type` one of wrapper_model_types) -> (its text model's config, that
        config's model_type); None where it is the text model's config itself."""
        return None

    def with_defaults(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The config with what transformers defaults where it is absent, where that differs from ModelConfig's."""
        return hf

    # What its configs may ask that transformers would apply and jaxspec does not implement, checked in this order:
    # each (hf, model_type) -> None raises UnsupportedModelError naming the field, its value and what is supported.
    refusals: tuple[Callable[[dict[str, Any], str], None], ...] = ()

    def refuse_unimplemented(self, hf: dict[str, Any], model_type: str) -> None:
        """The family's `refusals`, then its sliding-window rule's (a window it cannot apply is refused there)."""
        for refuse in self.refusals:
            refuse(hf, model_type)
        self.sliding_window(hf, model_type)

    def sliding_window(self, hf: dict[str, Any], model_type: str) -> tuple[int | None, tuple[bool, ...] | None]:
        """(the window, which layers slide) as transformers applies them to this family's configs: none by default."""
        return None, None

    def rope(self, hf: dict[str, Any], draft_head: bool) -> tuple[float, tuple | None]:
        """(rope_theta, rope_scaling) of ModelConfig. draft_head: the config of an EAGLE head, whose rotary may be
        any of DRAFT_HEAD_ROPE_TYPES (its target's)."""
        return rope_theta(hf), rope_scaling(hf, self.architecture.name, self.rope_types, draft_head)

    def family_fields(self, hf: dict[str, Any], model_type: str) -> dict[str, Any]:
        """ModelConfig's fields this family sets beyond those every config has (layer kinds, windows, experts...)."""
        return {}

    def config_fields(self, hf: dict[str, Any], model_type: str, draft_head: bool = False) -> dict[str, Any]:
        """ModelConfig's fields from a config.json of this family (`model_type` one of its model_types); a missing
        required field raises a ValueError naming it, a field asking for what jaxspec does not implement an
        UnsupportedModelError (`refuse_unimplemented`)."""
        hf = self.with_defaults(hf)
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"config is missing required field(s): {', '.join(missing)}")
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        self.refuse_unimplemented(hf, model_type)
        theta, scaling = self.rope(hf, draft_head)
        return dict(
            arch=self.architecture.name,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ()),
            **self.family_fields(hf, model_type))

    def __repr__(self) -> str:
        return f"<family {self.name}>"


def nested_text_config(outer: dict[str, Any], model_type: str, tie_by_default: bool,
                       outer_ids_win: bool) -> tuple[dict[str, Any], str]:
    """The text model's config of a vision-language config (`text_config`, absent: all transformers' defaults) and
    its model_type (absent: `model_type` + "_text"). Its tie_word_embeddings, where it has none, is the outer
    config's (absent: `tie_by_default`); bos/eos token ids the outer config's where it has them and `outer_ids_win`
    (Gemma 3's generation reads the outer config's), else only where the text config has none."""
    hf = {**(outer.get("text_config") or {})}
    hf.setdefault("tie_word_embeddings", outer.get("tie_word_embeddings", tie_by_default))
    for key in ("bos_token_id", "eos_token_id"):
        if outer.get(key) is not None and (outer_ids_win or key not in hf):
            hf[key] = outer[key]
    return hf, hf.get("model_type", model_type + "_text")


# ---- refusals several families share ---------------------------------------------------------------------------

# The MLP activations of SwiGLU, silu(gate) * up (transformers' ACT2FN: "swish" is SiLU too).
SWIGLU_ACTS = ("silu", "swish")


def refuse_unless_swiglu(hf: dict[str, Any], model_type: str | None = None) -> None:
    act = hf.get("hidden_act", "silu")
    if act not in SWIGLU_ACTS:
        raise UnsupportedModelError(f"unsupported hidden_act {act!r}; supported: {', '.join(SWIGLU_ACTS)} "
                                    "(the MLP is SwiGLU)")


def refuse_attention_bias(hf: dict[str, Any], model_type: str) -> None:
    """For a family whose transformers model adds q/k/v/o projection biases when attention_bias is true, and whose
    jaxspec model has none."""
    if hf.get("attention_bias"):
        raise UnsupportedModelError(f"attention_bias=true is not supported for model_type={model_type!r} (its q/k/v/o "
                                    "projection biases would be ignored); supported: attention_bias false")


def refuse_mlp_bias(hf: dict[str, Any], model_type: str | None = None) -> None:
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported (the gate/up/down projection biases would be "
                                    "ignored); supported: mlp_bias false")


def refuse_soft_capping(hf: dict[str, Any], model_type: str | None = None) -> None:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(field) is not None:
            raise UnsupportedModelError(f"{field}={hf[field]!r} is not supported (logit soft-capping is not "
                                        f"implemented); supported: {field} null")


def refuse_partial_rotary(hf: dict[str, Any], model_type: str, rope_dicts: tuple[dict, ...] = ()) -> None:
    """A partial_rotary_factor other than 1 in the config, its rope dict or `rope_dicts` (a family's per-layer-type
    rope parameters) is refused: rotary covers the whole head."""
    rope = [hf] + [hf[k] for k in ("rope_scaling", "rope_parameters") if isinstance(hf.get(k), dict)] + list(rope_dicts)
    factor = next((d["partial_rotary_factor"] for d in rope if d.get("partial_rotary_factor") is not None), 1.0)
    if float(factor) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={factor!r} is not supported for "
                                    f"model_type={model_type!r} (rotary covers the whole head); supported: 1.0")


# SwiGLU, no soft-capping, rotary over the whole head: what every dense family here implements
DENSE_REFUSALS = (refuse_unless_swiglu, refuse_soft_capping, refuse_partial_rotary)


# ---- sliding windows -------------------------------------------------------------------------------------------

def attention_layer_types(types, model_type: str) -> list[str] | None:
    """HF `layer_types` of a model whose layers are all attention (None where absent); a type other than
    full_attention and sliding_attention is refused."""
    if types is None:
        return None
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModelError(f"unsupported layer_types {unknown} for model_type={model_type!r}; supported: "
                                    "full_attention (sliding_attention only with a window that never bites)")
    return list(types)


def marked_sliding(types: list[str] | None) -> list[int]:
    """The layers `layer_types` marks sliding_attention."""
    return [i for i, t in enumerate(types or ()) if t == "sliding_attention"]


def window_bites(hf: dict[str, Any], window: int | None, sliding: list[int]) -> bool:
    """Whether a window on the layers `sliding` can change what a layer reads. A window of at least
    max_position_embeddings never bites: the engine caps max_model_len at max_position_embeddings
    (jaxspec.sched.config), so no query is that far from a key."""
    return not (window is None or window >= hf.get("max_position_embeddings", 4096) or not sliding)


def sliding_window_fields(hf: dict[str, Any], window: int | None,
                          sliding: list[int]) -> tuple[int | None, tuple[bool, ...] | None]:
    """ModelConfig's (sliding_window, sliding_layers) for a window on the layers `sliding`: (None, None) where it
    never bites, sliding_layers None where it is every layer's."""
    if not window_bites(hf, window, sliding):
        return None, None
    n = hf["num_hidden_layers"]
    return int(window), None if len(sliding) == n else tuple(i in sliding for i in range(n))
