"""Structured outputs on the device: the automata table, the mask of a row's allowed tokens, and the state a
token leads to. Everything is a gather or a scatter of static shape, inside the one jitted step.

The table holds every automaton in use, concatenated: `states[g] = (first edge, number of edges)` of global
state g, and `edges[e] = (token, next state)`, each state's edges sorted by token, the next state numbered
within its own automaton. A row names its automaton by `base` (the global index of its state 0; -1: the row is
unconstrained) and carries its state within it, so a slot's state never changes meaning when the host lays
the table out anew. A negative state is unconstrained too (a draft outside the grammar leads there; no
position after it is ever emitted).
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class GrammarTable:
    states: Any    # i32[S, 2] (first edge, number of edges) per global state
    edges: Any     # i32[E, 2] (token, next state within its automaton)
    # At least the most edges of any state: the width of the gather that reads a state's allowed tokens.
    # Static: a wider table is another compilation (the host grows it by powers of two).
    width: int = flax.struct.field(pytree_node=False, default=1)


def _lookup(table: GrammarTable, base, state):
    live = (base >= 0) & (state >= 0)
    g = jnp.where(live, base + state, 0)
    return live, table.states[g, 0], jnp.where(live, table.states[g, 1], 0)


def allowed_tokens(table: GrammarTable, base, state, vocab_size: int):
    """bool[N, V]: the tokens each row's state allows (every token for unconstrained rows). base, state i32[N]."""
    live, first, count = _lookup(table, base, state)
    E = table.edges.shape[0]
    j = jnp.arange(table.width, dtype=jnp.int32)[None, :]
    idx = jnp.clip(first[:, None] + j, 0, E - 1)
    token = jnp.where(j < count[:, None], table.edges[idx, 0], vocab_size)     # [N, width]; vocab_size: dropped
    rows = jnp.arange(base.shape[0])[:, None]
    mask = jnp.zeros((base.shape[0], vocab_size), bool).at[rows, token].set(True, mode="drop")
    return mask | ~live[:, None]


def advance(table: GrammarTable, base, state, token):
    """i32[N]: the state after `token` (a binary search in the state's sorted edges); -1 where the grammar
    does not allow it, and for unconstrained rows."""
    live, first, count = _lookup(table, base, state)
    E = table.edges.shape[0]

    def halve(_, bounds):                    # lower bound of `token` in edges[lo:hi]
        lo, hi = bounds
        mid = (lo + hi) // 2
        right = table.edges[jnp.clip(mid, 0, E - 1), 0] < token
        searching = lo < hi
        return jnp.where(searching & right, mid + 1, lo), jnp.where(searching & ~right, mid, hi)

    # A loop, not unrolled: XLA compiles a chain of gathers slowly, and the step advances 2K+1 times.
    lo, _ = jax.lax.fori_loop(0, max(table.width, 1).bit_length(), halve, (first, first + count))
    at = jnp.clip(lo, 0, E - 1)
    found = live & (lo < first + count) & (table.edges[at, 0] == token)
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
