"""A structured-outputs compile worker: one process that builds token automata for the parent's GrammarCompiler,
so that a constraint that takes too long or too much memory is stopped by ending this process (jaxspec/structured/
compile_pool.py starts, feeds and kills it).

It runs as a script (`python worker.py READ_FD WRITE_FD MEMORY_BYTES`), not as a module of the package: importing
`jaxspec` imports JAX (seconds and ~150 MB per process, and JAX reserves address space that a memory limit would
count). So this file imports only the standard library and outlines-core.

Protocol over two pipes (multiprocessing Connections, pickled messages):
    parent -> worker, once:  {"vocabulary": {bytes: [token ids]}, "eos_token_id", "eos_token_ids", "end_token",
                              "max_edges"}
    worker -> parent, once:  ("ready", None)
    parent -> worker:        (kind, regex)            the regex already ends with END (see compiler.py)
    worker -> parent:        ("ok", AutomatonArrays) | ("refused", message) | ("memory", message)
"""
from __future__ import annotations

import array
import os
import resource
import sys
import threading
import time
from multiprocessing.connection import Connection

# How often the worker checks that its parent still lives (it exits when the parent is gone).
PARENT_CHECK_SECONDS = 1.0


def automaton_arrays(index, kind: str, eos_token_ids: tuple[int, ...], end_token: int, max_edges: int) -> tuple:
    """outlines-core's Index (of a regex followed by END) -> (initial, first, count, token, next_state), the last
    four `array('i')` (compiler.TokenAutomaton's CSR layout): states renumbered from 0 (the initial state first),
    the states past END dropped, and an edge per model EOS token (to the same state) on each state that had an
    END edge. A ValueError names a constraint that matches no text or has more than `max_edges` edges."""
    transitions = index.get_transitions()             # {state: {token: next state}}
    initial = index.get_initial_state()
    # A state accepts where END leads to a final state. END is a character, so a pattern's character class can
    # match it too (inside a JSON string): there it leads on inside the pattern, which is not an end.
    finals = set(index.get_final_states())
    accepting = [s for s, out in transitions.items() if out.get(end_token) in finals]
    live = _states_reaching(accepting, transitions, end_token)
    if initial not in live:
        raise ValueError(f"structured_outputs.{kind} matches no text this model's tokens can spell")
    names = [initial] + sorted(live - {initial})
    number = {s: i for i, s in enumerate(names)}
    first, count, tokens, nexts = (array.array("i") for _ in range(4))
    for s in names:
        out = transitions.get(s, {})
        edges = {t: number[n] for t, n in out.items() if n in live and t != end_token}
        if out.get(end_token) in finals:
            edges.update({t: number[s] for t in eos_token_ids})
        first.append(len(tokens))
        count.append(len(edges))
        if len(tokens) + len(edges) > max_edges:
            raise ValueError(f"structured_outputs.{kind} compiles to more than {max_edges} token transitions (the "
                             "limit); simplify the constraint")
        for t in sorted(edges):
            tokens.append(t)
            nexts.append(edges[t])
    return 0, first, count, tokens, nexts


def _states_reaching(targets: list, transitions: dict, end_token: int) -> set:
    """The states from which one of `targets` can be reached (targets included), END edges left out."""
    into: dict[int, set] = {}
    for s, out in transitions.items():
        for t, n in out.items():
            if t != end_token:
                into.setdefault(n, set()).add(s)
    live, todo = set(targets), list(targets)
    while todo:
        for s in into.get(todo.pop(), ()):
            if s not in live:
                live.add(s)
                todo.append(s)
    return live


def compile_one(vocabulary, setup: dict, kind: str, regex: str) -> tuple[str, object]:
    """One job: ("ok", arrays), or ("refused", why) / ("memory", why) for a constraint that cannot be used."""
    from outlines_core import Index
    try:
        index = Index(regex, vocabulary)
    except MemoryError:
        return "memory", f"structured_outputs.{kind} needs more memory to compile than this server allows"
    except Exception as e:   # outlines-core's message says what in the regex it cannot take
        return "refused", (f"structured_outputs.{kind} cannot be compiled into a token automaton for this model's "
                           f"vocabulary: {e}")
    try:
        return "ok", automaton_arrays(index, kind, setup["eos_token_ids"], setup["end_token"], setup["max_edges"])
    except MemoryError:
        return "memory", f"structured_outputs.{kind} needs more memory to compile than this server allows"
    except ValueError as e:
        return "refused", str(e)


def _limit_memory(max_bytes: int):
    """Caps the process's address space: an allocation past it fails (a MemoryError in Python; outlines-core,
    in Rust, aborts the process), so a constraint cannot take more memory than the parent allows."""
    if max_bytes > 0:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))
        except (ValueError, OSError) as e:   # a system without address-space limits: the time budget still holds
            print(f"jaxspec compile worker: no memory limit ({e})", file=sys.stderr)


def _exit_with_parent():
    """A thread that ends this process when its parent is gone (killed without closing the pipes)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_SECONDS)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]):
    read_fd, write_fd, max_bytes = (int(a) for a in argv)
    _limit_memory(max_bytes)
    _exit_with_parent()
    jobs, results = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    from outlines_core import Vocabulary
    setup = jobs.recv()
    vocabulary = Vocabulary(setup["eos_token_id"], setup["vocabulary"])
    del setup["vocabulary"]
    results.send(("ready", None))
    while True:
        try:
            kind, regex = jobs.recv()
        except EOFError:   # the parent closed the pool
            return
        outcome = compile_one(vocabulary, setup, kind, regex)
        try:
            results.send(outcome)
        except MemoryError:   # pickling a large automaton failed before anything was written
            results.send(("memory", f"structured_outputs.{kind} needs more memory to compile than this server allows"))


if __name__ == "__main__":
    main(sys.argv[1:])
