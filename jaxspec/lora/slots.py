"""The adapters resident on the device: `max_loras` slots of A and B per LoRA-able weight, in the target's params
beside the weight (`<name>_lora_a` [L, max_loras + 1, R, K], `<name>_lora_b` [L, max_loras + 1, out..., R]; slot 0
stays zeros: a row without an adapter adds nothing), so the compiled step's shapes never change when adapters come
and go. Each step's rows name their slot (decode/inputs.py ROW_FIELDS "lora"); `jaxspec.nn.ops.lora_delta` adds it.

`AdapterSlots` owns the name -> slot map: a request's adapter is read and checked when the request is built, and the
request takes the adapter's slot when the scheduler admits it (writing it into a free slot, or the least recently used
one no running request holds) and gives it back when it ends. While every slot is held by running requests of other
adapters, the request waits in the queue (jaxspec/sched/scheduler.py says who passes it).
"""
from __future__ import annotations

import collections
import threading
from typing import Callable

import jax.numpy as jnp

from jaxspec.lora.peft import AdapterError, load_adapter, lora_shapes
from jaxspec.lora.request import LoRARequest
from jaxspec.nn.ops import LORA_A, LORA_B


def with_adapter_slots(params: dict, model_config, max_loras: int, max_rank: int) -> dict:
    """The target's params with zeroed adapter slots beside each LoRA-able weight (module docstring)."""
    shapes = lora_shapes(model_config, max_rank)
    if not shapes:
        raise AdapterError(f"this {model_config.arch!r} model has no weight LoRA adapters can target")
    layers = dict(params["layers"])
    dtype = params["embed"].dtype   # the model's compute dtype (an FP8 weight's adapters stay in it)
    for kind, names in shapes.items():
        stacks = dict(layers[kind])
        for name, (a_shape, b_shape, _) in names.items():
            stacks[name + LORA_A] = jnp.zeros((a_shape[0], max_loras + 1, *a_shape[1:]), dtype)
            stacks[name + LORA_B] = jnp.zeros((b_shape[0], max_loras + 1, *b_shape[1:]), dtype)
        layers[kind] = stacks
    return {**params, "layers": layers}


