"""The `jaxspec` command: `jaxspec serve MODEL` (an OpenAI-compatible server) and `jaxspec bench` (the same as
`jaxspec-bench`)."""
from __future__ import annotations

import argparse
import json
import os
import sys


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def add_engine_args(p: argparse.ArgumentParser):
    """The LLM options a command line sets (vLLM's flag names)."""
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-memory-fraction", type=float, default=None)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--speculative-config", type=json_object, default=None,
                   help='JSON, e.g. \'{"method": "eagle3", "model": "path/to/head", "num_speculative_tokens": 3}\'')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="devices to split the model over")
    p.add_argument("--structured-compile-timeout", type=float, default=30.0,
                   help="seconds one request's structured-outputs constraint (JSON schema, regex, choice) may take "
                        "to compile before the request is refused")
    p.add_argument("--logprobs-mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"],
                   help="what logprobs return: the model's log-softmax (raw) or the distribution sampled from "
                        "(processed: after penalties, temperature, top-k/top-p/min-p)")


def engine_kwargs(args) -> dict:
    return dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, kv_memory_fraction=args.kv_memory_fraction,
                async_scheduling=args.async_scheduling, enable_prefix_caching=args.enable_prefix_caching,
                speculative_config=args.speculative_config, seed=args.seed,
                tensor_parallel_size=args.tensor_parallel_size,
                structured_compile_timeout=args.structured_compile_timeout, logprobs_mode=args.logprobs_mode)


def serve(argv: list[str]):
    from jaxspec.serve.options import add_serve_args, options_from_args
    p = argparse.ArgumentParser(prog="jaxspec serve", description="An OpenAI-compatible server over one model.")
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct",
                   help="a preset name, a Hugging Face directory or a GGUF file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL)")
    p.add_argument("--api-key", default=os.environ.get("JAXSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $JAXSPEC_API_KEY)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--random-weights", action="store_true",
                   help="benchmarks: MODEL's shapes with random weights and no tokenizer (token-id prompts only)")
    add_engine_args(p)
    add_serve_args(p)
    args = p.parse_args(argv)
    try:
        options = options_from_args(args)
    except ValueError as e:
        p.error(str(e))

    import uvicorn

    from jaxspec.llm import LLM
    from jaxspec.serve import build_app
    model = args.model
    if args.random_weights:
        from jaxspec.llm import _resolve_dtype
        from jaxspec.models.random import random_model
        model = random_model(args.model, dtype=_resolve_dtype(args.dtype), seed=args.seed)
    llm = LLM(model, **engine_kwargs(args))
    app = build_app(llm, args.served_model_name or args.model, api_key=args.api_key or None, options=options)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


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
