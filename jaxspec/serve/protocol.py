"""The OpenAI request bodies the server takes, and how each becomes SamplingParams.

No field is silently ignored: each field OpenAI or vLLM defines either acts as it does in vLLM, or is refused with
a 400 that names it (`UNSUPPORTED`: fields refused unless they hold the value that asks for nothing). The only
fields accepted without effect are OpenAI platform bookkeeping that changes no output and that vLLM ignores too
(`IGNORED`). A field nobody defines is refused by name. Known fields with a bad type or value are a 400 naming the
field.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxspec.sampling_params import SamplingParams
from jaxspec.structured import StructuredOutputsParams

# OpenAI platform bookkeeping (end-user ids, tags, storage, routing hints): no effect on the output here, nor in vLLM.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                     "session_id"})

_NOTHING = (None, [], {})
# field -> (the values that ask for nothing, which are accepted; why another value is refused)
UNSUPPORTED = {
    "use_beam_search": ((False, None), "beam search is not implemented"),
    "length_penalty": ((1, 1.0, None), "it applies to beam search, which is not implemented"),
    "early_stopping": ((False, None), "it applies to beam search, which is not implemented"),
    "allowed_token_ids": (_NOTHING, "not implemented; logit_bias or structured_outputs can restrict the tokens"),
    "bad_words": (_NOTHING, "not implemented; logit_bias can ban single tokens"),
    "logprob_token_ids": (_NOTHING, "not implemented; use logprobs / top_logprobs"),
    "truncate_prompt_tokens": (_NOTHING, "prompts are never truncated here; shorten the prompt"),
    "truncation_side": (_NOTHING, "prompts are never truncated here"),
    "watermarking": ((False, None), "not implemented"),
    "priority": ((0, None), "priority scheduling is not implemented (every request has priority 0)"),
    "cache_salt": (_NOTHING, "prefix-cache salting is not implemented"),
    "kv_transfer_params": (_NOTHING, "disaggregated serving is not implemented"),
    "ec_transfer_params": (_NOTHING, "disaggregated serving is not implemented"),
    "vllm_xargs": (_NOTHING, "there are no custom extensions to pass them to"),
    "logits_processors": (_NOTHING, "custom logits processors are not implemented"),
    "thinking_token_budget": (_NOTHING, "there is no reasoning parser"),
    "repetition_detection": (_NOTHING, "not implemented"),
    "stream_interval": ((None, 1), "every step's tokens are streamed as they come"),
    "guided_decoding_backend": (_NOTHING, "there is one structured-outputs compiler; leave it out"),
    "prompt_embeds": (_NOTHING, "prompts are text or token ids"),
    "mm_processor_kwargs": (_NOTHING, "this server takes text only"),
    "media_io_kwargs": (_NOTHING, "this server takes text only"),
    "chat_template": (_NOTHING, "a request may not bring its own chat template (the server's --chat-template sets "
                                "it), as vLLM without --trust-request-chat-template"),
    "reasoning_effort": (_NOTHING, "there is no reasoning parser"),
    "functions": (_NOTHING, "the deprecated functions API is not served; give 'tools'"),
    "function_call": (_NOTHING, "the deprecated functions API is not served; give 'tool_choice'"),
    "audio": (_NOTHING, "this server answers in text only"),
    "modalities": ((None, ["text"]), "this server answers in text only"),
    "prediction": (_NOTHING, "predicted outputs are not implemented"),
    "verbosity": (_NOTHING, "not implemented"),
    "web_search_options": (_NOTHING, "there is no web search"),
}


def check_fields(model: type[BaseModel], data: Any) -> Any:
    """The raw body before validation: IGNORED fields and UNSUPPORTED ones that ask for nothing dropped; an
    UNSUPPORTED field with another value, or a field `model` does not define, is a ValueError naming it."""
    if not isinstance(data, dict):
        return data
    known = {f.alias or name for name, f in model.model_fields.items()}
    unknown = sorted(k for k in data if k not in known and k not in IGNORED and k not in UNSUPPORTED)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}: this server does not take them (vLLM's and OpenAI's fields it "
                         "does not implement are refused by name; see the README's server section)")
    for name, (accepted, why) in UNSUPPORTED.items():
        if name in data and data[name] not in accepted:
            raise ValueError(f"{name}={data[name]!r} is not supported: {why}")
    return {k: v for k, v in data.items() if k in known}


class _Body(BaseModel):
    """A request body: every field checked by `check_fields` first."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _fields(cls, data):
        return check_fields(cls, data)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False   # usage on every chunk (with include_usage)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON that a schema validates."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    """Fields both endpoints share (OpenAI's names, plus vLLM's extra sampling fields)."""
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None   # token id (as JSON keys are: text) -> bias, clamped to [-100, 100]
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None   # vLLM's extra body: json, regex, choice, json_object, ...
    # vLLM's older names of structured_outputs' keys
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    return_token_ids: bool | None = None             # the response carries prompt_token_ids and token_ids
    return_tokens_as_token_ids: bool | None = None   # logprobs name tokens "token_id:<id>"
    speculative: bool = True   # false: the request verifies no drafts (SamplingParams.speculative; jaxspec's own)

    @model_validator(mode="after")
    def _stream_only_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only for streamed requests (stream: true)")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM)")
        return self

    def guided(self) -> dict | None:
        """The guided_* fields as a structured_outputs dict, or None when none is given."""
        given = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")
                 if getattr(self, f"guided_{k}") is not None}
        if not given:
            if self.guided_whitespace_pattern is not None:
                raise ValueError("guided_whitespace_pattern is given without guided_json")
            return None
        if self.guided_whitespace_pattern is not None:
            given["whitespace_pattern"] = self.guided_whitespace_pattern
        return given

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint `response_format`, `structured_outputs` or the guided_* fields ask for (a
        ValueError names a bad one, or more than one way of asking)."""
        fmt = self.response_format
        ways = [name for name, given in (("response_format", fmt is not None and fmt.type != "text"),
                                         ("structured_outputs", self.structured_outputs is not None),
                                         ("guided_*", self.guided() is not None)) if given]
        if len(ways) > 1:
            raise ValueError(f"the request constrains its output with {' and '.join(ways)}; give one of them")
        if self.structured_outputs is not None:
            return StructuredOutputsParams.coerce(self.structured_outputs)
        if self.guided() is not None:
            return StructuredOutputsParams.coerce(self.guided())
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema (the JSON schema)")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with int token ids, each bias clamped to [-100, 100] (OpenAI's range, as vLLM clamps)."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias has the key {key!r}, which is not a token id (an integer)") from None
            bias[token] = min(100.0, max(-100.0, value))
        return bias

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int, logprobs: int | None,
                        max_logprobs: int = 20, prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None,
                        skip_special_tokens: bool | None = None, logprobs_field: str = "logprobs") -> SamplingParams:
        """SamplingParams (a ValueError names a bad field). Without max_tokens a request may run to the end of
        the context: `default_max_tokens` is what its prompt leaves of max_model_len. `max_logprobs`: the
        server's limit on logprobs and prompt_logprobs; `prompt_logprobs`, `structured` and `skip_special_tokens`
        override the body's own (echo, tool calls); `logprobs_field`: the body's name of `logprobs`."""
        prompt_logprobs = self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
        for name, value in ((logprobs_field, logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= max_logprobs:
                raise ValueError(f"{name}={value} is invalid; this server returns 0 to {max_logprobs} logprobs per "
                                 "token (--max-logprobs)")
        given = {k: v for k, v in {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty}.items() if v is not None}
        return SamplingParams(n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              max_tokens=max_tokens if max_tokens is not None else max(default_max_tokens, 1),
                              min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, logit_bias=self.token_bias(),
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=(self.skip_special_tokens if skip_special_tokens is None
                                                   else skip_special_tokens),
                              spaces_between_special_tokens=self.spaces_between_special_tokens,
                              speculative=self.speculative,
                              structured_outputs=structured if structured is not None else self.structured(), **given)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True   # the tokenizer's BOS (and such) before a text prompt

    def prompts(self) -> list:
        """The prompts it holds: a string, a token-id list, or a list of either."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("'prompt' is empty; give a string, a token-id list, or a list of those")
        return list(p)

    def echo_prompt_logprobs(self) -> int | None:
        """prompt_logprobs, or with echo and logprobs the prompt's logprobs of the same width (as vLLM)."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# Message fields OpenAI's client writes when an answer's message is sent back as it came (all null there): accepted
# when empty; with a value they would be dropped, so they are refused by name.
_EMPTY_MESSAGE_FIELDS = ("refusal", "annotations", "audio", "function_call", "reasoning", "reasoning_content")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _empty_fields(cls, data):
        if not isinstance(data, dict):
            return data
        for name in _EMPTY_MESSAGE_FIELDS:
            if data.get(name) not in _NOTHING:
                raise ValueError(f"a message's {name}={data[name]!r} is not supported (the chat templates here do "
                                 "not show it); leave it out")
        return {k: v for k, v in data.items() if k not in _EMPTY_MESSAGE_FIELDS}

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None     # an assistant's earlier calls
    tool_call_id: str | None = None              # a tool's answer: the call it answers

    def text(self, index: int) -> str | None:
        """The message's text: a string, or the text parts of a content list (others are refused); None for an
        assistant message of tool calls only."""
        if self.content is None:
            return None if self.tool_calls else ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}].content has a {part.get('type')!r} part; this server takes "
                                 "text parts only")
            parts.append(part["text"])
        return "".join(parts)

    def for_template(self, index: int) -> dict:
        """The message as chat templates read it; a tool call's arguments parsed into an object (templates write
        them with `tojson`, as vLLM hands them over)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text(index)}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        return out


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None   # the arguments always follow the schema under "required" and a named function


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False                        # the answer starts with the last message's text, if the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False          # the tokenizer's BOS (and such) on top of what the template writes
    documents: list[dict[str, str]] | None = None   # for templates that show documents (retrieval)
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True            # (there is no reasoning parser: the reasoning, if any, is the content)

    @model_validator(mode="after")
    def _logprob_fields(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def conversation(self) -> list[dict]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]

    def tool_dicts(self) -> list[dict] | None:
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_choice_value(self):
        """tool_choice as tools.plan_tools takes it (a named choice as a dict)."""
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    def chat_options(self, chat_template: str | None, tools: list[dict] | None) -> dict:
        """How LLM.encode_prompt renders the conversation (see LLM.apply_chat_template)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            kwargs["documents"] = self.documents
        return dict(add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message, tools=tools, chat_template=chat_template,
                    chat_template_kwargs=kwargs, add_special_tokens=self.add_special_tokens)

    def echo_prompt_logprobs(self) -> int | None:
        """prompt_logprobs, or with echo and logprobs the prompt's logprobs of top_logprobs' width (as vLLM)."""
        if self.prompt_logprobs is None and self.echo and self.logprobs and not self.stream:
            return self.top_logprobs or 0
        return self.prompt_logprobs
