"""An OpenAI-compatible HTTP server over one `LLM`: /v1/completions, /v1/chat/completions (server-sent events
with `stream: true`), /v1/models (and /v1/models/{id}), /tokenize, /detokenize, /version, /health and /metrics.

The engine loop runs on its own thread (`Engine.start`) and batches every client's requests; each HTTP request
queues its completions with an output sink that hands the engine's deltas to the event loop. A client that
disconnects, streamed or not, aborts its completions at once (the engine drops them at its next step and their
blocks return to the pool). On SIGTERM (`Server.drain`, from jaxspec/serve/lifecycle.py) new requests are
refused, running ones get the grace period (--shutdown-timeout) and are then aborted. Errors use OpenAI's body:
{"error": {"message", "type", "param", "code"}} (jaxspec/serve/errors.py). The API key, CORS and X-Request-Id:
jaxspec/serve/http.py.

Here: the app, its routes and the `Server` they share. The endpoints: serving_completion.py (/v1/completions),
serving_chat.py (/v1/chat/completions), what both share (serving_common.py), tokenize.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxspec.serve import tokenize
from jaxspec.serve.errors import APIError, error_response, install_error_handlers
from jaxspec.serve.http import HTTPOptions, install
from jaxspec.serve.metrics import ServerMetrics
from jaxspec.serve.options import ServeOptions
from jaxspec.serve.protocol import ChatCompletionRequest, CompletionRequest
from jaxspec.serve.serving_chat import create_chat_completion
from jaxspec.serve.serving_common import Completions, LogprobJSON
from jaxspec.serve.serving_completion import create_completion
from jaxspec.structured.compile_pool import CompileUnavailable

# While the server drains (SIGTERM), how often it looks whether the running requests have ended.
DRAIN_POLL_SECONDS = 0.05
# After the grace period, how long aborted requests may take to send their last response.
ABORT_WAIT_SECONDS = 5.0


class Server:
    """What the endpoints share: the LLM, the served model's name and limits, the request options, the metrics and
    the HTTP requests whose completions run (shutdown waits for them)."""

    def __init__(self, llm, model_name: str, api_key: str | None = None, options: ServeOptions | None = None):
        self.llm, self.model_name, self.api_key = llm, model_name, api_key
        self.options = options or ServeOptions()
        self.metrics = ServerMetrics(llm.engine, model_name)
        self.max_model_len = llm.engine.step_config.max_model_len
        self.created = int(time.time())
        self.logprobs = LogprobJSON(llm.tokenizer)   # how responses write logprobs and name tokens
        self.jobs: set[Completions] = set()   # HTTP requests whose completions run
        self.draining = False     # shutting down: new HTTP requests are refused (http.ShutdownGate)
        self.accepting = True     # False once the grace period is over: nothing more enters the engine
        # LoRA adapters served by name (--lora-modules, /v1/load_lora_adapter): a request's `model` picks one
        self.lora_modules: dict = {}
        self._lora_ids = itertools.count(1)
        for name, path in self.options.lora_modules:
            self.add_lora(name, path)

    def add_lora(self, name: str, path: str):
        """Serves the adapter at `path` as `name` (read and checked now: a bad one is a ValueError)."""
        from jaxspec.lora import LoRARequest
        from jaxspec.lora.peft import load_adapter
        if self.llm.engine.adapters is None:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        if name == self.model_name or name in self.lora_modules:
            raise ValueError(f"the name {name!r} is taken; give the adapter another")
        adapters = self.llm.engine.adapters
        load_adapter(path, self.llm.model.config, adapters.max_rank)   # refused here, not at its first request
        self.lora_modules[name] = LoRARequest(name, next(self._lora_ids), path)

    def remove_lora(self, name: str):
        if name not in self.lora_modules:
            raise ValueError(f"no adapter named {name!r} is served; served: {sorted(self.lora_modules)}")
        self.llm.engine.adapters.remove(name)   # refused while requests run with it or wait for it
        del self.lora_modules[name]

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

    def model_card(self, name: str | None = None) -> dict:
        """The served model's card, or the adapter `name`'s (its `parent` the base model, its `root` its path)."""
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "jaxspec",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}
        if name is not None and name != self.model_name:
            card.update(id=name, root=self.lora_modules[name].lora_path, parent=self.model_name)
        return card

    def check_model(self, model: str | None):
        """The LoRARequest a request's `model` names (None: the base model); an unknown name is a 404."""
        if model is None or model == self.model_name:
            return None
        if model in self.lora_modules:
            return self.lora_modules[model]
        served = ", ".join(f"`{n}`" for n in [self.model_name, *self.lora_modules])
        raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.", "NotFoundError",
                       "model")

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


