"""Tool calling for /v1/chat/completions, as vLLM serves it.

`tool_choice` decides how the model's text becomes the answer:

    "none"        plain text (the tools are still shown to the chat template)
    "required"    the output is constrained (structured outputs) to a JSON array of {"name", "parameters"} objects,
                  one per call, each name one of the tools' and its parameters valid for that tool's schema;
                  finish_reason "tool_calls"
    named         {"type": "function", "function": {"name": ...}}: the output is constrained to that function's
                  parameters schema and is its one call's arguments; finish_reason "stop" (as OpenAI and vLLM)
    "auto"        the model writes freely; a tool-call parser (`--tool-call-parser`, with
                  `--enable-auto-tool-choice`) finds the calls in its text; finish_reason "tool_calls" when it did

The parser here is `hermes`: calls written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, the format
of Qwen2.5's chat template (SmolLM2's template shows no tools; give it one that does with --chat-template).
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid

from jaxspec.structured import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# A function declared without parameters takes none: its arguments are the empty object.
NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str) -> dict:
    """One call in OpenAI's `tool_calls` shape (arguments: JSON text)."""
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclasses.dataclass
class ToolPlan:
    """What a chat request's tools and tool_choice ask of the engine and of the answer."""
    choice: str                           # "none", "auto", "required" or "named"
    tools: list[dict] | None              # the tools as the chat template gets them (OpenAI's shape)
    function: str | None = None           # named: the function's name
    constraint: StructuredOutputsParams | None = None   # required and named: what the output must match
    parallel: bool = True                 # parallel_tool_calls: more than one call allowed

    @property
    def skip_special_tokens(self) -> bool | None:
        """The hermes tags are special tokens in some vocabularies (Qwen2.5's <tool_call>): "auto" keeps special
        tokens in the text so the parser sees them (None: the request's own choice)."""
        return False if self.choice == "auto" else None


def plan_tools(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None, parser: str | None
               ) -> ToolPlan:
    """The request's ToolPlan; a ValueError names what is wrong (a tool_choice without tools, an unknown named
    function, "auto" on a server without a tool-call parser). `tools` are OpenAI's function tools as dicts;
    `parser`: the server's --tool-call-parser when --enable-auto-tool-choice is on, else None."""
    if tools is not None and not tools:
        raise ValueError("tools is an empty list; give at least one tool or leave the field out")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"   # as OpenAI: tools given and no choice means "auto"
    parallel = parallel_tool_calls is not False
    if tool_choice == "none":
        return ToolPlan("none", tools, parallel=parallel)
    if not tools:
        raise ValueError(f"tool_choice={tool_choice!r} needs tools; give the functions in 'tools'")
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if len(by_name) != len(tools):
        raise ValueError("tools has two functions of the same name; each function needs a name of its own")
    if tool_choice == "auto":
        if parser is None:
            raise ValueError('tool_choice="auto" (the default when tools are given) needs a server started with '
                             "--enable-auto-tool-choice and --tool-call-parser; or give tool_choice \"required\", "
                             "a named function, or \"none\"")
        return ToolPlan("auto", tools, parallel=parallel)
    if tool_choice == "required":
        schema = {"type": "array", "minItems": 1,
                  "items": {"anyOf": [_call_schema(name, f) for name, f in by_name.items()]}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, constraint=StructuredOutputsParams(json=schema), parallel=parallel)
    name = tool_choice["function"]["name"]
    if name not in by_name:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools ({sorted(by_name)})")
    return ToolPlan("named", tools, function=name,
                    constraint=StructuredOutputsParams(json=by_name[name].get("parameters") or NO_PARAMETERS),
                    parallel=parallel)


def _call_schema(name: str, function: dict) -> dict:
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                             "parameters": function.get("parameters") or NO_PARAMETERS},
            "required": ["name", "parameters"]}


# ---- the hermes parser ----------------------------------------------------------------------------------------

