"""/tokenize and /detokenize, with vLLM's request and response shapes.

    POST /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
                   or {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false, ...}
                   -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [int, ...]} -> {"prompt": str}

Fields these endpoints do not take are refused (400 naming them), not ignored.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxspec.serve.protocol import ChatMessage


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeText(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False   # the chat template adds the special tokens itself
    return_token_strs: bool = False


class Detokenize(_Strict):
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """The body as `model`; a ValueError naming the bad or unknown fields."""
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}"
                             for err in e.errors()[:5])
        raise ValueError(f"invalid request body: {problems}") from None


def tokenize(llm, max_model_len: int, body: Any) -> dict:
    """vLLM's TokenizeResponse for a text prompt or a conversation (a ValueError names what is wrong)."""
    tok = _tokenizer(llm)
    if isinstance(body, dict) and "messages" in body:
        req = parse(TokenizeChat, body)
        text = tok.apply_chat_template([{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
                                        for i, m in enumerate(req.messages)],
                                       add_generation_prompt=req.add_generation_prompt)
    else:
        req = parse(TokenizeText, body)
        text = req.prompt
    ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
    strs = tok.hf.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(llm, body: Any) -> dict:
    """vLLM's DetokenizeResponse: the ids' text, special tokens included (as vLLM decodes them)."""
    tok = _tokenizer(llm)
    req = parse(Detokenize, body)
    vocab = llm.model.config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}


def _tokenizer(llm):
    if llm.tokenizer is None:
        raise ValueError("this model has no tokenizer (it was served with --random-weights): nothing to tokenize with")
    return llm.tokenizer
