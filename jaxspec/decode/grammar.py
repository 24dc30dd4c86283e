"""Structured outputs on the device: the automata table, the mask of a row's allowed tokens, and the state a
token leads to. Everything is a gather or a scatter of static shape, inside the one jitted step: no loop, so
nothing in it waits on the host or splits the step into more launches than its fusions.

The table holds every automaton in use, concatenated: `states[g] = (first edge, number of edges, bitmap row)` of
global state g, and `edges[e] = (token, next state)`, each state's edges sorted by token, the next state numbered
within its own automaton. A state allowing many tokens (a JSON string allows most of the vocabulary) also has a
row of `bitmap`, one bit per token: its mask is that row unpacked, where scattering its edges would write a
vocabulary's worth per row; the other states have row 0 (all zeros) and their few edges are scattered. A row
names its automaton by `base` (the global index of its state 0; -1: the row is unconstrained) and carries its
state within it, so a slot's state never changes meaning when the host lays the table out anew. A negative
state is unconstrained too (a draft outside the grammar leads there; no position after it is ever emitted).
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax.numpy as jnp


@flax.struct.dataclass
class GrammarTable:
    states: Any    # i32[S, 3] (first edge, number of edges, bitmap row or 0) per global state
    edges: Any     # i32[E, 2] (token, next state within its automaton)
    bitmap: Any    # u32[D, ceil(V / 32)] allowed tokens of the wide states, bit t % 32 of word t // 32; row 0 empty
    # At least the most edges of a state without a bitmap row: the width of the scatter that masks its tokens.
    # Static: a wider table is another compilation (the host grows it by powers of two).
    width: int = flax.struct.field(pytree_node=False, default=1)
    # A power of two at least the most edges of any state: what the search in `advance` covers.
    search_width: int = flax.struct.field(pytree_node=False, default=1)


def _lookup(table: GrammarTable, base, state):
    live = (base >= 0) & (state >= 0)
    row = table.states[jnp.where(live, base + state, 0)]
    return live, row[:, 0], jnp.where(live, row[:, 1], 0), jnp.where(live, row[:, 2], 0)


def allowed_words(table: GrammarTable, base, state):
    """u32[N, ceil(V / 32)]: the tokens each row's state allows as bits (token t: bit t % 32 of word t // 32;
    every token for unconstrained rows). A wide state's row is read from the bitmap; a narrow state's few edges
    are added as bits into words (its tokens are distinct, so adding is setting). Kept as words, the mask is
    32x smaller than a bool per token, and unpacking it fuses into whatever reads it."""
    live, first, count, dense = _lookup(table, base, state)
    words = table.bitmap[dense]                                                          # [N, W]
    N, W = words.shape
    E = table.edges.shape[0]
    j = jnp.arange(table.width, dtype=jnp.int32)[None, :]
    token = table.edges[jnp.clip(first[:, None] + j, 0, E - 1), 0]
    scattered = (j < count[:, None]) & (dense[:, None] == 0)
    word = jnp.where(scattered, token // 32, W)                                          # W: dropped
    bit = jnp.left_shift(jnp.uint32(1), (token % 32).astype(jnp.uint32))
    words = words.at[jnp.arange(N)[:, None], word].add(bit, mode="drop")
    return jnp.where(live[:, None], words, jnp.uint32(0xFFFFFFFF))


def unpack(words, vocab_size: int):
    """u32[..., W] -> bool[..., V]: bit t % 32 of word t // 32 for each token t < V."""
    bits = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size] > 0


def allowed_tokens(table: GrammarTable, base, state, vocab_size: int):
    """bool[N, V]: the tokens each row's state allows (every token for unconstrained rows). base, state i32[N]."""
    return unpack(allowed_words(table, base, state), vocab_size)


def _search_strides(search_width: int) -> list[int]:
    """Strides of the search's two levels: sqrt(search_width) probes each, then 1."""
    bits = max(search_width, 1).bit_length() - 1
    return [1 << (bits // 2), 1] if bits > 1 else [1]


def advance(table: GrammarTable, base, state, token):
    """i32[N]: the state after `token`; -1 where the grammar does not allow it, and for unconstrained rows.

    A two-level search in the state's sorted edges: count the probes every `stride` edges that are below the
    token, step to just past the last of them, and count again with stride 1. Two gathers of sqrt(width)
    edges per row, where a binary search is log2(width) dependent gathers (a loop of ~18 launches)."""
    live, first, count, _ = _lookup(table, base, state)
    E = table.edges.shape[0]
    end = first + count
    lo, span = first, table.search_width
    for stride in _search_strides(table.search_width):
        probe = lo[:, None] + stride * jnp.arange(-(-span // stride), dtype=jnp.int32)[None, :]
        below = (probe < end[:, None]) & (table.edges[jnp.clip(probe, 0, E - 1), 0] < token[:, None])
        c = jnp.sum(below, axis=1, dtype=jnp.int32)       # probes below the token: a prefix (edges are sorted)
        lo = lo + jnp.where(c > 0, (c - 1) * stride + 1, 0)
        span = stride
    at = jnp.clip(lo, 0, E - 1)
    found = live & (lo < end) & (table.edges[at, 0] == token)
    return jnp.where(found, table.edges[at, 1], -1)


def states_along(table: GrammarTable, base, start, tokens):
    """i32[R, K+1]: each row's state before each of its K tokens and after the last. start [R], tokens [R, K]."""
    states = [start]
    for j in range(tokens.shape[1]):
        states.append(advance(table, base, states[-1], tokens[:, j]))
    return jnp.stack(states, axis=1)


def constrain(logits, allowed):
    """Logits outside the grammar set to -inf. A row with no allowed token of finite logit is left as it is (an
    EAGLE-3 head's draft vocabulary may miss every allowed token: its draft is then rejected, never emitted)."""
    masked = jnp.where(allowed, logits, -jnp.inf)
    some = jnp.any(jnp.isfinite(masked), axis=-1, keepdims=True)
    return jnp.where(some, masked, logits)


@flax.struct.dataclass
class DraftGrammar:
    """What a drafter needs to propose inside the grammar (None in a DraftContext when no row is constrained)."""
    table: GrammarTable
    base: Any      # i32[R]
    state: Any     # i32[R] each row's state after its emitted token (where its first draft is proposed)

    def constrain(self, logits, state):
        return constrain(logits, allowed_tokens(self.table, self.base, state, logits.shape[-1]))

    def advance(self, state, token):
        return advance(self.table, self.base, state, token)
