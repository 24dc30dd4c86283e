"""FP8 weights at decode sizes (issue #36): a step's projections as bf16, W8A16 (e4m3 weight converted inside the
matmul) and W8A8 (activations quantized per token, an e4m3 x e4m3 matmul), each compiled with the engine's options
for that token count (Ops.compiler_options: autotuned Triton GEMMs below 128 tokens, cuBLAS from there) and with
cuBLAS alone (the fast tier). Each projection is timed over a chain of distinct weights (more than the L2 cache
holds), so every matmul reads its weight from HBM, as a decode step does.

    python3 benchmarks/profiles/fp8_matmul.py [--model qwen2.5-coder-1.5b-instruct] [--tokens 8 32 128 256] [--json F]
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.random import KNOWN_SHAPES
from jaxspec.nn import quant
from jaxspec.nn.ops import Ops

FORMS = ("bf16", "w8a16", "w8a8")


def projections(c) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of a layer's weights (gate/up as one [2F, D])."""
    q = c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim
    return {"qkv": (q, c.hidden_size), "o": (c.hidden_size, c.num_heads * c.head_dim),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}


def chain_fn(form: str, layers: int):
    def run(x, w, scale):
        acc = jnp.zeros((x.shape[0], w.shape[1]), jnp.float32)
        for i in range(layers):
            if form == "bf16":
                y = x @ w[i].T
            else:
                y = quant.fp8_matmul(x, w[i], scale[i], w8a8=form == "w8a8")
            acc = acc + y.astype(jnp.float32)
        return acc
    return run


def time_form(form, T, N, K, options, reps=30):
    layers = int(max(4, min(128, (256 << 20) // (N * K))))
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (T, K), jnp.bfloat16)
    w = (0.02 * jax.random.normal(jax.random.fold_in(key, 1), (layers, N, K), jnp.float32)).astype(jnp.bfloat16)
    scale = jnp.ones((layers, N), jnp.float32)
    if form != "bf16":
        w, scale = quant.quantize_fp8(w)
    t0 = time.perf_counter()
    compiled = jax.jit(chain_fn(form, layers)).lower(x, w, scale).compile(options)
    compile_s = time.perf_counter() - t0
    compiled(x, w, scale).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        compiled(x, w, scale).block_until_ready()
        times.append(time.perf_counter() - t)
    us = 1e6 * float(np.median(times)) / layers
    weight_bytes = N * K * (2 if form == "bf16" else 1)
    return {"us": us, "GBps": weight_bytes / us / 1e3, "compile_s": compile_s, "layers": layers}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", choices=sorted(KNOWN_SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128, 256])
    p.add_argument("--tiers", nargs="+", default=["tuned", "fast"], choices=["tuned", "fast"])
    p.add_argument("--json")
    a = p.parse_args()
    ops = Ops.for_backend(16)
    rows = []
    print(f"{jax.devices()[0].device_kind}, {a.model}: us per matmul (GB/s of weight read)")
    for name, (N, K) in projections(KNOWN_SHAPES[a.model]).items():
        for T in a.tokens:
            for tier in a.tiers:
                cells = {}
                for form in FORMS:
                    r = time_form(form, T, N, K, ops.compiler_options(T, tier))
                    rows.append({"weight": name, "N": N, "K": K, "tokens": T, "tier": tier, "form": form, **r})
                    cells[form] = r
                best = min(cells, key=lambda f: cells[f]["us"])
                print(f"{name:8} {N:6}x{K:<6} T={T:<4} {tier:5}  " + "  ".join(
                    f"{f} {cells[f]['us']:7.2f} ({cells[f]['GBps']:6.0f})" for f in FORMS) + f"   best {best}",
                    flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "model": a.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
