"""Data-parallel serving on Ray Serve: N replicas of jaxspec's server, each its own engine on its own GPUs (a
tensor-parallel group of `tensor_parallel_size` devices), behind one OpenAI-compatible HTTP ingress.

The application has Ray Serve LLM's shape, two deployments:
- `JaxspecServer`, `num_replicas` of them: each loads the model, starts its engine and serves jaxspec's own ASGI
  app (`build_app`: every endpoint, field, error and metric of `jaxspec serve`) in-process. Per-replica resources
  are `ray_actor_options` (default `{"num_gpus": tensor_parallel_size}`; Ray gives the replica those GPUs through
  CUDA_VISIBLE_DEVICES, and its engine uses them all). Its health check is the engine's: a replica whose engine
  loop died is replaced by Serve.
- `JaxspecIngress` (`num_ingress_replicas` of them, by default as many as the servers): takes the HTTP requests
  and hands each to a replica through a deployment handle, so that the replica is chosen by Ray Serve's request
  router. With `prefix_affinity` (the default) that is Ray Serve LLM's
  `PrefixCacheAffinityRouter`: requests whose prompt (or chat messages) share a prefix go to the replica that saw
  it, whose prefix cache holds its KV; when nothing matches, to the replica with the least cached text. Without
  it, or where the installed Ray has no such router, Ray Serve's default power-of-two-choices router.

A stream's first chunk goes to the ingress at once; after it, what the app writes is sent at most once per
`stream_batching_interval_ms` (50 ms, as Ray Serve LLM), in one chunk: each chunk is a Ray object the ingress takes
in turn, and one per token held two H100s to the throughput of one (docs/performance.md, "Ray Serve").

Each response carries `x-jaxspec-replica` (the replica that answered). A replica that dies while a request runs:
a request nothing was sent for yet (a whole, non-streamed answer; a stream before its first byte) is sent again to
another replica (ATTEMPTS tries in all); a stream already under way ends with an error event (`data: {"error":
...}`, as vLLM's server ends a failed stream) and no `[DONE]`. The others keep serving; Serve starts a replacement.

/metrics is every replica's, as vLLM's data-parallel engines export theirs: each replica sends its metrics (vLLM's
names beside jaxspec's, jaxspec/serve/metrics.py) to a third deployment, `JaxspecMetricsBoard`, every
`metrics_interval_s` (2 s); a GET /metrics is first answered by one replica (so its key check applies) and then
carries every live replica's samples, replica i's labelled `engine="i"`.

On shutdown (or a replica's removal) Serve lets a replica's running requests finish for the HTTP options'
`shutdown_timeout` (`--shutdown-timeout`; Serve's graceful_shutdown_timeout_s), then stops it.

Run it: `python -m jaxspec.serve.ray MODEL --num-replicas 2 ...` (the flags of `jaxspec serve`), or from Python:
`serve.run(build_app(MODEL, num_replicas=2, ...), route_prefix="/")`. Needs `pip install 'jaxspec[ray]'`.
"""

import asyncio
import dataclasses
import inspect
import json
import logging
import sys
import threading
import time
from fastapi import FastAPI, Request

try:
    from ray import serve
except ImportError as e:   # pragma: no cover
    raise ImportError("jaxspec.serve.ray needs Ray Serve: pip install 'jaxspec[ray]'") from e

log = logging.getLogger("jaxspec.serve.ray")

REPLICA_HEADER = "x-jaxspec-replica"
# Ray Serve LLM's prefix-aware router: its public name (needs `ray[llm]`'s packages), then where it lives.
PREFIX_ROUTERS = ("ray.serve.llm.request_router:PrefixCacheAffinityRouter",
                  "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter")
