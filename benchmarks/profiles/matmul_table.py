"""Each matmul of a decode step against the bandwidth bound, in one table: per projection of the layers (q/k/v, o,
gate/up, down) and the LM head, the weight bytes a step reads, the microseconds it takes, the TB/s that makes and
its share of this GPU's device-to-device copy bandwidth (jaxspec.bench.measure.copy_bandwidth, measured in this
process), for each row count (decode tokens in the step).

Every projection runs exactly as the engine's step runs it: through `Ops.linear` with the engine's Ops for this
device (`Ops.for_backend`: the gemv kernel for few rows where it is chosen, XLA's dot otherwise, the FP8 paths) and
the arguments the layer gives it (its input norm, residual, activation), over every layer's weight of the stack
(unrolled with the layer index static on a GPU, scanned on a CPU, as `Decoder.forward` does), each layer's input
waiting on the layer before's output (one small elementwise op: fused into XLA's matmul, a kernel of a few us of its
own before a gemv kernel, counted in its time). The path column says which ran: "gemv" or "xla". One timed call
runs the whole stack `--inner` times in a device loop (so the host's ~150 us dispatch is not counted), the best of
`--repeats` calls after a warm-up compile with the engine's XLA options for a step of that many tokens
(`Ops.compiler_options`: autotuned Triton GEMMs below 128, cuBLAS from there).

    python3 benchmarks/profiles/matmul_table.py --model qwen2.5-coder-1.5b-instruct [--rows 1 8 32] \
        [--quantization fp8] [--json /tmp/matmuls.json]

Bytes are the weights (and FP8 scales) alone: the activations, norm weights and residuals beside them are a few
KiB. The total row sums the projections and compares them with every weight of the model, which a decode step
reads once (the rest: norms, biases, an untied embedding's looked-up rows).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


@dataclasses.dataclass(frozen=True)
class Call:
    """How a layer calls `Ops.linear` for one of its weights: the input norm's weight name, whether the residual
    stream is added after, and whether the config's hidden_act is the gate's activation (jaxspec.nn.layers)."""
    name: str
    norm: str | None = None
    residual: bool = False
    config_activation: bool = False


# The projections of each dense layer kind as its __call__ runs them (jaxspec.nn.layers.attention.Attention and its
# `mlp`, jaxspec.nn.layers.gemma3): the norm before and the residual after go into Ops.linear with the weight.
LAYER_CALLS = {
    "attention": (Call("qkv_proj", norm="attn_norm"), Call("o_proj", residual=True),
                  Call("gate_up_proj", norm="mlp_norm"), Call("down_proj", residual=True)),
    "gemma3_attention": (Call("qkv_proj", norm="attn_norm"), Call("o_proj"),
                         Call("gate_up_proj", norm="mlp_norm", config_activation=True), Call("down_proj")),
}


def weight_nbytes(params: dict, name: str) -> int:
    """Bytes of the weight `name` in `params` (a stack: every layer's) and of its FP8 scales if it has them."""
    from jaxspec.nn.quant import SCALE
    return sum(params[n].nbytes for n in (name, name + SCALE) if n in params)


def _timed(fn, args, inner: int, repeats: int) -> float:
    """Seconds of one of fn's `inner` iterations: the fastest of `repeats` calls, after a warm-up (the compile)."""
    import jax
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def _chained(x, y, zero):
    """x again, made to wait on y: x + y[0, 0] * zero, `zero` a traced 0 (an argument, so that XLA can neither fold
    the product away nor drop y's computation as unused, nor hoist the next projection out of the loop). One small
    elementwise op: XLA fuses it into the next projection's own (its norm, or its GEMM's input) on XLA's path, a
    kernel of its own (a few us on a GPU, counted in the projection's time) before a gemv kernel."""
    return x + (y[:1, :1].astype(zero.dtype) * zero).astype(x.dtype)


def _on_kernel(fn, *args) -> bool:
    """Whether fn's trace runs a Pallas kernel (the gemv), not XLA's dot."""
    import jax
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def layer_projection(ops, config, stacks: dict, call: Call, rows: int, dtype, inner: int, repeats: int,
                     seed: int) -> dict:
    """`call`'s projection over every layer of `stacks` (the kind's stacked weights [L, ...]) for `rows` rows: the
    layer's input [rows, K] and (with a residual) the residual stream [rows, N] random in `dtype` (the hidden
    states'); each layer's input waits on the previous layer's output (`_chained`), as in a step."""
    import jax
    import jax.numpy as jnp

    from jaxspec.nn.kernels import LayerWeights
    w = stacks[call.name]
    num_layers, K = w.shape[0], w.shape[-1]
    N = w.shape[1]                      # (a gate/up pair [L, F, 2, K]: F outputs)
    kx, kr = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (rows, K), dtype)
    residual = jax.random.normal(kr, (rows, N), dtype) if call.residual else None
    kwargs = {}
    if call.norm:
        kwargs.update(norm=call.norm, eps=config.rms_norm_eps)
    if call.config_activation:
        kwargs.update(activation=config.hidden_act)

    def one(lp, x, residual):   # Ops.linear as the layer calls it
        return ops.linear(x, lp, call.name, residual=residual, **kwargs)

    def step(x, stacks, residual, zero):   # every layer's weight once, as a decode step reads them
        if ops.unroll:   # Decoder.forward on a GPU: the layer index static, the kernels read the stack in place
            for i in range(num_layers):
                x = _chained(x, one(LayerWeights(stacks, i), x, residual), zero)
            return x

        def body(x, lp):   # Decoder.forward on a CPU: scanned over the stacked weights
            return _chained(x, one(lp, x, residual), zero), None
        return jax.lax.scan(body, x, stacks)[0]

    fn = jax.jit(lambda x, stacks, residual, zero: jax.lax.fori_loop(
        0, inner, lambda _, x: step(x, stacks, residual, zero), x),
                 compiler_options=ops.compiler_options(rows) or None)
    seconds = _timed(fn, (x, stacks, residual, jnp.float32(0)), inner, repeats)

    def first_layer(stacks, x, residual):
        return one(LayerWeights(stacks, 0) if ops.unroll else {n: s[0] for n, s in stacks.items()}, x, residual)
    return {"name": call.name, "shape": list(w.shape), "dtype": str(w.dtype), "layers": num_layers,
            "bytes": weight_nbytes(stacks, call.name), "seconds": seconds,
            "path": "gemv" if _on_kernel(first_layer, stacks, x, residual) else "xla"}


