"""The model families jaxspec reads from a HF config.json, one module each (jaxspec.models.families.base says what a
family declares), and the lookups built from them.

A new family is a module beside these (start from the nearest one) and a line in FAMILIES: ModelConfig.from_hf,
the safetensors loader and the weight readers find its model_types, fields, refusals and tensors here. A layer kind
of its own is a module of jaxspec.nn.layers and an entry in its LAYER_KINDS.
"""
from __future__ import annotations

from typing import Any

from jaxspec.models.families import gemma3, gpt_oss, llama, mistral, qwen2, qwen3, qwen3_hybrids, qwen3_moe
from jaxspec.models.families.base import Architecture, Family
from jaxspec.models.families.tensors import TensorRule

# In the order error messages list them (the first family of an architecture names it first).
FAMILIES: tuple[Family, ...] = (
    llama.LLAMA,
    mistral.MISTRAL,
    qwen2.QWEN2,
    qwen3.QWEN3,
    qwen3_moe.QWEN3_MOE,
    qwen3_hybrids.QWEN3_NEXT,
    qwen3_hybrids.QWEN3_5,
    gemma3.GEMMA3,
    gpt_oss.GPT_OSS,
)


def _unique(pairs, what: str) -> dict:
    """{key: value} from (key, value, family name) triples, refusing a key two families give different values."""
    merged: dict = {}
    owner: dict = {}
    for key, value, family in pairs:
        if key in merged and merged[key] != value:
            raise ValueError(f"families {owner[key]!r} and {family!r} declare different {what} for {key!r}")
        merged.setdefault(key, value)
        owner.setdefault(key, family)
    return merged


FAMILY_OF_MODEL_TYPE: dict[str, Family] = _unique(((t, f, f.name) for f in FAMILIES for t in f.model_types),
                                                  "families")
WRAPPER_FAMILY_OF_MODEL_TYPE: dict[str, Family] = _unique(
    ((t, f, f.name) for f in FAMILIES for t in f.wrapper_model_types), "families")
# ModelConfig.arch -> what it computes.
ARCHITECTURES: dict[str, Architecture] = _unique(((f.architecture.name, f.architecture, f.name) for f in FAMILIES),
                                                 "architectures")
# ModelConfig.arch -> layer kind -> declared weight -> its HF tensors (the union over the arch's families, which must
# agree), and its top-level weights'.
LAYER_TENSORS: dict[str, dict[str, dict[str, TensorRule]]] = {
    arch: _unique(((kind, table, f.name) for f in FAMILIES if f.architecture.name == arch
                   for kind, table in f.layer_tensors.items()), f"{arch} layer tensors")
    for arch in ARCHITECTURES}
TOP_TENSORS: dict[str, dict[str, TensorRule]] = _unique(
    ((f.architecture.name, f.top_tensors, f.name) for f in FAMILIES), "top-level tensors")
# A vision-language checkpoint's text model: the name of its embedding there -> (HF prefix, stored prefix) pairs.
TEXT_MODEL_PREFIXES: dict[str, tuple[tuple[str, str], ...]] = _unique(
    ((embed, renames, f.name) for f in FAMILIES for embed, renames in f.text_model_prefixes.items()),
    "text model prefixes")


def text_model(hf: dict[str, Any]) -> tuple[dict[str, Any], str, Family]:
    """(the text model's config, its model_type, its family) of a config.json: the config itself, or a
    vision-language one's nested text config. An unknown model_type raises a ValueError naming the supported."""
    model_type = hf.get("model_type")
    wrapper = WRAPPER_FAMILY_OF_MODEL_TYPE.get(model_type)
    nested = wrapper.text_model_config(hf, model_type) if wrapper is not None else None
    if nested is not None:
        hf, model_type = nested
    family = FAMILY_OF_MODEL_TYPE.get(model_type)
    if family is None:
        supported = sorted({*FAMILY_OF_MODEL_TYPE, *WRAPPER_FAMILY_OF_MODEL_TYPE})
        raise ValueError(f"unsupported architecture model_type={model_type!r}; supported: {', '.join(supported)}")
    return hf, model_type, family


def architecture(arch: str) -> Architecture:
    """What ModelConfig.arch `arch` computes; a ValueError naming the supported where it is none of them."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch]
