"""The server's HTTP options and the ASGI middleware that applies them around the FastAPI app: the API key, the
X-Request-Id header, refusing new requests while the server shuts down, and CORS (starlette's middleware).

Pure ASGI middleware rather than FastAPI's `@app.middleware("http")`: that one runs the endpoint in a task of its
own and passes its response through a memory stream, which keeps a handler from seeing its client go away.
"""
from __future__ import annotations

import dataclasses
import json
import secrets
import uuid

from starlette.middleware.cors import CORSMiddleware

# Open with an API key set, as in vLLM (which guards /v1/* only): liveness, the version and Prometheus's scrape.
# Every other endpoint (/v1/*, /tokenize, /detokenize, /docs, ...) needs the key.
OPEN_PATHS = ("/health", "/version", "/metrics")


@dataclasses.dataclass
class HTTPOptions:
    """What `jaxspec serve`'s HTTP flags set (vLLM's names)."""
    api_key: str | None = None
    protect_metrics: bool = False           # /metrics needs the API key too
    allowed_origins: tuple[str, ...] = ()   # CORS: origins a browser page may call from ("*": any); none: no CORS
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    shutdown_timeout: float = 0.0           # seconds running requests may finish after SIGTERM before they abort

    def open_paths(self) -> tuple[str, ...]:
        return tuple(p for p in OPEN_PATHS if not (self.protect_metrics and p == "/metrics"))


def install(app, server, options: HTTPOptions):
    """Adds the middleware to the FastAPI app. Outermost first: CORS (so that a browser can read even a 401), the
    request id, the shutdown gate, the API key (starlette runs the middleware added last outermost)."""
    if options.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=options.api_key, open_paths=options.open_paths())
    app.add_middleware(ShutdownGate, server=server)
    app.add_middleware(RequestIdMiddleware)
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=list(options.allowed_methods), allow_headers=list(options.allowed_headers),
                           allow_credentials=options.allow_credentials)


async def send_error(send, status: int, message: str, type_: str):
    """An OpenAI-style error body (see errors.error_response) straight from ASGI."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Every path but `open_paths` needs 'Authorization: Bearer <key>' (compared in constant time)."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...]):
        self.app, self.expected, self.open_paths = app, f"Bearer {api_key}".encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not secrets.compare_digest(given, self.expected):
            return await send_error(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                    "AuthenticationError")
        return await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Each response carries X-Request-Id: the request's own, or a new one when it sent none. The handler finds it
    in `request.state.request_id` (the completions' ids are made from it, as vLLM's are)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given.decode("latin-1") if given else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)
        return await self.app(scope, receive, send_with_id)


class ShutdownGate:
    """After SIGTERM (server.draining) a new request is refused with 503, /metrics excepted: requests already
    running go on (for the grace period), new ones go to another replica."""

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.server.draining and scope["path"] != "/metrics":
            return await send_error(send, 503, "the server is shutting down; send the request to another replica",
                                    "ServiceUnavailableError")
        return await self.app(scope, receive, send)