def head_projection(ops, params: dict, rows: int, dtype, inner: int, repeats: int, seed: int) -> dict:
    """The LM head as Decoder.logits runs it: the final hidden [rows, D] @ lm_head (or the tied embedding) to f32
    logits, `inner` times in one device loop (each call's input waiting on the one before)."""
    import jax
    import jax.numpy as jnp
    name = "lm_head" if "lm_head" in params else "embed"
    head = {n: params[n] for n in (name, name + "_scale") if n in params}
    w = head[name]
    x = jax.random.normal(jax.random.PRNGKey(seed), (rows, w.shape[-1]), dtype)

    def one(head, x):
        return ops.linear(x, head, name, out_dtype=jnp.float32)

    fn = jax.jit(lambda x, head, zero: jax.lax.fori_loop(0, inner, lambda _, x: _chained(x, one(head, x), zero), x),
                 compiler_options=ops.compiler_options(rows) or None)
    seconds = _timed(fn, (x, head, jnp.float32(0)), inner, repeats)
    return {"name": name, "shape": list(w.shape), "dtype": str(w.dtype), "layers": 1,
            "bytes": weight_nbytes(head, name), "seconds": seconds,
            "path": "gemv" if _on_kernel(one, head, x) else "xla"}


def matmul_rows(model, rows: list[int], quantization: str | None = None, inner: int = 20, repeats: int = 5,
                bandwidth: float | None = None) -> dict:
    """Every projection of `model`'s decode step (jaxspec Model, random or loaded) timed at each row count, with
    the engine's Ops and weights (`quantized_target`: FP8 as LLM(..., quantization="fp8") runs them) ->
    {"bandwidth", "bandwidth_source", "device", "step_weight_bytes", "quantization", "tables": {rows: [entry]}};
    each entry: name, shape, dtype, layers, bytes, seconds, path, tb_per_s, of_bandwidth (a fraction)."""
    import jax

    from jaxspec.bench.measure import hbm_bandwidth
    from jaxspec.nn.decoder import Decoder
    from jaxspec.nn.ops import Ops
    from jaxspec.sched.build import quantized_target
    from jaxspec.sched.config import EngineConfig
    model = quantized_target(model, quantization)
    quantization = model.quantization
    ops = Ops.for_backend(EngineConfig.block_size, quantization=quantization)
    decoder = Decoder(model.config, ops)
    kinds = [kind for kind in decoder.kinds if kind not in LAYER_CALLS]
    if kinds:
        raise SystemExit(f"layer kinds {kinds} are not in LAYER_CALLS (the dense kinds: {', '.join(LAYER_CALLS)}); "
                         "their projections are not tabled yet")
    source = ("given" if bandwidth is not None else "copy, measured here" if jax.devices()[0].platform == "gpu"
              else "jaxspec.bench.measure.HBM_BANDWIDTH: not a GPU")
    bandwidth = hbm_bandwidth(bandwidth)
    dtype = model.params["embed"].dtype   # the hidden states' (Decoder.forward: the embedding's rows)
    tables = {}
    for r in rows:
        entries = []
        for kind in decoder.kinds:
            stacks = model.params["layers"][kind]
            for call in LAYER_CALLS[kind]:
                entry = layer_projection(ops, model.config, stacks, call, r, dtype, inner, repeats, seed=r)
                entries.append({"kind": kind, **entry})
        entries.append({"kind": "head", **head_projection(ops, model.params, r, dtype, inner, repeats, seed=r)})
        for e in entries:
            e["tb_per_s"] = e["bytes"] / e["seconds"] / 1e12
            e["of_bandwidth"] = e["bytes"] / e["seconds"] / bandwidth
        tables[r] = entries
    return {"model": model.name, "quantization": quantization, "device": jax.devices()[0].device_kind,
            "bandwidth": bandwidth, "bandwidth_source": source, "inner": inner, "repeats": repeats,
            "step_weight_bytes": sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(model.params)),
            "tables": tables}