def build_app(llm, model_name: str, api_key: str | None = None, http_options: HTTPOptions | None = None,
              options: ServeOptions | None = None) -> FastAPI:
    """The ASGI app. The engine loop starts with the app and stops with it (the constraint compile processes
    too). `http_options`: the API key, CORS, /metrics' protection (jaxspec/serve/http.py); `api_key` overrides
    its key. `options`: how requests are answered (chat template, logprobs limit, automatic tool calling)."""
    http = http_options or HTTPOptions()
    if api_key is not None:
        http = dataclasses.replace(http, api_key=api_key)
    server = Server(llm, model_name, http.api_key, options)
    app = FastAPI(title="jaxspec", lifespan=_engine_lifespan(llm))
    app.state.server = server
    install(app, server, http)
    install_error_handlers(app)
    _add_info_routes(app, server)
    _add_tokenizer_routes(app, server)
    _add_completion_routes(app, server)
    _add_metrics_route(app, server)
    return app


def _engine_lifespan(llm):
    """The app's lifespan: the engine loop runs while the app does; the constraint compiles stop with it."""
    @asynccontextmanager
    async def lifespan(app):
        llm.engine.start()
        try:
            yield
        finally:
            llm.engine.stop_compiling()
            llm.engine.stop()
    return lifespan


def _add_info_routes(app: FastAPI, server: Server):
    """/health, /version, /v1/models and /v1/models/{id}."""
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        failure = server.llm.engine.failure
        if failure is not None:   # the engine loop died: every request would be refused
            return error_response(503, f"the engine loop stopped: {failure!r}", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        from jaxspec import __version__
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card(name) for name in [None, *server.lora_modules]]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server.check_model(model_id)
        return server.model_card(model_id)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await _json_body(request)
        name, path = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(path, str):
            raise APIError(400, "give lora_name and lora_path (a PEFT adapter directory on the server)")
        try:
            await asyncio.to_thread(server.add_lora, name, path)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await _json_body(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise APIError(400, "give lora_name")
        try:
            server.remove_lora(name)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")


def _add_tokenizer_routes(app: FastAPI, server: Server):
    """/tokenize and /detokenize (jaxspec/serve/tokenize.py)."""
    @app.post("/tokenize")
    async def tokenize_text(request: Request):
        return await _tokenizer_request(server, request,
                                        lambda body: tokenize.tokenize(server.llm, server.max_model_len, body))

    @app.post("/detokenize")
    async def detokenize_ids(request: Request):
        return await _tokenizer_request(server, request, lambda body: tokenize.detokenize(server.llm, body))


async def _tokenizer_request(server: Server, request: Request, answer):
    """`answer`'s reply to the request's JSON body, for the served model; a ValueError it raises is a 400."""
    body = await _json_body(request)
    server.check_model(body.get("model") if isinstance(body, dict) else None)
    try:
        return answer(body)
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def _json_body(request: Request):
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise APIError(400, f"the request body is not JSON: {e}") from None


def _add_completion_routes(app: FastAPI, server: Server):
    """/v1/completions (serving_completion.py) and /v1/chat/completions (serving_chat.py)."""
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(server, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(server, body, request)


def _add_metrics_route(app: FastAPI, server: Server):
    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)
