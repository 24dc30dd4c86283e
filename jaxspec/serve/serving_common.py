"""What /v1/completions (serving_completion.py) and /v1/chat/completions (serving_chat.py) share: the job that runs
one HTTP request's completions in the engine and aborts them when its client leaves, the response and chunk
builder, the logprobs' JSON, usage, server-sent events (the streamed loop) and the whole, non-streamed answer."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterable

from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxspec.sched.output import AsyncSink, CompletionOutput, request_output
from jaxspec.serve.errors import APIError

if TYPE_CHECKING:
    from jaxspec.serve.app import Server

# Put on a request's output queue when its client disconnects: its reader stops at once.
CLIENT_GONE = object()
# The last event of every stream, as OpenAI's servers end theirs.
SSE_DONE = "data: [DONE]\n\n"
# What JSON writes in place of a logprob of -inf (JSON has no number for it), as vLLM's server does.
MASKED_LOGPROB = -9999.0


class Completions:
    """One HTTP request's completions in the engine (every prompt's n), numbered as its response's choices."""

    def __init__(self, server: Server, prompts: list, params, http_request: Request, lora_request=None):
        if not server.accepting:
            raise APIError(503, "the server is shutting down; send the request to another replica",
                           "ServiceUnavailableError")
        self.server, self.http = server, http_request
        self.sink = AsyncSink(asyncio.get_running_loop())
        try:
            groups = server.llm.add_requests(prompts, params, outputs=self.sink, lora_request=lora_request)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:   # the engine loop has stopped
            raise APIError(503, str(e), "ServiceUnavailableError") from None
        self.requests = [r for g in groups for r in g]
        self.prompt_tokens = [len(g[0].prompt_token_ids) for g in groups]
        self.group_size = len(groups[0])                 # choices per prompt (SamplingParams.n)
        self.prompt_logprobs: dict[int, list] = {}       # prompt index -> its prompt logprobs, once they came
        # a completion's position among all of this HTTP request's choices
        self.choice = {(r.parent_id or r.request_id, r.index): p * len(g) + r.index
                       for p, g in enumerate(groups) for r in g}
        self.pending = set(self.choice.values())
        self.recorded: set[int] = set()   # choices whose end is in the metrics
        self.client_gone = False
        server.jobs.add(self)

    async def deltas(self):
        """(choice index, CompletionOutput delta) as the engine confirms them, until every choice ended. A
        client gone meanwhile aborts them all at once, however fast they produce tokens (a task listens for the
        disconnect while they run)."""
        listener = asyncio.create_task(self._abort_when_client_leaves())
        try:
            while self.pending:
                out = await self.sink.queue.get()
                if out is CLIENT_GONE:
                    return
                completion = out.outputs[0]
                choice = self.choice[(out.request_id, completion.index)]
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs[self.prompt_of(choice)] = out.prompt_logprobs
                if completion.finished:
                    self.pending.discard(choice)
                    self._record(choice, completion)
                yield choice, completion
        finally:
            listener.cancel()
            self.abort()
            self._close()

    async def _abort_when_client_leaves(self):
        """Waits for ASGI's `http.disconnect` (the endpoint has read the whole body, so nothing else arrives before
        it; the server sends it when the connection drops) and aborts the completions: the engine drops them at the
        start of its next step."""
        while (await self.http.receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        self.abort()
        self.sink.queue.put_nowait(CLIENT_GONE)

    def _record(self, choice: int, completion: CompletionOutput):
        if choice not in self.recorded:
            self.recorded.add(choice)
            self.server.metrics.record(completion)

    def abort(self):
        """Ends what still runs (the client is gone, or the handler failed) and records every end."""
        for r in self.requests:
            choice = self.choice[(r.parent_id or r.request_id, r.index)]
            if choice in self.recorded:
                continue
            if not r.finished:
                self.server.llm.engine.abort(r.request_id)
            self._record(choice, request_output(r, self.server.llm.tokenizer).outputs[0])

    def stop(self):
        """Aborts what still runs and lets the reader see it end: each choice's last delta says "abort" (the
        server shuts down; its response still goes out)."""
        for r in self.requests:
            if not r.finished:
                self.server.llm.engine.abort(r.request_id)

    def _close(self):
        """The request is over: its prompts are counted (once each, whatever their n) and it leaves the server's
        running jobs."""
        if self in self.server.jobs:
            self.server.jobs.discard(self)
            self.server.metrics.record_prompts(sum(self.prompt_tokens))

    def prompt_of(self, choice: int) -> int:
        """The index of the prompt a choice completes."""
        return choice // self.group_size

    def prompt_logprobs_of(self, choice: int) -> list | None:
        """The prompt logprobs of the prompt a choice completes, once they came."""
        return self.prompt_logprobs.get(self.prompt_of(choice))

    def usage(self, completion_tokens: int) -> dict:
        return usage_json(sum(self.prompt_tokens), completion_tokens)   # each prompt once, whatever its n

    def choice_usage(self, choice: int, completion_tokens: int) -> dict:
        """One choice's usage: its own prompt and its tokens so far."""
        return usage_json(self.prompt_tokens[self.prompt_of(choice)], completion_tokens)


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclasses.dataclass(frozen=True)
class Responses:
    """The one builder of an endpoint's responses: the whole answer and each streamed chunk carry the same id,
    creation time and model around their choices; only their `object` differs (chat's does, completions' not)."""
    id: str
    model: str
    whole_object: str
    chunk_object: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def whole(self, choices: list[dict], usage: dict) -> dict:
        return self._build(self.whole_object, choices, usage)

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        return self._build(self.chunk_object, choices, usage)

    def _build(self, obj: str, choices: list[dict], usage: dict | None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


class LogprobJSON:
    """Logprob entries ({"token_id", "logprob", "top": [(token id, logprob), ...]}) as the APIs write them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def completion_logprobs(self, entries: list, offset: int, as_ids: bool | None = None) -> dict:
        """OpenAI's completions logprobs: tokens, their logprobs, the top alternatives, text offsets. An entry
        whose logprob is None (an echoed prompt's first token, which nothing precedes) has no logprob and no top."""
        name = token_id_name if as_ids else self.token_text   # return_tokens_as_token_ids: "token_id:<id>"
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            text = name(e["token_id"])
            tokens.append(text)
            lps.append(None if e["logprob"] is None else json_logprob(e["logprob"]))
            tops.append(None if e["top"] is None else {name(t): json_logprob(lp) for t, lp in e["top"]})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, entries: list, as_ids: bool | None = None) -> dict:
        name = token_id_name if as_ids else self.token_text   # return_tokens_as_token_ids: "token_id:<id>"

        def item(token_id, lp):
            text = name(token_id)
            return {"token": text, "logprob": json_logprob(lp), "bytes": list(text.encode("utf-8"))}
        return {"content": [{**item(e["token_id"], e["logprob"]),
                             "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries]}

    def prompt_logprobs(self, entries: list | None) -> list | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {token id: {"logprob", "rank",
        "decoded_token"}} for the token itself and the top alternatives."""
        if entries is None:
            return None
        return [None if e is None else self._ranked(e) for e in entries]

    def _ranked(self, entry: dict) -> dict:
        ranked = {t: (lp, rank) for rank, (t, lp) in enumerate(entry["top"], 1)}
        ranked[entry["token_id"]] = (entry["logprob"], entry["rank"])
        return {str(t): {"logprob": json_logprob(lp), "rank": rank, "decoded_token": self.token_text(t)}
                for t, (lp, rank) in ranked.items()}


def token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def json_logprob(lp: float) -> float:
    """A logprob as JSON can carry it: processed logprobs are -inf for tokens the sampling masked (top-k beyond its
    k), which JSON has no number for."""
    return max(lp, MASKED_LOGPROB)


def with_ids(c: CompletionOutput) -> list:
    """The completion's logprob entries, each with the token id it belongs to."""
    return [{**e, "token_id": t} for e, t in zip(c.logprobs, c.token_ids)]


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


def chunk_usage(stream_options, job: Completions, choice: int, completion_tokens: dict) -> dict | None:
    """stream_options.continuous_usage_stats: each chunk's usage, its choice's tokens so far (as vLLM)."""
    if not (stream_options and stream_options.include_usage and stream_options.continuous_usage_stats):
        return None
    return job.choice_usage(choice, completion_tokens.get(choice, 0))


def completion_tokens(c: CompletionOutput) -> int:
    return len(c.token_ids)


async def stream_events(job: Completions, responses: Responses, stream_options,
                        choices_of: Callable[[int, CompletionOutput], list[dict]],
                        tokens_of: Callable[[CompletionOutput], int] = completion_tokens,
                        opening: Iterable[dict] = ()) -> AsyncIterator[str]:
    """A streamed response's events: the `opening` choices, then each engine delta's choices (`choices_of`) as
    they come, a chunk each, the usage last when stream_options asks for it, and [DONE]. `tokens_of`: the tokens a
    delta adds to its choice's usage."""
    for choice in opening:
        yield sse(responses.chunk([choice]))
    counted: dict[int, int] = {}   # choice -> its completion tokens so far
    async for index, c in job.deltas():
        if not (c.text or c.finished or c.token_ids):   # nothing a client would see
            continue
        counted[index] = counted.get(index, 0) + tokens_of(c)
        usage = chunk_usage(stream_options, job, index, counted)
        for choice in choices_of(index, c):
            yield sse(responses.chunk([choice], usage))
    if stream_options and stream_options.include_usage:
        yield sse(responses.chunk([], job.usage(sum(counted.values()))))
    yield SSE_DONE


async def collect(job: Completions) -> dict[int, CompletionOutput]:
    """The whole completions: choice -> CompletionOutput with the deltas joined."""
    results: dict[int, CompletionOutput] = {}
    async for choice, c in job.deltas():
        acc = results.setdefault(choice, CompletionOutput(c.index, "", [], None,
                                                          [] if c.logprobs is not None else None))
        acc.text += c.text
        acc.token_ids += c.token_ids
        if c.logprobs is not None:
            acc.logprobs += c.logprobs
        acc.finish_reason, acc.metrics = c.finish_reason, c.metrics
    if job.client_gone:   # nobody reads the answer (the server drops what is sent on a closed connection)
        raise APIError(499, "the client closed the connection before the completions ended", "ClientClosedRequest")
    return results
