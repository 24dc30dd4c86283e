"""An OpenAI-compatible HTTP server over one `LLM`: /v1/completions, /v1/chat/completions (server-sent events
with `stream: true`), /v1/models (and /v1/models/{id}), /tokenize, /detokenize, /version, /health and /metrics.

The engine loop runs on its own thread (`Engine.start`) and batches every client's requests; each HTTP request
queues its completions with an output sink that hands the engine's deltas to the event loop. A client that
disconnects, streamed or not, aborts its completions at once (the engine drops them at its next step and their
blocks return to the pool). On SIGTERM (`Server.drain`, from jaxspec/serve/lifecycle.py) new requests are
refused, running ones get the grace period (--shutdown-timeout) and are then aborted. Errors use OpenAI's body:
{"error": {"message", "type", "param", "code"}}. The API key, CORS and X-Request-Id: jaxspec/serve/http.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxspec.sched.output import AsyncSink, CompletionOutput, request_output
from jaxspec.serve import tokenize
from jaxspec.serve.http import HTTPOptions, install
from jaxspec.serve.metrics import ServerMetrics
from jaxspec.serve.options import ServeOptions
from jaxspec.serve.protocol import ChatCompletionRequest, CompletionRequest
from jaxspec.structured.compile_pool import CompileUnavailable
from jaxspec.serve.tools import ToolAnswer, plan_tools

# Put on a request's output queue when its client disconnects: its reader stops at once.
CLIENT_GONE = object()
# While the server drains (SIGTERM), how often it looks whether the running requests have ended.
DRAIN_POLL_SECONDS = 0.05
# After the grace period, how long aborted requests may take to send their last response.
ABORT_WAIT_SECONDS = 5.0


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_response(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


class Completions:
    """One HTTP request's completions in the engine (every prompt's n), numbered as its response's choices."""

    def __init__(self, server: "Server", prompts: list, params, http_request: Request):
        if not server.accepting:
            raise APIError(503, "the server is shutting down; send the request to another replica",
                           "ServiceUnavailableError")
        self.server, self.http = server, http_request
        self.sink = AsyncSink(asyncio.get_running_loop())
        try:
            groups = server.llm.add_requests(prompts, params, outputs=self.sink)
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
                    self.prompt_logprobs[choice // self.group_size] = out.prompt_logprobs
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

    def usage(self, completion_tokens: int) -> dict:
        prompt = sum(self.prompt_tokens)   # each prompt once, whatever its n
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}


