"""Why the gemv kernel reads e4m3 weights at half its bf16 byte rate (issue #36): the same plain product
(x [T, K] @ W[layer].T, K split, f32 partial sums) with the weight tile turned into a matrix-unit operand six ways:

    bf16        the bf16 weight as it is (the reference rate)
    e4m3-bf16   e4m3 converted to bf16 in the kernel (what jaxspec.pallas.gemv does today)
    e4m3-f16    e4m3 converted to f16 (one hardware instruction per pair on Hopper), x passed as f16
    e4m3-bits   e4m3's bits moved into a bf16 by shifts (exponent bias 7 against 127: the 2^120 goes to the scale)
    e4m3-dot    x quantized per token to e4m3 outside, an e4m3 x e4m3 product (W8A8 inside the kernel)
    int8-bf16   int8 weights converted to bf16 (GGUF Q8_0's values, per-channel scale only: an upper bound for it)

Each form is timed over a chain of distinct weights larger than the L2 cache (every product reads HBM).

    python3 benchmarks/profiles/fp8_gemv_forms.py [--model qwen2.5-coder-1.5b-instruct] [--tokens 1 8 32] [--json F]
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.models.random import KNOWN_SHAPES

FORMS = ("bf16", "e4m3-bf16", "e4m3-f16", "e4m3-bits", "e4m3-dot", "int8-bf16")


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, form, T, K, bn, bk, S, rows):
    n, s = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = n * bn
    row_ok = jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 0) < T
    dims = (((1,), (1,)), ((), ()))
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=dims, preferred_element_type=jnp.float32)

    def operand(w):
        if form in ("bf16", "e4m3-dot"):
            return w
        if form == "e4m3-f16":
            return w.astype(jnp.float16)
        if form == "e4m3-bits":   # s eeee mmm -> s 0000eeee mmm0000 (a bf16 2^-120 times the e4m3 value)
            v = w.astype(jnp.int32)
            return jax.lax.bitcast_convert_type(((v & 0x80) << 8 | (v & 0x7F) << 4).astype(jnp.uint16),
                                                jnp.bfloat16)
        return w.astype(jnp.bfloat16)

    def step(j, acc):
        k = s * (K // S) + j * bk
        x = plgpu.load(x_ref.at[pl.ds(0, rows), pl.ds(k, bk)], mask=row_ok, other=0)
        return acc + dot(x, operand(w_ref[layer, pl.ds(n0, bn), pl.ds(k, bk)]))

    acc = jax.lax.fori_loop(0, K // S // bk, step, jnp.zeros((rows, bn), jnp.float32))
    out_ok = jax.lax.broadcasted_iota(jnp.int32, (rows, bn), 0) < T
    plgpu.store(o_ref.at[s, pl.ds(0, rows), pl.ds(n0, bn)], acc, mask=out_ok)


def product(x, w, layer, *, form, bn, bk, S, warps, stages):
    T, K = x.shape
    N = w.shape[1]
    rows = 16 if T <= 16 else 32
    whole = lambda a: pl.BlockSpec(a.shape, lambda n, s: (0,) * len(a.shape))  # noqa: E731
    args = [jnp.reshape(layer, (1,)).astype(jnp.int32), x, w]
    out = jax.ShapeDtypeStruct((S, T, N), jnp.float32)
    return pl.pallas_call(
        functools.partial(_kernel, form=form, T=T, K=K, bn=bn, bk=bk, S=S, rows=rows), grid=(N // bn, S),
        in_specs=[whole(a) for a in args], out_specs=pl.BlockSpec(out.shape, lambda n, s: (0, 0, 0)), out_shape=out,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages), name="gemv_form",
        interpret=jax.default_backend() != "gpu")(*args).sum(0)


def weights(form, layers, N, K):
    key = jax.random.PRNGKey(0)
    w = 0.02 * jax.random.normal(key, (layers, N, K), jnp.float32)
    if form == "bf16":
        return w.astype(jnp.bfloat16)
    if form == "int8-bf16":
        return jnp.clip(jnp.round(w * 3000), -127, 127).astype(jnp.int8)
    w = (w * 2000).astype(jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(w, jnp.uint8) if form == "e4m3-bits" else w   # its bits, for the shifts


def activations(form, T, K):
    x = jax.random.normal(jax.random.PRNGKey(1), (T, K), jnp.float32)
    if form == "e4m3-f16":
        return x.astype(jnp.float16)
    if form == "e4m3-dot":
        return x.astype(jnp.float8_e4m3fn)
    return x.astype(jnp.bfloat16)


def time_form(form, T, N, K, tiling, reps=20):
    one_byte = form != "bf16"
    layers = int(max(4, min(64, (160 << 20) // (N * K * (1 if one_byte else 2)))))   # > the 50 MB L2
    w, x = weights(form, layers, N, K), activations(form, T, K)

    def chain(x, w):
        acc = jnp.zeros((T, N), jnp.float32)
        for i in range(layers):
            acc = acc + product(x, w, i, form=form, **tiling)
        return acc
    compiled = jax.jit(chain).lower(x, w).compile()
    out = compiled(x, w).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        compiled(x, w).block_until_ready()
        times.append(time.perf_counter() - t)
    us = 1e6 * float(np.median(times)) / layers
    # the product of layer 0 against a float32 reference of the same operands (the forms must compute the product)
    w0 = jax.lax.bitcast_convert_type(w[0], jnp.float8_e4m3fn) if form == "e4m3-bits" else w[0]
    ref = (x.astype(jnp.float32) @ w0.astype(jnp.float32).T)
    got = product(x, w, 0, form=form, **tiling)
    if form == "e4m3-bits":
        got = got * 2.0 ** 120
    err = float(jnp.max(jnp.abs(got - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))
    del out
    return {"us": us, "GBps": N * K * (1 if one_byte else 2) / us / 1e3, "rel_err": err}


def tilings(form, K, grid):
    """The tilings of `grid` (block_n, block_k of a one-byte weight: bf16 takes half, warps, stages) that divide K;
    K split so that each program walks >= 1024 of it."""
    for bn in grid["bn"]:
        for bk in grid["bk"]:
            bk = bk // 2 if form == "bf16" else bk
            if K % bk:
                continue
            S = next((s for s in (5, 7, 4, 3, 2, 1) if K % (s * bk) == 0 and K // s >= 1024), 1)
            for warps in grid["warps"]:
                for stages in grid["stages"]:
                    yield {"bn": bn, "bk": bk, "S": S, "warps": warps, "stages": stages}


def projections(c):
    q = c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim
    return {"qkv": (q, c.hidden_size), "o": (c.hidden_size, c.num_heads * c.head_dim),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", nargs="+", default=["qwen2.5-coder-1.5b-instruct"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    p.add_argument("--weights", nargs="+", default=["qkv", "o", "gate_up", "down"])
    p.add_argument("--bn", type=int, nargs="+", default=[32])
    p.add_argument("--bk", type=int, nargs="+", default=[256], help="of a one-byte weight (bf16: half)")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    rows = []
    print(f"{jax.devices()[0].device_kind}: best tiling's us per product (GB/s of weight read)", flush=True)
    for model in a.model:
        for name, (N, K) in projections(KNOWN_SHAPES[model]).items():
            if name not in a.weights:
                continue
            for T in a.tokens:
                cells = {}
                for form in a.forms:
                    best = None
                    grid = {"bn": a.bn, "bk": a.bk, "warps": a.warps, "stages": a.stages}
                    for t in tilings(form, K, grid):
                        if N % t["bn"]:
                            continue
                        try:
                            r = time_form(form, T, N, K, t)
                        except Exception as e:   # noqa: BLE001 - a form or tiling Triton cannot compile
                            print(f"  {form} {t}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                            continue
                        rows.append({"model": model, "weight": name, "N": N, "K": K, "tokens": T, "form": form,
                                     "tiling": t, **r})
                        if best is None or r["us"] < best["us"]:
                            best = {**r, "tiling": t}
                        if a.verbose:
                            print(f"    {form} {t} {r['us']:.2f} us", flush=True)
                    if best:
                        cells[form] = best
                print(f"{model[:12]:12} {name:8} {N:6}x{K:<6} T={T:<3} " + "  ".join(
                    f"{f} {c['us']:6.2f} ({c['GBps']:5.0f}{'' if c['rel_err'] < 0.05 else ' ERR'}) "
                    f"{c['tiling']['bn']}/{c['tiling']['bk']}/{c['tiling']['warps']}/{c['tiling']['stages']}"
                    for f, c in cells.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
