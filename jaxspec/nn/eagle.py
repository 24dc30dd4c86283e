"""EAGLE-1 and EAGLE-3 draft heads, from the layer library (the same attention and MLP blocks as the target).

Both heads run on pairs (feature at position p, token at position p+1), stored in the head's own paged KV at
position p, and predict the token at p+2:
  EAGLE-1: feature = the target's hidden state after its final norm; x = fc([embed(token); feature]) (+ bias);
           decoder layers (the first without its input norm); the output hidden goes through the target's
           lm_head (after `norm` when the head has one).
  EAGLE-3: feature = fc(the target's residual stream after layers 1, L//2-1 and L-4, concatenated); one
           layer whose attention reads [attn_norm(embed(token)); hidden_norm(feature)] (2D wide) with the
           feature as residual; `norm`, then its own lm_head over a draft vocabulary mapped to target ids.
Later proposals feed back the head's own output hidden (before `norm`) as the feature. A parallel EAGLE-3 head
(`parallel`) proposes its k drafts in one forward instead: the pair at the last accepted position followed by k-1
placeholders at the next positions, each [attn_norm(mask_embed); hidden_norm(mask_hidden)] with mask_hidden as its
residual (two learned vectors), attending to the pairs and to the placeholders before it; placeholder j's output
predicts draft j+1 (docs/parallel_drafting.md). The token embedding
(and EAGLE-1's lm_head) are the target's: they come from the target's params, not the head's. An engine serving
in FP8 quantizes the head's projections (fc and its layers') as the target's; EAGLE-3's lm_head stays, as the
target's does (`EagleHead.quantization`).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.nn.decoder import Decoder
from jaxspec.nn.kernels import LayerWeights
from jaxspec.nn.layers import CacheShape, attention, attention_params, kv_state, mlp, mlp_params
from jaxspec.nn.ops import ForwardBatch, Ops, rms_norm
from jaxspec.nn.quant import quantized_schema
from jaxspec.nn.schema import Spec


def eagle3_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Target layers whose output residual EAGLE-3 reads (the inputs of layers 2, L//2 and L-3)."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))


@dataclasses.dataclass(frozen=True)
class EagleHead:
    method: str               # "eagle" (EAGLE-1) or "eagle3"
    config: object            # the head's ModelConfig (its width equals the target's)
    target_config: object
    fc_bias: bool = False     # EAGLE-1 checkpoints with a bias on fc
    final_norm: bool = False  # EAGLE-1 checkpoints with a `norm` before the target's lm_head
    draft_vocab_size: int = 0  # EAGLE-3
    # "fp8": its params are quantized (jaxspec.nn.quant: the engine's quantization, at serving only; a head is
    # loaded and trained in its own dtype)
    quantization: str | None = None
    # EAGLE-3 heads trained to draft in parallel: the placeholder vectors (mask_embed, mask_hidden) in their params
    parallel: bool = False

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return eagle3_aux_layers(self.target_config.num_layers) if self.method == "eagle3" else ()

    def param_schema(self) -> dict:
        """Its params as declared; quantized (fc and the layers' projections e4m3, their scales beside them) when
        `quantization` is set, as the params the engine quantized are: placement and sharding read this."""
        schema = self._schema()
        return quantized_schema(schema) if self.quantization is not None else schema

    def _schema(self) -> dict:
        c, D = self.config, self.config.hidden_size
        if self.method == "eagle3":
            layer = {**attention_params(c, in_dim=2 * D), **mlp_params(c)}
            return {"fc": Spec((D, 3 * D), ("embed", None)),
                    "layers": {"attention": {k: s.stacked(1) for k, s in layer.items()}},
                    "hidden_norm": Spec((D,), ("embed",), "ones"),
                    "norm": Spec((D,), ("embed",), "ones"),
                    "lm_head": Spec((self.draft_vocab_size, D), ("draft_vocab", "embed")),
                    "draft_to_target": Spec((self.draft_vocab_size,), ("draft_vocab",), "zeros", jnp.int32),
                    **({"mask_embed": Spec((D,), ("embed",)), "mask_hidden": Spec((D,), ("embed",))}
                       if self.parallel else {})}
        layer = {**attention_params(c), **mlp_params(c)}
        schema = {"fc": Spec((D, 2 * D), ("embed", None)),
                  "layers": {"attention": {k: s.stacked(c.num_layers) for k, s in layer.items()}}}
        if self.fc_bias:
            schema["fc_bias"] = Spec((D,), ("embed",), "zeros")
        if self.final_norm:
            schema["norm"] = Spec((D,), ("embed",), "ones")
        return schema

    def state_schema(self, cache: CacheShape) -> dict:
        n = 1 if self.method == "eagle3" else self.config.num_layers
        return {"attention": {k: s.stacked(n) for k, s in kv_state(self.config, cache).items()}}

    def features(self, ops: Ops, params, hidden, aux):
        """The feature of every token of the target's batch [T, D]: fc of the aux streams (EAGLE-3) or the
        target's final hidden (EAGLE-1)."""
        if self.method == "eagle3":
            return ops.linear(jnp.concatenate(list(aux), axis=-1), params, "fc")
        return hidden

    def forward(self, ops: Ops, params, target_params, kv, ids, feature, batch: ForwardBatch):
        """ids i32[T], feature [T, D] -> (output hidden [T, D] before `norm`, kv). A parallel head's placeholders
        are ids < 0: they read mask_embed (their feature is the caller's mask_hidden)."""
        c = self.config
        embed = target_params["embed"]
        emb = embed[jnp.clip(ids, 0, embed.shape[0] - 1)]                                    # [T, D]
        if self.parallel:
            emb = jnp.where((ids < 0)[:, None], params["mask_embed"].astype(emb.dtype), emb)
        feature = feature.astype(emb.dtype)
        layers = params["layers"]["attention"]
        if self.method == "eagle3":
            lp = LayerWeights(layers, 0)
            attn_in = jnp.concatenate([rms_norm(emb, lp["attn_norm"], c.rms_norm_eps),
                                       rms_norm(feature, params["hidden_norm"], c.rms_norm_eps)], axis=-1)  # [T, 2D]
            attn, kv = attention(c, ops, lp, attn_in, kv, 0, batch)
            return mlp(c, ops, lp, feature + attn), kv
        x = ops.linear(jnp.concatenate([emb, feature], axis=-1), params, "fc")                # [T, D]
        if "fc_bias" in params:
            x = x + params["fc_bias"]
        for i in range(c.num_layers):
            lp = LayerWeights(layers, i)
            attn_in = rms_norm(x, lp["attn_norm"], c.rms_norm_eps) if i else x                # layer 0: no norm
            attn, kv = attention(c, ops, lp, attn_in, kv, i, batch)
            x = mlp(c, ops, lp, x + attn)
        return x, kv

    def logits(self, ops: Ops, params, target_params, hidden):
        """Output hidden [N, D] -> f32 logits over the target vocabulary [N, V] (EAGLE-3: -inf outside the
        draft vocabulary)."""
        c, V = self.config, self.target_config.vocab_size
        if self.method == "eagle3":
            draft = ops.linear(hidden, params, "lm_head", norm="norm", eps=c.rms_norm_eps, out_dtype=jnp.float32)
            full = jnp.full((hidden.shape[0], V), -jnp.inf, jnp.float32)
            return full.at[:, params["draft_to_target"]].set(draft)
        if "norm" in params:
            hidden = rms_norm(hidden, params["norm"], c.rms_norm_eps)
        return Decoder.logits(target_params, hidden, ops)
