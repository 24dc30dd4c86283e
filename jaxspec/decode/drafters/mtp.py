"""MTP drafting: the MTP head of a Qwen3-Next / Qwen3.5 checkpoint (`jaxspec.nn.mtp.MtpHead`) proposes the k
drafts, its one layer reused for each.

The head pairs the target's hidden state at p with the token at p+1, as an EAGLE-1 head does, so the drafter is
the EAGLE drafter's pass (jaxspec.decode.drafters.eagle) with this head: (a) every token of the step paired with
the feature before it and written into the head's KV, (b) k single-token head forwards per row from the feature
at the last accepted position and the emitted token, each next one feeding the head's own output (after its
norm) and its draft. Each slot saves the feature at its last position whose target KV is final.

The weights are read from the target's own checkpoint (`mtp.fc`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` in the layout of the target's full-attention layers, `mtp.norm`):
the directory the target was loaded from, or `SpeculativeConfig.model` when given.
"""
from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode.drafters.eagle import EagleDrafter
from jaxspec.nn.mtp import MTP_LAYER_KIND, MtpHead

MTP_TOP_TENSORS = {"fc": "mtp.fc.weight", "pre_fc_norm_embedding": "mtp.pre_fc_norm_embedding.weight",
                   "pre_fc_norm_hidden": "mtp.pre_fc_norm_hidden.weight", "norm": "mtp.norm.weight"}
MTP_LAYER_PREFIX = "mtp.layers.0."
ZERO_CENTRED = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


class MtpDrafter(EagleDrafter):
    """The EAGLE drafter's pass with an MtpHead (method "mtp"); its state: the head's KV pages and the feature
    each slot saved (plus the draft distributions when drafts are sampled)."""


def mtp_tensor_names(config) -> list[str]:
    """Every HF tensor the MTP head of a model with this config is read from."""
    from jaxspec.models.weights import layer_sources
    layer = MtpHead(config).param_schema()["layers"][MTP_LAYER_KIND]
    names = [MTP_LAYER_PREFIX + s for name in layer for s in layer_sources(MTP_LAYER_KIND, name, config)]
    return list(MTP_TOP_TENSORS.values()) + names


def load_mtp_head(path, target_config, dtype) -> tuple[MtpHead, dict]:
    """(MtpHead, its declared params) from the `mtp.*` tensors of the checkpoint directory `path`. A ValueError
    names the checkpoint and what it lacks: MTP weights at all, some of them, or it has more than one layer."""
    from jaxspec.models.hf_loader import SafetensorsDir
    from jaxspec.models.weights import plus_one, read_layer_weight, read_top_weight
    tensors = SafetensorsDir(path)
    if not any(name.startswith("mtp.") for name in tensors.file_of):
        raise ValueError(f"the checkpoint {str(path)!r} has no MTP weights (no 'mtp.*' tensors): speculative method "
                         "'mtp' reads the MTP head that Qwen3-Next / Qwen3.5 checkpoints ship beside the model; use "
                         "a checkpoint that has them, or another method")
    layers = sorted({int(m.group(1)) for name in tensors.file_of if (m := re.match(r"mtp\.layers\.(\d+)\.", name))})
    if layers != [0]:
        raise ValueError(f"the checkpoint {str(path)!r} has MTP layers {layers}; jaxspec runs exactly one "
                         "(mtp.layers.0.*, reused for every draft position)")
    missing = [name for name in mtp_tensor_names(target_config) if name not in tensors]
    if missing:
        raise ValueError(f"the checkpoint {str(path)!r} lacks MTP tensor(s) {missing[:6]}"
                         f"{f' and {len(missing) - 6} more' if len(missing) > 6 else ''} that a "
                         f"{target_config.arch} MTP head of this config needs")
    head = MtpHead(target_config)
    schema = head.param_schema()
    np_dtype = np.dtype(dtype)
    params = {}
    for key, name in MTP_TOP_TENSORS.items():
        value = read_top_weight(tensors.get_tensor, name, schema[key].shape, np.float32)
        params[key] = (plus_one(target_config, value) if key in ZERO_CENTRED else value).astype(np_dtype)
    params["layers"] = {MTP_LAYER_KIND: {
        name: read_layer_weight(tensors.get_tensor, MTP_LAYER_KIND, name, MTP_LAYER_PREFIX, target_config,
                                spec.shape[1:], np_dtype)[None]
        for name, spec in schema["layers"][MTP_LAYER_KIND].items()}}
    return head, jax.tree_util.tree_map(jnp.asarray, params)


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
