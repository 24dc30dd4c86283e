"""KV block allocation: a free list of fixed-size blocks and a pool of device request slots."""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.free_slots: deque[int] = deque(range(num_slots))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extend `block_ids` in place to hold `num_tokens`; False (nothing taken) if the pool is short."""
        need = self.blocks_for(num_tokens) - len(block_ids)
        if need > len(self.free_blocks):
            return False
        block_ids.extend(self.free_blocks.popleft() for _ in range(max(need, 0)))
        return True

    def free(self, block_ids: list[int]):
        self.free_blocks.extend(block_ids)
        block_ids.clear()

    def take_slot(self) -> int | None:
        return self.free_slots.popleft() if self.free_slots else None

    def free_slot(self, slot: int):
        self.free_slots.append(slot)
