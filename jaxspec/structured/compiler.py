"""Constraints compiled on the host into token automata, once per constraint (cached), off the engine's loop.

A constraint becomes a regular expression (a JSON schema by outlines-core's `build_regex_from_schema`; any JSON
object by a JSON regex of bounded nesting; choices by an alternation), and outlines-core builds the token-level
DFA of that regex over the model's vocabulary (each token id's bytes). The DFA is kept as a `TokenAutomaton`:
per state, its allowed tokens sorted by id and the state each one leads to (a CSR layout: `first` and `count`
index into the edge arrays). The model's end-of-sequence tokens are edges of the accepting states only (to the
same state): EOS is allowed exactly when the output so far is a whole match.

The regex is compiled followed by END, a character no text holds, whose own token (an id past the model's
vocabulary) marks where the output may end: outlines-core's DFA keeps no path that continues past a final state
through non-final ones (`(yes|yes sir)` would lose " sir", `[0-9]+([.][0-9]+)?` its fraction), and with END
appended the only final states are past END. States whose END edge leads to a final state accept (a
character class inside the pattern, a JSON string's, can match END too and lead on: no end there); END edges, the states past them and
every state from which no accepting state can be reached (those a token holding only the first bytes of END leads
to) are dropped, so every state allows some token.

Compiling runs in worker processes (compile_pool.py, worker.py), each capped in memory, and a compile that runs
past its time budget is stopped by killing its process: a constraint that is refused leaves nothing running.
Before any compiling, a regex whose counted repetitions would explode (`(a|b){1,100000}`) is refused with what
is wrong (pattern_size.py). Results are cached by constraint, refusals too (the same bad constraint is refused at
once the next time), but not a busy answer (CompileUnavailable: the constraint was never compiled).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
import weakref

import numpy as np

from jaxspec.structured.compile_pool import CompilePool
from jaxspec.structured.params import StructuredOutputsParams, choice_regex
from jaxspec.structured.pattern_size import check_pattern_size

MAX_EDGES = 1 << 25          # a constraint whose automaton has more (token, next state) edges is refused
CACHE_SIZE = 256             # compiled constraints kept (least recently used dropped first)
JSON_OBJECT_DEPTH = 2        # json_object: an object whose values nest objects / arrays this deep
COMPILE_WORKERS = 2          # constraint compiles that run at once (one process each)
END = "\uffff"               # a Unicode noncharacter: appended to every regex (see above)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
    """A token-level DFA in CSR form. States are 0..num_states-1, `initial` the start state."""
    key: tuple                 # the constraint it was compiled from (StructuredOutputsParams.key)
    initial: int
    first: np.ndarray          # i32[states] index of each state's first edge
    count: np.ndarray          # i32[states] its number of edges (allowed tokens)
    token: np.ndarray          # i32[edges] the allowed token of each edge, sorted within a state
    next_state: np.ndarray     # i32[edges] the state it leads to

    @property
    def num_states(self) -> int:
        return len(self.first)

    @property
    def num_edges(self) -> int:
        return len(self.token)

    def allowed(self, state: int) -> np.ndarray:
        """The tokens state `state` allows, sorted (none for -1, outside the grammar)."""
        if state < 0:
            return self.token[:0]
        return self.token[self.first[state]:self.first[state] + self.count[state]]

    def next(self, state: int, token: int) -> int:
        """The state after `token`, or -1 when the grammar does not allow it here."""
        if state < 0:
            return -1
        lo, n = int(self.first[state]), int(self.count[state])
        at = lo + int(np.searchsorted(self.token[lo:lo + n], token))
        return int(self.next_state[at]) if at < lo + n and self.token[at] == token else -1

    def walk(self, tokens) -> int:
        """The state after `tokens` from the initial state (-1 if they leave the grammar)."""
        state = self.initial
        for t in tokens:
            state = self.next(state, int(t))
        return state


# ---- the vocabulary as bytes -------------------------------------------------------------------------------

def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: printable Latin-1 bytes as themselves, the
    others as the characters from U+0100 on, in byte order. -> character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _is_byte_level(hf, vocab: dict[str, int]) -> bool:
    backend = getattr(hf, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is not None:
        return "ByteLevel" in repr(decoder)
    return sum("Ġ" in t for t in vocab) > sum("▁" in t for t in vocab)


def token_bytes(tokenizer, vocab_size: int) -> dict[int, bytes]:
    """Token id -> the bytes it adds to the text, for every id the model can emit except special and added
    tokens (which never belong inside structured text)."""
    hf = tokenizer.hf
    vocab = hf.get_vocab()
    special = set(getattr(hf, "all_special_ids", ())) | set(getattr(hf, "added_tokens_decoder", {}))
    special |= set(tokenizer.eos_token_ids)
    byte_level = _is_byte_level(hf, vocab)
    alphabet = _byte_level_alphabet()
    out = {}
    for text, i in vocab.items():
        if i in special or not 0 <= i < vocab_size:
            continue
        if byte_level and all(c in alphabet for c in text):
            data = bytes(alphabet[c] for c in text)
        elif not byte_level and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            data = bytes([int(text[3:5], 16)])      # a sentencepiece byte-fallback token
        else:
            data = text.replace("▁", " ").encode("utf-8")
        if data:
            out[i] = data
    return out


# ---- constraints -> regex -> automaton -------------------------------------------------------------------

def json_object_regex(whitespace: str | None) -> str:
    """Any JSON object whose values nest objects and arrays up to JSON_OBJECT_DEPTH levels."""
    from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING, WHITESPACE
    ws = WHITESPACE if whitespace is None else whitespace

    def obj(value):
        member = f"{STRING}{ws}:{ws}{value}"
        return rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"

    def value(depth):
        scalar = f"({STRING}|{NUMBER}|{BOOLEAN}|{NULL})"
        if depth == 0:
            return scalar
        inner = value(depth - 1)
        return rf"({scalar}|{obj(inner)}|\[{ws}({inner}({ws},{ws}{inner})*)?{ws}\])"

    return obj(value(JSON_OBJECT_DEPTH - 1))


def constraint_regex(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind == "regex":
        return params.regex
    if kind == "choice":
        return choice_regex(params.choice)
    if kind == "json_object":
        return json_object_regex(params.whitespace())
    from outlines_core.json_schema import build_regex_from_schema
    schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
    try:
        return build_regex_from_schema(schema, params.whitespace())
    except Exception as e:   # the library's own message says which part of the schema it cannot take
        raise ValueError(f"structured_outputs.json is a JSON schema that cannot be compiled: {e}") from None


class GrammarCompiler:
    """Compiles constraints into TokenAutomata over one model's vocabulary, in worker processes; cached by
    constraint. `timeout`: seconds a compile may run (and a compile may wait for a free worker) before it is
    stopped; `memory_gb`: GiB of address space a compile process may use."""

    def __init__(self, tokenizer, vocab_size: int, timeout: float = 30.0, memory_gb: float = 2.0,
                 workers: int = COMPILE_WORKERS):
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer (to know each token's text); this "
                             "model has none")
        self.tokenizer, self.vocab_size, self.timeout, self.memory_gb = tokenizer, vocab_size, timeout, memory_gb
        self.end_token = vocab_size     # END's token: never a model token
        self.eos_token_ids = tuple(t for t in tokenizer.eos_token_ids if 0 <= t < vocab_size)
        self._vocabulary = None
        self._cache: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.pool = CompilePool(self._worker_setup, workers, int(memory_gb * 2**30))
        weakref.finalize(self, self.pool.close)   # no compile process outlives its compiler

    def __len__(self) -> int:
        """Constraints compiled (or compiling) in the cache."""
        return len(self._cache)

    def close(self):
        """Stops the compile processes: compiles under way end with CompileUnavailable, and so do later ones."""
        self.pool.close()

    def compile(self, params: StructuredOutputsParams) -> TokenAutomaton:
        """The constraint's automaton: from the cache, or compiled within `timeout` seconds. A ValueError names a
        constraint that cannot be used (bad, too large, too slow to compile, too much memory); CompileUnavailable
        (a RuntimeError) says the compile processes were busy with others' constraints the whole `timeout`."""
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if owner:
                future = self._cache[key] = concurrent.futures.Future()
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        if owner:
            self._settle(future, params, key)
        return future.result()

    def _settle(self, future: concurrent.futures.Future, params: StructuredOutputsParams, key: tuple):
        """Compiles the constraint into `future`. A refusal stays cached; a busy pool is not the constraint's
        fault, so that outcome is dropped from the cache (the next request compiles again)."""
        try:
            future.set_result(self._compile(params, key))
        except ValueError as e:
            future.set_exception(e)
        except BaseException as e:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]
            future.set_exception(e)

    def _compile(self, params: StructuredOutputsParams, key: tuple) -> TokenAutomaton:
        kind = params.kind
        regex = constraint_regex(params)
        check_pattern_size(regex, kind, self.vocab_size, MAX_EDGES)
        outcome, value = self.pool.compile(kind, f"({regex}){END}", self.timeout, wait=self.timeout)
        if outcome == "ok":
            initial, *arrays = value
            return TokenAutomaton(key, initial, *(np.frombuffer(a, np.int32).copy() for a in arrays))
        if outcome == "timeout":
            raise ValueError(f"structured_outputs.{kind} took longer than {self.timeout:g} s to compile (the limit "
                             "per request); simplify the constraint")
        if outcome in ("memory", "ended"):
            ended = f"; its compile process ended by {value}" if outcome == "ended" else ""
            raise ValueError(f"structured_outputs.{kind} needs more memory to compile than the {self.memory_gb:g} GiB "
                             f"a compile may use{ended}; simplify the constraint")
        raise ValueError(value)

    def _worker_setup(self) -> dict:
        """What each compile process receives once: the vocabulary as outlines-core builds it (token bytes ->
        ids, END's token among them), the EOS ids and the edge limit."""
        return {"vocabulary": self._token_ids_by_bytes(), "eos_token_id": self._outlines_eos(),
                "eos_token_ids": self.eos_token_ids, "end_token": self.end_token, "max_edges": MAX_EDGES}

    def _token_ids_by_bytes(self) -> dict[bytes, list[int]]:
        by_bytes: dict[bytes, list[int]] = {}
        for i, data in token_bytes(self.tokenizer, self.vocab_size).items():
            by_bytes.setdefault(data, []).append(i)
        by_bytes.setdefault(END.encode(), []).append(self.end_token)
        return by_bytes

    def _outlines_eos(self) -> int:
        return self.eos_token_ids[0] if self.eos_token_ids else self.vocab_size + 1

    # ---- in this process: the reference the tests compare the device's masks with ---------------------------
    def vocabulary(self):
        """outlines-core's Vocabulary of the model's tokens (built once)."""
        with self._lock:
            if self._vocabulary is None:
                from outlines_core import Vocabulary
                self._vocabulary = Vocabulary(self._outlines_eos(), self._token_ids_by_bytes())
            return self._vocabulary

    def index(self, params: StructuredOutputsParams):
        """outlines-core's Index of the constraint's regex followed by END, built in this process (no budget)."""
        from outlines_core import Index
        regex = f"({constraint_regex(params)}){END}"
        try:
            return Index(regex, self.vocabulary())
        except Exception as e:
            raise ValueError(f"structured_outputs.{params.kind} cannot be compiled into a token automaton for this "
                             f"model's vocabulary: {e}") from None

