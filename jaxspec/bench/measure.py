"""Offline measurements: one configuration served by `LLM.generate` (throughput, TTFT/TPOT/ITL, speculation),
steady-state decode (wall vs device step time, device-busy fraction, HBM roofline) and the speedup a speculative
configuration's acceptance allows."""
from __future__ import annotations

import time

import numpy as np

from jaxspec.bench.outputs import output_digest, output_summary
from jaxspec.bench.workloads import Workload

HBM_BANDWIDTH = 2.98e12  # bytes/s, an H100's device-to-device copy: the roofline's bandwidth off a GPU
_measured_bandwidth: dict = {}


def _pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def decode_bytes(engine, batch: int, context: int) -> int:
    """Fewest bytes one decode step reads on each device: every weight once, plus each row's KV context; under
    tensor parallelism what the busiest device holds of them (its shards, and replicated weights whole), so the
    roofline is one GPU's bytes against one GPU's bandwidth."""
    runner = engine.runner
    return runner.weight_bytes(per_device=True) + runner.kv_bytes_per_token(per_device=True) * context * batch


def hbm_bandwidth(given: float | None) -> float:
    """Bytes/s for the roofline: `given` (--hbm-bandwidth), else this GPU's own device-to-device copy bandwidth
    (measured once per process: an H200's is not an H100's), else HBM_BANDWIDTH off a GPU."""
    import jax
    if given is not None:
        return given
    device = jax.devices()[0]
    if device.platform != "gpu":
        return HBM_BANDWIDTH
    if device.device_kind not in _measured_bandwidth:
        _measured_bandwidth[device.device_kind] = copy_bandwidth()
    return _measured_bandwidth[device.device_kind]


def copy_bandwidth(num_bytes: int = 1 << 28, passes: int = 10, repeats: int = 5) -> float:
    """Bytes/s of an elementwise pass over a `num_bytes` array into another on the default device: bytes read plus
    bytes written over the pass's time (as CUDA's bandwidthTest counts a device-to-device copy). `passes` are issued
    back to back (no launch gap between them), the fastest of `repeats` such runs; 256 MiB keeps it small beside an
    engine's KV pool."""
    import jax
    import jax.numpy as jnp
    x = jnp.zeros(num_bytes // 4, jnp.float32)
    bump = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(bump(x))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(passes):
            y = bump(x)
        jax.block_until_ready(y)
        best = min(best, (time.perf_counter() - t0) / passes)
    return 2 * num_bytes / best


def device_step_time(engine, num_tokens: int, repeats: int = 20) -> float:
    """Seconds one compiled step of this token bucket takes on the device, steps issued back to back.

    Replays the engine's last live inputs of that bucket (the same rows, slots and block tables, each
    replay decoding one more token)."""
    import jax
    runner = engine.runner
    T = runner.bucket_for(num_tokens)
    if T not in runner.last_inputs:
        raise ValueError(f"bucket {T} has not run a live step yet; nothing to replay")
    for _ in range(3):
        out = runner.replay(T)
    jax.block_until_ready(out["tokens"])
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = runner.replay(T)
    jax.block_until_ready(out["tokens"])
    return (time.perf_counter() - t0) / repeats



def bench_adapters(args, model_config) -> list:
    """The adapters the requests take turns with: --lora-modules', then --random-loras written once for this
    model's shapes (under a temporary directory) -> [LoRARequest]."""
    if getattr(args, "lora_requests", None) is None:
        import tempfile

        from jaxspec.lora import LoRARequest
        from jaxspec.lora.peft import write_random_adapter
        adapters = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(args.lora_modules)]
        if args.random_loras:
            root = tempfile.mkdtemp(prefix="jaxspec-bench-loras-")
            for i in range(args.random_loras):
                path = write_random_adapter(model_config, f"{root}/random-{i}", args.max_lora_rank, seed=i)
                adapters.append(LoRARequest(f"random-{i}", len(adapters) + 1, str(path)))
        args.lora_requests = adapters
    return args.lora_requests


def request_adapters(args, llm, count: int):
    """Each of `count` requests' LoRARequest in turn over the adapters (--lora-mix: the base model, None, takes a
    turn too); None when the bench runs no adapters."""
    adapters = bench_adapters(args, llm.model.config) if getattr(args, "enable_lora", False) else []
    if not adapters:
        return None
    turn = ([None] if args.lora_mix else []) + adapters
    return [turn[i % len(turn)] for i in range(count)]


