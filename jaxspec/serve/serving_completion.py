"""/v1/completions: OpenAI's text completions, one or several prompts (text or token ids), each with its n
choices, whole or streamed (server-sent events); `echo` puts the prompt (and its logprobs) before the answer."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

from jaxspec.sampling_params import SamplingParams
from jaxspec.sched.output import CompletionOutput
from jaxspec.serve.errors import APIError
from jaxspec.serve.protocol import CompletionRequest
from jaxspec.serve.serving_common import (Completions, LogprobJSON, Responses, collect, sse_response, stream_events,
                                          with_ids)

if TYPE_CHECKING:
    from jaxspec.serve.app import Server

OBJECT = "text_completion"   # a whole response's and a chunk's alike


async def create_completion(server: Server, body: CompletionRequest, http: Request):
    lora = server.check_model(body.model)   # a LoRA adapter served under that name, or None
    refuse_unsupported(body)
    # echo with max_tokens 0 scores the prompt alone (lm-eval's loglikelihood): one token is generated and
    # dropped, as vLLM does
    echo_only = body.echo and body.max_tokens == 0
    encoded, params = prepare(server, body, echo_only)
    await server.compile_constraint(params)
    job = Completions(server, [{"prompt_token_ids": ids} for ids, _ in encoded], params, http, lora)
    responses = Responses(f"cmpl-{http.state.request_id}", lora.lora_name if lora else server.model_name, OBJECT,
                          OBJECT)
    choices = CompletionChoices(server.logprobs, body, job, encoded, echo_only)
    if body.stream:
        return sse_response(stream_events(job, responses, body.stream_options, choices.streamed, choices.tokens))
    results = await collect(job)
    return responses.whole([choices.choice(i, c, True, 0) for i, c in sorted(results.items())],
                           job.usage(sum(choices.tokens(c) for c in results.values())))


def refuse_unsupported(body: CompletionRequest):
    if body.suffix or (body.best_of not in (None, body.n)):
        raise APIError(400, "suffix and best_of (other than n) are not supported",
                       param="suffix" if body.suffix else "best_of")


def prepare(server: Server, body: CompletionRequest, echo_only: bool
            ) -> tuple[list[tuple[list[int], str]], SamplingParams]:
    """(each prompt's (token ids, text), the sampling parameters); a request the server cannot take is a 400."""
    try:
        encoded = [encode_prompt(server.llm, p, i, body.add_special_tokens) for i, p in enumerate(body.prompts())]
        encoded_len = max(len(ids) for ids, _ in encoded)
        max_tokens = 1 if echo_only else body.max_tokens
        server.check_length(encoded_len, max_tokens)
        params = body.sampling_params(max_tokens, server.max_model_len - encoded_len, body.logprobs,
                                      server.options.max_logprobs, prompt_logprobs=body.echo_prompt_logprobs())
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return encoded, params


def encode_prompt(llm, prompt, index: int, add_special_tokens: bool) -> tuple[list[int], str]:
    """(token ids, text): the text is the prompt's, or for token ids their decoding (what echo shows)."""
    ids, text = llm.encode_prompt(prompt, index)
    if text is not None and not add_special_tokens:
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
    if text is None:
        text = llm.tokenizer.decode(ids, skip_special_tokens=False) if llm.tokenizer is not None else ""
    return ids, text


def echo_entries(prompt_ids: list[int], prompt_logprobs: list | None) -> list:
    """The logprob entries of an echoed prompt: its first token has none; each other token its logprob and
    the top alternatives with itself among them (as vLLM's echo)."""
    entries = [{"token_id": prompt_ids[0], "logprob": None, "top": None}]
    for t, e in zip(prompt_ids[1:], (prompt_logprobs or [None])[1:]):
        top = list(e["top"]) + ([] if any(i == t for i, _ in e["top"]) else [(t, e["logprob"])])
        entries.append({"token_id": t, "logprob": e["logprob"], "top": top})
    return entries


class CompletionChoices:
    """Writes one request's choices: whole, or streamed delta by delta."""

    def __init__(self, logprobs: LogprobJSON, body: CompletionRequest, job: Completions,
                 encoded: list[tuple[list[int], str]], echo_only: bool):
        self.logprobs, self.body, self.job, self.encoded, self.echo_only = logprobs, body, job, encoded, echo_only
        self.offsets: dict[int, int] = {}   # streamed: choice -> the length of its text so far (its next text_offset)

    def tokens(self, c: CompletionOutput) -> int:
        """The completion tokens a delta counts for (none when only the prompt is scored)."""
        return 0 if self.echo_only else len(c.token_ids)

    def streamed(self, index: int, c: CompletionOutput) -> list[dict]:
        offset = self.offsets.get(index, 0)
        out = self.choice(index, c, index not in self.offsets, offset)
        self.offsets[index] = offset + len(out["text"])
        return [out]

    def choice(self, index: int, c: CompletionOutput, first: bool, offset: int) -> dict:
        """A choice (whole, or a streamed delta; `first`: its first, which carries the echoed prompt)."""
        if self.echo_only:   # the generated token is dropped
            c = CompletionOutput(c.index, "", [], c.finish_reason, [] if c.logprobs is not None else None)
        text, entries = self._with_echo(index, c, first)
        out = {"index": index, "text": text, "finish_reason": c.finish_reason,
               "logprobs": (self.logprobs.completion_logprobs(entries, offset, self.body.return_tokens_as_token_ids)
                            if entries is not None else None)}
        if first and self.body.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.logprobs.prompt_logprobs(self.job.prompt_logprobs_of(index))
        if self.body.return_token_ids:
            out["token_ids"] = c.token_ids
            if first:
                out["prompt_token_ids"] = self._prompt(index)[0]
        return out

    def _with_echo(self, index: int, c: CompletionOutput, first: bool) -> tuple[str, list | None]:
        """The choice's text and logprob entries, the prompt's before them on its first (with echo)."""
        text, entries = c.text, with_ids(c) if c.logprobs is not None else None
        if self.body.echo and first:
            prompt_ids, prompt_text = self._prompt(index)
            text = prompt_text + text
            if entries is not None:
                entries = echo_entries(prompt_ids, self.job.prompt_logprobs_of(index)) + entries
        return text, entries

    def _prompt(self, index: int) -> tuple[list[int], str]:
        return self.encoded[self.job.prompt_of(index)]
