"""The device-resident decode state, declared once.

Everything is indexed by a persistent request *slot* (a running request owns one until it finishes or is
preempted), never by its row in this step's batch. Slot `num_slots` is a trash slot: padding rows point
there, so their updates need no masking.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax.numpy as jnp

from jaxspec.nn import schema
from jaxspec.nn.layers import CacheShape
from jaxspec.nn.schema import Spec


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static facts of the compiled step (changing any of them is a new compilation). The number of
    speculative tokens lives here and only here."""
    block_size: int
    num_blocks: int
    num_slots: int
    max_model_len: int
    num_speculative_tokens: int = 0
    logprobs_mode: str = "raw_logprobs"   # one of sched.config.LOGPROBS_MODES: which distribution `logprobs` reads
    kv_dtype: str | None = None           # the KV pools' dtype by name (None: the model's; sched.config.KV_CACHE_DTYPES)

    @property
    def history_len(self) -> int:
        return self.max_model_len + self.num_speculative_tokens + 2

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def cache_shape(self) -> CacheShape:
        return CacheShape(num_kv_slots=self.num_blocks * self.block_size, num_slots=self.num_slots + 1,
                          num_speculative_tokens=self.num_speculative_tokens, kv_dtype=self.kv_dtype)


@flax.struct.dataclass
class DecodeState:
    layers: dict          # per layer kind, its declared state: KV pools [n, S, Hkv, hd], per-slot states
    history: Any          # i32[slots+1, history_len]  every known token of each slot's sequence
    num_tokens: Any       # i32[slots+1]  tokens in `history` (authoritative)
    num_computed: Any     # i32[slots+1]  tokens whose KV is written (authoritative)
    drafts: Any           # i32[slots+1, max(k,1)]  drafts the next step verifies
    grammar_state: Any    # i32[slots+1]  structured outputs: the automaton state after the slot's last token
    drafter: Any = None   # the drafter's own declared state (its KV pages, features), or None


def state_schema(decoder, sc: StepConfig) -> dict:
    """The target's part of the decode state (the drafter declares its own)."""
    n = sc.num_slots + 1
    return {"layers": decoder.state_schema(sc.cache_shape),
            "history": Spec((n, sc.history_len), ("slots", "seq"), "zeros", jnp.int32),
            "num_tokens": Spec((n,), ("slots",), "zeros", jnp.int32),
            "num_computed": Spec((n,), ("slots",), "zeros", jnp.int32),
            "drafts": Spec((n, max(sc.num_speculative_tokens, 1)), ("slots", "draft"), -1, jnp.int32),
            "grammar_state": Spec((n,), ("slots",), -1, jnp.int32)}


def init_state(decoder, sc: StepConfig, dtype, drafter_schema=None) -> DecodeState:
    arrays = schema.initialize(state_schema(decoder, sc), dtype)
    drafter = schema.initialize(drafter_schema, dtype) if drafter_schema is not None else None
    return DecodeState(**arrays, drafter=drafter)