class AdapterSlots:
    """Which adapter sits in which slot, who holds it, and whose requests wait for one. `write(slot, adapter)`: puts
    an adapter's arrays ({kind: {name: (A, B)}}, or None: zeros) into the device slot (the model runner's
    `write_adapter`).

    A request's adapter is read and checked when the request is built (`stage`, on the caller's thread: a bad adapter
    is refused there) and its host arrays kept while it is resident or a request waits for it (vLLM's CPU copy), so
    taking a slot at admission (`acquire`, on the loop) never reads a file."""

    def __init__(self, model_config, max_loras: int, max_rank: int, write: Callable[[int, dict | None], None]):
        self.model_config, self.max_loras, self.max_rank, self._write = model_config, max_loras, max_rank, write
        self._lock = threading.Lock()
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()   # lora_int_id -> slot, LRU first
        # lora_int_id -> its LoRARequest and host arrays, for adapters resident or staged
        self.request_of: dict[int, LoRARequest] = {}
        self.arrays_of: dict[int, dict] = {}
        self.holders: collections.Counter = collections.Counter()   # slot -> requests holding it
        self.staged: collections.Counter = collections.Counter()    # lora_int_id -> requests built, not yet holding
        self.loads = 0
        # per adapter name: requests ended, their output tokens, and the drafts verified and accepted for them
        self.served: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def stage(self, request: LoRARequest):
        """A request built with `request`'s adapter: the adapter read and checked (AdapterError when it cannot be
        served over this base) unless it is resident or staged already; it waits for `acquire` or `unstage`."""
        with self._lock:
            self._check_id(request)
            known = request.lora_int_id in self.arrays_of
            if known:
                self.staged[request.lora_int_id] += 1
                return
        adapter = load_adapter(request.lora_path, self.model_config, self.max_rank)   # outside the lock: a file read
        with self._lock:
            self._check_id(request)
            self.request_of.setdefault(request.lora_int_id, request)
            self.arrays_of.setdefault(request.lora_int_id, adapter)
            self.staged[request.lora_int_id] += 1

    def acquire(self, request: LoRARequest, behind_waiter: bool = False) -> int | None:
        """A staged request's slot (its adapter written there if not resident: into a free slot, or the least recently
        used one nobody holds), held until `release`; None when no slot can be had now. `behind_waiter`: a request
        ahead of this one waits for a slot, so this one takes no free slot and does not join the held slot with the
        fewest holders, which is left to drain for the waiter (`draining`)."""
        with self._lock:
            lora_id = request.lora_int_id
            slot = self.slot_of.get(lora_id)
            if slot is None:
                slot = None if behind_waiter else self._free_slot()
                if slot is None:
                    return None
                self._write(slot, self.arrays_of[lora_id])
                self.loads += 1
            elif behind_waiter and slot == self.draining():
                return None
            self.slot_of[lora_id] = slot
            self.slot_of.move_to_end(lora_id)
            self.holders[slot] += 1
            self._unstage(lora_id)
            return slot

    def release(self, slot: int):
        with self._lock:
            if slot and self.holders[slot] > 0:
                self.holders[slot] -= 1

    def unstage(self, request: LoRARequest):
        """A staged request that ends (or is never queued) without taking a slot."""
        with self._lock:
            self._unstage(request.lora_int_id)

    def draining(self) -> int | None:
        """(Under the lock.) The held slot with the fewest holders (the least recently used of those): while a request
        waits for a slot, no request behind it joins this one, so it empties and the waiter takes it."""
        held = [slot for slot in self.slot_of.values() if self.holders[slot]]
        return min(held, key=self.holders.__getitem__) if held else None

    def record(self, lora_name: str, output_tokens: int, draft_tokens: int, accepted_tokens: int):
        """An ended request's counts, under its adapter's name (`stats`' per_adapter)."""
        with self._lock:
            self.served[lora_name].update(requests=1, output_tokens=output_tokens, draft_tokens=draft_tokens,
                                          accepted_tokens=accepted_tokens)

    def remove(self, lora_name: str) -> bool:
        """Unloads the adapter named `lora_name` (its slot zeroed); False when none is resident. AdapterError while a
        running request holds it or a queued one waits for it."""
        with self._lock:
            for lora_id, req in list(self.request_of.items()):
                if req.lora_name == lora_name and lora_id in self.slot_of:
                    slot = self.slot_of[lora_id]
                    if self.holders[slot] or self.staged[lora_id]:
                        raise AdapterError(f"adapter {lora_name!r} is in use by {self.holders[slot]} running "
                                           f"request(s) and awaited by {self.staged[lora_id]} queued one(s); unload "
                                           "it when they end")
                    del self.slot_of[lora_id]
                    self._forget(lora_id)
                    self._write(slot, None)
                    return True
            return False

    def resident(self) -> list[LoRARequest]:
        with self._lock:
            return [self.request_of[i] for i in self.slot_of]

    def _check_id(self, request: LoRARequest):
        known = self.request_of.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise AdapterError(f"lora_int_id={request.lora_int_id} is adapter {known.lora_name!r} "
                               f"({known.lora_path!r}); give {request.lora_name!r} its own id")

    def _unstage(self, lora_id: int):
        if self.staged[lora_id] > 0:
            self.staged[lora_id] -= 1
        self._forget(lora_id)

    def _forget(self, lora_id: int):
        """Drops an adapter's request and host arrays once it is neither resident nor staged."""
        if lora_id not in self.slot_of and not self.staged[lora_id]:
            self.request_of.pop(lora_id, None)
            self.arrays_of.pop(lora_id, None)
            self.staged.pop(lora_id, None)

    def _free_slot(self) -> int | None:
        used = set(self.slot_of.values())
        for slot in range(1, self.max_loras + 1):
            if slot not in used:
                return slot
        for lora_id, slot in self.slot_of.items():   # least recently used first
            if not self.holders[slot]:
                del self.slot_of[lora_id]
                self._forget(lora_id)
                return slot
        return None   # every slot is held by running requests: the request waits for one to end

    def stats(self) -> dict:
        with self._lock:
            per_adapter = {name: {**c, "acceptance_rate": c["accepted_tokens"] / c["draft_tokens"]
                                  if c["draft_tokens"] else 0.0} for name, c in self.served.items()}
            return {"max_loras": self.max_loras, "max_lora_rank": self.max_rank, "loads": self.loads,
                    "resident": [self.request_of[i].lora_name for i in self.slot_of],
                    "running": [self.request_of[i].lora_name for i, s in self.slot_of.items() if self.holders[s]],
                    "queued": {self.request_of[i].lora_name: n for i, n in self.staged.items() if n},
                    "per_adapter": per_adapter}
