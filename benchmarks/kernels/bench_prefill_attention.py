"""One prefill chunk's attention on one GPU, per layer: the prefill kernel's query tiles
(jaxspec.pallas.prefill_attention) against the per-token kernel the step ran before (jaxspec.pallas.paged_attention,
one program per token and kv head), for a row whose chunk of T tokens ends a context of C tokens, at Qwen2.5-1.5B's
(2 kv heads x 6) and Llama-3.1-8B's (8 x 4) attention shapes, bf16, 16-token pages. Each case prints the
microseconds per layer, the attention's TFLOP/s (causal: 4 * T * (C - T/2) * Hq * hd FLOP) and the largest
difference between the kernels relative to the output's largest value.

    python3 benchmarks/kernels/bench_prefill_attention.py [--contexts 2048 8192 32768] [--chunks 512 2048] [--json f]
        [--q-tiles 16 32 64] [--heads 1 2 6]     # query heads per program: a kv head's share each page group read
"""
import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SHAPES = {"qwen2.5-1.5b": (2, 6, 128), "llama-3.1-8b": (8, 4, 128)}


def timed(fn, iters: int) -> float:
    import jax
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def case(shape: str, context: int, chunk: int, q_tile: int, iters: int, heads: int = 1) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.pallas.paged_attention import paged_attention
    from jaxspec.pallas.prefill_attention import prefill_attention
    Hkv, G, hd = SHAPES[shape]
    bs, layers = 16, 2
    blocks = context // bs + 1
    rng = np.random.default_rng(context + chunk)
    pool = lambda: jnp.asarray(rng.standard_normal((layers, blocks * bs, Hkv, hd)), jnp.bfloat16)  # noqa: E731
    k_pool, v_pool = pool(), pool()
    q = jnp.asarray(rng.standard_normal((chunk, Hkv * G, hd)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(blocks)[None, :], jnp.int32)
    positions = jnp.arange(context - chunk, context, dtype=jnp.int32)
    rows, first = jnp.zeros(chunk, jnp.int32), jnp.zeros(chunk, jnp.int32)
    layer = jnp.int32(1)
    tiles = lambda: prefill_attention(  # noqa: E731
        q, k_pool, v_pool, layer, positions, first, rows, tables, block_size=bs, q_tile=q_tile, heads_per_program=heads)
    per_token = lambda: paged_attention(q, k_pool, v_pool, layer, positions, rows, tables, block_size=bs)  # noqa: E731
    a, b = tiles().astype(jnp.float32), per_token().astype(jnp.float32)
    diff = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    flop = 4 * chunk * (context - chunk / 2) * Hkv * G * hd
    t_tiles, t_token = timed(tiles, iters), timed(per_token, iters)
    return {"shape": shape, "context": context, "chunk": chunk, "q_tile": q_tile, "heads_per_program": heads,
            "tiles_us": 1e6 * t_tiles,
            "per_token_us": 1e6 * t_token, "speedup": t_token / t_tiles, "tiles_tflops": flop / t_tiles / 1e12,
            "per_token_tflops": flop / t_token / 1e12, "max_rel_diff": diff}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--q-tiles", type=int, nargs="+", default=[64])
    p.add_argument("--heads", type=int, nargs="+", default=[1],
                   help="query heads per program (a kv head's: divisors of the group; 1: one per query head)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for shape in args.shapes:
        for context in args.contexts:
            for chunk in args.chunks:
                for q_tile, heads in itertools.product(args.q_tiles, args.heads):
                    if chunk > context or SHAPES[shape][1] % heads:
                        continue
                    r = case(shape, context, chunk, q_tile, args.iters, heads)
                    rows.append(r)
                    print(f"{shape:>13} C={context:>6} T={chunk:>5} q_tile={q_tile:>3} heads={heads}: "
                          f"tiles {r['tiles_us']:9.1f} us "
                          f"({r['tiles_tflops']:5.1f} TFLOP/s)  per-token {r['per_token_us']:9.1f} us "
                          f"({r['per_token_tflops']:5.1f})  x{r['speedup']:.2f}  diff {r['max_rel_diff']:.1e}",
                          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