# Requests one replica accepts at once (Ray Serve's max_ongoing_requests): what the engine does not run yet waits in
# its own queue (vllm:num_requests_waiting), where the routers read it.
DEFAULT_MAX_ONGOING_REQUESTS = 256
INGRESS_MAX_ONGOING_REQUESTS = 4096
# Tries of a request whose replica dies before it answers (each on a replica the router still thinks alive).
ATTEMPTS = 3
# A stream's chunks after its first are sent at most once per this interval, each carrying what the app wrote since
# the last (Ray Serve LLM's stream_batching_interval_ms, same default). Every chunk is one Ray object the ingress
# takes in turn: one per token capped a deployment near 2,000 tokens/s on an H100 pair, whatever the replicas.
DEFAULT_STREAM_BATCHING_INTERVAL_MS = 50
# Each replica sends its /metrics to the board this often; a replica silent for three intervals has left it.
DEFAULT_METRICS_INTERVAL_S = 2.0
HTTP_METHODS = ["GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH"]


@dataclasses.dataclass
class ForwardedRequest:
    """An HTTP request as the ingress hands it to a replica. `prompt` is the text the prefix-aware router matches
    (`routed_prompt`)."""
    method: str
    path: str
    query_string: bytes
    headers: list
    body: bytes
    prompt: str = ""


