"""The OpenAI request bodies the server takes, and how each becomes SamplingParams.

Unknown fields are ignored (OpenAI clients send fields a server may not use); known fields with a bad type
or value are a 400 naming the field.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxspec.sampling_params import SamplingParams
from jaxspec.structured import StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON that a schema validates."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(BaseModel):
    """Fields both endpoints share (OpenAI's names, plus vLLM's extra sampling fields)."""
    model_config = ConfigDict(extra="ignore")
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
    min_tokens: int = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None   # vLLM's extra body: json, regex, choice, json_object, ...

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint `response_format` or `structured_outputs` asks for (a ValueError names a bad one)."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise ValueError("the request has both response_format and structured_outputs; give one of them")
        if self.structured_outputs is not None:
            return StructuredOutputsParams.coerce(self.structured_outputs)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema (the JSON schema)")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams (a ValueError names a bad field). Without max_tokens a request may run to the end of
        the context: `default_max_tokens` is what its prompt leaves of max_model_len."""
        given = {k: v for k, v in {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty}.items() if v is not None}
        return SamplingParams(n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              max_tokens=max_tokens if max_tokens is not None else max(default_max_tokens, 1),
                              min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
                              structured_outputs=self.structured(), **given)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list:
        """The prompts it holds: a string, a token-id list, or a list of either."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("'prompt' is empty; give a string, a token-id list, or a list of those")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, index: int) -> str:
        """The message's text: a string, or the text parts of a content list (others are refused)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}].content has a {part.get('type')!r} part; this server takes "
                                 "text parts only")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def conversation(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
                for i, m in enumerate(self.messages)]
