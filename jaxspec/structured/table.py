"""The host's side of the device automata table: which automata it holds, where each begins, and its upload.

Automata are laid out one after another (states and edges). The table's arrays have capacities in powers of
two, and so does the gather width (the most edges of a state, at most the vocabulary): a new automaton that
fits takes the free space at the end; one that does not first makes the table drop the automata no running
request uses and lay the rest out again, and only if that is not enough grows a capacity (a new shape: the
steps that read the table compile again, counted in `growths` and in the engine's recompiles). Every change
builds fresh host arrays and uploads them whole: a dispatched step keeps reading the arrays it was given.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxspec.decode.grammar import GrammarTable
from jaxspec.structured.compiler import TokenAutomaton

MIN_STATES, MIN_EDGES, MIN_WIDTH = 256, 1 << 14, 64


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass
class _Entry:
    automaton: TokenAutomaton
    base: int = 0          # global index of its state 0
    edge_base: int = 0     # global index of its first edge
    users: int = 0         # running requests that use it


class GrammarTables:
    def __init__(self, vocab_size: int, sharding=None):
        self.vocab_size, self.sharding = vocab_size, sharding
        self.entries: dict[int, _Entry] = {}          # id(automaton) -> its place
        self.state_capacity, self.edge_capacity, self.width = MIN_STATES, MIN_EDGES, MIN_WIDTH
        self.num_states = self.num_edges = 0
        self.growths = 0
        self._states = np.zeros((MIN_STATES, 2), np.int32)
        self._edges = np.zeros((MIN_EDGES, 2), np.int32)
        self._device: GrammarTable | None = None

    # ---- requests ----------------------------------------------------------------------------------
    def acquire(self, automaton: TokenAutomaton):
        """A request that uses `automaton` is queued: it gets a place in the table if it has none."""
        entry = self.entries.get(id(automaton))
        if entry is None:
            entry = self._place(automaton)
        entry.users += 1

    def release(self, automaton: TokenAutomaton):
        """A request that used it has ended (its place stays until the space is needed)."""
        entry = self.entries.get(id(automaton))
        if entry is not None:
            entry.users -= 1

    def base(self, automaton: TokenAutomaton) -> int:
        return self.entries[id(automaton)].base

    def device_table(self) -> GrammarTable:
        """The table as device arrays, uploaded again only after a change."""
        if self._device is None:
            states = jax.device_put(self._states.copy(), self.sharding)
            edges = jax.device_put(self._edges.copy(), self.sharding)
            self._device = GrammarTable(states, edges, self.width)
        return self._device

    def stats(self) -> dict:
        return {"automata": len(self.entries), "states": self.num_states, "edges": self.num_edges,
                "state_capacity": self.state_capacity, "edge_capacity": self.edge_capacity, "width": self.width,
                "growths": self.growths}

    # ---- layout ------------------------------------------------------------------------------------
    def _fits(self, num_states: int, num_edges: int, width: int) -> bool:
        return (num_states <= self.state_capacity and num_edges <= self.edge_capacity and width <= self.width)

    def _width_of(self, automaton: TokenAutomaton) -> int:
        most = int(automaton.count.max()) if automaton.num_states else 1
        return min(_pow2_at_least(most, MIN_WIDTH), max(self.vocab_size, 1))

    def _place(self, automaton: TokenAutomaton) -> _Entry:
        width = self._width_of(automaton)
        if not self._fits(self.num_states + automaton.num_states, self.num_edges + automaton.num_edges, width):
            # Drop what no request uses, lay the rest out again; grow only if that is not enough.
            self.entries = {k: e for k, e in self.entries.items() if e.users > 0}
            live = [e.automaton for e in self.entries.values()] + [automaton]
            need_states = sum(a.num_states for a in live)
            need_edges = sum(a.num_edges for a in live)
            need_width = max(self._width_of(a) for a in live)
            if not self._fits(need_states, need_edges, need_width):
                self.state_capacity = max(self.state_capacity, _pow2_at_least(need_states, MIN_STATES))
                self.edge_capacity = max(self.edge_capacity, _pow2_at_least(need_edges, MIN_EDGES))
                self.width = max(self.width, need_width)
                self.growths += 1
            self._states = np.zeros((self.state_capacity, 2), np.int32)
            self._edges = np.zeros((self.edge_capacity, 2), np.int32)
            self.num_states = self.num_edges = 0
            for entry in self.entries.values():
                self._write(entry)
        entry = self.entries[id(automaton)] = _Entry(automaton)
        self._write(entry)
        return entry

    def _write(self, entry: _Entry):
        a = entry.automaton
        entry.base, entry.edge_base = self.num_states, self.num_edges
        s, e = slice(self.num_states, self.num_states + a.num_states), slice(self.num_edges, self.num_edges + a.num_edges)
        self._states[s, 0] = a.first + entry.edge_base
        self._states[s, 1] = a.count
        self._edges[e, 0] = a.token
        self._edges[e, 1] = a.next_state
        self.num_states += a.num_states
        self.num_edges += a.num_edges
        self._device = None
