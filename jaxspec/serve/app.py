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
from jaxspec.serve.protocol import ChatCompletionRequest, CompletionRequest
from jaxspec.structured.compile_pool import CompileUnavailable

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
    def __init__(self, llm, model_name: str, api_key: str | None = None):
        self.llm, self.model_name, self.api_key = llm, model_name, api_key
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
        self.llm.engine.intake.stop_compiling()
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

    def completion_logprobs(self, entries: list, offset: int) -> dict:
        """OpenAI's completions logprobs: tokens, their logprobs, the top alternatives, text offsets."""
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            text = self.token_text(e["token_id"])
            tokens.append(text)
            lps.append(_json_logprob(e["logprob"]))
            tops.append({self.token_text(t): _json_logprob(lp) for t, lp in e["top"]})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, entries: list) -> dict:
        def item(token_id, lp):
            text = self.token_text(token_id)
            return {"token": text, "logprob": _json_logprob(lp), "bytes": list(text.encode("utf-8"))}
        return {"content": [{**item(e["token_id"], e["logprob"]),
                             "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries]}

    # ---- endpoints ---------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: Request):
        self.check_model(body.model)
        if body.echo or body.suffix or (body.best_of not in (None, body.n)):
            raise APIError(400, "echo, suffix and best_of are not supported", param="echo")
        try:
            prompts = body.prompts()
            encoded_len = max(len(self.llm.encode_prompt(p)[0]) for p in prompts)
            self.check_length(encoded_len, body.max_tokens)
            params = body.sampling_params(body.max_tokens, self.max_model_len - encoded_len, body.logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        await self.compile_constraint(params)
        job = Completions(self, prompts, params, http)
        rid, created = f"cmpl-{http.state.request_id}", int(time.time())

        def chunk(choices, usage=None):
            out = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": choices}
            if usage is not None:
                out["usage"] = usage
            return out

        if body.stream:
            async def events():
                completion_tokens, offsets = 0, {}
                async for choice, c in job.deltas():
                    completion_tokens += len(c.token_ids)
                    lp = None
                    if c.logprobs is not None:
                        lp = self.completion_logprobs(_with_ids(c), offsets.get(choice, 0))
                    offsets[choice] = offsets.get(choice, 0) + len(c.text)
                    if c.text or c.finished or c.token_ids:
                        yield _sse(chunk([{"index": choice, "text": c.text, "logprobs": lp,
                                           "finish_reason": c.finish_reason}]))
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse(chunk([], job.usage(completion_tokens)))
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        results = await _collect(job)
        choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                    "logprobs": self.completion_logprobs(_with_ids(c), 0) if c.logprobs is not None else None}
                   for i, c in sorted(results.items())]
        return chunk(choices, job.usage(sum(len(c.token_ids) for c in results.values())))

    async def chat_completions(self, body: ChatCompletionRequest, http: Request):
        self.check_model(body.model)
        if self.llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it has no chat template")
        try:
            conversation = body.conversation()
            prompt_len = len(self.llm.encode_prompt(conversation)[0])
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            self.check_length(prompt_len, max_tokens)
            params = body.sampling_params(max_tokens, self.max_model_len - prompt_len, logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        await self.compile_constraint(params)
        job = Completions(self, [conversation], params, http)
        rid, created = f"chatcmpl-{http.state.request_id}", int(time.time())

        def chunk(obj, choices, usage=None):
            out = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if usage is not None:
                out["usage"] = usage
            return out

        if body.stream:
            async def events():
                completion_tokens = 0
                for i in range(params.n):
                    yield _sse(chunk("chat.completion.chunk", [{"index": i, "delta": {"role": "assistant",
                                                                                       "content": ""},
                                                                "logprobs": None, "finish_reason": None}]))
                async for choice, c in job.deltas():
                    completion_tokens += len(c.token_ids)
                    if not (c.text or c.finished or c.token_ids):
                        continue
                    lp = self.chat_logprobs(_with_ids(c)) if c.logprobs is not None else None
                    yield _sse(chunk("chat.completion.chunk", [{"index": choice, "delta": {"content": c.text}
                                                                if c.text else {}, "logprobs": lp,
                                                                "finish_reason": c.finish_reason}]))
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse(chunk("chat.completion.chunk", [], job.usage(completion_tokens)))
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        results = await _collect(job)
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                    "logprobs": self.chat_logprobs(_with_ids(c)) if c.logprobs is not None else None}
                   for i, c in sorted(results.items())]
        return chunk("chat.completion", choices, job.usage(sum(len(c.token_ids) for c in results.values())))


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


def build_app(llm, model_name: str, api_key: str | None = None, http_options: HTTPOptions | None = None) -> FastAPI:
    """The ASGI app. The engine loop starts with the app and stops with it (the constraint compile processes
    too). `http_options`: the API key, CORS, /metrics' protection (jaxspec/serve/http.py); `api_key` overrides
    its key."""
    options = http_options or HTTPOptions()
    if api_key is not None:
        options = dataclasses.replace(options, api_key=api_key)
    server = Server(llm, model_name, options.api_key)

    @asynccontextmanager
    async def lifespan(app):
        llm.engine.start()
        try:
            yield
        finally:
            llm.engine.intake.stop_compiling()
            llm.engine.stop()

    app = FastAPI(title="jaxspec", lifespan=lifespan)
    app.state.server = server
    install(app, server, options)

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
