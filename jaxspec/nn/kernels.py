"""The kernels' adapters: where the model's vocabulary (a layer's weights by name, a ForwardBatch, a model config)
becomes the arrays the Pallas kernels of `jaxspec.pallas` take. The kernels import JAX only; `Ops` and the layer
library reach them through here.

Weights are passed as one layer's `lp` and a name: under the unrolled decoder `lp` is a `LayerWeights`, whose
`stack(name)` gives the whole stacked weight and the layer's index, and a kernel reads the layer's slice in place
(a sliced weight passed to a kernel would be copied first).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.pallas import paged_attention as pa   # attributes read at call time (NUM_SPLITS, kernels set for a run)
from jaxspec.pallas.delta_rule import CHUNK, delta_rule_chunked, delta_rule_recurrent
from jaxspec.pallas import grouped_matmul as gm
from jaxspec.pallas import prefill_attention as prefill
from jaxspec.pallas.gemv import gemv, needs_packing, tiling_for


class LayerWeights(dict):
    """One layer's weights as the unrolled decoder hands them to a layer: `lp[name]` is the layer's slice, as in
    a plain dict, and `stack(name)` the whole stacked weight and the layer's index, which the kernels read in
    place (a sliced weight passed to a kernel would be copied first)."""

    def __init__(self, stacks: dict, index: int):
        super().__init__({name: w[index] for name, w in stacks.items()})
        self.stacks, self.index = stacks, index

    def stack(self, name: str):
        return self.stacks[name], self.index

    def replacing(self, stacks: dict) -> "LayerWeights":
        """The same layer with the named stacks replaced (the other slices kept, not sliced again)."""
        new = LayerWeights({}, self.index)
        new.update({**self, **{name: w[self.index] for name, w in stacks.items()}})
        new.stacks = {**self.stacks, **stacks}
        return new


def stacked(lp, name: str):
    """(the stacked weight [L, ...], the layer's index in it) of `lp[name]`; a plain dict's weight as a stack of
    one."""
    return lp.stack(name) if isinstance(lp, LayerWeights) else (lp[name][None], 0)


# ---- matmuls ---------------------------------------------------------------------------------------------------

def gemv_linear(x, lp, name: str, *, norm: str | None = None, eps: float | None = None, residual=None):
    """`Ops.linear` over the gemv kernel (jaxspec.pallas.gemv): x [T, K] (T <= 32) @ lp[name].T with the layer's
    rms_norm `norm` applied to x first and `residual` added; a gate/up weight [F, 2, K] gives silu(gate) * up
    [T, F]. One kernel, or two where K is split (the partial sums are added, with the residual, by one XLA
    fusion). None where no measured tiling divides the weight: the caller uses XLA's dot."""
    w, layer = stacked(lp, name)
    g = None
    if norm is not None:
        g, g_layer = stacked(lp, norm)
        assert g_layer == layer
    scale = _scales(lp, name)
    tiling = tiling_for(w.shape[1], x.shape[1], norm=norm is not None, pairs=w.ndim == 4, fp8=scale is not None,
                        rows=x.shape[0], x_bytes=x.dtype.itemsize, w_bytes=w.dtype.itemsize)
    if tiling is None:
        return None
    if tiling.splits > 1:   # (norm and pairs tilings are never split)
        y = gemv(x, w, layer, scale=scale, tiling=tiling).sum(0)
        return (y if residual is None else residual.astype(jnp.float32) + y).astype(x.dtype)
    return gemv(x, w, layer, g, residual, scale, tiling=tiling, eps=eps)


def gemv_matmul(x, lp, name: str):
    """x [T, K] @ lp[name].T over the gemv kernel with nothing around it (a gate/up pair weight [F, 2, K] read as
    its [2F, K] rows): [T, N] (pairs [T, 2F], interleaved) in x's dtype, or None where no tiling divides the weight.
    FP8 weights' unfused path (Ops.fp8_gemv), whose plain tilings were swept for e4m3."""
    w, layer = stacked(lp, name)
    scale = _scales(lp, name)
    if w.ndim == 4:   # [L, F, 2, K] -> [L, 2F, K]: a bitcast, the stack still read in place
        w = w.reshape(w.shape[0], -1, w.shape[-1])
        scale = None if scale is None else scale.reshape(scale.shape[0], -1)
    tiling = tiling_for(w.shape[1], x.shape[1], norm=False, pairs=False, fp8=scale is not None, rows=x.shape[0],
                        x_bytes=x.dtype.itemsize, w_bytes=w.dtype.itemsize)
    if tiling is None:
        return None
    y = gemv(x, w, layer, scale=scale, tiling=tiling)
    return (y.sum(0) if tiling.splits > 1 else y).astype(x.dtype)


def grouped_linear(x, lp, name: str, group_sizes, out_dtype=None):
    """`Ops.linear` of the experts over the grouped-matmul kernel (jaxspec.pallas.grouped_matmul): x [R, K], rows
    sorted by expert, against lp[name] [E, K, N] (gate/up pairs [E, K, F, 2], read as [E, K, 2F]; FP8 with their
    per-channel scales) -> [R, N], only the experts rows were routed to read. None where no tiling divides the
    weight, or an FP8 stack the Triton lowering cannot index: the caller uses ragged_dot."""
    w, layer = stacked(lp, name)
    w = w.reshape(*w.shape[:3], -1)      # [L, E, K, N] (pairs' gate and up columns interleaved: a bitcast)
    scale = _scales(lp, name)            # FP8 experts: per output channel, [L, E, N]
    if scale is not None:
        scale = scale.reshape(*w.shape[:2], -1)
    tiling = gm.tiling_for(w.shape[-1], x.shape[1], x.shape[0], w.shape[1])
    if tiling is None or needs_packing(w):   # (1-byte stacks of 2^31+ elements under 4 GiB: gemv's fault)
        return None
    return gm.grouped_matmul(x, w, layer, group_sizes, scale, tiling=tiling, out_dtype=out_dtype)


def _scales(lp, name: str):
    """The stacked per-channel scales of an FP8 weight (jaxspec.nn.quant stores them as `<name>_scale`), or None."""
    return stacked(lp, name + "_scale")[0] if name + "_scale" in lp else None


# ---- attention -------------------------------------------------------------------------------------------------

def paged_attention_fn(q, k_pool, v_pool, layer, batch, block_size: int, window: int | None = None, sinks=None):
    """`Ops.attend` over the kernel: q [T, Hq, hd] against layer `layer` of the pools [L, S, Hkv, hd] as the
    ForwardBatch `batch` places each token -> [T, Hq*hd]. Padding tokens (their KV write dropped: slot past the
    pool) get position -1, so their programs visit no page."""
    positions = jnp.where(batch.slot_mapping < k_pool.shape[1], batch.positions, -1)
    return pa.paged_attention(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), positions, batch.row_of_token,
                              batch.block_tables, block_size=block_size, num_splits=pa.NUM_SPLITS, window=window,
                              sinks=sinks)


