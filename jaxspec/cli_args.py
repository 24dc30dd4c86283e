"""What the command lines (`jaxspec serve`, `jaxspec-bench`, `jaxspec-train-eagle`) share to check their arguments
before anything imports JAX or loads a model, and to answer a bad one, or a failure at run time, in one line; and
the engine's flags (ENGINE_FLAGS), declared once for every command that builds an engine, with the engine's defaults.

A bad flag: `PROG: error: argument --flag: VALUE is invalid; WHAT IS VALID (see PROG --help)`, exit code 2.
A failure at run time (a missing file, a server that does not answer, a model that cannot load): `PROG: error:
WHAT`, exit code 1. Neither prints a traceback unless $JAXSPEC_TRACEBACK is set. Ranges are checked by the classes
that own them (EngineConfig, SpeculativeConfig, SamplingParams, TrainConfig), whose errors name a field; the field
is renamed to the flag that set it. Nothing here imports JAX.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
from typing import Callable

TRACEBACK_ENV = "JAXSPEC_TRACEBACK"


def one_line(text: str) -> str:
    """Multi-line messages (a pip command on a line of its own) joined into one."""
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, its errors on one line: the usage of a command with fifty flags would bury the one
    line that says which flag is wrong."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


# ---- argparse types: ranges of the command lines' own counts (the engine's are EngineConfig's) ----
def int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int; give an int >= {lo}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} is invalid; it must be an int >= {lo}")
        return value
    parse.__name__ = f"int >= {lo}"
    return parse


def positive_float(allow_inf: bool = False) -> Callable[[str], float]:
    valid = "a number > 0" + (" (or inf)" if allow_inf else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give {valid}") from None
        if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
            raise argparse.ArgumentTypeError(f"{text} is invalid; give {valid}")
        return value
    parse.__name__ = valid
    return parse


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number; give an int in [0, 65535]") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is invalid; a port is an int in [0, 65535] (0: any free port)")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def _number(text: str, unit: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")   # refused below, as NaN and inf are
    if not (0 <= value < float("inf")) or (value == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"a number of {unit} {'>=' if allow_zero else '>'} 0 is needed, got {text!r}")
    return value


def seconds(text: str) -> float:
    return _number(text, "seconds", allow_zero=True)


def gibibytes(text: str) -> float:
    return _number(text, "GiB", allow_zero=False)


# ---- the engine's flags ----
# Every flag that sets a keyword of LLM(...) (vLLM's flag names), declared here once for each command that builds an
# engine: `jaxspec serve` and the Ray Serve replicas (SERVER_ENGINE_FIELDS), `jaxspec-bench` and `jaxspec-bench
# startup` (jaxspec/bench/args.py's BENCH_ENGINE_FIELDS). A flag's dest is the keyword it sets and its default is
# LLM(...)'s own (tests/test_cli.py holds them equal): a flag left out means what the keyword left out means, in
# every command. The choices are written out, not imported from jaxspec.sched.config: a bad flag is answered
# before any of the engine's modules is imported.
ENGINE_FLAGS: dict[str, tuple[tuple[str, ...], dict]] = {
    "dtype": (("--dtype",), dict(
        default="auto", choices=["auto", "bfloat16", "float16", "float32"],
        help="auto: bfloat16 on GPU, float32 on CPU")),
    "max_num_seqs": (("--max-num-seqs",), dict(type=int, default=16)),
    "max_model_len": (("--max-model-len",), dict(
        type=int, default=None, help="tokens of prompt and output a request may hold (default: the model's "
                                     "max_position_embeddings, at most 4096)")),
    "max_num_batched_tokens": (("--max-num-batched-tokens",), dict(
        type=int, default=512, help="the most tokens one engine step takes, prefill chunks and decode rows together")),
    "block_size": (("--block-size",), dict(type=int, default=16)),
    "num_kv_blocks": (("--num-kv-blocks",), dict(type=int, default=None)),
    "kv_memory_fraction": (("--kv-memory-fraction",), dict(
        type=float, default=None, help="share of the device's free memory the KV pool takes (GPU default 0.5)")),
    "gpu_memory_utilization": (("--gpu-memory-utilization",), dict(
        type=float, default=None, help="vLLM's sizing: the share of the device memory (XLA's limit) that weights, "
                                       "activations and the KV pool fill together")),
    "async_scheduling": (("--async-scheduling",), dict(action=argparse.BooleanOptionalAction, default=True)),
    "enable_prefix_caching": (("--enable-prefix-caching",), dict(action=argparse.BooleanOptionalAction, default=True)),
    "speculative_config": (("--speculative-config",), dict(
        type=json_object, default=None,
        help='the speculative configuration as JSON, e.g. \'{"method": "eagle3", "model": "path/to/head", '
             '"num_speculative_tokens": 3}\' or \'{"method": "ngram", "num_speculative_tokens": 3, '
             '"prompt_lookup_max": 5}\'')),
    "seed": (("--seed",), dict(type=int, default=0)),
    "attention": (("--attention",), dict(
        default="auto", choices=["auto", "pallas", "reference"],
        help="paged attention: the Pallas kernel or the jnp gather (auto: the kernel on a GPU)")),
    "delta_rule": (("--delta-rule",), dict(
        default="auto", choices=["auto", "reference", "pallas"],
        help="hybrid models' Gated DeltaNet recurrence: the JAX scan or the Pallas kernel")),
    "tensor_parallel_size": (("--tensor-parallel-size", "-tp"), dict(
        type=int, default=1, help="devices to split the model over")),
    "structured_compile_timeout": (("--structured-compile-timeout",), dict(
        type=float, default=30.0,
        help="seconds one request's structured-outputs constraint (JSON schema, regex, choice) may take to compile "
             "before the request is refused (and its compile stopped); also how long it may wait for a compile "
             "process while others' constraints hold them all (then 503)")),
    "structured_compile_memory": (("--structured-compile-memory",), dict(
        type=gibibytes, default=2.0,
        help="GiB of memory one constraint's compile (a process of its own) may use before it is stopped and the "
             "request refused")),
    "warmup": (("--warmup",), dict(
        default="auto", choices=["auto", "tiered", "full", "fast", "none"],
        help="when the step programs compile: tiered (the GPU's auto: serve after the smallest bucket's programs, "
             "compile the rest and the autotuned ones in the background), full (everything autotuned first), fast "
             "(everything first, nothing autotuned), none (each on first use)")),
    "quantization": (("--quantization", "-q"), dict(
        default=None, choices=["fp8"],
        help="weights quantized on load: fp8 (float8 e4m3 with per-output-channel scales: the layers' projections, "
             "MoE experts included, of the target and of a draft model or EAGLE/MTP head)")),
    "kv_cache_dtype": (("--kv-cache-dtype",), dict(
        default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="the KV cache's dtype: auto (the model's) or fp8 (e4m3, as fp8_e4m3) / fp8_e5m2, a byte per value with "
             "a per-tensor scale of 1: twice the tokens of a bf16 cache")),
    "enable_lora": (("--enable-lora",), dict(
        action=argparse.BooleanOptionalAction, default=False,
        help="LoRA adapters per request (PEFT directories: --lora-modules, or a request's LoRARequest)")),
    "max_loras": (("--max-loras",), dict(type=int, default=1, help="--enable-lora: adapters resident at once")),
    "max_lora_rank": (("--max-lora-rank",), dict(type=int, default=16, help="--enable-lora: the largest rank served")),
    "logprobs_mode": (("--logprobs-mode",), dict(
        default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"],
        help="what logprobs return: the model's log-softmax (raw) or the distribution sampled from (processed: "
             "after penalties, temperature, top-k/top-p/min-p)")),
}

# The engine flags of a server (`jaxspec serve`, each Ray Serve replica), in the order its --help lists them.
SERVER_ENGINE_FIELDS = ("dtype", "max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size",
                        "num_kv_blocks", "kv_memory_fraction", "gpu_memory_utilization", "async_scheduling",
                        "enable_prefix_caching",
                        "speculative_config", "seed", "tensor_parallel_size", "structured_compile_timeout",
                        "structured_compile_memory", "warmup", "quantization", "kv_cache_dtype", "logprobs_mode",
                        "enable_lora", "max_loras", "max_lora_rank")


def add_engine_args(p: argparse.ArgumentParser, fields: tuple[str, ...] = SERVER_ENGINE_FIELDS):
    """Declares the engine flags of `fields` (LLM keywords, ENGINE_FLAGS' names) on `p`."""
    for field in fields:
        names, options = ENGINE_FLAGS[field]
        p.add_argument(*names, dest=field, **options)


def engine_kwargs(args, fields: tuple[str, ...] = SERVER_ENGINE_FIELDS) -> dict:
    """LLM(...)'s keywords that the engine flags of `fields` set."""
    return {field: getattr(args, field) for field in fields}


def check_engine_args(p: argparse.ArgumentParser, args):
    """A server's engine flags, checked as the engine checks them when it starts (EngineConfig, SpeculativeConfig),
    before anything loads."""
    check_engine_config(p, engine_kwargs(args))
    if args.speculative_config is not None:
        check_speculative_config(p, args.speculative_config)


# ---- checks that reuse the owners' validation ----
def flag_of(field: str) -> str:
    return "--" + field.replace("_", "-")


def name_flags(message: str, flags: dict[str, str]) -> str:
    """`message` (a ValueError's, naming fields as `field=value` or `Class.field=value`) with each field renamed
    to the flag that set it: "max_num_seqs=0 is invalid" -> "--max-concurrency 0 is invalid"."""
    for field, flag in flags.items():
        message = re.sub(rf"(?<![\w.])(?:\w+\.)?{re.escape(field)}=", f"{flag} ", message)
    return message


def refuse_invalid(parser: argparse.ArgumentParser, build: Callable, flags: dict[str, str], where: str = ""):
    """`build()` (a config's constructor or its validate), its ValueError answered as a bad flag (exit code 2).
    `flags`: field -> the flag that set it; `where`: the flag that holds them all (--speculative-config)."""
    try:
        return build()
    except ValueError as e:
        parser.error((f"argument {where}: " if where else "") + name_flags(str(e), flags))


def check_engine_config(parser, fields: dict, flags: dict[str, str] | None = None):
    """The engine's options as EngineConfig checks them (the same check the engine makes when it starts).
    `fields`: EngineConfig field -> value; `flags`: fields set by a flag not named after them."""
    import dataclasses

    from jaxspec.sched.config import EngineConfig
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**{k: v for k, v in fields.items() if k in names})
    refuse_invalid(parser, config.validate, {name: flag_of(name) for name in names} | (flags or {}))


