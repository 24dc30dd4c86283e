"""A decode step's attention over long contexts on one GPU, per layer: the fused kernel the engine runs
(jaxspec.pallas.paged_attention.paged_attention_fused: rotary and the KV write inside, the context split over
programs and merged) for `batch` rows of one token each in a bucket of `tokens` (the rest padding), every row at a
context of C tokens, at Qwen2.5-1.5B's attention shapes (2 kv heads x 6, head_dim 128), bf16, 16-token pages. Each
case is (context splits, pages a split program reads per iteration); the engine's choice today is
`fused_splits(tokens)` and `_split_pages`. Prints microseconds per layer and the KV bytes read per second. Each timed
call runs the layer `--inner` times in one program (a device loop), so the host's dispatch (~150 us a call on an
H100) is not counted as the kernel's.

    python3 benchmarks/kernels/bench_decode_attention.py [--contexts 1024 8192 32768] [--batches 1 8 32] [--json f]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def case(context: int, batch: int, tokens: int, splits: int, pages_per_iter: int | None, iters: int,
         inner: int = 1) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.pallas import paged_attention as pa
    Hkv, G, hd, bs = 2, 6, 128, 16
    per_row = context // bs + 1
    blocks = batch * per_row
    rng = np.random.default_rng(context + batch)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((2, blocks * bs, Hkv, hd)), jnp.bfloat16) for _ in range(2))
    qkv = jnp.asarray(rng.standard_normal((tokens, Hkv * (G + 2) * hd)), jnp.bfloat16)
    cos = jnp.asarray(rng.standard_normal((tokens, hd // 2)), jnp.float32)
    sin = jnp.asarray(rng.standard_normal((tokens, hd // 2)), jnp.float32)
    tables = jnp.asarray(rng.permutation(blocks).reshape(batch, per_row), jnp.int32)
    live = np.arange(tokens) < batch
    positions = jnp.asarray(np.where(live, context - 1, 0), jnp.int32)
    rows = jnp.asarray(np.where(live, np.arange(tokens), 0), jnp.int32)
    slots = np.where(live, np.asarray(tables)[np.minimum(np.arange(tokens), batch - 1), (context - 1) // bs] * bs
                     + (context - 1) % bs, blocks * bs)
    slots = jnp.asarray(slots, jnp.int32)
    first = jnp.arange(tokens, dtype=jnp.int32)
    old = pa.FUSED_SPLIT_PAGES_PER_ITER
    pa.FUSED_SPLIT_PAGES_PER_ITER = pages_per_iter
    try:
        def layer(k, v):
            return pa.paged_attention_fused(qkv, k, v, jnp.int32(1), cos, sin, positions, slots, first, rows, tables,
                                            num_heads=Hkv * G, block_size=bs, num_splits=splits)
        out_shape = jax.eval_shape(layer, k_pool, v_pool)[0]

        def repeated(k, v):   # the layer `inner` times in one program: the host dispatches once per call
            return jax.lax.fori_loop(0, inner, lambda i, c: layer(c[1], c[2]),
                                     (jnp.zeros(out_shape.shape, out_shape.dtype), k, v))
        fn = jax.jit(repeated, donate_argnums=(0, 1))
        out, k_pool, v_pool = fn(k_pool, v_pool)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(iters):
            out, k_pool, v_pool = fn(k_pool, v_pool)
        jax.block_until_ready(out)
        seconds = (time.perf_counter() - t0) / iters / inner
    finally:
        pa.FUSED_SPLIT_PAGES_PER_ITER = old
    kv_bytes = batch * context * 2 * Hkv * hd * 2
    return {"context": context, "batch": batch, "tokens": tokens, "splits": splits, "pages_per_iter": pages_per_iter,
            "inner": inner, "us": 1e6 * seconds, "kv_gb_per_s": kv_bytes / seconds / 1e9}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--splits", type=int, nargs="+", default=None, help="default: the engine's, 16, 32 and 64")
    p.add_argument("--pages-per-iter", type=int, nargs="+", default=[0, 4], help="0: the engine's (_split_pages)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--inner", type=int, default=20, help="layers per timed call, run in one device loop")
    p.add_argument("--json")
    args = p.parse_args()
    from jaxspec.pallas import paged_attention as pa
    rows = []
    for batch in args.batches:
        tokens = max(8, 1 << (batch - 1).bit_length())
        for context in args.contexts:
            for splits in sorted(set(args.splits or [pa.fused_splits(tokens), 16, 32, 64])):
                for ppi in args.pages_per_iter:
                    r = case(context, batch, tokens, splits, ppi or None, args.iters, args.inner)
                    r["engine_choice"] = splits == pa.fused_splits(tokens) and not ppi
                    rows.append(r)
                    print(f"batch {batch:>3} ({tokens:>3} tokens) C={context:>6} splits {splits:>3} pages/iter "
                          f"{ppi or 'engine':>6}: {r['us']:8.1f} us  {r['kv_gb_per_s']:7.0f} GB/s"
                          f"{'  <- engine' if r['engine_choice'] else ''}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
