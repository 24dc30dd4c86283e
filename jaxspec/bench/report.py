"""The report of a benchmark: the table printed per configuration, the JSON file, the plot."""
from __future__ import annotations

import json
import os

import numpy as np


def print_report(r: dict):
    line = "=" * 60
    print(f"{line}\n{r['label']:^60}\n{line}")
    rows = [("Successful requests", r["requests"]), ("Benchmark duration (s)", f"{r['duration_s']:.2f}"),
            ("Total input tokens", r["input_tokens"]), ("Total generated tokens", r["output_tokens"]),
            ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{r['total_throughput']:.2f}"),
            ("Engine steps", r.get("steps", "-")),
            # None: the engine ran no warm-up (--warmup none), so nothing counts as a recompile
            ("Recompiles after warm-up", "-" if r.get("recompiles") is None else r["recompiles"])]
    if "kv_cache" in r:   # what the KV pool holds (an offline run: the engine is in this process)
        kv = r["kv_cache"]
        rows += [("KV cache (tokens)", f"{kv['tokens']:,}"),
                 (f"Requests of {kv['max_model_len']:,} tokens at once", f"{kv['max_model_len_requests']:.2f}")]
    if "saturated_output_throughput" in r:   # while max_concurrency requests were in flight (online.py)
        rows.insert(6, ("Saturated output throughput (tok/s)", f"{r['saturated_output_throughput']:.2f}"))
    if np.isfinite(r.get("request_rate", float("inf"))):
        rows.insert(1, ("Request rate (req/s, Poisson)", f"{r['request_rate']:.2f}"))
    if "output_len" in r:
        ol = r["output_len"]
        rows.append(("Output length (mean/min/max)", f"{ol['mean']:.1f}/{ol['min']}/{ol['max']}"))
    if "finish_reasons" in r:
        rows.append(("Finish reasons", " ".join(f"{k}:{v}" for k, v in r["finish_reasons"].items())))
    if "structured_outputs" in r:
        so = r["structured_outputs"]
        compact = ", no whitespace" if so.get("disable_any_whitespace") else ""
        rows.append(("Structured outputs", f"{so['kind']} ({os.path.basename(so['source'])}{compact})"))
        if "valid_outputs" in so:
            rows.append(("Outputs matching the constraint", f"{so['valid_outputs']}/{r['requests']}"))
    if "prefix_cache" in r:
        pc = r["prefix_cache"]
        rows.append(("Prefix cache hit rate (%)", f"{100 * pc['hit_rate']:.1f}" if pc["enabled"] else "off"))
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name[:-3].upper()} (ms)", f"{r[name][stat]:.2f}"))
    if "spec" in r:
        s = r["spec"]
        rows += [("Acceptance rate (%)", f"{100 * s['acceptance_rate']:.2f}"),
                 ("Acceptance length", f"{s['mean_acceptance_length']:.2f}"), ("Drafts", s["drafts"]),
                 ("Draft tokens", s["draft_tokens"]), ("Accepted tokens", s["accepted_tokens"]),
                 ("Per-position acceptance", " ".join(f"{x:.2f}" for x in s["per_position_acceptance"]))]
        if s.get("adaptive"):
            rows.append(("Chosen k (steps per k)", " ".join(str(n) for n in s["chosen_k"])))
    if "steady" in r:
        for st in r["steady"]:
            rows += [(f"Decode step, batch {st['batch']} (ms)", f"{st['wall_step_ms']:.3f} wall, "
                      f"{st['device_step_ms']:.3f} device"),
                     (f"Device busy, batch {st['batch']} (%)", f"{100 * st['device_busy']:.1f}"),
                     (f"HBM roofline, batch {st['batch']} (%)", f"{100 * st['roofline_fraction']:.1f}")]
        rows.append(("HBM bandwidth for the roofline (TB/s)", f"{r['steady'][0]['hbm_bandwidth'] / 1e12:.2f}"))
    for name, value in rows:
        print(f"{name:<40}{value:>20}")
    print(line)


def plot(results: list[dict], path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [r["label"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(labels, [r["output_throughput"] for r in results], color="tab:blue")
    a.set_ylabel("output tokens/s")
    b.bar(labels, [r["tpot_ms"]["mean"] for r in results], color="tab:orange")
    b.set_ylabel("mean TPOT (ms)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_json(results: list[dict], path: str):
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=float)
