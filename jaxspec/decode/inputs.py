"""What the host sends each step: typed per-token and per-row fields, declared once, packed into one int32
buffer (floats bit-cast) so a step is a single transfer, and unpacked by name inside the jitted step.

Adding a per-row input is one entry in `ROW_FIELDS` (its dtype, its value in padding rows and, when it is
fixed for the request's life, how to read it from the request), plus where the engine fills it or the step
reads it. Shapes: T tokens, R rows (both padded to a bucket), MB blocks per row.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

MAX_STOP_IDS = 8


@dataclasses.dataclass(frozen=True)
class Field:
    dtype: Any                                  # np.int32 or np.float32
    pad: Any                                    # value in padding rows / tokens ("trash_slot": num_slots)
    of_request: Callable | None = None          # (request, vocab_size) -> value, for fields fixed per request


def _seed_word(word: int):
    def read(req, vocab_size):   # the 64-bit seed's 32-bit words, as the device's int32s
        return int(np.uint32((req.seed % 2**64) >> (32 * word) & 0xFFFFFFFF).view(np.int32))
    return read


TOKEN_FIELDS = {
    "token_id": Field(np.int32, -1),            # host-known id; -1: the device fills it (decode tokens, drafts)
    "row": Field(np.int32, 0),                  # the token's row
    "offset": Field(np.int32, -1),              # its offset in the row; -1: padding
}

ROW_FIELDS = {
    # set each step from the scheduled row
    "slot": Field(np.int32, "trash_slot"),      # the request's slot
    "num_new": Field(np.int32, 0),              # tokens the row feeds the model
    "start": Field(np.int32, 0),                # position of its first token; -1: the device's own count
    "num_drafts": Field(np.int32, 0),           # of num_new, drafts to verify
    "first_token": Field(np.int32, 0),          # index in T of the row's first token
    "sample": Field(np.int32, 0),               # 1: the row emits tokens
    "new_slot": Field(np.int32, 0),             # 1: the request's first step in this slot (its state is stale)
    "grammar_base": Field(np.int32, -1),        # its automaton's first state in the grammar table; -1: none
    "grammar_init": Field(np.int32, -1),        # prefill rows: the automaton state after the outputs so far
    # fixed for the request's life
    "prompt_len": Field(np.int32, 0, lambda r, v: len(r.prompt_token_ids)),
    "seed": Field(np.int32, 0, _seed_word(0)),
    "seed_hi": Field(np.int32, 0, _seed_word(1)),
    "top_k": Field(np.int32, 0, lambda r, v: min(max(r.params.top_k, 0), v)),   # 0: off
    "min_tokens": Field(np.int32, 0, lambda r, v: r.params.min_tokens),
    # 1: the row adds its slot's row of the logit-bias table (written when the request takes the slot)
    "logit_bias": Field(np.int32, 0, lambda r, v: int(bool(r.params.logit_bias))),
    # its LoRA adapter's slot (jaxspec.lora.slots; taken at admission: with_request_value); 0: none
    "lora": Field(np.int32, 0, lambda r, v: r.lora_slot),
    "temperature": Field(np.float32, 0.0, lambda r, v: r.params.temperature),
    "top_p": Field(np.float32, 1.0, lambda r, v: r.params.top_p),
    "min_p": Field(np.float32, 0.0, lambda r, v: r.params.min_p),
    "presence_penalty": Field(np.float32, 0.0, lambda r, v: r.params.presence_penalty),
    "frequency_penalty": Field(np.float32, 0.0, lambda r, v: r.params.frequency_penalty),
    "repetition_penalty": Field(np.float32, 1.0, lambda r, v: r.params.repetition_penalty),
}
INT_ROWS = [name for name, f in ROW_FIELDS.items() if f.dtype == np.int32]
FLOAT_ROWS = [name for name, f in ROW_FIELDS.items() if f.dtype == np.float32]
STEP_INT_ROWS = [n for n in INT_ROWS if ROW_FIELDS[n].of_request is None]
REQUEST_INT_ROWS = [n for n in INT_ROWS if ROW_FIELDS[n].of_request is not None]
REQUEST_FLOAT_ROWS = [n for n in FLOAT_ROWS if ROW_FIELDS[n].of_request is not None]
assert INT_ROWS == STEP_INT_ROWS + REQUEST_INT_ROWS and FLOAT_ROWS == REQUEST_FLOAT_ROWS


def request_values(req, vocab_size: int) -> tuple[tuple, tuple]:
    """The request's fixed row values (ints, floats) in declaration order, computed once per request."""
    return (tuple(ROW_FIELDS[n].of_request(req, vocab_size) for n in REQUEST_INT_ROWS),
            tuple(ROW_FIELDS[n].of_request(req, vocab_size) for n in REQUEST_FLOAT_ROWS))


