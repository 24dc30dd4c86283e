"""Device time of a stacked weight indexed statically against the same weights as separate buffers: the 0.5B
draft model's shapes (Qwen2.5-Coder-0.5B, random bf16), 8 tokens, 24 layers unrolled, 5 forwards in one jit (as
a draft model's step runs them).

    python3 scripts/bench_stacked_weights.py
"""
import time

import jax
import jax.numpy as jnp

from jaxspec.models.random import KNOWN_SHAPES, random_model
from jaxspec.nn import CacheShape, Decoder, ForwardBatch, Ops, schema
from jaxspec.nn.layers import LAYER_KINDS
from jaxspec.nn.ops import rms_norm

FORWARDS, T = 5, 8


def main():
    c = KNOWN_SHAPES["qwen2.5-coder-0.5b-instruct"]
    params = random_model(c, dtype="bfloat16").params
    ops = Ops(attention="pallas", block_size=16, unroll=True)
    decoder, kind = Decoder(c, ops), LAYER_KINDS["attention"]
    state = schema.initialize(decoder.state_schema(CacheShape(num_kv_slots=64 * 16, num_slots=9)), jnp.bfloat16)
    rows = jnp.arange(T, dtype=jnp.int32)
    batch = ForwardBatch(rows, jnp.full((T,), 100, jnp.int32), rows * 16 + 4, rows,
                         jnp.arange(64, dtype=jnp.int32).reshape(8, 8), rows)

    def stacked(params, state):
        total = 0.0
        for _ in range(FORWARDS):
            logits, _, _, state = decoder.forward(params, state, batch)
            total = total + logits.sum()
        return total, state

    def separate(params, state):
        total = 0.0
        kv = state["attention"]
        for _ in range(FORWARDS):
            h = params["embed"][batch.token_ids]
            for i, lp in enumerate(params["layers"]):
                h, kv, _ = kind(c, ops, lp, h, kv, i, batch)
            total = total + Decoder.logits(params, rms_norm(h, params["final_norm"], c.rms_norm_eps)).sum()
        return total, {"attention": kv}

    per_layer = {**params, "layers": [{k: jnp.array(v[i]) for k, v in params["layers"]["attention"].items()}
                                      for i in range(c.num_layers)]}      # a buffer of its own per weight
    for name, fn, p in [("stacked", stacked, params), ("separate", separate, per_layer)] * 2:
        f = jax.jit(fn, donate_argnums=(1,))
        out, state = f(p, state)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(50):
            out, state = f(p, state)
        jax.block_until_ready(out)
        print(f"{name}: {1e3 * (time.perf_counter() - t0) / 50:.3f} ms per {FORWARDS} forwards", flush=True)


if __name__ == "__main__":
    main()
