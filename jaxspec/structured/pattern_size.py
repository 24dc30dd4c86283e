"""What a constraint's regex will cost to compile, estimated from its parse tree before any compiling, so that
patterns known to explode are refused at once with what is wrong, instead of holding a compile process for its
whole time or memory budget.

A token automaton has about one state per position of the regex with its counted repetitions unrolled:
`(a|b){1,100000}` is short to write but needs ~100000 states, and building each state walks the whole
vocabulary (about a second per thousand states for a 49k vocabulary on one CPU core). A position whose class
takes almost any character (`.`, `[^"]`, `\\W`) is worse: nearly every token leads on from each of its states,
and a character outside ASCII needs a state per UTF-8 byte, so it costs ~3 x vocabulary-size edges
(`.{0,500}`: 72M edges, 9 GB while compiling).

The regex is parsed with Python's own regex parser. outlines-core reads Rust's regex syntax, which is close but
not the same: a regex Python cannot parse is not estimated (the compile's own time and memory budgets still
hold).
"""
from __future__ import annotations

import dataclasses

try:                       # Python 3.11+
    from re import _constants as sre_constants, _parser as sre_parse
except ImportError:        # pragma: no cover  (Python 3.10)
    import sre_constants
    import sre_parse

MAX_UNROLLED_POSITIONS = 10_000   # a regex whose counted repetitions add more positions than this is refused
WIDE_STATES_PER_CHARACTER = 3     # states a class of non-ASCII characters takes per character (UTF-8 bytes)
WIDE_CLASS_SIZE = 128             # a class taking more characters than this lets nearly every token through

_REPEATS = {sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, getattr(sre_constants, "POSSESSIVE_REPEAT", None)}


@dataclasses.dataclass
class Size:
    """Positions of a regex: with its counted repetitions unrolled, and as written (each repetition once); the
    same for its wide positions. Only what the counts add is judged: a long regex (a choice among a thousand
    strings, a JSON schema with many properties) is as long as its request, and alternatives share automaton
    states, but a count multiplies states that nothing in the request pays for."""
    unrolled: int = 0
    written: int = 0
    wide_unrolled: int = 0
    wide_written: int = 0
    repeat: tuple | None = None   # (min, max or None, positions added) of the repetition that adds most

    @property
    def added(self) -> int:
        return self.unrolled - self.written

    @property
    def wide_added(self) -> int:
        return self.wide_unrolled - self.wide_written

    def add(self, other: "Size", times: int = 1):
        self.unrolled += times * other.unrolled
        self.written += other.written
        self.wide_unrolled += times * other.wide_unrolled
        self.wide_written += other.wide_written
        self._blame(other.repeat)

    def _blame(self, repeat: tuple | None):
        if repeat is not None and (self.repeat is None or repeat[2] > self.repeat[2]):
            self.repeat = repeat


def pattern_size(regex: str) -> Size | None:
    """The regex's size, or None when Python's parser cannot read it."""
    try:
        tree = sre_parse.parse(regex)
    except Exception:   # Rust syntax Python lacks (\p{L}, ...), or a count past Python's limit
        return None
    return _size(tree)


def check_pattern_size(regex: str, kind: str, vocab_size: int, max_edges: int):
    """A ValueError naming the problem when the regex (the one compiled for structured_outputs.`kind`) would
    unroll to more than MAX_UNROLLED_POSITIONS positions or need more than `max_edges` token transitions."""
    size = pattern_size(regex)
    if size is None:
        return
    where = f"structured_outputs.{kind}"
    schema_hint = (" (a JSON schema's maxLength, minLength, maxItems and minItems become such counts)"
                   if kind in ("json", "json_object") else "")
    if size.added > MAX_UNROLLED_POSITIONS:
        lo, hi, _ = size.repeat
        raise ValueError(f"{where} repeats a part of its pattern {_count(lo, hi)} times: unrolled, its counted "
                         f"repetitions add about {size.added} positions (about one automaton state each), more than "
                         f"the {MAX_UNROLLED_POSITIONS} allowed{schema_hint}; lower the count, or use an unbounded "
                         f"repetition (* or +)")
    edges = size.wide_added * WIDE_STATES_PER_CHARACTER * vocab_size
    if edges > max_edges:
        lo, hi, _ = size.repeat
        raise ValueError(f"{where} repeats a class that takes almost any character (such as `.` or a negated class) "
                         f"{_count(lo, hi)} times{schema_hint}: each repetition lets nearly every token of the "
                         f"vocabulary through, about {edges} token transitions in all, more than the limit of "
                         f"{max_edges}; narrow the class or lower the count")


def _count(lo: int, hi: int | None) -> str:
    if hi is None:
        return f"{{{lo},}}"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def _size(items) -> Size:
    total = Size()
    for op, av in items:
        total.add(_item_size(op, av))
    return total


def _item_size(op, av) -> Size:
    C = sre_constants
    if op in _REPEATS:
        lo, hi, sub = av
        unbounded = hi == C.MAXREPEAT
        copies = max(lo + 1 if unbounded else hi, 1)   # X{m,} is m copies, then X*
        inner = _size(sub)
        out = Size()
        out.add(inner, copies)
        out._blame((lo, None if unbounded else hi, out.unrolled - inner.unrolled))
        return out
    if op == C.SUBPATTERN:
        return _size(av[-1])
    if op == C.BRANCH:
        out = Size()
        for branch in av[1]:
            out.add(_size(branch))
        return out
    if op in (C.ASSERT, C.ASSERT_NOT):
        return _size(av[1])
    if op == getattr(C, "ATOMIC_GROUP", None):
        return _size(av)
    if op == C.GROUPREF_EXISTS:
        out = _size(av[1])
        if av[2] is not None:
            out.add(_size(av[2]))
        return out
    if op in (C.AT, C.GROUPREF):
        return Size()
    wide = int(_is_wide(op, av))
    return Size(unrolled=1, written=1, wide_unrolled=wide, wide_written=wide)


def _is_wide(op, av) -> bool:
    """Whether one position takes almost any character (so almost any token can follow)."""
    C = sre_constants
    if op in (C.ANY, C.NOT_LITERAL):
        return True
    if op == C.CATEGORY:
        return av in (C.CATEGORY_NOT_DIGIT, C.CATEGORY_NOT_SPACE, C.CATEGORY_NOT_WORD, C.CATEGORY_WORD)
    if op == C.IN:
        if any(o == C.NEGATE for o, _ in av):
            return True
        taken = 0
        for o, a in av:
            if o == C.RANGE:
                taken += a[1] - a[0] + 1
            elif o == C.CATEGORY:
                taken += WIDE_CLASS_SIZE + 1 if _is_wide(C.CATEGORY, a) else 10
            else:
                taken += 1
        return taken > WIDE_CLASS_SIZE
    return False