def markdown(result: dict) -> str:
    """The table for docs/performance.md: one block per row count, a total row under each."""
    bw = result["bandwidth"]
    lines = [(f"{result['model']}, {result['quantization'] or 'unquantized'}, {result['device']}: copy bandwidth "
              f"{bw / 1e12:.2f} TB/s ({result['bandwidth_source']}); every weight of the model "
              f"{result['step_weight_bytes'] / 1e6:.1f} MB"), "",
             "| rows | projection | weight (all layers) | dtype | path | MB read | us per step | TB/s | % of copy |",
             "|---:|---|---|---|---|---:|---:|---:|---:|"]
    for r, entries in result["tables"].items():
        for e in entries:
            lines.append(f"| {r} | {e['name']} | {'x'.join(map(str, e['shape']))} | {e['dtype']} | {e['path']} | "
                         f"{e['bytes'] / 1e6:.2f} | {1e6 * e['seconds']:.1f} | {e['tb_per_s']:.3f} | "
                         f"{100 * e['of_bandwidth']:.1f} |")
        total_bytes, total_s = sum(e["bytes"] for e in entries), sum(e["seconds"] for e in entries)
        lines.append(f"| {r} | **total** ({100 * total_bytes / result['step_weight_bytes']:.1f}% of the step's "
                     f"weight bytes) | | | | {total_bytes / 1e6:.2f} | {1e6 * total_s:.1f} | "
                     f"{total_bytes / total_s / 1e12:.3f} | {100 * total_bytes / total_s / bw:.1f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a preset (random weights of its shapes)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="tokens in the step (a decode step's rows, "
                   "padded to the engine's bucket: ModelRunner.bucket_for)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", choices=["fp8"], help="the engine's quantization (weights quantized on load)")
    p.add_argument("--inner", type=int, default=20, help="steps' worth of each projection per timed call")
    p.add_argument("--repeats", type=int, default=5, help="timed calls; the fastest is kept")
    p.add_argument("--hbm-bandwidth", type=float, help="bytes/s to compare with (default: the copy bandwidth "
                   "measured here on a GPU)")
    p.add_argument("--json", help="write the result here")
    return p


def main(argv=None, model=None) -> dict:
    """The table printed (and written to --json); `model`: a jaxspec Model to time instead of --model's preset."""
    a = parser().parse_args(argv)
    if model is None:
        from jaxspec.models.random import random_model
        model = random_model(a.model, dtype=a.dtype, seed=0)
    result = matmul_rows(model, a.rows, a.quantization, a.inner, a.repeats, a.hbm_bandwidth)
    print(markdown(result), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
