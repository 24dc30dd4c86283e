"""What every layer kind shares: the `LayerKind` protocol, the sizes its state is declared by, and the per-slot
state kept as a ring by position.

A layer kind's state is declared per layer; its axes say how the step treats it:
  - a field whose first axis is `kv_slots` is paged (the KV pool): the layer writes it in place at the
    batch's slot mapping; positions past the accepted drafts are overwritten by a later step;
  - a field whose first axis is `slots` is per request slot (a recurrent state), kept as a ring by position:
    entry p % size holds what the slot had after position p (`write_ring`, for the last `size` positions of
    each row), and a row starting at position p0 reads entry (p0 - 1) % size (`read_ring`). The start
    comes from the device's own count (its last accepted token), so the entry read is the state after the
    accepted tokens, whichever of the step's last k+1 positions that was: a state that cannot be overwritten
    later, as KV is, is rolled back past rejected drafts by reading an earlier entry. A state is `snapshots`
    = k+1 entries (`CacheShape.snapshots`); a window of the last K inputs, K-1+k.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from jaxspec.nn.ops import ForwardBatch, Ops
from jaxspec.nn.schema import Spec


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """What a layer's state is sized by: flat KV slots of the paged pool, request slots (+1 trash slot), and
    the drafts a step verifies at most (k: a per-slot state keeps the value after each of the last k+1
    positions, any of which the next step may start after)."""
    num_kv_slots: int
    num_slots: int
    num_speculative_tokens: int = 0
    kv_dtype: str | None = None    # the KV pools' dtype by name (None: the state's, the model's)

    @property
    def snapshots(self) -> int:
        return self.num_speculative_tokens + 1


class LayerKind(Protocol):
    name: str

    def params(self, c) -> dict[str, Spec]:
        """One layer's weights (the decoder stacks them per kind)."""

    def state(self, c, cache: CacheShape) -> dict[str, Spec]:
        """One layer's state (first axis `kv_slots`: paged; `slots`: per request slot)."""

    def __call__(self, c, ops: Ops, lp: dict, h, state: dict, i, batch: ForwardBatch):
        """h [T, D] -> (h [T, D], state with this step's KV and per-slot entries written). `lp`: this layer's
        weights; `state`: every layer of this kind's state ([n, ...] per field), `i` this layer's index among
        them."""


# ---- per-slot state kept as a ring by position -------------------------------------------------------------

def snapshot_spec(cache: CacheShape, shape: tuple, axes: tuple, dtype=None) -> Spec:
    """A per-slot state of `shape`, kept after each of the slot's last k+1 positions: [slots, k+1, *shape]."""
    return Spec((cache.num_slots, cache.snapshots, *shape), ("slots", None, *axes), "zeros", dtype)


def ring_writers(batch: ForwardBatch, size: int):
    """bool[T]: the tokens that write their ring entry, those that extend their sequence (`writes_state`)
    among the last `size` positions of their row. Earlier ones would be overwritten in the same step: one
    write per entry, so the scatter has no duplicate index."""
    written = jnp.ones_like(batch.positions, bool) if batch.writes_state is None else batch.writes_state
    num_rows = batch.block_tables.shape[0]
    last = jax.ops.segment_max(jnp.where(written, batch.positions, -1), batch.row_of_token, num_segments=num_rows)
    return written & (batch.positions > last[batch.row_of_token] - size)


def write_ring(ring, i, batch: ForwardBatch, values):
    """ring [n, slots, size, ...] with layer i's entries at each writing token's (slot, position % size) set to
    its value [T, ...]; the other tokens write nothing (an out-of-range slot, dropped)."""
    size, nowhere = ring.shape[2], ring.shape[1]
    slot = jnp.where(ring_writers(batch, size), batch.slot_of_row[batch.row_of_token], nowhere)
    return ring.at[i, slot, batch.positions % size].set(values.astype(ring.dtype), mode="drop")


def read_ring(ring, i, slot, position):
    """Layer i's entries at (slot, position % size) [..., *entry]; zeros for positions < 0 (before a sequence's
    first token). `slot` and `position` broadcast together."""
    entry = ring[i, slot, position % ring.shape[2]]
    before_start = (position < 0).reshape(position.shape + (1,) * (entry.ndim - position.ndim))
    return jnp.where(before_start, jnp.zeros_like(entry), entry)


def per_slot_fields(state_specs: dict[str, Spec]) -> list[str]:
    """The fields of a layer kind's state that are kept per request slot."""
    return [name for name, spec in state_specs.items() if spec.axes[0] == "slots"]