def routed_prompt(path: str, body: bytes) -> str:
    """The text a request's replica is chosen by: /v1/completions' prompt (the first of a batch; token ids as
    text, so that a shared prefix of ids is one of the text), /v1/chat/completions' messages' text, joined; ""
    for anything else."""
    if not body or path.rstrip("/") not in ("/v1/completions", "/v1/chat/completions"):
        return ""
    try:
        fields = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(fields, dict):
        return ""
    if path.rstrip("/").endswith("chat/completions"):
        messages = fields.get("messages")
        return "".join(_text(m.get("content")) for m in messages if isinstance(m, dict)) \
            if isinstance(messages, list) else ""
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return "".join(f"{t}," for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def _text(content) -> str:
    """A chat message's content as text: a string, or its parts' text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prefix_router():
    """Ray Serve LLM's PrefixCacheAffinityRouter class as `request_router_class` takes it (an import path), or
    None where the installed Ray has none."""
    import importlib
    for path in PREFIX_ROUTERS:
        module, name = path.split(":")
        try:
            getattr(importlib.import_module(module), name)
            return path
        except (ImportError, AttributeError):
            continue
    return None


class JaxspecMetricsBoard:
    """Every replica's latest /metrics text, as each replica sends it every `interval_s`; `exposition()` merges
    those of the live replicas (jaxspec/serve/metrics.py's merge_expositions: replica i's samples carry
    `engine="i"`, replicas in the order of their ids)."""

    def __init__(self, interval_s: float = DEFAULT_METRICS_INTERVAL_S):
        self.interval_s = interval_s
        self.latest: dict[str, tuple[float, str]] = {}   # replica id -> (when it arrived, its text)

    def publish(self, replica: str, text: str):
        self.latest[replica] = (time.monotonic(), text)

    def exposition(self) -> str:
        from jaxspec.serve.metrics import merge_expositions
        now = time.monotonic()
        self.latest = {r: v for r, v in self.latest.items() if now - v[0] <= 3 * self.interval_s}
        return merge_expositions([self.latest[r][1] for r in sorted(self.latest)])


class JaxspecServer:
    """One replica: an engine and jaxspec's app over it (see the module's docstring)."""

    def __init__(self, model, served_model_name: str, llm_kwargs: dict, http_options=None, options=None,
                 random_weights: bool = False, stream_batching_interval_ms: float = DEFAULT_STREAM_BATCHING_INTERVAL_MS,
                 board=None, metrics_interval_s: float = DEFAULT_METRICS_INTERVAL_S):
        from jaxspec.llm import LLM
        from jaxspec.serve.app import build_app
        if random_weights:
            from jaxspec.models.weights import resolve_dtype
            from jaxspec.models.random import random_model
            model = random_model(model, dtype=resolve_dtype(llm_kwargs.get("dtype", "auto")),
                                 seed=llm_kwargs.get("seed", 0))
        self.llm = LLM(model, **llm_kwargs)
        self.app = build_app(self.llm, served_model_name, http_options=http_options, options=options)
        self.replica = _replica_id()
        self.batching_interval = stream_batching_interval_ms / 1e3
        self.running: set[asyncio.Task] = set()
        self.llm.engine.start()   # what the app's lifespan does: the replica is the app's server
        self.stopped = threading.Event()
        if board is not None:
            threading.Thread(target=self._publish_metrics, args=(board, metrics_interval_s), daemon=True,
                             name="jaxspec-metrics").start()

    def _publish_metrics(self, board, interval_s: float):
        """Sends this replica's /metrics text to the board every interval until the replica stops."""
        from prometheus_client import generate_latest
        registry = self.app.state.server.metrics.registry
        while True:
            try:
                board.publish.remote(self.replica, generate_latest(registry).decode()).result(
                    timeout_s=max(5.0, interval_s))
            except Exception as e:   # the board restarting: the next interval tries again
                log.warning("replica %s could not send its metrics: %s", self.replica, e)
            if self.stopped.wait(interval_s):
                return

    def replica_id(self) -> str:
        return self.replica

    def check_health(self):
        """Ray Serve's periodic health check: a replica whose engine loop stopped is replaced."""
        if self.llm.engine.failure is not None:
            raise RuntimeError(f"replica {self.replica}: the engine loop stopped: {self.llm.engine.failure!r}")

    def __del__(self):
        try:
            self.stopped.set()
            self.llm.engine.stop_compiling()
            self.llm.engine.stop()
        except Exception:   # shutting down: nothing left to tell
            pass

    async def serve_request(self, request: ForwardedRequest):
        """Runs the request through the app. Yields ("start", status, headers), then the body's chunks. Closed
        early (the ingress's client left, or the ingress itself), the app is told its client disconnected: it
        aborts the request's completions at once."""
        gone = asyncio.Event()
        sent: asyncio.Queue = asyncio.Queue()
        body_read = False

        async def receive():
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await sent.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": request.method, "scheme": "http", "path": request.path,
                 "raw_path": request.path.encode(), "query_string": request.query_string, "root_path": "",
                 "headers": [(bytes(k), bytes(v)) for k, v in request.headers], "client": None,
                 "server": None, "state": {}}
        finished = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self._run(scope, receive, send, sent, finished))
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        loop = asyncio.get_running_loop()
        last_chunk = None   # when the last body chunk went: the first goes at once (time to first token)
        try:
            while True:
                message = await sent.get()
                if message is None:
                    return
                if message["type"] == "http.response.start":
                    headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
                    headers.append((REPLICA_HEADER.encode(), self.replica.encode()))
                    yield ("start", message["status"], headers)
                    continue
                if message["type"] != "http.response.body":
                    continue
                parts, ended = [message.get("body", b"")], not message.get("more_body", False)
                if not ended and last_chunk is not None and self.batching_interval > 0:
                    wait = last_chunk + self.batching_interval - loop.time()
                    if wait > 0:   # until the interval is up, or the app has written all it will
                        try:
                            await asyncio.wait_for(finished.wait(), wait)
                        except asyncio.TimeoutError:
                            pass
                    while not ended and not sent.empty():   # what the app wrote meanwhile, in one chunk
                        message = sent.get_nowait()
                        if message is None:
                            ended = True
                        elif message["type"] == "http.response.body":
                            parts.append(message.get("body", b""))
                            ended = not message.get("more_body", False)
                body = b"".join(parts)
                if body:
                    yield body
                    last_chunk = loop.time()
                if ended:
                    return
        finally:
            gone.set()

    async def _run(self, scope, receive, send, sent: asyncio.Queue, finished: asyncio.Event):
        try:
            await self.app(scope, receive, send)
        finally:
            await sent.put(None)
            finished.set()


