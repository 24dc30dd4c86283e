"""The gated delta rule of a decode / verify / prefill step on one GPU: the Pallas recurrent kernel against the
plain-JAX scan (`jaxspec.nn.layers.delta_rule_scan`), at Qwen3-Next's linear-attention shapes (32 value heads,
key and value width 128, fp32 state), one layer, rows of 1 (decode), 1+k (verify) or a long prefill chunk.
Prints the time per call of each and the largest difference of their outputs and rings.

    python3 scripts/bench_delta_rule.py [--heads 32] [--dk 128] [--dv 128] [--k 4] [--json out.json]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


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


def timed(fn, args, iters: int) -> float:
    import jax
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="drafts per verify row (ring of k+1 entries)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json")
    args = p.parse_args()
    import jax
    import numpy as np

    from jaxspec.nn.layers import delta_rule_scan
    from jaxspec.pallas.delta_rule import delta_rule_fn
    W = args.k + 1
    cases = [("decode", r, 1) for r in (1, 8, 32)] + [("verify", r, 1 + args.k) for r in (1, 8, 32)] + \
            [("prefill", 1, 512)]
    scan, kernel = jax.jit(delta_rule_scan), jax.jit(delta_rule_fn)
    results = []
    for kind, rows, n in cases:
        batch, q, k, v, beta, g, ring = inputs(rows, n, args.heads, args.dk, args.dv, W, start=100 if n < W else 0)
        call = (ring, 0, batch, q, k, v, beta, g)
        row = {"kind": kind, "rows": rows, "tokens_per_row": n}
        try:
            want_o, want_ring = scan(*call)
            got_o, got_ring = kernel(*call)
            row["max_abs_diff_o"] = float(np.max(np.abs(np.asarray(got_o) - np.asarray(want_o))))
            row["max_abs_diff_ring"] = float(np.max(np.abs(np.asarray(got_ring) - np.asarray(want_ring))))
            row["scan_us"] = 1e6 * timed(scan, call, args.iters)
            row["kernel_us"] = 1e6 * timed(kernel, call, args.iters)
        except Exception as e:   # a failure to compile is a result too
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "heads": args.heads, "dk": args.dk, "dv": args.dv,
                       "k": args.k, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
