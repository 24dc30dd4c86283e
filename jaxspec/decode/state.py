"""The device-resident decode state and the per-step inputs the host builds.

Everything is indexed by a persistent request *slot* (a running request owns one until it finishes or is
preempted), never by its row in this step's batch. Slot `num_slots` is a trash slot: padding rows
point there, so their updates need no masking.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax.numpy as jnp
import numpy as np

from jaxspec.models.llama import init_kv_cache

MAX_STOP_IDS = 8

# Row-wise integer inputs, one row of `StepInputs.rows` each.
ROW_SLOT, ROW_NUM_NEW, ROW_START, ROW_NUM_DRAFTS, ROW_FIRST_TOKEN, ROW_SAMPLE, ROW_PROMPT_LEN, ROW_SEED, \
    ROW_SEED_HI, ROW_TOP_K, ROW_MIN_TOKENS = range(11)
NUM_ROW_INTS = 11
# Row-wise float inputs, one row of `StepInputs.rows_f` each.
ROW_TEMPERATURE, ROW_TOP_P, ROW_MIN_P, ROW_PRESENCE, ROW_FREQUENCY, ROW_REPETITION = range(6)
NUM_ROW_FLOATS = 6


@flax.struct.dataclass
class DecodeState:
    kv: dict              # target KV pages {"k", "v"}: [L, num_blocks*block_size, Hkv, hd]
    history: Any          # i32[num_slots+1, history_len]  every known token of each slot's sequence
    num_tokens: Any       # i32[num_slots+1]  tokens in `history` (authoritative)
    num_computed: Any     # i32[num_slots+1]  tokens whose KV is written (authoritative)
    drafts: Any           # i32[num_slots+1, max(k,1)]  drafts the next step verifies
    drafter: Any = None   # the drafter's own device state (its KV pages, hidden states), or None


@flax.struct.dataclass
class StepInputs:
    """What the host sends each step, padded to a bucket: T tokens, R rows."""
    tokens: Any        # i32[3, T]: host-known token id (-1: the device fills it), row, offset in row (-1: padding)
    rows: Any          # i32[NUM_ROW_INTS, R]
    rows_f: Any        # f32[NUM_ROW_FLOATS, R]
    stop_ids: Any      # i32[R, MAX_STOP_IDS]: ids masked until min_tokens (-1 padding)
    block_tables: Any  # i32[R, max_blocks_per_seq] (-1: no block)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static facts of the compiled step (changing any of them is a new compilation)."""
    block_size: int
    num_blocks: int
    num_slots: int
    max_model_len: int
    num_spec_tokens: int = 0
    attention: str = "reference"  # "pallas": the kernel that reads KV pages in place; "reference": jnp gather

    @property
    def history_len(self) -> int:
        return self.max_model_len + self.num_spec_tokens + 2

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def init_state(model_config, step_config: StepConfig, dtype, drafter_state=None) -> DecodeState:
    n = step_config.num_slots + 1
    return DecodeState(
        kv=init_kv_cache(model_config, step_config.num_blocks, step_config.block_size, dtype),
        history=jnp.zeros((n, step_config.history_len), jnp.int32),
        num_tokens=jnp.zeros((n,), jnp.int32),
        num_computed=jnp.zeros((n,), jnp.int32),
        drafts=jnp.full((n, max(step_config.num_spec_tokens, 1)), -1, jnp.int32),
        drafter=drafter_state,
    )


def pack_inputs(h: dict[str, np.ndarray]) -> np.ndarray:
    """All of one step's host inputs in one int32 buffer (floats bit-cast): a single transfer per step."""
    return np.concatenate([h["tokens"].ravel(), h["rows"].ravel(), h["rows_f"].view(np.int32).ravel(),
                           h["stop_ids"].ravel(), h["block_tables"].ravel()])


def unpack_inputs(buf, num_tokens: int, num_rows: int, max_blocks: int) -> StepInputs:
    """Inverse of `pack_inputs`, inside the jitted step (the sizes are static per bucket)."""
    import jax
    T, R = num_tokens, num_rows
    sizes = [3 * T, NUM_ROW_INTS * R, NUM_ROW_FLOATS * R, R * MAX_STOP_IDS, R * max_blocks]
    offsets = np.cumsum([0] + sizes)
    part = [buf[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]
    return StepInputs(tokens=part[0].reshape(3, T), rows=part[1].reshape(NUM_ROW_INTS, R),
                      rows_f=jax.lax.bitcast_convert_type(part[2], jnp.float32).reshape(NUM_ROW_FLOATS, R),
                      stop_ids=part[3].reshape(R, MAX_STOP_IDS), block_tables=part[4].reshape(R, max_blocks))


def empty_inputs(num_tokens: int, num_rows: int, step_config: StepConfig) -> dict[str, np.ndarray]:
    """Fresh host arrays for one step: every row padding (trash slot), every token padding."""
    tokens = np.zeros((3, num_tokens), np.int32)
    tokens[0] = -1
    tokens[2] = -1
    rows = np.zeros((NUM_ROW_INTS, num_rows), np.int32)
    rows[ROW_SLOT] = step_config.num_slots
    rows[ROW_START] = 0
    rows_f = np.zeros((NUM_ROW_FLOATS, num_rows), np.float32)
    rows_f[ROW_TOP_P] = 1.0
    rows_f[ROW_REPETITION] = 1.0
    return dict(tokens=tokens, rows=rows, rows_f=rows_f,
                stop_ids=np.full((num_rows, MAX_STOP_IDS), -1, np.int32),
                block_tables=np.full((num_rows, step_config.max_blocks_per_seq), -1, np.int32))
