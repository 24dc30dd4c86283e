"""`StructuredOutputsParams`: what a request's output must match (vLLM's names): a JSON schema, any JSON object,
a regular expression or one of a list of choices."""
from __future__ import annotations

import dataclasses
import json
import re

KINDS = ("json", "regex", "choice", "json_object", "grammar", "structural_tag")
SUPPORTED = ("json", "regex", "choice", "json_object")


@dataclasses.dataclass
class StructuredOutputsParams:
    json: str | dict | None = None          # a JSON schema (a dict, or its JSON text)
    regex: str | None = None                # the whole output matches it
    choice: list[str] | None = None         # the output is one of these strings
    json_object: bool | None = None         # any JSON object
    grammar: str | None = None              # (EBNF grammars are refused: no compiler for them here)
    structural_tag: str | None = None       # (refused)
    whitespace_pattern: str | None = None   # JSON: the regex of the whitespace allowed between tokens
    disable_any_whitespace: bool = False    # JSON: no whitespace between tokens
    disable_fallback: bool = False          # accepted for compatibility: there is one compiler, never a fallback

    def __post_init__(self):
        self.validate()

    @classmethod
    def coerce(cls, value) -> "StructuredOutputsParams | None":
        """None, a StructuredOutputsParams, or a dict of its fields (vLLM's `structured_outputs` request body)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            names = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise ValueError(f"structured_outputs has unknown keys {unknown}; valid keys: {names}")
            return cls(**value)
        raise ValueError(f"structured_outputs={value!r} is invalid; give a StructuredOutputsParams or a dict with "
                         f"one of {list(SUPPORTED)}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self):
        """Exactly one constraint, of a supported kind, well formed; a ValueError names what is wrong."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs sets {given or 'no constraint'}; set exactly one of "
                             f"{list(SUPPORTED)}")
        kind = given[0]
        if kind not in SUPPORTED:
            raise ValueError(f"structured_outputs.{kind} is not supported; give one of {list(SUPPORTED)}")
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON text ({e}); give a JSON schema "
                                     "as a dict or as its JSON text") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured_outputs.json={self.json!r} is invalid; a JSON schema is an object "
                                 "(a dict)")
        elif kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"structured_outputs.regex={self.regex!r} is invalid; give a non-empty string")
        elif kind == "choice":
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice={self.choice!r} is invalid; give a non-empty list of "
                                 "non-empty strings")
            self.choice = list(self.choice)
        elif self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object={self.json_object!r} is invalid; it must be True")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError(f"structured_outputs.whitespace_pattern={self.whitespace_pattern!r} is invalid; give a "
                             "regex string or None")
        for name in ("disable_any_whitespace", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name}={getattr(self, name)!r} is invalid; it must be a bool")

    def whitespace(self) -> str | None:
        """The whitespace regex between JSON tokens (None: the compiler's default, one optional space)."""
        return "" if self.disable_any_whitespace else self.whitespace_pattern

    def key(self) -> tuple:
        """What identifies the compiled automaton: (kind, canonical spec, whitespace)."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            value = json.dumps(schema, sort_keys=True)
        elif kind == "choice":
            value = tuple(value)
        return kind, value, self.whitespace() if kind in ("json", "json_object") else None


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of the strings."""
    return "(" + "|".join(re.escape(c) for c in choices) + ")"
