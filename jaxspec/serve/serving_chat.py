"""/v1/chat/completions: OpenAI's chat completions over the model's chat template, with tool calling
(jaxspec/serve/tools.py), whole or streamed (server-sent events); `echo` puts the last message before the answer
when it is the assistant's (the one being continued)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fastapi import Request

from jaxspec.sampling_params import SamplingParams
from jaxspec.sched.output import CompletionOutput
from jaxspec.serve.errors import APIError
from jaxspec.serve.protocol import ChatCompletionRequest
from jaxspec.serve.serving_common import (Completions, LogprobJSON, Responses, collect, sse_response, stream_events,
                                          with_ids)
from jaxspec.serve.tools import ToolAnswer, ToolPlan, plan_tools

if TYPE_CHECKING:
    from jaxspec.serve.app import Server


@dataclasses.dataclass
class ChatPrompt:
    """A chat request as the engine takes it."""
    plan: ToolPlan
    conversation: list[dict]
    prompt_ids: list[int]
    params: SamplingParams

    def echoed(self, echo: bool | None) -> str:
        """With echo, what the answer begins with: the last message, when it is the assistant's."""
        last = self.conversation[-1]
        return last["content"] if echo and last["role"] == "assistant" and last["content"] else ""


async def create_chat_completion(server: Server, body: ChatCompletionRequest, http: Request):
    lora = server.check_model(body.model)   # a LoRA adapter served under that name, or None
    if server.llm.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it has no chat template")
    prompt = prepare(server, body)
    await server.compile_constraint(prompt.params)
    job = Completions(server, [{"prompt_token_ids": prompt.prompt_ids}], prompt.params, http, lora)
    responses = Responses(f"chatcmpl-{http.state.request_id}", lora.lora_name if lora else server.model_name,
                          "chat.completion", "chat.completion.chunk")
    choices = ChatChoices(server.logprobs, body, prompt)
    if body.stream:
        return sse_response(stream_events(job, responses, body.stream_options, choices.streamed,
                                          opening=choices.opening()))
    results = await collect(job)
    out = responses.whole([choices.choice(i, c) for i, c in sorted(results.items())],
                          job.usage(sum(len(c.token_ids) for c in results.values())))
    if prompt.params.prompt_logprobs is not None:
        out["prompt_logprobs"] = server.logprobs.prompt_logprobs(job.prompt_logprobs_of(0))
    if body.return_token_ids:
        out["prompt_token_ids"] = prompt.prompt_ids
    return out


def prepare(server: Server, body: ChatCompletionRequest) -> ChatPrompt:
    """The request's tools, conversation, prompt and sampling parameters; one the server cannot take is a 400."""
    try:
        plan = plan_tools(body.tool_dicts(), body.tool_choice_value(), body.parallel_tool_calls,
                          server.options.auto_tool_parser)
        if plan.constraint is not None and body.structured() is not None:
            raise ValueError(f"tool_choice {plan.choice!r} constrains the output to tool calls; it cannot also "
                             "be constrained by response_format / structured_outputs")
        conversation = body.conversation()
        prompt_ids, _ = server.llm.encode_prompt(conversation, 0,
                                                 body.chat_options(server.options.chat_template, plan.tools))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        server.check_length(len(prompt_ids), max_tokens)
        params = body.sampling_params(max_tokens, server.max_model_len - len(prompt_ids), logprobs,
                                      server.options.max_logprobs, prompt_logprobs=body.echo_prompt_logprobs(),
                                      structured=plan.constraint, skip_special_tokens=plan.skip_special_tokens,
                                      logprobs_field="top_logprobs")
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return ChatPrompt(plan, conversation, prompt_ids, params)


class ChatChoices:
    """Writes one request's choices: whole messages, or streamed deltas (a ToolAnswer per choice follows its
    text)."""

    def __init__(self, logprobs: LogprobJSON, body: ChatCompletionRequest, prompt: ChatPrompt):
        self.logprobs, self.body, self.plan = logprobs, body, prompt.plan
        self.echoed = prompt.echoed(body.echo)
        self.n = prompt.params.n
        self.answers = [ToolAnswer(prompt.plan) for _ in range(self.n)]   # streamed: each choice's text so far

    def opening(self) -> list[dict]:
        """What every streamed choice starts with: the assistant's role, then the echoed message."""
        deltas = [{"role": "assistant", "content": ""}] + ([{"content": self.echoed}] if self.echoed else [])
        return [{"index": i, "delta": d, "logprobs": None, "finish_reason": None}
                for i in range(self.n) for d in deltas]

    def streamed(self, index: int, c: CompletionOutput) -> list[dict]:
        deltas, finish = self.answers[index].deltas(c.text, c.finish_reason)
        with_tokens = bool(self.body.return_token_ids and c.token_ids)
        outs = stream_choices(index, deltas, finish, self._logprobs(c), with_tokens)
        if self.body.return_token_ids:
            for j, out in enumerate(outs):   # a delta's tokens go with its first chunk
                out["token_ids"] = c.token_ids if j == 0 else []
        return outs

    def choice(self, index: int, c: CompletionOutput) -> dict:
        message, finish = ToolAnswer(self.plan).message(c.text, c.finish_reason)
        if self.echoed:
            message["content"] = self.echoed + (message["content"] or "")
        out = {"index": index, "message": message, "finish_reason": finish, "logprobs": self._logprobs(c)}
        if self.body.return_token_ids:
            out["token_ids"] = c.token_ids
        return out

    def _logprobs(self, c: CompletionOutput) -> dict | None:
        if c.logprobs is None:
            return None
        return self.logprobs.chat_logprobs(with_ids(c), self.body.return_tokens_as_token_ids)


def stream_choices(index: int, deltas: list[dict], finish_reason: str | None, logprobs, has_tokens: bool
                   ) -> list[dict]:
    """The streamed choices of one engine delta: one per chat delta, the logprobs on the first and the finish
    reason on the last (an empty delta when there is nothing else to carry them, or token ids to send)."""
    if not deltas:
        deltas = [{}] if (finish_reason is not None or logprobs is not None or has_tokens) else []
    return [{"index": index, "delta": d, "logprobs": logprobs if j == 0 else None,
             "finish_reason": finish_reason if j == len(deltas) - 1 else None} for j, d in enumerate(deltas)]