def run_config(llm, workload: Workload, args, label: str) -> dict:
    from jaxspec import SamplingParams
    so = getattr(args, "structured", None)   # a constrained request ends where its automaton accepts
    params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=args.ignore_eos and so is None,
                             seed=args.seed + i, structured_outputs=so) for i, n in enumerate(workload.output_lens)]
    engine = llm.engine
    start_steps = engine.counters["steps"]
    t0 = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=not args.quiet,
                        lora_request=request_adapters(args, llm, len(workload.prompts)))
    duration = time.perf_counter() - t0
    steps = engine.counters["steps"] - start_steps
    ttft = [o.metrics["ttft"] for o in outs if o.metrics["ttft"] is not None]
    tpot = [o.metrics["tpot"] for o in outs if o.metrics["tpot"] is not None]
    itl = [x for o in outs for x in o.metrics["inter_token_latencies"]]
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.token_ids) for o in outs)
    res = {
        "label": label, "requests": len(outs), "duration_s": duration, "input_tokens": n_in, "output_tokens": n_out,
        "request_throughput": len(outs) / duration, "output_throughput": n_out / duration,
        "total_throughput": (n_in + n_out) / duration, "steps": steps,
        "ttft_ms": {"mean": 1e3 * np.mean(ttft), "median": 1e3 * np.median(ttft), "p99": 1e3 * _pct(ttft, 99)},
        "tpot_ms": {"mean": 1e3 * np.mean(tpot) if tpot else float("nan"),
                    "median": 1e3 * np.median(tpot) if tpot else float("nan"), "p99": 1e3 * _pct(tpot, 99)},
        "itl_ms": {"mean": 1e3 * np.mean(itl) if itl else float("nan"),
                   "median": 1e3 * np.median(itl) if itl else float("nan"), "p99": 1e3 * _pct(itl, 99)},
        "recompiles": engine.stats()["recompiles"],
        "kv_cache": engine.kv_cache(),
        # Which tokens came out (configurations that must agree, e.g. sync and async greedy, compare this)
        "output_digest": output_digest([o.token_ids for o in outs]),
        **output_summary(args, [len(o.token_ids) for o in outs], [o.text for o in outs],
                         [o.finish_reason for o in outs]),
    }
    if "spec" in engine.stats():
        res["spec"] = engine.stats()["spec"]
    if "lora" in engine.stats():
        res["lora"] = engine.stats()["lora"]
    return res


def steady_state(llm, args, batch: int) -> dict:
    """Steady-state decode: `batch` requests all decoding; wall time per engine step vs device time."""
    from jaxspec import SamplingParams
    from jaxspec.sched.request import Status
    engine = llm.engine
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(args.seed)
    warm, timed = 8, args.steady_steps
    k = engine.step_config.num_speculative_tokens
    # Rows admitted first decode while later ones still prefill, so each may run for many steps before
    # the timed window: allow them all the room the model length leaves (they are aborted afterwards).
    max_tokens = engine.step_config.max_model_len - args.input_len - 2 * (k + 1)
    if max_tokens < warm + timed + 8:
        raise SystemExit(f"--steady-state needs --max-model-len >= input_len + {warm + timed + 8 + 2 * (k + 1)} "
                         f"(got {engine.step_config.max_model_len})")
    adapters = request_adapters(args, llm, batch) or [None] * batch
    reqs = [engine.add_request(rng.integers(0, vocab, args.input_len).tolist(),
                               SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                               lora_request=adapter)
            for adapter in adapters]
    while any(r.status is Status.WAITING or r.prefilling for r in reqs):
        engine.step()
    for _ in range(warm):
        engine.step()
    context_start = np.mean([r.num_tokens for r in reqs])
    t0 = time.perf_counter()
    for _ in range(timed):
        engine.step()
    wall = (time.perf_counter() - t0) / timed
    issue = list(engine.runner.issue_seconds)[-timed:]   # host time to issue each timed step
    engine.flush()   # read the in-flight step before replaying its inputs
    if any(r.finished for r in reqs):
        raise SystemExit(f"--steady-state {batch}: a request finished before the timed steps ended; raise "
                         f"--max-model-len or --max-num-batched-tokens")
    context = int((context_start + np.mean([r.num_tokens for r in reqs])) / 2)
    device = device_step_time(engine, batch * (1 + k))
    for r in reqs:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    bandwidth = hbm_bandwidth(args.hbm_bandwidth)
    bound = decode_bytes(engine, batch, context) / bandwidth
    return {"batch": batch, "async": engine.config.async_scheduling, "wall_step_ms": 1e3 * wall,
            "device_step_ms": 1e3 * device, "device_busy": min(1.0, device / wall),
            "hbm_bound_ms": 1e3 * bound, "hbm_bandwidth": bandwidth, "roofline_fraction": bound / device,
            "mean_context": context,
            "bucket_tokens": engine.runner.bucket_for(batch * (1 + k)),
            "argument_buffers": engine.runner.argument_buffers(),
            "host_issue_ms": 1e3 * float(np.median(issue))}


def speedup_bounds(results: list[dict]):
    """For each speculative configuration with a steady-state measurement, the speedup its acceptance
    length allows given the measured device step times (plain step vs step with drafting and verification
    at the same batch): bound = acceptance_length * t_plain / t_spec; and how much of it the serving run's
    output throughput reached (meaningful when --max-concurrency equals the steady-state batch)."""
    plain = {r["label"]: r for r in results if "spec" not in r and "steady" in r}
    for r in results:
        parts = r["label"].split("+")   # mode+method[+...]: the plain run's label drops the method
        base = plain.get("+".join(parts[:1] + parts[2:]))
        if "spec" not in r or "steady" not in r or base is None:
            continue
        r["speedup_bound"] = []
        for st, st0 in zip(r["steady"], base["steady"]):
            bound = r["spec"]["mean_acceptance_length"] * st0["device_step_ms"] / st["device_step_ms"]
            measured = r["output_throughput"] / base["output_throughput"]   # the serving run's speedup
            r["speedup_bound"].append({"batch": st["batch"], "bound": bound, "measured": measured,
                                       "of_bound": measured / bound})
            print(f"{r['label']} batch {st['batch']}: speedup bound {bound:.2f}x (acceptance length "
                  f"{r['spec']['mean_acceptance_length']:.2f} x plain {st0['device_step_ms']:.3f} ms / spec "
                  f"{st['device_step_ms']:.3f} ms), measured {measured:.2f}x = {100 * measured / bound:.0f}% of it")