def check_speculative_config(parser, value: dict, flag: str = "--speculative-config", random_weights: bool = False):
    """A speculative configuration (serve's and bench's JSON, or bench's separate flags) as SpeculativeConfig checks
    it, and its draft model or head found where it says."""
    from jaxspec.spec import SpeculativeConfig
    spec = refuse_invalid(parser, lambda: SpeculativeConfig.coerce(value), {}, flag)
    if spec.model is not None and not isinstance(spec.model, (str, os.PathLike)):
        parser.error(f"argument {flag}: model={spec.model!r} is invalid; give the draft model or head as a preset "
                     "name or a path")
    if isinstance(spec.model, (str, os.PathLike)):
        check_model(parser, f"{flag} model", spec.model, random_weights and spec.method == "draft_model")
    return spec


def check_model(parser, flag: str, spec, random_weights: bool = False):
    """A model `load_model` (or, with random weights, `random_model`) can take: a preset, an existing path or a
    hub id. An unknown name is a bad flag (exit code 2); a preset whose packages are missing raises its
    PresetPackageMissingError (an install to make: exit code 1, with the pip command)."""
    from jaxspec.models.errors import PresetPackageMissingError
    from jaxspec.models.loader import check_model_spec
    from jaxspec.models.random import KNOWN_SHAPES
    if random_weights and spec in KNOWN_SHAPES:
        return
    try:
        check_model_spec(spec)
    except PresetPackageMissingError:
        raise
    except (ValueError, OSError) as e:
        parser.error(f"argument {flag}: {e}")


