"""FP8 weights at decode sizes (issue #36): a step's projections as bf16, W8A16 (e4m3 weight converted inside the
matmul) and W8A8 (activations quantized per token, an e4m3 x e4m3 matmul), each compiled with the engine's options
for that token count (Ops.compiler_options: autotuned Triton GEMMs below 128 tokens, cuBLAS from there) and with
cuBLAS alone (the fast tier). Each projection is timed over a chain of distinct weights (more than the L2 cache
holds), so every matmul reads its weight from HBM, as a decode step does.

    python3 benchmarks/profiles/fp8_matmul.py [--model qwen2.5-coder-1.5b-instruct] [--tokens 8 32 128 256] [--json F]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.random import KNOWN_SHAPES
from jaxspec.nn import kernels, quant
from jaxspec.nn.ops import Ops
from jaxspec.pallas.gemv import MAX_ROWS, Tiling, gemv, tiling_for

FORMS = ("bf16", "w8a16", "w8a8", "gemv16", "gemv8")   # gemv: jaxspec.pallas.gemv (bf16 / e4m3 weights), T <= 32


def projections(c) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of a layer's weights (gate/up as one [2F, D])."""
    q = c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim
    return {"qkv": (q, c.hidden_size), "o": (c.hidden_size, c.num_heads * c.head_dim),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}


def chain_fn(form: str, layers: int, tiling=None):
    def run(x, w, scale):
        acc = jnp.zeros((x.shape[0], w.shape[1]), jnp.float32)
        for i in range(layers):
            if tiling is not None:   # the kernel at a given tiling (--sweep)
                y = gemv(x, w, i, scale=None if form == "gemv16" else scale, tiling=tiling)
                y = y.sum(0) if tiling.splits > 1 else y
            elif form.startswith("gemv"):   # the layer's weight read in place from the stack, as the engine does
                stacks = {"w": w} if form == "gemv16" else {"w": w, "w_scale": scale}
                y = kernels.gemv_linear(x, kernels.LayerWeights(stacks, i), "w")
            elif form == "bf16":
                y = x @ w[i].T
            else:
                y = quant.fp8_matmul(x, w[i], scale[i], w8a8=form == "w8a8")
            acc = acc + y.astype(jnp.float32)
        return acc
    return run


def time_form(form, T, N, K, options, reps=30, tiling=None, min_layers=4):
    # at least 256 MB of weights (past the L2 cache); min_layers also makes one call long against its dispatch
    layers = int(max(min_layers, min(128, (256 << 20) // (N * K))))
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (T, K), jnp.bfloat16)
    w = (0.02 * jax.random.normal(jax.random.fold_in(key, 1), (layers, N, K), jnp.float32)).astype(jnp.bfloat16)
    scale = jnp.ones((layers, N), jnp.float32)
    if form not in ("bf16", "gemv16"):
        w, scale = quant.quantize_fp8(w)
    t0 = time.perf_counter()
    compiled = jax.jit(chain_fn(form, layers, tiling)).lower(x, w, scale).compile(options)
    compile_s = time.perf_counter() - t0
    compiled(x, w, scale).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        compiled(x, w, scale).block_until_ready()
        times.append(time.perf_counter() - t)
    us = 1e6 * float(np.median(times)) / layers
    weight_bytes = N * K * (2 if form in ("bf16", "gemv16") else 1)
    return {"us": us, "GBps": weight_bytes / us / 1e3, "compile_s": compile_s, "layers": layers}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", choices=sorted(KNOWN_SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128, 256])
    p.add_argument("--tiers", nargs="+", default=["tuned", "fast"], choices=["tuned", "fast"])
    p.add_argument("--sweep", action="store_true", help="the gemv8 kernel over a grid of tilings (block_k, warps, "
                                                        "stages, splits) around the bf16 one")
    p.add_argument("--weights", nargs="+", default=["qkv", "o", "gate_up", "down"], help="which projections")
    p.add_argument("--json")
    a = p.parse_args()
    ops = Ops.for_backend(16)
    rows = []
    if a.sweep:
        return sweep(a, ops)
    print(f"{jax.devices()[0].device_kind}, {a.model}: us per matmul (GB/s of weight read)")
    for name, (N, K) in projections(KNOWN_SHAPES[a.model]).items():
        for T in a.tokens:
            for tier in a.tiers:
                cells = {}
                for form in [f for f in FORMS if T <= 32 or not f.startswith("gemv")]:
                    r = time_form(form, T, N, K, ops.compiler_options(T, tier))
                    rows.append({"weight": name, "N": N, "K": K, "tokens": T, "tier": tier, "form": form, **r})
                    cells[form] = r
                best = min(cells, key=lambda f: cells[f]["us"])
                print(f"{name:8} {N:6}x{K:<6} T={T:<4} {tier:5}  " + "  ".join(
                    f"{f} {cells[f]['us']:7.2f} ({cells[f]['GBps']:5.0f})" for f in cells) + f"   best {best}",
                    flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "model": a.model, "rows": rows}, f, indent=1)


def sweep(a, ops):
    rows = []
    print(f"{jax.devices()[0].device_kind}, {a.model}: gemv8 tilings, us per matmul (GB/s of weight read)")
    for name, (N, K) in projections(KNOWN_SHAPES[a.model]).items():
        if name not in a.weights:
            continue
        base = tiling_for(N, K, norm=False, pairs=False, fp8=True)   # the engine's, for the plain fp8 product
        for T in a.tokens:
            if T > MAX_ROWS:
                continue
            results = []
            for bk in sorted({base.block_k, 2 * base.block_k, 4 * base.block_k}):
                for splits in sorted({1, 2, base.splits}):
                    for warps in (4, 8):
                        for stages in (3, 4):
                            t = Tiling(base.block_n, bk, splits, warps, stages)
                            if K % (splits * bk):
                                continue
                            try:
                                r = time_form("gemv8", T, N, K, ops.compiler_options(T), reps=15, tiling=t,
                                              min_layers=16)
                            except Exception as e:   # noqa: BLE001 - a tiling Triton cannot compile
                                print(f"  {t}: {type(e).__name__}")
                                continue
                            results.append((r["us"], t))
                            rows.append({"weight": name, "tokens": T, "tiling": dataclasses.asdict(t), **r})
            results.sort(key=lambda x: x[0])
            base_us = next((u for u, t in results if t == base), None)
            print(f"{name:8} T={T:<3} bf16-tiling {base_us if base_us is None else round(base_us, 2)} us; best "
                  + "; ".join(f"{u:.2f} us {t}" for u, t in results[:2]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "model": a.model, "sweep": rows}, f, indent=1)


if __name__ == "__main__":
    main()
