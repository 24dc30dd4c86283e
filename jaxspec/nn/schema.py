"""Declared arrays: every weight kind and every decode-state field is declared once, as a `Spec` (shape, logical
axes, initial value, dtype), in a nested dict that mirrors the pytree it describes.

Everything that makes or reads such a pytree goes through the declaration: random initialisation, the
loaders' shape checks, orbax restore targets, the decode state's zeros, and (later) shardings, which map each
logical axis to a mesh axis. Logical axis names:

    layers    a stacked layer axis (one entry per layer of a kind)
    vocab     vocabulary            embed     model width D         mlp      MLP width F
    heads     query heads x head_dim (flattened, head-major)        kv_heads  kv heads x (their q/k/v rows)
    head_dim  one head's width      draft_vocab  an EAGLE-3 draft vocabulary
    kv_slots  flat paged-KV slots (pages x block size)              slots    request slots (+1 trash slot)
    seq       positions of a sequence                               draft    draft positions
    None      not to be split
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Spec:
    """One declared array. `init`: "normal" (N(0, 1/fan_in) scaled by the caller's `scale`), "ones", "zeros",
    or a number to fill with. `dtype` None: the model's (or state's) dtype."""
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Any = "normal"
    dtype: Any = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if len(self.shape) != len(self.axes):
            raise ValueError(f"Spec shape {self.shape} and axes {self.axes} differ in rank")

    def stacked(self, n: int) -> "Spec":
        """The same array for each of `n` layers, on a leading `layers` axis."""
        return dataclasses.replace(self, shape=(n, *self.shape), axes=("layers", *self.axes))

    def resolved_dtype(self, default) -> Any:
        return jnp.dtype(self.dtype if self.dtype is not None else default)


def is_spec(x) -> bool:
    return isinstance(x, Spec)


def tree_map(fn, schema):
    """`fn(spec)` on every Spec of a (nested dict) schema."""
    return jax.tree_util.tree_map(fn, schema, is_leaf=is_spec)


def shapes(schema):
    return tree_map(lambda s: s.shape, schema)


def logical_axes(schema):
    return tree_map(lambda s: s.axes, schema)


def abstract(schema, dtype, sharding=None):
    """jax.ShapeDtypeStruct per Spec (orbax restore targets, eval_shape)."""
    return tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.resolved_dtype(dtype), sharding=sharding), schema)


def _initial(spec: Spec, key, dtype, scale: float):
    dt = spec.resolved_dtype(dtype)
    if spec.init == "normal":
        fan_in = spec.shape[-1] if len(spec.shape) > 1 else 1
        std = scale if scale is not None else 1.0 / math.sqrt(fan_in)
        return (std * jax.random.normal(key, spec.shape, jnp.float32)).astype(dt)
    value = {"zeros": 0, "ones": 1}.get(spec.init, spec.init)
    return jnp.full(spec.shape, value, dt)


def initialize(schema, dtype, key=None, scale: float | None = None):
    """Arrays for a schema: "normal" specs drawn from `key` (std `scale`, or 1/sqrt(fan_in) when None), the
    others filled. Every leaf gets its own key (folded with its position in the tree). One program makes them all:
    drawn op by op, each shape's draw, scaling and cast compiled on its own (3.1 s of a warm start on an H100 for a
    1.5B model's random weights, docs/lab/2026-11-26-startup.md)."""
    leaves, treedef = jax.tree_util.tree_flatten(schema, is_leaf=is_spec)
    key = jax.random.PRNGKey(0) if key is None else key

    def make(key):
        return [_initial(s, jax.random.fold_in(key, i), dtype, scale) for i, s in enumerate(leaves)]
    return jax.tree_util.tree_unflatten(treedef, jax.jit(make)(key))


def check(schema, tree, what: str = "params"):
    """ValueError naming the first array whose shape differs from its declaration (or that is missing)."""
    flat_spec = dict(jax.tree_util.tree_flatten_with_path(schema, is_leaf=is_spec)[0])
    flat_tree = dict(jax.tree_util.tree_flatten_with_path(tree)[0])
    for path, spec in flat_spec.items():
        name = jax.tree_util.keystr(path)
        if path not in flat_tree:
            raise ValueError(f"{what}{name} is missing; declared {spec.shape}")
        if tuple(np.shape(flat_tree[path])) != spec.shape:
            raise ValueError(f"{what}{name} has shape {tuple(np.shape(flat_tree[path]))}; declared {spec.shape}")
    extra = set(flat_tree) - set(flat_spec)
    if extra:
        raise ValueError(f"{what} has undeclared arrays: {sorted(jax.tree_util.keystr(p) for p in extra)}")


def num_buffers(*trees) -> int:
    """Arrays a jitted call receives for these pytrees (one argument buffer each)."""
    return sum(len(jax.tree_util.tree_leaves(t)) for t in trees)
