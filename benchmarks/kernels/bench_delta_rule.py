"""The gated delta rule of a decode / verify / prefill step on one GPU: the Pallas kernels against the plain-JAX
scan (`jaxspec.nn.layers.delta_rule_scan`), at Qwen3-Next's linear-attention shapes (32 value heads, key and
value width 128, fp32 state), rows of 1 (decode), 1+k (verify) or one long prefill chunk (512 and 2048 tokens).
Per case the time per layer (`--layers` layers a jitted call, the ring donated and threaded from call to call,
as in the engine) of the scan, of the recurrent kernel alone over every token (`recurrent_us`: how prefill ran
before the chunked kernels) and of the engine's path (`kernel_us`: `jaxspec.nn.kernels.delta_rule_fn`,
a prefill row's tokens before its last k+1 in the chunked kernels, the rest recurrent; decode and verify rows
recurrent, with the chunked kernels' launches in steps of more than k+1 tokens), the first call's seconds
(mostly its compile), and the largest difference of each from the scan (outputs and rings).

    python3 benchmarks/kernels/bench_delta_rule.py [--heads 32] [--dk 128] [--dv 128] [--k 4] [--json out.json]
    python3 benchmarks/kernels/bench_delta_rule.py --kinds prefill --sweep   # the chunked kernels' chunk / block_v / warps
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def inputs(rows: int, tokens_per_row: int, heads: int, dk: int, dv: int, window: int, start: int, seed: int = 0):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.nn.ops import ForwardBatch
    rng = np.random.default_rng(seed)
    T = rows * tokens_per_row
    pos = np.tile(np.arange(start, start + tokens_per_row), rows)
    row_of = np.repeat(np.arange(rows), tokens_per_row)
    i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)   # noqa: E731
    batch = ForwardBatch(i32(np.zeros(T)), i32(pos), i32(pos), i32(row_of), i32(np.zeros((rows, 1))),
                         i32(np.arange(T)), slot_of_row=i32(np.arange(rows)),
                         first_token_of_row=i32(np.arange(rows) * tokens_per_row), writes_state=jnp.ones((T,), bool))
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)   # noqa: E731
    q, k = f32(T, heads, dk), f32(T, heads, dk)
    q, k = q / jnp.linalg.norm(q, axis=-1, keepdims=True), k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    ring = 0.1 * f32(1, rows + 1, window, heads, dk, dv)
    return batch, q, k, f32(T, heads, dv), jax.nn.sigmoid(f32(T, heads)), -jax.nn.softplus(f32(T, heads)), ring


def timed(fn, args, iters: int, layers: int) -> float:
    """Seconds per layer of fn(ring, layer, *rest) applied to `layers` layers of a stacked ring in one jitted call
    (as the engine's unrolled step does: one dispatch for them all), the ring donated and threaded from call to
    call (no copy of it, 10.5 MB per slot and layer at Qwen3-Next's shapes, in the time)."""
    import jax
    import jax.numpy as jnp

    def all_layers(ring, *rest):
        for i in range(layers):
            o, ring = fn(ring, i, *rest)
        return o, ring

    run = jax.jit(all_layers, donate_argnums=(0,))
    ring, rest = jnp.concatenate([args[0]] * layers), args[2:]
    o, ring = run(ring, *rest)
    jax.block_until_ready((o, ring))
    t0 = time.perf_counter()
    for _ in range(iters):
        o, ring = run(ring, *rest)
    jax.block_until_ready((o, ring))
    return (time.perf_counter() - t0) / iters / layers


def sweep_configs(ieee: bool):
    """The chunked kernels' settings --sweep times on the prefill cases."""
    for chunk in (32, 64):
        for block_v in (32, 64):
            for warps in ((4, 4), (8, 4)):
                yield dict(chunk=chunk, block_v=block_v, num_warps=warps)
    if ieee:   # f32 FMA matmuls: minutes to compile
        yield dict(chunk=64, block_v=64, num_warps=(4, 4), ieee=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="drafts per verify row (ring of k+1 entries)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--layers", type=int, default=8, help="layers per timed call (one dispatch for them all)")
    p.add_argument("--prefill", default="512,2048", help="prefill chunk lengths (one row each)")
    p.add_argument("--sweep", action="store_true", help="also time the chunked kernel's settings on prefill")
    p.add_argument("--ieee", action="store_true", help="--sweep also times f32 FMA matmuls (slow to compile)")
    p.add_argument("--kinds", default="decode,verify,prefill")
    p.add_argument("--json")
    args = p.parse_args()
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.nn.layers import delta_rule_scan
    from jaxspec.nn.kernels import delta_rule_fn
    W = args.k + 1
    cases = [("decode", r, 1) for r in (1, 8, 32)] + [("verify", r, 1 + args.k) for r in (1, 8, 32)] + \
            [("prefill", 1, int(n)) for n in args.prefill.split(",")]
    cases = [c for c in cases if c[0] in args.kinds.split(",")]
    donated = functools.partial(jax.jit, donate_argnums=(0,))
    scan = delta_rule_scan
    paths = {"recurrent": functools.partial(delta_rule_fn, chunked=False), "kernel": delta_rule_fn}
    results = []
    for kind, rows, n in cases:
        batch, q, k, v, beta, g, ring = inputs(rows, n, args.heads, args.dk, args.dv, W, start=100 if n < W else 0)
        call = (ring, 0, batch, q, k, v, beta, g)
        row = {"kind": kind, "rows": rows, "tokens_per_row": n}
        try:
            want_o, want_ring = donated(scan)(jnp.array(ring, copy=True), *call[1:])
            row["scan_us"] = 1e6 * timed(scan, call, args.iters, args.layers)
            todo = dict(paths)
            if args.sweep and kind == "prefill":
                for cfg in sweep_configs(args.ieee):
                    name = "chunked_c{chunk}_bv{block_v}_w{w[0]}_{w[1]}{f32}".format(
                        f32="_ieee" if cfg.get("ieee") else "", w=cfg["num_warps"], **cfg)
                    todo[name] = functools.partial(delta_rule_fn, **cfg)
            for name, fn in todo.items():
                try:
                    t0 = time.perf_counter()
                    got_o, got_ring = jax.block_until_ready(donated(fn)(jnp.array(ring, copy=True), *call[1:]))
                    row[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 2)   # mostly its compile
                    diff = lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b))))   # noqa: E731
                    row[f"{name}_max_abs_diff_o"] = diff(got_o, want_o)
                    row[f"{name}_max_abs_diff_ring"] = diff(got_ring, want_ring)
                    row[f"{name}_us"] = 1e6 * timed(fn, call, args.iters, args.layers)
                except Exception as e:   # a failure to compile is a result too
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "heads": args.heads, "dk": args.dk, "dv": args.dv,
                       "k": args.k, "layers": args.layers, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
