"""The layer library: each kind of decoder layer is one function plus the declaration of its weights and of the
state it keeps (jaxspec.nn.layers.base says how the step treats that state). The target's decoder, the draft model
and the EAGLE / MTP heads are all built from these. One module per kind: `attention` (with the blocks the others
build from), `moe`, `gemma3`, `gpt_oss`, `gated_attention`, `gated_deltanet`.

`LAYER_KINDS` is the public table: a new kind registered there can be named in `ModelConfig.layer_types`,
with no edit to the decoder, the step or the engine.
"""
from __future__ import annotations

from jaxspec.nn.layers.attention import (NO_WINDOW, Attention, attend_qkv, attention, attention_params, kv_state,
                                         layer_window, mlp, mlp_params, project_qkv, split_qkv, write_kv)
from jaxspec.nn.layers.base import (CacheShape, LayerKind, per_slot_fields, read_ring, ring_writers, snapshot_spec,
                                    write_ring)
from jaxspec.nn.layers.gated_attention import GatedAttention, partial_rope
from jaxspec.nn.layers.gated_deltanet import (GatedDeltaNet, conv_window, delta_rule, delta_rule_chunked,
                                              delta_rule_scan, l2_normalize)
from jaxspec.nn.layers.gemma3 import GEMMA3_NORMS, Gemma3Attention, layer_inv_freq, with_query_scale
from jaxspec.nn.layers.gpt_oss import GptOss, clamped_swiglu, gpt_oss_moe, gpt_oss_moe_params
from jaxspec.nn.layers.moe import AttentionMoE, ExpertRoutes, ffn, ffn_params, moe, moe_params, route_by_expert

LAYER_KINDS: dict[str, LayerKind] = {kind.name: kind for kind in (
    Attention(), AttentionMoE(), Gemma3Attention(), GptOss(), GatedAttention(), GatedDeltaNet())}

__all__ = [
    "LAYER_KINDS", "CacheShape", "LayerKind", "per_slot_fields", "read_ring", "ring_writers", "snapshot_spec",
    "write_ring",
    "NO_WINDOW", "Attention", "attend_qkv", "attention", "attention_params", "kv_state", "layer_window", "mlp",
    "mlp_params", "project_qkv", "split_qkv", "write_kv",
    "AttentionMoE", "ExpertRoutes", "ffn", "ffn_params", "moe", "moe_params", "route_by_expert",
    "GEMMA3_NORMS", "Gemma3Attention", "layer_inv_freq", "with_query_scale",
    "GptOss", "clamped_swiglu", "gpt_oss_moe", "gpt_oss_moe_params",
    "GatedAttention", "partial_rope",
    "GatedDeltaNet", "conv_window", "delta_rule", "delta_rule_chunked", "delta_rule_scan", "l2_normalize",
]
