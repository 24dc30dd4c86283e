"""The engine the bench's flags describe, for the measured runs (jaxspec/bench/cli.py) and the start-up runs' child
(jaxspec/bench/startup.py): the model (its checkpoint, or its shapes with random weights), the draft model or head,
the context length, and LLM(...)'s keywords."""
from __future__ import annotations

from jaxspec.bench.args import BENCH_ENGINE_FIELDS
from jaxspec.bench.workloads import tokenizer_for
from jaxspec.cli_args import engine_kwargs


def model_from_args(args):
    """The model --model names, in --dtype: its checkpoint, or its shapes with random weights (--random-weights)."""
    from jaxspec.models.weights import resolve_dtype
    from jaxspec.models.loader import load_model
    dtype = resolve_dtype(args.dtype)
    if args.random_weights:
        from jaxspec.models.random import random_model
        model = random_model(args.model, dtype=dtype, seed=args.seed)
        if getattr(args, "structured", None) is not None:   # the constraint is compiled over the vocabulary
            model.tokenizer = tokenizer_for(args.model)
            if model.tokenizer is None:
                raise SystemExit(f"--structured-* needs a tokenizer, and --model {args.model!r} has none")
        return model
    return load_model(args.model, dtype=dtype)


def with_random_draft(args, model, spec: dict | None) -> dict | None:
    """--random-weights: the draft model's (or MTP head's) shapes with random weights too."""
    if spec is None or not args.random_weights or spec["method"] not in ("mtp", "draft_model"):
        return spec
    spec = dict(spec)
    if spec["method"] == "mtp":
        from jaxspec.decode.drafters.mtp import random_mtp_params
        spec["model"] = random_mtp_params(model.config, model.params["embed"].dtype.name, args.seed + 1)
    else:
        from jaxspec.models.random import random_model
        spec["model"] = random_model(spec["model"], dtype=model.params["embed"].dtype.name, seed=args.seed + 1)
    return spec


def resolve_max_model_len(args, model_config):
    """Without --max-model-len, sets args.max_model_len to the length the engine chooses for this model (its
    default: EngineConfig.resolve_max_model_len). What reads it before or beside the engine then reads the engine's
    length: the multi-turn workload (conversations that fit), vLLM's baseline (the same length as jaxspec's) and
    the reports."""
    if args.max_model_len is None:
        from jaxspec.sched.config import EngineConfig
        args.max_model_len = EngineConfig().resolve_max_model_len(model_config)


def engine_options(args, async_scheduling: bool, spec) -> dict:
    """LLM(...)'s keywords for one configuration: the engine flags as given, --max-concurrency as max_num_seqs, the
    configuration's scheduling and its speculative configuration (`spec`: with_random_draft's)."""
    return {**engine_kwargs(args, BENCH_ENGINE_FIELDS), "max_num_seqs": args.max_concurrency,
            "async_scheduling": async_scheduling, "speculative_config": spec}
