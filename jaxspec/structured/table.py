"""The host's side of the device automata table: which automata it holds, where each begins, and its upload.

Automata are laid out one after another (states, edges, and a bitmap row for each wide state: one allowing
more than `dense_above` tokens). The table's arrays have capacities in powers of two, and so does the scatter
width (the most edges of a state without a bitmap row): a new automaton that fits takes the free space at the
end; one that does not first makes the table drop the automata no running
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

MIN_STATES, MIN_EDGES, MIN_WIDTH, MIN_BITMAP_ROWS = 256, 1 << 14, 64, 16


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass
class _Entry:
    automaton: TokenAutomaton
    base: int = 0          # global index of its state 0
    edge_base: int = 0     # global index of its first edge
    bitmap_base: int = 0   # row of its first wide state in the bitmap
    users: int = 0         # running requests that use it


class GrammarTables:
    def __init__(self, vocab_size: int, sharding=None):
        self.vocab_size, self.sharding = vocab_size, sharding
        # A state allowing more tokens than this gets a bitmap row (vocab_size / 8 bytes, at most 4x its edges'
        # bytes): its mask is unpacked from the row rather than scattered a vocabulary's worth at a time.
        self.dense_above = max(MIN_WIDTH, vocab_size // 256)
        self.search_width = _pow2_at_least(max(vocab_size, 1), 1)    # covers any state: never grows
        self.entries: dict[int, _Entry] = {}          # id(automaton) -> its place
        self.state_capacity, self.edge_capacity, self.width = MIN_STATES, MIN_EDGES, MIN_WIDTH
        self.bitmap_capacity = MIN_BITMAP_ROWS
        self.num_states = self.num_edges = 0
        self.num_bitmap_rows = 1                      # row 0: no token (the narrow states' row)
        self.growths = 0
        self._alloc()
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
            states, edges, bitmap = (jax.device_put(a.copy(), self.sharding)
                                     for a in (self._states, self._edges, self._bitmap))
            self._device = GrammarTable(states, edges, bitmap, self.width, self.search_width)
        return self._device

    def stats(self) -> dict:
        return {"automata": len(self.entries), "states": self.num_states, "edges": self.num_edges,
                "state_capacity": self.state_capacity, "edge_capacity": self.edge_capacity, "width": self.width,
                "bitmap_rows": self.num_bitmap_rows, "bitmap_capacity": self.bitmap_capacity, "growths": self.growths}

    # ---- layout ------------------------------------------------------------------------------------
    def _alloc(self):
        self._states = np.zeros((self.state_capacity, 3), np.int32)
        self._edges = np.zeros((self.edge_capacity, 2), np.int32)
        self._bitmap = np.zeros((self.bitmap_capacity, -(-self.vocab_size // 32)), np.uint32)

    def _fits(self, num_states: int, num_edges: int, bitmap_rows: int, width: int) -> bool:
        return (num_states <= self.state_capacity and num_edges <= self.edge_capacity
                and bitmap_rows <= self.bitmap_capacity and width <= self.width)

    def _wide(self, automaton: TokenAutomaton) -> np.ndarray:
        return automaton.count > self.dense_above

    def _width_of(self, automaton: TokenAutomaton) -> int:
        narrow = automaton.count[~self._wide(automaton)]
        return _pow2_at_least(int(narrow.max()) if narrow.size else 1, MIN_WIDTH)

    def _place(self, automaton: TokenAutomaton) -> _Entry:
        width, wide = self._width_of(automaton), int(self._wide(automaton).sum())
        if not self._fits(self.num_states + automaton.num_states, self.num_edges + automaton.num_edges,
                          self.num_bitmap_rows + wide, width):
            # Drop what no request uses, lay the rest out again; grow only if that is not enough.
            self.entries = {k: e for k, e in self.entries.items() if e.users > 0}
            live = [e.automaton for e in self.entries.values()] + [automaton]
            need_states = sum(a.num_states for a in live)
            need_edges = sum(a.num_edges for a in live)
            need_rows = 1 + sum(int(self._wide(a).sum()) for a in live)
            need_width = max(self._width_of(a) for a in live)
            if not self._fits(need_states, need_edges, need_rows, need_width):
                self.state_capacity = max(self.state_capacity, _pow2_at_least(need_states, MIN_STATES))
                self.edge_capacity = max(self.edge_capacity, _pow2_at_least(need_edges, MIN_EDGES))
                self.bitmap_capacity = max(self.bitmap_capacity, _pow2_at_least(need_rows, MIN_BITMAP_ROWS))
                self.width = max(self.width, need_width)
                self.growths += 1
            self._alloc()
            self.num_states = self.num_edges = 0
            self.num_bitmap_rows = 1
            for entry in self.entries.values():
                self._write(entry)
        entry = self.entries[id(automaton)] = _Entry(automaton)
        self._write(entry)
        return entry

    def _write(self, entry: _Entry):
        a = entry.automaton
        entry.base, entry.edge_base, entry.bitmap_base = self.num_states, self.num_edges, self.num_bitmap_rows
        s, e = slice(self.num_states, self.num_states + a.num_states), slice(self.num_edges, self.num_edges + a.num_edges)
        self._states[s, 0] = a.first + entry.edge_base
        self._states[s, 1] = a.count
        self._edges[e, 0] = a.token
        self._edges[e, 1] = a.next_state
        wide = np.flatnonzero(self._wide(a))
        rows = entry.bitmap_base + np.arange(len(wide), dtype=np.int32)
        self._states[entry.base + wide, 2] = rows
        words = self._bitmap.shape[1]
        for state, row in zip(wide, rows):
            bits = np.zeros(words * 32, bool)
            bits[a.allowed(int(state))] = True
            self._bitmap[row] = np.packbits(bits, bitorder="little").view("<u4")
        self.num_states += a.num_states
        self.num_edges += a.num_edges
        self.num_bitmap_rows += len(wide)
        self._device = None