def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a model's text: the text before the first <tool_call> is the content (None when only
    whitespace), each <tool_call>{"name": ..., "arguments": ...}</tool_call> a call (the last one may lack its
    closing tag: the output ended there). Text whose tool calls are not all valid JSON objects with a string
    name is content, with no calls (as vLLM: a malformed call is not guessed at)."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls = []
    for m in re.finditer(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", text[start:],
                         re.DOTALL):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(tool_call(call["name"], arguments if isinstance(arguments, str)
                               else json.dumps(arguments, ensure_ascii=False)))
    content = text[:start]
    return (content if content.strip() else None), calls


def parse_required(text: str) -> list[dict] | None:
    """The calls of a "required" answer (a JSON array of {"name", "parameters"}), or None when the text is not one
    (the output was cut short by max_tokens)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    return [tool_call(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items]


# ---- one choice's answer -----------------------------------------------------------------------------------

class ToolAnswer:
    """One choice's text -> its chat message (whole) or its deltas (streamed), by the request's ToolPlan."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""              # streamed: what arrived so far
        self.sent = 0               # streamed "auto": characters of `text` already sent as content
        self.named_id: str | None = None

    # -- whole ---------------------------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the finish reason) of the whole text."""
        calls, content = self._calls(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": content, "tool_calls": calls},
                self._finish_reason(calls, finish_reason))

    def _calls(self, text: str) -> tuple[list[dict] | None, str | None]:
        """(calls, content); calls None when the answer is plain text."""
        plan = self.plan
        if plan.choice == "named":
            return [tool_call(plan.function, text)], None
        if plan.choice == "required":
            return parse_required(text), None
        if plan.choice == "auto":
            content, calls = parse_hermes(text)
            if calls:
                return (calls if plan.parallel else calls[:1]), content
        return None, None

    def _finish_reason(self, calls: list[dict], finish_reason: str | None) -> str | None:
        # OpenAI's (and vLLM's): "tool_calls" when the model chose to call ("auto") or had to ("required") and
        # ended by itself; a named function's call ends with "stop"
        if self.plan.choice == "auto" or (self.plan.choice == "required" and finish_reason == "stop"):
            return "tool_calls"
        return finish_reason

    # -- streamed ------------------------------------------------------------------------------------------
    def deltas(self, new_text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The chat deltas of `new_text` (and, when finish_reason is set, of the end), and the finish reason to
        send. Plain text streams as content. A named function's arguments stream as they come; "required" and
        "auto" calls are sent whole once the text is complete (a call's JSON is only known valid then), and "auto"
        streams the content before a call, holding back what may be the start of a <tool_call> tag."""
        plan = self.plan
        self.text += new_text
        if plan.choice == "named":
            out = []
            if self.named_id is None:
                self.named_id = tool_call_id()
                out.append({"tool_calls": [{"index": 0, "id": self.named_id, "type": "function",
                                            "function": {"name": plan.function, "arguments": ""}}]})
            if new_text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]})
            return out, finish_reason
        if plan.choice not in ("auto", "required"):
            return ([{"content": new_text}] if new_text else []), finish_reason
        if finish_reason is None:
            return self._content_so_far(), None
        calls, content = self._calls(self.text)
        if calls is None:   # no call after all: the rest is content
            rest, self.sent = self.text[self.sent:], len(self.text)
            return ([{"content": rest}] if rest else []), finish_reason
        out = []
        if content is not None and len(content) > self.sent:
            out.append({"content": content[self.sent:]})
        out += [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]
        return out, self._finish_reason(calls, finish_reason)

    def _content_so_far(self) -> list[dict]:
        """"auto" while the text grows: the content before any <tool_call>, less a tail that may begin one."""
        if self.plan.choice == "required":
            return []
        at = self.text.find(TOOL_CALL_START)
        end = at if at >= 0 else len(self.text) - _partial_tag(self.text)
        if end <= self.sent:
            return []
        chunk, self.sent = self.text[self.sent:end], end
        return [{"content": chunk}]


def _partial_tag(text: str) -> int:
    """How many of the text's last characters could be the start of TOOL_CALL_START."""
    for n in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-n:]):
            return n
    return 0
