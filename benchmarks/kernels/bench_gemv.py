"""The decode step's four matmuls per layer through jaxspec.pallas.gemv (norm, SwiGLU and residual fused) against
XLA's path (the same math in jnp: its GEMM plus the norm / SwiGLU / residual kernels around it), on the
Qwen2.5-Coder-1.5B shapes with every layer's weight stacked [28, ...] and each layer's read once per call (so the
weights stream from HBM); device time from a profiler trace.

    python3 benchmarks/kernels/bench_gemv.py --tokens 8 16 32 --json /tmp/gemv.jsonl
    python3 benchmarks/kernels/bench_gemv.py --engine-tilings --tokens 8 16     # only the tilings the engine uses

Prints, per (matmul, tokens): XLA's time per layer, each tiling's, and the best as a fraction of the copy
bandwidth (weight bytes / time against --copy-gbs).
"""
import argparse
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp

from jaxspec.nn.ops import rms_norm
from jaxspec.pallas.gemv import Tiling, gemv, tiling_for

L, D, F, QKV = (4, 256, 512, 384) if os.environ.get("BENCH_GEMV_SMALL") else (28, 1536, 8960, 2048)
EPS = 1e-6


def ops(key):
    """name -> (weight, weight bytes per layer, x builder, xla fn(x, w, norm, res, i), gemv fn(x, w, norm, res, i, tiling))."""
    ks = jax.random.split(key, 4)
    def rnd(k, shape):
        return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(jnp.bfloat16)
    w_qkv, w_o = rnd(ks[0], (L, QKV, D)), rnd(ks[1], (L, D, D))
    w_gu, w_down = rnd(ks[2], (L, F, 2, D)), rnd(ks[3], (L, D, F))

    return {
        "qkv (norm)": (w_qkv, D, lambda x, w, g, r, i: rms_norm(x, g[i], EPS) @ w[i].T,
                       lambda x, w, g, r, i, t: gemv(x, w, i, g, tiling=t, eps=EPS)),
        "o (+residual)": (w_o, D, lambda x, w, g, r, i: r + x @ w[i].T,
                          lambda x, w, g, r, i, t: (gemv(x, w, i, residual=r, tiling=t) if t.splits == 1 else
                                                    r + gemv(x, w, i, tiling=t).sum(0).astype(r.dtype))),
        "gate_up (norm, SwiGLU)": (w_gu, D, lambda x, w, g, r, i: _swiglu(rms_norm(x, g[i], EPS), w[i]),
                                   lambda x, w, g, r, i, t: gemv(x, w, i, g, tiling=t, eps=EPS)),
        "down (+residual)": (w_down, F, lambda x, w, g, r, i: r + x @ w[i].T,
                             lambda x, w, g, r, i, t: (gemv(x, w, i, residual=r, tiling=t) if t.splits == 1 else
                                                       r + gemv(x, w, i, tiling=t).sum(0).astype(r.dtype))),
    }


def _swiglu(x, w):
    gu = (x @ w.reshape(-1, w.shape[-1]).T).reshape(x.shape[0], w.shape[0], 2)
    return jax.nn.silu(gu[..., 0]) * gu[..., 1]


def timed(fn, args, reps=3):
    """Device time per layer: every kernel's duration in a profiler trace of `reps` calls (the host's dispatch
    of 28 outputs per call would otherwise be what a wall clock measures)."""
    import glob
    import tempfile

    from jax.profiler import ProfileData
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(reps):
                out = fn(*args)
            jax.block_until_ready(out)
        total = 0
        for plane in ProfileData.from_file(sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1]).planes:
            if "GPU" in plane.name:
                for line in plane.lines:
                    if "Stream" in line.name or "Kernel" in line.name:
                        total += sum(ev.duration_ns for ev in line.events if not ev.name.startswith("Memcpy"))
    return total / 1e9 / reps / L


def all_layers(one):
    """Each of the 28 layers' matmul once per call, every output returned (nothing is dead)."""
    def f(x, w, g, r):
        return [one(x, w, g, r, i) for i in range(L)]
    return jax.jit(f)