class JaxspecIngressBase:
    """The HTTP side: each request to a replica through the server deployment's handle (its router picks it)."""

    def __init__(self, server, board=None):
        self.server = server.options(stream=True)
        self.board = board

    async def forward(self, request):
        from fastapi.responses import JSONResponse, Response, StreamingResponse
        from ray.exceptions import ActorUnavailableError, RayActorError
        body = await request.body()
        forwarded = ForwardedRequest(request.method, request.url.path, request.url.query.encode(),
                                     list(request.headers.raw), body, routed_prompt(request.url.path, body))
        for attempt in range(1, ATTEMPTS + 1):   # a replica that dies before answering: again, on another
            # the prefix-aware router matches a positional argument's `prompt`; a request without one goes as a
            # keyword (that router needs some text: the others go by queue length alone)
            chunks = (self.server.serve_request.remote(forwarded) if forwarded.prompt else
                      self.server.serve_request.remote(request=forwarded))
            try:
                start = await chunks.__anext__()
                break
            except (RayActorError, ActorUnavailableError) as e:
                chunks.cancel()
                if attempt == ATTEMPTS:
                    return JSONResponse(_error(503, f"the replicas serving the request failed, {ATTEMPTS} times: {e}"),
                                        status_code=503)
                log.warning("a replica failed before answering (%s); sending the request to another", e)
            except StopAsyncIteration:
                return JSONResponse(_error(502, "the replica ended the request without a response"), 502)
            except BaseException:
                chunks.cancel()
                raise
        _, status, headers = start
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        media = dict((k.lower(), v) for k, v in headers).get("content-type", "")
        # (Serve's proxy sets its own x-request-id: the one the app was given and echoed)
        headers = [(k, v) for k, v in headers if k.lower() not in ("content-length", "transfer-encoding",
                                                                   "x-request-id")]

        async def body_chunks():
            try:
                async for chunk in chunks:
                    yield chunk
            except (RayActorError, ActorUnavailableError) as e:
                log.warning("a replica failed mid-response: %s", e)
                if media.startswith("text/event-stream"):
                    yield f"data: {json.dumps(_error(503, f'the replica serving the stream failed: {e}'))}\n\n"
            finally:
                chunks.cancel()

        if request.method == "HEAD":
            chunks.cancel()
            return Response(status_code=status, headers=dict(headers))
        if self.board is not None and request.method == "GET" and request.url.path == "/metrics" and status == 200:
            # the replica answered (and checked the key where /metrics is protected): every replica's metrics
            chunks.cancel()
            text = await self.board.exposition.remote()
            headers = [(k, v) for k, v in headers if k.lower() != REPLICA_HEADER]
            return Response(text, status_code=200, headers=dict(headers))
        response = StreamingResponse(body_chunks(), status_code=status)
        response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        return response


def _error(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "ServiceUnavailableError" if status == 503 else "Error",
                      "param": None, "code": status}}


def _replica_id() -> str:
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.to_full_id_str()   # its actor's name (namespace "serve")
    except Exception:   # not in a Serve replica (a test constructing it directly)
        return "local"


