"""MTP drafting: the MTP head of a Qwen3-Next / Qwen3.5 checkpoint (`jaxspec.nn.mtp.MtpHead`) proposes the k
drafts, its one layer reused for each.

The head pairs the target's hidden state at p with the token at p+1, as an EAGLE-1 head does, so the drafter is
the EAGLE drafter's pass (jaxspec.decode.drafters.eagle) with this head: (a) every token of the step paired with
the feature before it and written into the head's KV, (b) k single-token head forwards per row from the feature
at the last accepted position and the emitted token, each next one feeding the head's own output (after its
norm) and its draft. Each slot saves the feature at its last position whose target KV is final.

The weights are read (jaxspec.models.heads.load_mtp_head) from the target's own checkpoint (`mtp.fc`,
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` in the layout of the target's
full-attention layers, `mtp.norm`): the directory the target was loaded from, or `SpeculativeConfig.model` when
given.
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec.decode.drafters.eagle import EagleDrafter
from jaxspec.models.heads import load_mtp_head
from jaxspec.nn.mtp import MtpHead


class MtpDrafter(EagleDrafter):
    """The EAGLE drafter's pass with an MtpHead (method "mtp"); its state: the head's KV pages and the feature
    each slot saved (plus the draft distributions when drafts are sampled)."""


def random_mtp_params(config, dtype="bfloat16", seed: int = 0, scale: float = 0.02) -> dict:
    """An MTP head's declared params drawn at random (weights N(0, scale), norms ones): benchmarks of the step
    time of MTP drafting on a model with random weights, which has no checkpoint to read them from."""
    from jaxspec.nn import schema
    return schema.initialize(MtpHead(config).param_schema(), jnp.dtype(dtype), jax.random.PRNGKey(seed), scale)


def build_mtp_drafter(spec, target):
    """-> (MtpDrafter, head params) from the target's own checkpoint, or from `spec.model` when given: a directory
    with the mtp.* tensors, or the head's declared params (a dict, as `random_mtp_params` makes)."""
    if not target.config.hybrid:
        raise ValueError(f"speculative method 'mtp' needs a Qwen3-Next or Qwen3.5 target (their checkpoints ship the "
                         f"MTP head); the target is {target.config.arch!r}")
    head = MtpHead(target.config)
    if isinstance(spec.model, dict):
        from jaxspec.nn import schema
        schema.check(head.param_schema(), spec.model, "the MTP params")
        return MtpDrafter(head, spec.draft_sampling), spec.model
    path = spec.model if spec.model is not None else target
    if hasattr(path, "params"):   # a Model: the directory it was loaded from
        path = path.source
    if path is None or not Path(path).is_dir():
        raise ValueError("speculative method 'mtp' reads the mtp.* weights from the target's checkpoint directory, "
                         f"but the target {target.name!r} was not loaded from one; load it with "
                         "jaxspec.load_model(<HF directory>) or pass speculative_config model=<HF directory with the "
                         "mtp.* tensors>")
    head, params = load_mtp_head(path, target.config, target.params["embed"].dtype)
    return MtpDrafter(head, spec.draft_sampling), params