def prefill_attention_fn(q, k_pool, v_pool, layer, batch, block_size: int, window: int | None = None, sinks=None):
    """`Ops.attend` over the prefill kernel's query tiles (the batch's `first_in_step` set): as `paged_attention_fn`."""
    positions = jnp.where(batch.slot_mapping < k_pool.shape[1], batch.positions, -1)
    group = q.shape[1] // k_pool.shape[2]
    heads = max(h for h in range(1, min(group, prefill.HEADS_PER_PROGRAM) + 1) if group % h == 0)
    return prefill.prefill_attention(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), positions, batch.first_in_step,
                                     batch.row_of_token, batch.block_tables, block_size=block_size,
                                     heads_per_program=heads, window=window, sinks=sinks)


def fused_attention_fn(c, lp, qkv, cos, sin, k_pool, v_pool, layer, batch, block_size: int,
                       num_splits: int | None = None, window=None, sinks=None):
    """`attend_qkv` over the fused kernel: the layer's q/k/v projection qkv [T, Hkv*(G+2)*hd] (before bias, norms
    and rotary), cos/sin f32 [T, hd/2] of each token's rotary angles, the pools [L, S, Hkv, hd] and the batch
    (whose `first_in_step` is set); `window`: the layer's sliding window (an int or i32 scalar) or None; `sinks`:
    the layer's attention-sink logits [Hq] or None
    -> (out [T, Hq*hd], k_pool, v_pool with this step's k/v written)."""
    # the layer's bias and q/k norms as whole stacks and its index in them (a sliced weight would be copied)
    names = ("qkv_bias", "q_norm", "k_norm")
    stacks = {name: stacked(lp, name) for name in names if name in lp}
    bias, q_norm, k_norm = (stacks.get(name, (None, 0))[0] for name in names)
    weight_layer = next((index for _, index in stacks.values()), 0)      # one index: the layer's, in every stack
    return pa.paged_attention_fused(qkv, k_pool, v_pool, jnp.asarray(layer, jnp.int32), cos, sin, batch.positions,
                                    batch.slot_mapping, batch.first_in_step, batch.row_of_token, batch.block_tables,
                                    bias, q_norm, k_norm, jnp.asarray(weight_layer, jnp.int32),
                                    num_heads=c.num_heads, block_size=block_size, eps=c.rms_norm_eps,
                                    num_splits=num_splits, window=window, sinks=sinks)


