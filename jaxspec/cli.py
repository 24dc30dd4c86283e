"""The `jaxspec` command: `jaxspec serve MODEL` (an OpenAI-compatible server) and `jaxspec bench` (the same as
`jaxspec-bench`)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from jaxspec.cli_args import (ArgumentParser, add_engine_args, check_engine_args, check_model, engine_kwargs,
                              one_line_errors, port, seconds)


def string_list(text: str) -> tuple[str, ...]:
    """vLLM's form, a JSON list of strings ('["https://a.example", "https://b.example"]'), or a comma-separated
    list."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list ({e}): {text!r}") from None
        if not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"a list of strings is needed, got {text!r}")
        return tuple(value)
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_http_args(p: argparse.ArgumentParser):
    """The server's HTTP options (vLLM's flag names): CORS, /metrics' protection, shutdown."""
    p.add_argument("--allowed-origins", type=string_list, default=(),
                   help="CORS: origins whose pages may call the server from a browser, as a JSON list or comma-"
                        "separated ('*': any); default none (no CORS headers)")
    p.add_argument("--allowed-methods", type=string_list, default=("*",),
                   help="CORS: the HTTP methods allowed (default '*')")
    p.add_argument("--allowed-headers", type=string_list, default=("*",),
                   help="CORS: the request headers allowed (default '*')")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: let browsers send credentials (cookies, HTTP authentication) with cross-origin "
                        "requests")
    p.add_argument("--protect-metrics", action="store_true",
                   help="/metrics requires the API key too (by default it is open, as vLLM's is)")
    p.add_argument("--shutdown-timeout", type=seconds, default=0.0,
                   help="on SIGTERM/SIGINT, seconds running requests may still run before they are aborted (new "
                        "requests are refused at once); default 0: abort them at once")


def http_options(args):
    from jaxspec.serve.http import HTTPOptions
    return HTTPOptions(api_key=args.api_key or None, protect_metrics=args.protect_metrics,
                       allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                       allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                       shutdown_timeout=args.shutdown_timeout)


def add_server_args(p: argparse.ArgumentParser):
    """The model and the endpoint of a server: `jaxspec serve`'s, and each Ray Serve replica's
    (jaxspec/serve/ray.py)."""
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct",
                   help="a preset name, a Hugging Face directory or a GGUF file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000, help="0: any free port")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL)")
    p.add_argument("--api-key", default=os.environ.get("JAXSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health, /version and /metrics "
                        "(see --protect-metrics) (default: $JAXSPEC_API_KEY)")
    p.add_argument("--random-weights", action="store_true",
                   help="benchmarks: MODEL's shapes with random weights and no tokenizer (token-id prompts only)")


def checked_server_options(p, args):
    """A server CLI's MODEL and engine flags checked (p.error on a bad one), and its ServeOptions."""
    from jaxspec.serve.options import options_from_args
    check_model(p, "MODEL", args.model, random_weights=args.random_weights)
    check_engine_args(p, args)
    try:
        return options_from_args(args)
    except ValueError as e:
        p.error(str(e))


def serve(argv: list[str]):
    from jaxspec.serve.options import add_serve_args
    p = ArgumentParser(prog="jaxspec serve", description="An OpenAI-compatible server over one model.")
    add_server_args(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_http_args(p)
    add_engine_args(p)
    add_serve_args(p)
    args = p.parse_args(argv)
    with one_line_errors(p.prog):
        options = checked_server_options(p, args)
        from jaxspec.listen import LoadingResponder, listen
        sock = listen(args.host, args.port)   # before loading: a port in use is reported at once
        print(f"jaxspec serve: listening on {url_of(sock)}; requests are answered 503 until the model is loaded",
              file=sys.stderr, flush=True)
        with LoadingResponder(sock):
            app = load_app(args, options)
        run_server(app, sock, args)


def kv_cache_line(kv: dict) -> str:
    """Engine.kv_cache() in a line: what the pool holds, in tokens and in requests of max_model_len tokens."""
    return (f"KV cache of {kv['tokens']:,} tokens ({kv['bytes'] / 2**30:.2f} GiB): "
            f"{kv['max_model_len_requests']:.2f} requests of max_model_len {kv['max_model_len']:,} tokens at once")


def url_of(sock) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def load_app(args, options):
    """The model loaded, its engine started and compiled, and the app that serves it."""
    from jaxspec.llm import LLM
    from jaxspec.serve import build_app
    model = args.model
    if args.random_weights:
        from jaxspec.models.weights import resolve_dtype
        from jaxspec.models.random import random_model
        model = random_model(args.model, dtype=resolve_dtype(args.dtype), seed=args.seed)
    llm = LLM(model, **engine_kwargs(args))
    print(f"jaxspec serve: {kv_cache_line(llm.engine.kv_cache())}", file=sys.stderr, flush=True)
    return build_app(llm, args.served_model_name or args.model, http_options=http_options(args), options=options)


def run_server(app, sock, args):
    """Serves `app` on the socket taken before loading, until the server is stopped (jaxspec.serve.lifecycle)."""
    from jaxspec.serve.lifecycle import run
    run(app, host=args.host, port=sock.getsockname()[1], log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout, sockets=[sock])


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": serve}
    if not argv or argv[0] not in ("serve", "bench"):
        print("usage: jaxspec {serve,bench} ...\n  serve  an OpenAI-compatible server (jaxspec serve --help)\n"
              "  bench  benchmarks (jaxspec bench --help)", file=sys.stderr)
        sys.exit(2)
    if argv[0] == "bench":
        from jaxspec.bench import main as bench_main
        sys.argv = ["jaxspec bench", *argv[1:]]
        return bench_main()
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