def tilings(N, K, pairs, norm):
    """Block sizes and splits at 4 warps and 4 stages (the first pass); a norm or gate/up pairs take one split."""
    for bn, bk, S in itertools.product((16, 32, 64, 128), (128, 256, 512), (1, 2, 3, 4, 5, 7, 8)):
        programs = N // bn * S
        if N % bn or K % (S * bk) or K % bk or not 64 <= programs <= 1200 or (pairs and bn > 64):
            continue
        if (pairs or norm) and S > 1:
            continue
        yield Tiling(bn, bk, S, 4, 4)


def variants(t):
    """Warps and pipeline depth around a good tiling (the second pass)."""
    for warps, stages in itertools.product((2, 4, 8), (2, 3, 4, 5)):
        if (warps, stages) != (t.num_warps, t.num_stages):
            yield Tiling(t.block_n, t.block_k, t.splits, warps, stages)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--ops", nargs="+", help="a subset of the matmuls (by name prefix)")
    p.add_argument("--copy-gbs", type=float, default=2980.0, help="the device's copy bandwidth, GB/s")
    p.add_argument("--budget-s", type=float, default=60.0, help="sweep each (matmul, tokens) for at most this long")
    p.add_argument("--json", help="append one JSON line per measurement here")
    p.add_argument("--engine-tilings", action="store_true",
                   help="time only the tiling the engine picks for each matmul (jaxspec.pallas.gemv.tiling_for)")
    a = p.parse_args()
    table = ops(jax.random.PRNGKey(0))
    norm = jnp.ones((L, F), jnp.bfloat16)
    log = open(a.json, "a") if a.json else None
    best_of = {}
    for name, (w, K, xla_one, gemv_one) in table.items():
        if a.ops and not any(name.startswith(o) for o in a.ops):
            continue
        pairs = w.ndim == 4
        N = w.shape[1]
        wbytes = w[0].size * w.dtype.itemsize
        for T in a.tokens:
            x = (jax.random.normal(jax.random.PRNGKey(T), (T, K))).astype(jnp.bfloat16)
            r = jnp.zeros((T, N), jnp.bfloat16)
            g = norm[:, :K]
            xla_s = timed(all_layers(xla_one), (x, w, g, r))
            ref = jax.jit(lambda x, w, g, r: xla_one(x, w, g, r, 3))(x, w, g, r)
            results = []
            t_start = time.perf_counter()

            def measure(t):
                try:
                    out = jax.jit(lambda x, w, g, r, t=t: gemv_one(x, w, g, r, 3, t))(x, w, g, r)
                    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
                    s = timed(all_layers(lambda x, w, g, r, i, t=t: gemv_one(x, w, g, r, i, t)), (x, w, g, r))
                except Exception as e:  # noqa: BLE001 - a tiling Triton cannot compile is skipped, named
                    print(f"  {name} T={T} {t}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    return
                results.append((s, t, err))
                if log:
                    log.write(json.dumps({"op": name, "T": T, "tiling": t.__dict__, "us": 1e6 * s, "max_err": err,
                                          "xla_us": 1e6 * xla_s}) + "\n")
                    log.flush()

            if a.engine_tilings:
                measure(tiling_for(N, K, norm="norm" in name, pairs=pairs))
            else:
                for t in tilings(N, K, pairs, norm="norm" in name):
                    if time.perf_counter() - t_start < a.budget_s:
                        measure(t)
                for best in sorted(results, key=lambda z: z[0])[:2]:
                    for t in variants(best[1]):
                        if time.perf_counter() - t_start < a.budget_s:
                            measure(t)
            results.sort(key=lambda z: z[0])
            bw = lambda s: wbytes / s / 1e9 / a.copy_gbs if s else float("nan")  # noqa: E731 (no GPU: no trace)
            print(f"{name:24s} T={T:3d}  XLA {1e6 * xla_s:7.2f} us ({100 * bw(xla_s):4.1f}% of copy bw)", flush=True)
            for s, t, err in results[:4]:
                print(f"    gemv {1e6 * s:7.2f} us ({100 * bw(s):4.1f}%)  {t}  max|diff| {err:.3g}", flush=True)
            if results:
                best_of[(name, T)] = results[0][1]
    print("best tilings:")
    for (name, T), t in best_of.items():
        print(f"  {name!r}, {T}: {t}")


if __name__ == "__main__":
    main()
