"""The decoder of every supported family (Llama, Qwen2, Qwen3, the hybrids, Gemma 3), composed from its per-layer
table.

    h = embed[ids]                                    # [T, D]   (Gemma 3: times sqrt(D))
    for each layer i:  h = LAYER_KINDS[layer_types[i]](h, state of its kind)
    hidden = rms_norm(h)                              # [T, D]
    logits = hidden[logits_indices] @ lm_head.T       # [N, V]   (tied: the embedding)

Weights of one kind are stacked `[n, ...]` (n layers of that kind) and indexed with a static layer number in
the unrolled forward, so a step passes a handful of argument buffers however deep the model is.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

from jaxspec.nn.kernels import LayerWeights
from jaxspec.nn.layers import LAYER_KINDS, CacheShape, per_slot_fields
from jaxspec.nn.ops import ForwardBatch, Ops, rms_norm
from jaxspec.nn.quant import quantized_schema
from jaxspec.nn.schema import Spec, initialize


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A model's math: its config and the engine's `Ops` (hashable: it is a static argument of the step)."""
    config: object        # jaxspec.models.config.ModelConfig
    ops: Ops = Ops()

    @property
    def layer_types(self) -> tuple[str, ...]:
        types = self.config.layer_types or ("attention",) * self.config.num_layers
        unknown = sorted(set(types) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"layer types {unknown} are not in jaxspec.nn.layers.LAYER_KINDS "
                             f"({', '.join(sorted(LAYER_KINDS))})")
        return types

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.layer_types))

    def runs(self):
        """(kind, index of the first layer among its kind, count, global index of the first layer) for each
        run of consecutive layers of one kind."""
        seen: dict[str, int] = {}
        g = 0
        for kind, group in itertools.groupby(self.layer_types):
            n = len(list(group))
            yield kind, seen.get(kind, 0), n, g
            seen[kind] = seen.get(kind, 0) + n
            g += n

    # ---- declarations -------------------------------------------------------------------------------
    def param_schema(self) -> dict:
        c = self.config
        V, D = c.vocab_size, c.hidden_size
        counts = {k: self.layer_types.count(k) for k in self.kinds}
        schema = {"embed": Spec((V, D), ("vocab", "embed")),
                  "final_norm": Spec((D,), ("embed",), "ones", jnp.float32 if c.plus_one_norms else None),
                  "layers": {k: {name: spec.stacked(counts[k]) for name, spec in LAYER_KINDS[k].params(c).items()}
                             for k in self.kinds}}
        if not c.tie_word_embeddings:
            schema["lm_head"] = Spec((V, D), ("vocab", "embed"))
        if self.ops.quantization is not None:   # the layers' projections (jaxspec.nn.quant)
            schema["layers"] = quantized_schema(schema["layers"])
        return schema

    def state_schema(self, cache: CacheShape) -> dict:
        counts = {k: self.layer_types.count(k) for k in self.kinds}
        return {k: {name: spec.stacked(counts[k]) for name, spec in LAYER_KINDS[k].state(self.config, cache).items()}
                for k in self.kinds}

    # ---- the forward --------------------------------------------------------------------------------
    def forward(self, params: dict, state: dict, batch: ForwardBatch, aux_layers: tuple[int, ...] = ()):
        """-> (logits f32[N, V] at batch.logits_indices, hidden [T, D] after the final norm, aux [len(aux_layers),
        T, D] residual stream after each chosen layer (or None), new state: this step's KV and per-slot ring
        entries written)."""
        c, ops = self.config, self.ops
        h = params["embed"][jnp.clip(batch.token_ids, 0, c.vocab_size - 1)]            # [T, D]
        if c.embed_scale is not None:   # rounded to the weights' dtype first, as transformers multiplies
            h = h * jnp.asarray(c.embed_scale, jnp.float32).astype(h.dtype)
        state = {k: dict(v) for k, v in state.items()}
        after: dict[int, jax.Array] = {}
        for kind_name, first, count, g in self.runs():
            kind, lp_all, st = LAYER_KINDS[kind_name], params["layers"][kind_name], state[kind_name]
            if ops.unroll or count == 1:
                for j in range(count):
                    lp = LayerWeights(lp_all, first + j)   # a dict of the layer's slices; kernels read the stacks
                    h, st = kind(c, ops, lp, h, st, first + j, batch)
                    after[g + j] = h
            else:   # scanned: one layer body to compile
                wanted = [a - g for a in aux_layers if g <= a < g + count]

                def body(carry, xs, kind=kind):
                    h, st = carry
                    lp, i = xs
                    h, st = kind(c, ops, lp, h, st, i, batch)
                    return (h, st), h if wanted else None

                xs = ({name: w[first:first + count] for name, w in lp_all.items()},
                      jnp.arange(first, first + count, dtype=jnp.int32))
                (h, st), hs = jax.lax.scan(body, (h, st), xs)
                after.update({g + j: hs[j] for j in wanted})
            state[kind_name] = st
        aux = jnp.stack([after[a] for a in aux_layers]) if aux_layers else None
        hidden = rms_norm(h, params["final_norm"], c.rms_norm_eps)
        logits = self.logits(params, hidden[batch.logits_indices], ops)
        return logits, hidden, aux, state

    @staticmethod
    def logits(params: dict, hidden, ops: Ops = Ops()):
        """hidden [N, D] -> f32 logits [N, V] (tied embeddings when there is no lm_head), through `ops.linear`
        (the engine's Ops; the default computes with XLA's dot)."""
        return ops.linear(hidden, params, "lm_head" if "lm_head" in params else "embed", out_dtype=jnp.float32)

    def per_slot_fields(self, cache: CacheShape) -> dict[str, list[str]]:
        return {k: per_slot_fields(LAYER_KINDS[k].state(self.config, cache)) for k in self.kinds}

    # ---- one dense sequence -------------------------------------------------------------------------
    def dense_forward(self, params: dict, token_ids, aux_layers: tuple[int, ...] = (), segments=None,
                      positions=None, attention_mask=None):
        """Dense causal forward over one sequence i32[T], no paging: (f32 logits [T, V], hidden [T, D] after the
        final norm, aux [len(aux_layers), T, D] or None). What `score` and EAGLE training run. `segments` i32[T]:
        several sequences packed end to end (a run of equal values is one): positions restart at each and a token
        attends within its own only. A training forward of its own layout (jaxspec.train.pard) gives `positions`
        i32[T] (each token's rotary position; default: its index, or its place in its segment) and
        `attention_mask` bool[T, T] (the keys each token sees, within its segment and at or before its position;
        default: all of those, causal attention)."""
        T = token_ids.shape[0]
        dense = dataclasses.replace(self, ops=dataclasses.replace(self.ops, attention="dense", block_size=T, tp=None))
        slots = jnp.arange(T, dtype=jnp.int32)
        rows, default_positions = jnp.zeros(T, jnp.int32), slots
        if segments is not None:   # dense attention sees only keys of the token's own row
            rows, default_positions = segments, segment_positions(segments)
        positions = default_positions if positions is None else positions
        state = initialize(dense.state_schema(CacheShape(num_kv_slots=T, num_slots=1)), params["embed"].dtype)
        zero = jnp.zeros((1,), jnp.int32)
        batch = ForwardBatch(token_ids, positions, slots, rows, jnp.zeros((1, 1), jnp.int32),
                             slots, slot_of_row=zero, first_token_of_row=zero, dense_mask=attention_mask)
        logits, hidden, aux, _ = dense.forward(params, state, batch, aux_layers)
        return logits, hidden, aux

    @functools.partial(jax.jit, static_argnums=0)
    def score(self, params: dict, token_ids):
        """Dense causal forward over one sequence, no paging: f32 logits [T, V]."""
        return self.dense_forward(params, token_ids)[0]


def segment_positions(segments):
    """i32[..., T] runs of equal segment ids -> each token's position within its run."""
    T = segments.shape[-1]
    index = jnp.arange(T, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones(segments.shape[:-1] + (1,), bool), segments[..., 1:] != segments[..., :-1]], -1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=segments.ndim - 1)
