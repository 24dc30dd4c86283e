"""The experts' grouped matmul (jaxspec.pallas.grouped_matmul) against XLA's ragged_dot on GPT-OSS-20B's expert
shapes (32 experts, top 4; gate/up [2880, 5760], down [2880, 2880]) or Qwen3-30B-A3B's (`--shape qwen3-moe`: 128
experts, top 8; gate/up [2048, 1536], down [768, 2048]), bf16, for the rows of a decode step of T tokens routed at
random. L layers' experts are stacked (--layers, 24), and one program multiplies by each layer's in turn (the
weights stream from HBM, and no two calls are alike for XLA to merge); its wall time / L. At one token a program's
fixed cost still shows: GPT-OSS-20B's gate/up took 72.8 us a call with 12 layers and 52.8 us with 24, where a
trace of the engine's decode step has 49.6 us (6 layers, as this bench ran until 2026-11-28, gave 62-125 us). A
trace (benchmarks/profiles/profile_step.py) is the reference for one token's matmuls; this bench compares tilings.
--bucket B: the rows of a decode step's token bucket (B x top-k), of which the T tokens' are routed and the rest
routed to no expert, as the engine runs a step of T tokens in a bucket of B.

    python3 benchmarks/kernels/bench_grouped_matmul.py --tokens 1 8 32 160 [--shape gpt-oss] [--layers L]
        [--bucket B] [--sweep | --split-sweep] [--no-xla] [--json OUT.json]

--sweep: block_n x block_k x stages; --split-sweep: block_n x splits of K (block_k 64, 4 stages); neither: the
engine's own choice (`tiling_for`).

Prints per (matmul, tokens): the routed experts' bytes, ragged_dot's time, each tiling's, and the best as GB/s of
the routed experts' weights.
"""
import argparse
import dataclasses
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.pallas.grouped_matmul import Tiling, grouped_matmul, tiling_for

MODELS = {"gpt-oss": (32, 4, 2880, 2880), "qwen3-moe": (128, 8, 2048, 768)}    # experts, top-k, hidden, expert F


def timed(fn, *args, calls: int, reps: int = 5) -> float:
    """Seconds per kernel call: fn runs `calls` of them in one program, so the device's time, not the host's
    dispatch, is what is timed."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps / calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 160])
    p.add_argument("--shape", choices=sorted(MODELS), default="gpt-oss")
    p.add_argument("--sweep", action="store_true", help="every tiling of the grid below, not the default alone")
    p.add_argument("--split-sweep", action="store_true", help="block_n x splits of K")
    p.add_argument("--layers", type=int, default=24, help="layers stacked, each read once per program")
    p.add_argument("--bucket", type=int, help="token slots of the step (>= each T): the rest are routed nowhere")
    p.add_argument("--no-xla", action="store_true", help="skip ragged_dot (slow to compile at 128 experts)")
    p.add_argument("--json")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    L = a.layers
    E, TOP_K, D, F = MODELS[a.shape]
    for name, (K, N) in {"gate_up": (D, 2 * F), "down": (F, D)}.items():
        w = 0.02 * jax.random.normal(jax.random.PRNGKey(0), (L, E, K, N), jnp.bfloat16)
        for T in a.tokens:
            top_e = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(T)])
            gs = jnp.asarray(np.bincount(top_e.reshape(-1), minlength=E), jnp.int32)
            R = max(T, a.bucket or T) * TOP_K
            x = jnp.asarray(rng.standard_normal((R, K)), jnp.bfloat16)
            routed = int((np.asarray(gs) > 0).sum())
            nbytes = routed * K * N * 2
            xla = jax.jit(lambda x, w, gs: sum(jax.lax.ragged_dot(x[:T * TOP_K], w[i], gs) for i in range(L)))
            row = {"shape": a.shape, "matmul": name, "tokens": T, "rows": R, "routed_experts": routed,
                   "layers": L, "stack_bytes": w.nbytes,
                   "xla_us": None if a.no_xla else 1e6 * timed(xla, x, w, gs, calls=L), "tilings": []}
            if a.sweep:
                grid = [Tiling(16, bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32, 64, 128), (32, 64),
                                                                                      (3, 4))]
            elif a.split_sweep:
                grid = [Tiling(16, bn, 64, 4, 4, sp) for bn, sp in itertools.product((32, 64, 128), (1, 2, 4, 8))]
            else:
                grid = [tiling_for(N, K, R, E)]
            for t in grid:
                if N % t.block_n or K % t.block_k:
                    continue
                fn = jax.jit(lambda x, w, gs, t=t: sum(grouped_matmul(x, w, jnp.int32(i), gs, tiling=t)
                                                       for i in range(L)))
                try:
                    us = 1e6 * timed(fn, x, w, gs, calls=L)
                except Exception as e:   # a tiling Triton refuses (shared memory): skipped
                    print(f"  {t}: {type(e).__name__}", flush=True)
                    continue
                row["tilings"].append({"tiling": list(dataclasses.astuple(t)), "us": us, "GBps": nbytes / us / 1e3})
            best = min(row["tilings"], key=lambda r: r["us"])
            xla_us = "-" if row["xla_us"] is None else f"{row['xla_us']:8.1f}"
            print(f"{name:8s} T={T:4d} routed {routed:3d}/{E}: ragged_dot {xla_us} us | kernel best "
                  f"{best['us']:8.1f} us {best['GBps']:6.0f} GB/s {best['tiling']}", flush=True)
            for r in sorted(row["tilings"], key=lambda r: r["us"])[:4] if len(grid) > 1 else []:
                print(f"      {r['us']:8.1f} us {r['GBps']:6.0f} GB/s {r['tiling']}")
            rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
