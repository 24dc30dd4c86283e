"""What the requests generated, as report fields: a digest of their tokens, their lengths and finish reasons, and
with a constraint how many outputs satisfy it."""
from __future__ import annotations

import hashlib
import json
import re

import numpy as np


def output_digest(token_ids: list[list[int]]) -> str:
    """A short hash of the requests' output tokens, in request order."""
    flat = np.asarray([t for ids in token_ids for t in [-1, *ids]], np.int64)
    return hashlib.sha256(flat.tobytes()).hexdigest()[:16]



def output_matches(so, text: str) -> bool:
    """Whether an output's text satisfies the constraint: a choice, the regex (Python's re, whole text), or JSON
    that parses and validates against the schema (with jsonschema where it is installed, else parsing only)."""
    if so.kind == "choice":
        return text in so.choice
    if so.kind == "regex":
        return re.fullmatch(so.regex, text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if so.kind == "json_object":
        return isinstance(value, dict)
    try:
        import jsonschema
    except ImportError:
        return True
    try:
        jsonschema.validate(value, so.json if isinstance(so.json, dict) else json.loads(so.json))
        return True
    except jsonschema.ValidationError:
        return False


def output_summary(args, token_counts: list[int], texts: list[str] | None, finish_reasons: list | None) -> dict:
    """Report fields on what the requests generated: output lengths (tokens actually generated, which a
    constraint makes differ per request), finish reasons, and with a constraint how many outputs satisfy it."""
    out = {"output_len": {"mean": float(np.mean(token_counts)) if token_counts else float("nan"),
                          "min": int(min(token_counts, default=0)), "max": int(max(token_counts, default=0))}}
    if finish_reasons is not None:
        out["finish_reasons"] = {r: finish_reasons.count(r) for r in sorted(set(map(str, finish_reasons)))}
    so, described = getattr(args, "structured", None), getattr(args, "structured_report", None)
    if so is not None:
        out["structured_outputs"] = dict(described, ignore_eos=False)
        if texts is not None:
            out["structured_outputs"]["valid_outputs"] = sum(output_matches(so, t) for t in texts)
    return out