class Server:
    def __init__(self, llm, model_name: str, api_key: str | None = None, options: ServeOptions | None = None):
        self.llm, self.model_name, self.api_key = llm, model_name, api_key
        self.options = options or ServeOptions()
        self.metrics = ServerMetrics(llm.engine, model_name)
        self.max_model_len = llm.engine.step_config.max_model_len
        self.created = int(time.time())
        self.jobs: set[Completions] = set()   # HTTP requests whose completions run
        self.draining = False     # shutting down: new HTTP requests are refused (http.ShutdownGate)
        self.accepting = True     # False once the grace period is over: nothing more enters the engine

    async def drain(self, grace: float):
        """Shutdown (SIGTERM): refuses new requests, lets the running ones finish for `grace` seconds, then aborts
        what still runs (each response ends with finish_reason "abort") and stops the constraint compiles, and
        waits (ABORT_WAIT_SECONDS at most) for those responses to go out."""
        loop = asyncio.get_running_loop()
        self.draining = True
        await self._wait_for_jobs(loop.time() + grace)
        self.accepting = False
        self.llm.engine.stop_compiling()
        for job in list(self.jobs):
            job.stop()
        await self._wait_for_jobs(loop.time() + ABORT_WAIT_SECONDS)

    async def _wait_for_jobs(self, until: float):
        loop = asyncio.get_running_loop()
        while self.jobs and loop.time() < until:
            await asyncio.sleep(DRAIN_POLL_SECONDS)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "jaxspec",
                "max_model_len": self.max_model_len}

    # ---- helpers -----------------------------------------------------------------------------------
    def check_model(self, model: str | None):
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           "NotFoundError", "model")

    def check_length(self, prompt_len: int, max_tokens: int | None):
        """As OpenAI servers do: a request whose prompt and max_tokens exceed the context is refused."""
        if max_tokens is not None and prompt_len + max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens (max_model_len); "
                                f"the request asks for {prompt_len + max_tokens}: {prompt_len} in the prompt and "
                                f"max_tokens={max_tokens}", param="max_tokens")

    async def compile_constraint(self, params):
        """Compiles the request's structured-outputs constraint (cached after the first time) on a worker thread:
        the event loop keeps serving meanwhile. One that cannot be compiled, or not in time, is a 400."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.llm.engine.compile_structured, params.structured_outputs)
        except ValueError as e:
            raise APIError(400, str(e), param="response_format") from None
        except CompileUnavailable as e:   # busy with others' constraints, or shutting down: not this one's fault
            raise APIError(503, str(e), "ServiceUnavailableError") from None

    def token_text(self, token_id: int) -> str:
        tok = self.llm.tokenizer
        return tok.decode([token_id]) if tok is not None else str(token_id)

    def completion_logprobs(self, entries: list, offset: int, as_ids: bool | None = None) -> dict:
        """OpenAI's completions logprobs: tokens, their logprobs, the top alternatives, text offsets. An entry
        whose logprob is None (an echoed prompt's first token, which nothing precedes) has no logprob and no top."""
        name = _token_id_name if as_ids else self.token_text   # return_tokens_as_token_ids: "token_id:<id>"
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            text = name(e["token_id"])
            tokens.append(text)
            lps.append(None if e["logprob"] is None else _json_logprob(e["logprob"]))
            tops.append(None if e["top"] is None else {name(t): _json_logprob(lp) for t, lp in e["top"]})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, entries: list, as_ids: bool | None = None) -> dict:
        name = _token_id_name if as_ids else self.token_text   # return_tokens_as_token_ids: "token_id:<id>"

        def item(token_id, lp):
            text = name(token_id)
            return {"token": text, "logprob": _json_logprob(lp), "bytes": list(text.encode("utf-8"))}
        return {"content": [{**item(e["token_id"], e["logprob"]),
                             "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries]}

    def prompt_logprobs_json(self, entries: list | None) -> list | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {token id: {"logprob", "rank",
        "decoded_token"}} for the token itself and the top alternatives."""
        if entries is None:
            return None
        out = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            ranked = {t: (lp, rank) for rank, (t, lp) in enumerate(e["top"], 1)}
            ranked[e["token_id"]] = (e["logprob"], e["rank"])
            out.append({str(t): {"logprob": _json_logprob(lp), "rank": rank, "decoded_token": self.token_text(t)}
                        for t, (lp, rank) in ranked.items()})
        return out

    def echo_entries(self, prompt_ids: list[int], prompt_logprobs: list | None) -> list:
        """The logprob entries of an echoed prompt: its first token has none; each other token its logprob and
        the top alternatives with itself among them (as vLLM's echo)."""
        entries = [{"token_id": prompt_ids[0], "logprob": None, "top": None}]
        for t, e in zip(prompt_ids[1:], (prompt_logprobs or [None])[1:]):
            top = list(e["top"]) + ([] if any(i == t for i, _ in e["top"]) else [(t, e["logprob"])])
            entries.append({"token_id": t, "logprob": e["logprob"], "top": top})
        return entries

    def continuous_usage(self, body, job: Completions, choice: int, completion_tokens: dict) -> dict | None:
        """stream_options.continuous_usage_stats: each chunk's usage, its choice's tokens so far (as vLLM)."""
        so = body.stream_options
        if not (so and so.include_usage and so.continuous_usage_stats):
            return None
        prompt, done = job.prompt_tokens[choice // job.group_size], completion_tokens.get(choice, 0)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    # ---- endpoints ---------------------------------------------------------------------------------
    def encode_completion_prompt(self, prompt, index: int, add_special_tokens: bool) -> tuple[list[int], str]:
        """(token ids, text): the text is the prompt's, or for token ids their decoding (what echo shows)."""
        ids, text = self.llm.encode_prompt(prompt, index)
        if text is not None and not add_special_tokens:
            ids = self.llm.tokenizer.encode(text, add_special_tokens=False)
        if text is None:
            text = self.llm.tokenizer.decode(ids, skip_special_tokens=False) if self.llm.tokenizer is not None else ""
        return ids, text

    async def completions(self, body: CompletionRequest, http: Request):
        self.check_model(body.model)
        if body.suffix or (body.best_of not in (None, body.n)):
            raise APIError(400, "suffix and best_of (other than n) are not supported",
                           param="suffix" if body.suffix else "best_of")
        # echo with max_tokens 0 scores the prompt alone (lm-eval's loglikelihood): one token is generated and
        # dropped, as vLLM does
        echo_only = body.echo and body.max_tokens == 0
        try:
            encoded = [self.encode_completion_prompt(p, i, body.add_special_tokens)
                       for i, p in enumerate(body.prompts())]
            encoded_len = max(len(ids) for ids, _ in encoded)
            max_tokens = 1 if echo_only else body.max_tokens
            self.check_length(encoded_len, max_tokens)
            params = body.sampling_params(max_tokens, self.max_model_len - encoded_len, body.logprobs,
                                          self.options.max_logprobs, prompt_logprobs=body.echo_prompt_logprobs())
        except ValueError as e:
            raise APIError(400, str(e)) from None
        await self.compile_constraint(params)
        job = Completions(self, [{"prompt_token_ids": ids} for ids, _ in encoded], params, http)
        rid, created = f"cmpl-{http.state.request_id}", int(time.time())
        as_ids = body.return_tokens_as_token_ids

        def chunk(choices, usage=None):
            out = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": choices}
            if usage is not None:
                out["usage"] = usage
            return out

        def choice_json(index: int, c: CompletionOutput, first: bool, offset: int) -> dict:
            """A choice (whole, or a streamed delta; `first`: its first, which carries the echoed prompt)."""
            if echo_only:
                c = CompletionOutput(c.index, "", [], c.finish_reason, [] if c.logprobs is not None else None)
            prompt_ids, prompt_text = encoded[index // job.group_size]
            text, entries = c.text, _with_ids(c) if c.logprobs is not None else None
            if body.echo and first:
                text = prompt_text + text
                if entries is not None:
                    entries = self.echo_entries(prompt_ids, job.prompt_logprobs.get(index // job.group_size)) + entries
            out = {"index": index, "text": text, "finish_reason": c.finish_reason,
                   "logprobs": self.completion_logprobs(entries, offset, as_ids) if entries is not None else None}
            if first and body.prompt_logprobs is not None:
                out["prompt_logprobs"] = self.prompt_logprobs_json(job.prompt_logprobs.get(index // job.group_size))
            if body.return_token_ids:
                out["token_ids"] = c.token_ids
                if first:
                    out["prompt_token_ids"] = prompt_ids
            return out

        if body.stream:
            async def events():
                completion_tokens, offsets = {}, {}
                async for choice, c in job.deltas():
                    if not (c.text or c.finished or c.token_ids):
                        continue
                    tokens = 0 if echo_only else len(c.token_ids)
                    completion_tokens[choice] = completion_tokens.get(choice, 0) + tokens
                    out = choice_json(choice, c, choice not in offsets, offsets.get(choice, 0))
                    offsets[choice] = offsets.get(choice, 0) + len(out["text"])
                    yield _sse(chunk([out], self.continuous_usage(body, job, choice, completion_tokens)))
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse(chunk([], job.usage(sum(completion_tokens.values()))))
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        results = await _collect(job)
        choices = [choice_json(i, c, True, 0) for i, c in sorted(results.items())]
        return chunk(choices, job.usage(0 if echo_only else sum(len(c.token_ids) for c in results.values())))

    async def chat_completions(self, body: ChatCompletionRequest, http: Request):
        self.check_model(body.model)
        if self.llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it has no chat template")
        try:
            plan = plan_tools(body.tool_dicts(), body.tool_choice_value(), body.parallel_tool_calls,
                              self.options.auto_tool_parser)
            if plan.constraint is not None and body.structured() is not None:
                raise ValueError(f"tool_choice {plan.choice!r} constrains the output to tool calls; it cannot also "
                                 "be constrained by response_format / structured_outputs")
            conversation = body.conversation()
            prompt_ids, _ = self.llm.encode_prompt(conversation, 0,
                                                   body.chat_options(self.options.chat_template, plan.tools))
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            self.check_length(len(prompt_ids), max_tokens)
            params = body.sampling_params(max_tokens, self.max_model_len - len(prompt_ids), logprobs,
                                          self.options.max_logprobs, prompt_logprobs=body.echo_prompt_logprobs(),
                                          structured=plan.constraint, skip_special_tokens=plan.skip_special_tokens,
                                          logprobs_field="top_logprobs")
        except ValueError as e:
            raise APIError(400, str(e)) from None
        await self.compile_constraint(params)
        job = Completions(self, [{"prompt_token_ids": prompt_ids}], params, http)
        rid, created = f"chatcmpl-{http.state.request_id}", int(time.time())
        as_ids = body.return_tokens_as_token_ids
        last = conversation[-1]
        # echo: the answer begins with the last message, when it is the assistant's (the one being continued)
        echoed = last["content"] if body.echo and last["role"] == "assistant" and last["content"] else ""

        def chunk(obj, choices, usage=None):
            out = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if usage is not None:
                out["usage"] = usage
            return out

        if body.stream:
            async def events():
                completion_tokens: dict[int, int] = {}
                answers = [ToolAnswer(plan) for _ in range(params.n)]
                for i in range(params.n):
                    first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}
                    yield _sse(chunk("chat.completion.chunk", [first]))
                    if echoed:
                        yield _sse(chunk("chat.completion.chunk", [{"index": i, "delta": {"content": echoed},
                                                                    "logprobs": None, "finish_reason": None}]))
                async for choice, c in job.deltas():
                    if not (c.text or c.finished or c.token_ids):
                        continue
                    completion_tokens[choice] = completion_tokens.get(choice, 0) + len(c.token_ids)
                    lp = self.chat_logprobs(_with_ids(c), as_ids) if c.logprobs is not None else None
                    deltas, finish = answers[choice].deltas(c.text, c.finish_reason)
                    for out in _stream_choices(choice, deltas, finish, lp, bool(body.return_token_ids and c.token_ids)):
                        if body.return_token_ids:
                            out["token_ids"] = c.token_ids
                            c = dataclasses.replace(c, token_ids=[])   # a delta's tokens go with its first chunk
                        yield _sse(chunk("chat.completion.chunk", [out],
                                         self.continuous_usage(body, job, choice, completion_tokens)))
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse(chunk("chat.completion.chunk", [], job.usage(sum(completion_tokens.values()))))
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        results = await _collect(job)
        choices = []
        for i, c in sorted(results.items()):
            message, finish = ToolAnswer(plan).message(c.text, c.finish_reason)
            if echoed:
                message["content"] = echoed + (message["content"] or "")
            choice = {"index": i, "message": message, "finish_reason": finish,
                      "logprobs": self.chat_logprobs(_with_ids(c), as_ids) if c.logprobs is not None else None}
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        out = chunk("chat.completion", choices, job.usage(sum(len(c.token_ids) for c in results.values())))
        if params.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs_json(job.prompt_logprobs.get(0))
        if body.return_token_ids:
            out["prompt_token_ids"] = prompt_ids
        return out


def _stream_choices(index: int, deltas: list[dict], finish_reason: str | None, logprobs, has_tokens: bool
                    ) -> list[dict]:
    """The streamed choices of one engine delta: one per chat delta, the logprobs on the first and the finish
    reason on the last (an empty delta when there is nothing else to carry them, or token ids to send)."""
    if not deltas:
        deltas = [{}] if (finish_reason is not None or logprobs is not None or has_tokens) else []
    return [{"index": index, "delta": d, "logprobs": logprobs if j == 0 else None,
             "finish_reason": finish_reason if j == len(deltas) - 1 else None} for j, d in enumerate(deltas)]


def _token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def _with_ids(c) -> list:
    """The completion's logprob entries, each with the token id it belongs to."""
    return [{**e, "token_id": t} for e, t in zip(c.logprobs, c.token_ids)]


def _json_logprob(lp: float) -> float:
    """A logprob as JSON can carry it: processed logprobs are -inf for tokens the sampling masked (top-k beyond its
    k), which JSON has no number for; -9999.0 in their place, as vLLM's server writes them."""
    return max(lp, -9999.0)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _collect(job: Completions) -> dict:
    """The whole completions: choice -> CompletionOutput with the deltas joined."""
    results: dict[int, CompletionOutput] = {}
    async for choice, c in job.deltas():
        acc = results.setdefault(choice, CompletionOutput(c.index, "", [], None, [] if c.logprobs is not None else None))
        acc.text += c.text
        acc.token_ids += c.token_ids
        if c.logprobs is not None:
            acc.logprobs += c.logprobs
        acc.finish_reason, acc.metrics = c.finish_reason, c.metrics
    if job.client_gone:   # nobody reads the answer (the server drops what is sent on a closed connection)
        raise APIError(499, "the client closed the connection before the completions ended", "ClientClosedRequest")
    return results


def build_app(llm, model_name: str, api_key: str | None = None, http_options: HTTPOptions | None = None,
              options: ServeOptions | None = None) -> FastAPI:
    """The ASGI app. The engine loop starts with the app and stops with it (the constraint compile processes
    too). `http_options`: the API key, CORS, /metrics' protection (jaxspec/serve/http.py); `api_key` overrides
    its key. `options`: how requests are answered (chat template, logprobs limit, automatic tool calling)."""
    http = http_options or HTTPOptions()
    if api_key is not None:
        http = dataclasses.replace(http, api_key=api_key)
    server = Server(llm, model_name, http.api_key, options)

    @asynccontextmanager
    async def lifespan(app):
        llm.engine.start()
        try:
            yield
        finally:
            llm.engine.stop_compiling()
            llm.engine.stop()

    app = FastAPI(title="jaxspec", lifespan=lifespan)
    app.state.server = server
    install(app, server, http)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, e: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'][1:]) or 'body'}: {err['msg']}"
                             for err in e.errors()[:5])
        return error_response(400, f"invalid request body: {problems}", "BadRequestError")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "NotFoundError" if e.status_code == 404 else "Error")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if llm.engine.failure is not None:   # the engine loop died: every request would be refused
            return error_response(503, f"the engine loop stopped: {llm.engine.failure!r}", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        from jaxspec import __version__
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server.check_model(model_id)
        return server.model_card()

    @app.post("/tokenize")
    async def tokenize_text(request: Request):
        body = await _json_body(request)
        server.check_model(body.get("model") if isinstance(body, dict) else None)
        try:
            return tokenize.tokenize(llm, server.max_model_len, body)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    @app.post("/detokenize")
    async def detokenize_ids(request: Request):
        body = await _json_body(request)
        server.check_model(body.get("model") if isinstance(body, dict) else None)
        try:
            return tokenize.detokenize(llm, body)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat_completions(body, request)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _json_body(request: Request):
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise APIError(400, f"the request body is not JSON: {e}") from None