_ingress_app = FastAPI(title="jaxspec (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(_ingress_app)
class JaxspecIngress(JaxspecIngressBase):
    """JaxspecIngressBase as a Serve FastAPI ingress: one route, every path and method, to a replica."""

    @_ingress_app.api_route("/{path:path}", methods=HTTP_METHODS)
    async def route(self, path: str, request: Request):
        return await self.forward(request)


def build_app(model, *, num_replicas: int = 1, served_model_name: str | None = None, llm_kwargs: dict | None = None,
              http_options=None, options=None, random_weights: bool = False, ray_actor_options: dict | None = None,
              prefix_affinity: bool = True, router_kwargs: dict | None = None,
              max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS, ingress_actor_options: dict | None = None,
              stream_batching_interval_ms: float = DEFAULT_STREAM_BATCHING_INTERVAL_MS,
              num_ingress_replicas: int | None = None, metrics_interval_s: float = DEFAULT_METRICS_INTERVAL_S,
              name: str = "jaxspec"):
    """The Ray Serve application: `num_replicas` JaxspecServer replicas behind a JaxspecIngress (module docstring).

    `model`: a preset, a Hugging Face directory, a GGUF file or a loaded jaxspec Model; `llm_kwargs`: `LLM`'s
    options (those `jaxspec serve`'s engine flags set); `http_options` / `options`: jaxspec/serve/http.py's
    HTTPOptions and jaxspec/serve/options.py's ServeOptions, as `build_app`'s. `ray_actor_options`: each replica's
    resources (default one GPU per tensor-parallel device); `prefix_affinity`: route by prompt prefix (Ray Serve
    LLM's PrefixCacheAffinityRouter) rather than by queue length alone; `router_kwargs`: that router's options
    (e.g. imbalanced_threshold); `stream_batching_interval_ms`: a stream's chunks after its first go at most once
    per interval, each with everything written since (0: every write at once); `num_ingress_replicas`: HTTP-side
    replicas (default: as many as `num_replicas`, so the front scales with the engines); `metrics_interval_s`: how
    often each replica sends its metrics to the board /metrics merges. Returns the bound application for
    `serve.run`."""
    from ray.serve.config import RequestRouterConfig
    from jaxspec.llm import LLM
    llm_kwargs = dict(llm_kwargs or {})
    known = [p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "model")]
    unknown = sorted(set(llm_kwargs) - set(known))
    if unknown:
        raise ValueError(f"llm_kwargs {unknown} are not LLM options; valid: {known}")
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas!r} is invalid; give an int >= 1 (engines, each on its own "
                         "devices)")
    if not isinstance(max_ongoing_requests, int) or max_ongoing_requests < 1:
        raise ValueError(f"max_ongoing_requests={max_ongoing_requests!r} is invalid; give an int >= 1")
    if not isinstance(stream_batching_interval_ms, (int, float)) or isinstance(stream_batching_interval_ms, bool) \
            or not 0 <= stream_batching_interval_ms < float("inf"):
        raise ValueError(f"stream_batching_interval_ms={stream_batching_interval_ms!r} is invalid; give a number of "
                         "milliseconds >= 0 (0: every chunk sent at once)")
    if num_ingress_replicas is None:
        num_ingress_replicas = num_replicas
    if not isinstance(num_ingress_replicas, int) or isinstance(num_ingress_replicas, bool) or num_ingress_replicas < 1:
        raise ValueError(f"num_ingress_replicas={num_ingress_replicas!r} is invalid; give an int >= 1")
    if not isinstance(metrics_interval_s, (int, float)) or isinstance(metrics_interval_s, bool) \
            or not 0 < metrics_interval_s < float("inf"):
        raise ValueError(f"metrics_interval_s={metrics_interval_s!r} is invalid; give seconds > 0")
    if router_kwargs and not prefix_affinity:
        raise ValueError(f"router_kwargs {sorted(router_kwargs)} are the prefix-aware router's options; they need "
                         "prefix_affinity=True")
    if served_model_name is None:
        if not isinstance(model, str):
            raise ValueError("served_model_name is needed when model is a loaded Model (it has no name to serve "
                             "it by)")
        served_model_name = model
    if ray_actor_options is None:
        ray_actor_options = {"num_gpus": llm_kwargs.get("tensor_parallel_size", 1)}
    router = None
    if prefix_affinity:
        router_class = prefix_router()
        if router_class is None:
            log.warning("this Ray has no PrefixCacheAffinityRouter: requests are routed by Ray Serve's default "
                        "power-of-two-choices router")
        else:
            router = RequestRouterConfig(request_router_class=router_class,
                                         request_router_kwargs=dict(router_kwargs or {}))
    server_options = dict(name=f"{name}-server", num_replicas=num_replicas, ray_actor_options=ray_actor_options,
                          max_ongoing_requests=max_ongoing_requests)
    if http_options is not None and http_options.shutdown_timeout:   # jaxspec's drain is Serve's here
        server_options["graceful_shutdown_timeout_s"] = http_options.shutdown_timeout
    if router is not None:
        server_options["request_router_config"] = router
    board = serve.deployment(JaxspecMetricsBoard, name=f"{name}-metrics", num_replicas=1,
                             ray_actor_options={"num_cpus": 0}).bind(metrics_interval_s)
    server = serve.deployment(JaxspecServer, **server_options).bind(
        model, served_model_name, llm_kwargs, http_options, options, random_weights, stream_batching_interval_ms,
        board, metrics_interval_s)
    ingress = serve.deployment(JaxspecIngress, name=f"{name}-ingress", num_replicas=num_ingress_replicas,
                               ray_actor_options=ingress_actor_options or {"num_cpus": 0},
                               max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS)
    return ingress.bind(server, board)


