"""Tensor parallelism with jax.sharding: a one-axis mesh ("tp") over N local devices, and one table from the
logical axes every weight and state field declares (nn/schema.py) to that mesh axis.

The step stays one jitted function; XLA's partitioner inserts the collectives. With the table below a layer
splits as Megatron does: q/k/v rows and gate/up rows by head and MLP column (column-parallel), o and down by
their input columns (row-parallel, one all-reduce each), embedding and lm_head by vocabulary, the KV pages by KV
head. An array is split on the first of its axes that the table names and N divides; the others stay whole.
Attention itself runs per device under shard_map (each device attends with its own heads and its own pages).

A model whose KV heads N does not divide (Qwen2.5-1.5B has 2) keeps attention whole on every device (its
weights and KV pages replicated) and splits the rest.
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec.nn import schema as schema_lib

TP = "tp"
PARAM_RULES = ("kv_heads", "heads", "mlp", "vocab")   # logical axes split over TP, in priority order
STATE_RULES = ("kv_heads",)
ATTENTION_AXES = ("kv_heads", "heads")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    mesh: Mesh
    shard_attention: bool      # False: attention weights and KV pages replicated (KV heads not divisible)

    @property
    def size(self) -> int:
        return self.mesh.size

    @staticmethod
    def create(size: int, configs) -> "TensorParallel | None":
        """The mesh over the first `size` devices, for these model configs (the target and a draft model or head:
        they share the mesh). None for size 1. A ValueError names the valid sizes. The devices are every process's
        under jax.distributed (one engine across processes: jaxspec.distributed), else this process's."""
        devices = jax.devices()
        valid = [n for n in range(1, len(devices) + 1) if all(c.intermediate_size % n == 0 for c in configs)]
        if not isinstance(size, int) or isinstance(size, bool) or size not in valid:
            why = (f"only {len(devices)} device(s)" if isinstance(size, int) and size > len(devices) else
                   "the MLP width of every model must divide by it")
            raise ValueError(f"tensor_parallel_size={size!r} is invalid ({why}); valid sizes here: {valid}")
        if size == 1:
            return None
        shard_attention = all(c.num_kv_heads % size == 0 for c in configs)
        if not shard_attention:
            kv = sorted({c.num_kv_heads for c in configs})
            warnings.warn(f"tensor_parallel_size={size} does not divide the {kv} KV heads: attention (its weights "
                          f"and KV pages) is replicated on every device, the MLP and vocabulary are split",
                          stacklevel=3)
        return TensorParallel(Mesh(np.asarray(devices[:size]), (TP,)), shard_attention)

    def partition(self, spec: schema_lib.Spec, rules) -> P:
        if not self.shard_attention:
            rules = [r for r in rules if r not in ATTENTION_AXES]
        for rule in rules:
            for i, (axis, dim) in enumerate(zip(spec.axes, spec.shape)):
                if axis == rule and dim % self.size == 0:
                    return P(*([None] * i), TP)
        return P()

    def shardings(self, schema, rules) -> dict:
        """NamedSharding per declared array of `schema` (a nested dict of Specs)."""
        return schema_lib.tree_map(lambda s: NamedSharding(self.mesh, self.partition(s, rules)), schema)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def attention(self, fn):
        """`fn(q [T, Hq, hd], k_pool, v_pool [L, S, Hkv, hd], layer, batch) -> [T, Hq*hd]` run per device on its
        own heads and KV pages."""
        if not self.shard_attention:
            return fn
        heads, pools = P(None, TP, None), P(None, None, TP, None)

        def sharded(q, k_pool, v_pool, layer, batch):
            if isinstance(layer, int):   # unrolled layers: the index stays static inside
                local = jax.shard_map(lambda q, k, v, b: fn(q, k, v, layer, b), mesh=self.mesh,
                                      in_specs=(heads, pools, pools, P()), out_specs=P(None, TP), check_vma=False)
                return local(q, k_pool, v_pool, batch)
            local = jax.shard_map(fn, mesh=self.mesh, in_specs=(heads, pools, pools, P(), P()),
                                  out_specs=P(None, TP), check_vma=False)
            return local(q, k_pool, v_pool, layer, batch)
        return sharded