# ---- the gated delta rule --------------------------------------------------------------------------------------

def delta_rule_fn(ring, i, batch, q, k, v, beta, g, *, chunked: bool = True, **options):
    """`jaxspec.nn.layers.delta_rule_scan`'s contract over the kernels: per row, its first token, its tokens that
    keep state, its slot and first position from the ForwardBatch. -> (o [T, Hv, dv], ring). chunked=False:
    every row on the recurrent kernel (benchmarks); `options` go to `delta_rule_chunked`.

    One compiled step holds rows of every kind (prefill chunks, decode and verify rows) and how many tokens a
    row has is device data, so the split between the kernels is made per row on the device, never from a
    Python value: a row of n tokens that keep state gives its first max(n - W, 0) to the chunked kernel, and
    the recurrent kernel walks the rest (at most W) from the state the chunks left. Those last W are the
    tokens whose states the ring keeps (the next step may start after any of a verify row's tokens; a hybrid
    draft model's folded pass is read before its last), and the chunked form has no state between a chunk's
    tokens. The hand-over is the ring entry just before the recurrent part's first position: the entry it
    reads anyway, and one it overwrites in the same step, so the ring ends as the scan leaves it. Decode and
    verify rows (n <= W) go to the recurrent kernel alone; a step of at most W tokens cannot hold a longer
    row, and has no chunked kernels at all (compiled out: T and W are shapes), while in larger steps rows
    without chunked tokens leave their programs at once: on the H100, steps of 8 or 32 decode or verify rows
    took 4-9 us more per layer than the recurrent kernel alone (the two launches), docs/lab/2026-11-24-delta-rule-chunked.md."""
    T, R, W = q.shape[0], batch.block_tables.shape[0], ring.shape[2]
    written = jnp.ones((T,), bool) if batch.writes_state is None else batch.writes_state
    count = jax.ops.segment_sum(written.astype(jnp.int32), batch.row_of_token, num_segments=R)
    first = batch.first_token_of_row
    start = batch.positions[jnp.clip(first, 0, T - 1)]
    o = None
    if chunked and T > W:
        head = jnp.maximum(count - W, 0)
        # rows with chunked tokens have more than W tokens: at most T // (W + 1) of them
        C = options.get("chunk", CHUNK)
        options.setdefault("max_chunks", -(-T // C) + min(R, T // (W + 1)))
        o, ring = delta_rule_chunked(q, k, v, beta, g, ring, i, first, head, batch.slot_of_row, start, **options)
        first, count, start = first + head, count - head, start + head
    return delta_rule_recurrent(q, k, v, beta, g, ring, i, first, count, batch.slot_of_row, start, o)
