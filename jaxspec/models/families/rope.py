"""The rotary fields of a HF config.json, as most families spell them: `rope_theta` and `rope_scaling` (transformers
>= 5: `rope_parameters`). A scaling type jaxspec does not implement, or one of its fields, is refused by name."""
from __future__ import annotations

from typing import Any, NamedTuple

from jaxspec.models.errors import UnsupportedModelError

# Rope scaling types the rotary code implements (jaxspec.nn.ops.rope_inv_freq; "default": plain rope). Which of them a
# family's configs may ask for is the family's (`Family.rope_types`).
ROPE_TYPES = ("default", "llama3", "yarn")
# An EAGLE-3 head's config.json (one Llama layer) carries its target's global rotary whatever the target's family
# (jaxspec.models.heads.save_head): Gemma 3's linear scaling, Llama 3's, GPT-OSS's YaRN. The head loader reads each as
# the target's loader does (jaxspec.nn.ops.rope_inv_freq computes them for any layer).
DRAFT_HEAD_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys of a rope dict that name no scaling (a dict of only these, without a type, is plain rope). mrope_*: Qwen3.5's
# multimodal sections, the same rotation for text (every section gets the same position).
PLAIN_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# YaRN's fields jaxspec implements (transformers' _compute_yarn_parameters): those it needs, and those with a default.
# Its other fields (attention_factor, mscale, mscale_all_dim: other ways to set the attention scale) are refused.
_YARN_REQUIRED_KEYS = ("factor", "original_max_position_embeddings")
_YARN_OPTIONAL_KEYS = ("beta_fast", "beta_slow", "truncate")


class GivenScaling(NamedTuple):
    """A config's rope scaling as written: the field it is in, its type, the dict."""
    field: str
    kind: str
    scaling: dict


def rope_theta(hf: dict[str, Any]) -> float:
    """The rotary base: `rope_theta`, or `rope_parameters.rope_theta` (transformers >= 5), else 10000."""
    theta = hf.get("rope_theta")
    if theta is None and isinstance(hf.get("rope_parameters"), dict):
        theta = hf["rope_parameters"].get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def given_rope_scaling(hf: dict[str, Any], draft_head: bool = False) -> GivenScaling | None:
    """The config's rope scaling (None: none given), its type one the rotary code implements (ROPE_TYPES; an EAGLE
    head's, `draft_head`: DRAFT_HEAD_ROPE_TYPES), else refused naming it."""
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
        scales = sorted(set(scaling) - PLAIN_ROPE_KEYS)
        if scales:
            raise UnsupportedModelError(f"{field}={scaling!r} names no rope_type but sets {', '.join(scales)}; "
                                        f"supported: no scaling, or rope_type in {', '.join(ROPE_TYPES)}")
        kind = "default"
    if kind not in supported:
        raise UnsupportedModelError(f"unsupported rope scaling type {kind!r} ({field}={scaling!r}); supported: "
                                    f"{', '.join(supported)}")
    return GivenScaling(field, kind, scaling)


def rope_scaling(hf: dict[str, Any], arch: str, rope_types: tuple[str, ...], draft_head: bool = False) -> tuple | None:
    """The config's rope scaling as ModelConfig.rope_scaling (None: plain rope); a type jaxspec does not implement
    (dynamic, linear, longrope, ...), or one the family does not take (`rope_types`: yarn is tested against
    transformers for GPT-OSS only), is refused, naming it. An EAGLE head's (`draft_head`) may be any of
    DRAFT_HEAD_ROPE_TYPES."""
    given = given_rope_scaling(hf, draft_head)
    if given is None or given.kind == "default":
        return None
    field, kind, scaling = given
    if kind == "linear":   # (a draft head's: Gemma 3's global layers)
        return linear_scaling(field, scaling)
    if kind not in rope_types and not draft_head:
        raise UnsupportedModelError(f"unsupported rope scaling type {kind!r} for {arch} ({field}={scaling!r}); "
                                    f"supported: {', '.join(rope_types)}")
    if kind == "yarn":
        return _yarn_scaling(hf, field, scaling)
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in scaling]
    if missing:
        raise UnsupportedModelError(f"{field} type 'llama3' lacks {', '.join(missing)}; it needs "
                                    f"{', '.join(_LLAMA3_ROPE_KEYS)}")
    return tuple(sorted((k, scaling[k]) for k in _LLAMA3_ROPE_KEYS))


def linear_scaling(field: str, scaling: dict) -> tuple:
    """Linear scaling (positions divided by `factor`) as ModelConfig.rope_scaling, the form Gemma 3's loader gives
    its global layers'; a field other than factor that would scale is refused, naming it."""
    unknown = sorted(set(scaling) - PLAIN_ROPE_KEYS - {"factor"})
    if unknown or "factor" not in scaling:
        raise UnsupportedModelError(f"{field} type 'linear' needs factor and nothing else that scales ({field}="
                                    f"{scaling!r}); supported: factor")
    return (("factor", float(scaling["factor"])), ("rope_type", "linear"))


def _yarn_scaling(hf: dict[str, Any], field: str, scaling: dict) -> tuple:
    """YaRN's fields as ModelConfig.rope_scaling, with transformers' defaults (beta_fast 32, beta_slow 1, truncate
    true; no factor: max_position_embeddings / original_max_position_embeddings); a field it does not implement is
    refused, naming it."""
    unknown = sorted(set(scaling) - PLAIN_ROPE_KEYS - set(_YARN_REQUIRED_KEYS) - set(_YARN_OPTIONAL_KEYS))
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