def main(argv: list[str] | None = None):
    """`python -m jaxspec.serve.ray MODEL --num-replicas N [jaxspec serve's flags]`: starts (or joins, with
    --address) a Ray cluster and serves the application on --host:--port until interrupted."""
    import argparse
    import os
    import time
    from jaxspec.cli import add_http_args, add_server_args, checked_server_options, http_options
    from jaxspec.cli_args import add_engine_args, engine_kwargs, one_line_errors
    from jaxspec.serve.options import add_serve_args
    p = argparse.ArgumentParser(prog="python -m jaxspec.serve.ray",
                                description="jaxspec's OpenAI-compatible server, data-parallel on Ray Serve: "
                                            "--num-replicas engines behind one HTTP endpoint.")
    add_server_args(p)
    p.add_argument("--num-replicas", type=int, default=1, help="engines, each on --tensor-parallel-size devices")
    p.add_argument("--address", default=None, help="the Ray cluster to join (default: $RAY_ADDRESS, else a local "
                                                   "one started here)")
    p.add_argument("--no-prefix-affinity", dest="prefix_affinity", action="store_false",
                   help="route by queue length only (Ray Serve's power-of-two choices), not by prompt prefix")
    p.add_argument("--num-gpus-per-replica", type=float, default=None,
                   help="GPUs Ray reserves for each replica (default: --tensor-parallel-size; 0 on a CPU cluster)")
    p.add_argument("--num-cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    p.add_argument("--num-ingress-replicas", type=int, default=None,
                   help="HTTP-side replicas that hand requests to the engines (default: --num-replicas)")
    p.add_argument("--stream-batching-interval-ms", type=float, default=DEFAULT_STREAM_BATCHING_INTERVAL_MS,
                   help="a stream's chunks after its first go at most once per interval, each with everything "
                        "written since (0: every token's chunk at once)")
    add_http_args(p)
    add_engine_args(p)
    add_serve_args(p)
    args = p.parse_args(argv)
    if args.num_replicas < 1:
        p.error(f"--num-replicas {args.num_replicas} is invalid; give 1 or more")
    if args.num_ingress_replicas is not None and args.num_ingress_replicas < 1:
        p.error(f"--num-ingress-replicas {args.num_ingress_replicas} is invalid; give 1 or more")
    if not 0 <= args.stream_batching_interval_ms < float("inf"):
        p.error(f"--stream-batching-interval-ms {args.stream_batching_interval_ms} is invalid; give milliseconds >= 0")
    with one_line_errors(p.prog):
        options = checked_server_options(p, args)
        import ray
        from ray import serve
        ray.init(address=args.address or os.environ.get("RAY_ADDRESS"))
        gpus = args.num_gpus_per_replica
        if gpus is None:
            gpus = args.tensor_parallel_size if ray.cluster_resources().get("GPU", 0) > 0 else 0
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(args.model, num_replicas=args.num_replicas, served_model_name=args.served_model_name,
                            llm_kwargs=engine_kwargs(args), http_options=http_options(args), options=options,
                            random_weights=args.random_weights, prefix_affinity=args.prefix_affinity,
                            ray_actor_options={"num_gpus": gpus, "num_cpus": args.num_cpus_per_replica},
                            stream_batching_interval_ms=args.stream_batching_interval_ms,
                            num_ingress_replicas=args.num_ingress_replicas),
                  name="jaxspec", route_prefix="/")
        print(f"jaxspec on Ray Serve: {args.num_replicas} replica(s) of {args.model} at "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            serve.shutdown()


if __name__ == "__main__":
    main()