def with_request_value(ints: tuple, name: str, value: int) -> tuple:
    """`request_values`' ints with field `name` set anew: a value the request gets after it is built (the LoRA slot
    it takes when the scheduler admits it)."""
    i = REQUEST_INT_ROWS.index(name)
    return ints[:i] + (value,) + ints[i + 1:]


class StepInputs:
    """One step's host inputs, every token and row padding until written: `tokens[name]` [T], `rows[name]`
    [R] (views into two matrices, so rows are written in a few array writes), `stop_ids` [R, MAX_STOP_IDS]
    (ids masked until min_tokens; -1 padding), `block_tables` [R, MB] (-1: no block)."""

    def __init__(self, num_tokens: int, num_rows: int, num_slots: int, max_blocks: int):
        def padded(fields, names, length, dtype):
            pads = [num_slots if fields[n].pad == "trash_slot" else fields[n].pad for n in names]
            return np.repeat(np.asarray(pads, dtype)[:, None], length, axis=1)
        self.token_matrix = padded(TOKEN_FIELDS, list(TOKEN_FIELDS), num_tokens, np.int32)
        self.int_rows = padded(ROW_FIELDS, INT_ROWS, num_rows, np.int32)
        self.float_rows = padded(ROW_FIELDS, FLOAT_ROWS, num_rows, np.float32)
        self.stop_ids = np.full((num_rows, MAX_STOP_IDS), -1, np.int32)
        self.block_tables = np.full((num_rows, max_blocks), -1, np.int32)

    def copy(self) -> "StepInputs":
        """A fresh copy (arrays of its own): a blank is copied rather than rebuilt each step."""
        new = object.__new__(StepInputs)
        for name in ("token_matrix", "int_rows", "float_rows", "stop_ids", "block_tables"):
            setattr(new, name, getattr(self, name).copy())
        return new

    @property
    def tokens(self) -> dict[str, np.ndarray]:
        return dict(zip(TOKEN_FIELDS, self.token_matrix))

    @property
    def rows(self) -> dict[str, np.ndarray]:
        return {**dict(zip(INT_ROWS, self.int_rows)), **dict(zip(FLOAT_ROWS, self.float_rows))}

    def write_rows(self, step_ints: np.ndarray, request_ints: np.ndarray, request_floats: np.ndarray):
        """Rows 0..n-1 at once: step_ints [n, len(STEP_INT_ROWS)], request_ints/floats [n, ...] (the requests'
        `request_values`), in declaration order."""
        n = len(step_ints)
        self.int_rows[:len(STEP_INT_ROWS), :n] = step_ints.T
        self.int_rows[len(STEP_INT_ROWS):, :n] = request_ints.T
        self.float_rows[:, :n] = request_floats.T

    def pack(self) -> np.ndarray:
        """Everything in one int32 buffer (floats bit-cast): a single transfer per step."""
        return np.concatenate([self.token_matrix.ravel(), self.int_rows.ravel(), self.float_rows.view(np.int32).ravel(),
                               self.stop_ids.ravel(), self.block_tables.ravel()])


@dataclasses.dataclass(frozen=True)
class DeviceInputs:
    """`StepInputs` inside the jitted step, by the same names."""
    tokens: dict          # name -> i32[T]
    rows: dict            # name -> i32[R] / f32[R]
    stop_ids: Any         # i32[R, MAX_STOP_IDS]
    block_tables: Any     # i32[R, MB]


def unpack(buf, num_tokens: int, num_rows: int, max_blocks: int) -> DeviceInputs:
    """Inverse of `StepInputs.pack` (the sizes are static per bucket)."""
    T, R = num_tokens, num_rows
    sizes = [len(TOKEN_FIELDS) * T, len(INT_ROWS) * R, len(FLOAT_ROWS) * R, R * MAX_STOP_IDS, R * max_blocks]
    offsets = np.cumsum([0] + sizes)
    part = [buf[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]
    tokens = part[0].reshape(len(TOKEN_FIELDS), T)
    ints = part[1].reshape(len(INT_ROWS), R)
    floats = jax.lax.bitcast_convert_type(part[2], jnp.float32).reshape(len(FLOAT_ROWS), R)
    return DeviceInputs(tokens=dict(zip(TOKEN_FIELDS, tokens)),
                        rows={**dict(zip(INT_ROWS, ints)), **dict(zip(FLOAT_ROWS, floats))},
                        stop_ids=part[3].reshape(R, MAX_STOP_IDS), block_tables=part[4].reshape(R, max_blocks))
