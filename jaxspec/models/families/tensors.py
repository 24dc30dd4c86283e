"""How a family names the HF tensors each declared weight is read from, and the combines its families share.

A declared weight (jaxspec.nn: a layer kind's `params`, or embed / final_norm / lm_head) is read by a `TensorRule`:
the HF tensors it is made of and the `Combine` that assembles them into the declared layout. Numpy only: the
loaders (jaxspec.models.weights) check shapes, cast and stack.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numpy as np


class Combine:
    """Assembles one declared weight from its HF tensors: `combine(config, *tensors)`.

    `by_rows`: it only orders, groups and concatenates its tensors' rows, the last axis carried along, so that a
    per-row array of each tensor (an FP8 checkpoint's scales, jaxspec.models.fp8_checkpoint) combines into the
    weight's rows the same way; the loader reads such a weight with its scales as stored."""

    def __init__(self, assemble: Callable, by_rows: bool):
        self.assemble = assemble
        self.by_rows = by_rows
        functools.update_wrapper(self, assemble)

    def __call__(self, config, *tensors):
        return self.assemble(config, *tensors)


def combine(by_rows: bool):
    """Decorator: the function (config, *tensors) -> array as a `Combine`."""
    return lambda assemble: Combine(assemble, by_rows)


class TensorRule(NamedTuple):
    """How one declared weight is read: the HF tensors it is made of (inside a layer: their names after
    `model.layers.{i}.`), or a function of the model config that gives them, and how they combine (None: the one
    tensor as it is)."""
    sources: tuple[str, ...] | Callable
    combine: Combine | None = None

    def names(self, config) -> tuple[str, ...]:
        return self.sources(config) if callable(self.sources) else self.sources


@combine(by_rows=True)
def group_qkv(c, q, k, v):
    """HF q [Hq*hd, ...], k/v [Hkv*hd, ...] -> rows grouped per kv head: [its G q heads, its k, its v]."""
    num_kv_heads = c.num_kv_heads
    tail = q.shape[1:]
    q = q.reshape(num_kv_heads, -1, *((k.shape[0] // num_kv_heads,) + tail))             # [Hkv, G, hd, ...]
    k = k.reshape(num_kv_heads, 1, *q.shape[2:])
    v = v.reshape(num_kv_heads, 1, *q.shape[2:])
    return np.concatenate([q, k, v], axis=1).reshape(-1, *tail)


@combine(by_rows=True)
def interleave_gate_up(c, gate, up):
    """HF gate/up [F, D] -> [F, 2, D]."""
    return np.stack([gate, up], axis=1)


@combine(by_rows=True)
def concat_rows(c, *parts):
    return np.concatenate(parts, axis=0)


@combine(by_rows=False)
def plus_one(c, w):
    """Zero-centred RMSNorm weights (HF computes x * (1 + w)) as the plain weight our RMSNorm multiplies by."""
    return w.astype(np.float32) + 1.0


# The top-level weights (jaxspec.nn.decoder.Decoder.param_schema) where every family keeps them.
TOP_TENSORS: dict[str, TensorRule] = {"embed": TensorRule(("model.embed_tokens.weight",)),
                                      "final_norm": TensorRule(("model.norm.weight",)),
                                      "lm_head": TensorRule(("lm_head.weight",))}
# Those of a model whose final norm is zero-centred (stored w, computed as 1 + w).
TOP_TENSORS_ZERO_CENTRED_NORM: dict[str, TensorRule] = {**TOP_TENSORS,
                                                        "final_norm": TensorRule(("model.norm.weight",), plus_one)}

ATTN = "self_attn."
