"""The MTP (multi-token prediction) head that Qwen3-Next and Qwen3.5 checkpoints ship beside the model (`mtp.*`).

Like an EAGLE head it runs on pairs (the target's hidden state at position p, the token at p+1), stored in its
own paged KV at position p, and predicts the token at p+2:

    x   = fc([pre_fc_norm_embedding(embed(token)); pre_fc_norm_hidden(hidden)])     # [T, 2D] -> [T, D]
    x   = one full-attention decoder layer of the target's kind (gated attention, then the MLP or the MoE)
    out = norm(x)                                                                   # what is fed back
    logits = out @ lm_head.T                                                        # the target's own head

`hidden` is the target's hidden state after its final norm; the token embedding and lm_head are the target's.
The one layer serves every draft position: the second and later drafts pair the head's own `out` with its
draft. Every norm is zero-centred, as all of the hybrids' are (the loader stores 1 + w).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.nn.decoder import Decoder
from jaxspec.nn.kernels import LayerWeights
from jaxspec.nn.layers import LAYER_KINDS, CacheShape, kv_state
from jaxspec.nn.ops import ForwardBatch, Ops, rms_norm
from jaxspec.nn.quant import quantized_schema
from jaxspec.nn.schema import Spec

MTP_LAYER_KIND = "gated_attention"


@dataclasses.dataclass(frozen=True)
class MtpHead:
    config: object            # the target's ModelConfig: the MTP layer is one of its full-attention layers
    quantization: str | None = None   # "fp8": its params are quantized (jaxspec.nn.quant; the engine's, at serving)
    method = "mtp"
    aux_layers = ()           # it reads the target's final hidden state only
    parallel = False          # it drafts as a chain (EagleDrafter's step (b), one forward per draft)

    @property
    def target_config(self):
        return self.config

    def param_schema(self) -> dict:
        """Its params as declared; quantized (fc and the layer's projections, MoE experts included, e4m3 with their
        scales) when `quantization` is set, as the params the engine quantized are."""
        D = self.config.hidden_size
        norm = Spec((D,), ("embed",), "ones")
        layer = LAYER_KINDS[MTP_LAYER_KIND].params(self.config)
        schema = {"fc": Spec((D, 2 * D), ("embed", None)),
                  "pre_fc_norm_embedding": norm, "pre_fc_norm_hidden": norm,
                  "layers": {MTP_LAYER_KIND: {k: s.stacked(1) for k, s in layer.items()}},
                  "norm": norm}
        return quantized_schema(schema) if self.quantization is not None else schema

    def state_schema(self, cache: CacheShape) -> dict:
        """Its KV pools, one layer ([1, S, Hkv, hd] each), under the key the EAGLE drafter reads."""
        return {"attention": {k: s.stacked(1) for k, s in kv_state(self.config, cache).items()}}

    def features(self, ops: Ops, params, hidden, aux):
        """The feature of every token of the target's batch: its hidden state after the final norm [T, D]."""
        return hidden

    def forward(self, ops: Ops, params, target_params, kv, ids, feature, batch: ForwardBatch):
        """ids i32[T], feature [T, D] -> (out [T, D] after `norm`: the logits' input and the next feature, kv)."""
        c = self.config
        embed = target_params["embed"]
        emb = embed[jnp.clip(ids, 0, embed.shape[0] - 1)]                                   # [T, D]
        x = jnp.concatenate([rms_norm(emb, params["pre_fc_norm_embedding"], c.rms_norm_eps),
                             rms_norm(feature.astype(emb.dtype), params["pre_fc_norm_hidden"], c.rms_norm_eps)],
                            axis=-1)                                                         # [T, 2D]
        x = ops.linear(x, params, "fc")                                                      # [T, D]
        lp = LayerWeights(params["layers"][MTP_LAYER_KIND], 0)
        x, kv = LAYER_KINDS[MTP_LAYER_KIND](c, ops, lp, x, kv, 0, batch)
        return rms_norm(x, params["norm"], c.rms_norm_eps), kv

    def logits(self, ops: Ops, params, target_params, out):
        """out [N, D] -> f32 logits [N, V] through the target's lm_head (its embedding when tied)."""
        return Decoder.logits(target_params, out, ops)
