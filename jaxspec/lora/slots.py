"""The adapters resident on the device: `max_loras` slots of A and B per LoRA-able weight, in the target's params
beside the weight (`<name>_lora_a` [L, max_loras + 1, R, K], `<name>_lora_b` [L, max_loras + 1, out..., R]; slot 0
stays zeros: a row without an adapter adds nothing), so the compiled step's shapes never change when adapters come
and go. Each step's rows name their slot (decode/inputs.py ROW_FIELDS "lora"); `jaxspec.nn.ops.lora_delta` adds it.

`AdapterSlots` owns the name -> slot map: a request takes its adapter's slot when it is built (loading it from disk
into a free slot, or the least recently used one no running request holds) and gives it back when it ends.
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
    """Which adapter sits in which slot, and who holds it. `write(slot, adapter)`: puts an adapter's arrays
    ({kind: {name: (A, B)}}, or None: zeros) into the device slot (the model runner's `write_adapter`)."""

    def __init__(self, model_config, max_loras: int, max_rank: int, write: Callable[[int, dict | None], None]):
        self.model_config, self.max_loras, self.max_rank, self._write = model_config, max_loras, max_rank, write
        self._lock = threading.Lock()
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()   # lora_int_id -> slot, LRU first
        self.request_of: dict[int, LoRARequest] = {}      # lora_int_id -> the request that loaded it
        self.holders: collections.Counter = collections.Counter()   # slot -> requests holding it
        self.loads = 0
        # per adapter name: requests ended, their output tokens, and the drafts verified and accepted for them
        self.served: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def acquire(self, request: LoRARequest) -> int:
        """The slot of `request`'s adapter, loaded if it is not resident; held until `release`. AdapterError for an
        adapter that cannot be served, or when every slot is held by running requests."""
        with self._lock:
            known = self.request_of.get(request.lora_int_id)
            if known is not None and known.lora_path != request.lora_path:
                raise AdapterError(f"lora_int_id={request.lora_int_id} is adapter {known.lora_name!r} "
                                   f"({known.lora_path!r}); give {request.lora_name!r} its own id")
            slot = self.slot_of.get(request.lora_int_id)
            if slot is None:
                adapter = load_adapter(request.lora_path, self.model_config, self.max_rank)
                slot = self._free_slot()
                self._write(slot, adapter)
                self.loads += 1
                self.request_of[request.lora_int_id] = request
            self.slot_of[request.lora_int_id] = slot
            self.slot_of.move_to_end(request.lora_int_id)
            self.holders[slot] += 1
            return slot

    def release(self, slot: int):
        with self._lock:
            if slot and self.holders[slot] > 0:
                self.holders[slot] -= 1

    def record(self, lora_name: str, output_tokens: int, draft_tokens: int, accepted_tokens: int):
        """An ended request's counts, under its adapter's name (`stats`' per_adapter)."""
        with self._lock:
            self.served[lora_name].update(requests=1, output_tokens=output_tokens, draft_tokens=draft_tokens,
                                          accepted_tokens=accepted_tokens)

    def remove(self, lora_name: str) -> bool:
        """Unloads the adapter named `lora_name` (its slot zeroed); False when none is resident. AdapterError while a
        running request holds it."""
        with self._lock:
            for lora_id, req in list(self.request_of.items()):
                if req.lora_name == lora_name and lora_id in self.slot_of:
                    slot = self.slot_of[lora_id]
                    if self.holders[slot]:
                        raise AdapterError(f"adapter {lora_name!r} is in use by {self.holders[slot]} running "
                                           "request(s); unload it when they end")
                    del self.slot_of[lora_id], self.request_of[lora_id]
                    self._write(slot, None)
                    return True
            return False

    def resident(self) -> list[LoRARequest]:
        with self._lock:
            return [self.request_of[i] for i in self.slot_of]

    def _free_slot(self) -> int:
        used = set(self.slot_of.values())
        for slot in range(1, self.max_loras + 1):
            if slot not in used:
                return slot
        for lora_id, slot in self.slot_of.items():   # least recently used first
            if not self.holders[slot]:
                del self.slot_of[lora_id], self.request_of[lora_id]
                return slot
        raise AdapterError(f"all max_loras={self.max_loras} adapter slots are held by running requests; raise "
                           "max_loras or send this adapter's requests when some of those end")

    def stats(self) -> dict:
        with self._lock:
            per_adapter = {name: {**c, "acceptance_rate": c["accepted_tokens"] / c["draft_tokens"]
                                  if c["draft_tokens"] else 0.0} for name, c in self.served.items()}
            return {"max_loras": self.max_loras, "max_lora_rank": self.max_rank, "loads": self.loads,
                    "resident": [self.request_of[i].lora_name for i in self.slot_of], "per_adapter": per_adapter}