def check_input_file(parser, flag: str, path: str | None):
    if path is not None and not os.path.isfile(path):
        why = "is a directory" if os.path.isdir(path) else "does not exist"
        parser.error(f"argument {flag}: {path!r} {why}; give an existing file")


def check_output_file(parser, flag: str, path: str | None):
    """A file to write: not a directory, in a directory that exists."""
    if path is None:
        return
    if os.path.isdir(path):
        parser.error(f"argument {flag}: {path!r} is a directory; give a file path to write")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        parser.error(f"argument {flag}: the directory {parent!r} does not exist; create it or give another path")


def check_output_dir(parser, flag: str, path: str):
    """A directory to create or reuse: not an existing file, nor below one."""
    target = os.path.abspath(path)
    while target and not os.path.exists(target):
        target = os.path.dirname(target)
    if os.path.isfile(target):
        where = "is a file" if target == os.path.abspath(path) else f"is below the file {target!r}"
        parser.error(f"argument {flag}: {path!r} {where}; give a directory (it is created if missing)")


# ---- failures at run time ----
# What a user can cause and fix: a missing file, a refused connection, a model that cannot load, a value only the
# loaded model can judge (max_model_len beyond its positions). Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError)


@contextlib.contextmanager
def one_line_errors(prog: str, also: tuple[type[BaseException], ...] = ()):
    """Runs a command's body; a user error it raises is printed as one line and exits with code 1
    ($JAXSPEC_TRACEBACK=1: the traceback instead)."""
    try:
        yield
    except USER_ERRORS + also as e:
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"{prog}: error: {one_line(e) or type(e).__name__} (set {TRACEBACK_ENV}=1 for the traceback)",
              file=sys.stderr)
        sys.exit(1)
