"""KV block allocation with automatic prefix caching, and the pool of device request slots.

Blocks are reference-counted: a block in use by several requests (a shared prefix) is freed when the last
one lets go. A block full of confirmed tokens whose KV is final is registered in the prefix cache under a
chained hash of its token ids (the parent block's hash and its own tokens), so a later request whose prompt
starts with the same tokens reuses it instead of recomputing it. Freed blocks wait in `free` in least recently
used order; a cached block there keeps its cache entry until the pool needs it (then it is evicted). A match is
confirmed by comparing token ids, never by the hash alone.

With a sliding window a request lets go of the blocks behind it as it moves on (`release_before`), so a long
sequence holds a bounded number of blocks.

`key_overlap` tokens past a block belong to its key when what the block holds depends on them: an EAGLE
head's KV at position p pairs token p+1 with the target's feature at p, so its blocks are keyed by their tokens
and the next one.
"""
from __future__ import annotations

from collections import OrderedDict, deque


# A request's block-table entry whose block went back to the pool (behind a sliding window): never read again. The
# device's tables read it as no block (-1).
RELEASED = -1


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, enable_prefix_caching: bool = False,
                 key_overlap: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.key_overlap = key_overlap
        self.ref_count = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))   # first: reused first
        self.free_slots: deque[int] = deque(range(num_slots))
        # prefix cache: hash -> block, and each cached block's (hash, token ids)
        self.cached: dict[int, int] = {}
        self.block_key: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones among them: reusable after eviction)."""
        return len(self.free)

    # ---- allocation --------------------------------------------------------------------------------
    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extend `block_ids` in place to hold `num_tokens`; False (nothing taken) if the pool is short."""
        need = self.blocks_for(num_tokens) - len(block_ids)
        if need > len(self.free):
            return False
        for _ in range(max(need, 0)):
            block, _ = self.free.popitem(last=False)
            self._evict(block)
            self.ref_count[block] = 1
            block_ids.append(block)
        return True

    def free_blocks(self, block_ids: list[int]):
        """Let go of a request's blocks. Cached ones become the most recently used (the first blocks of a
        sequence last, so its tail is evicted first); the rest are reused first."""
        for block in reversed(block_ids):
            self._let_go(block)
        block_ids.clear()

    def release_before(self, block_ids: list[int], num_blocks: int):
        """Let go of the request's first `num_blocks` blocks (no position in them is read again: they are behind
        a sliding window); their table entries become RELEASED, so positions keep their block index."""
        for b in range(min(num_blocks, len(block_ids))):
            self._let_go(block_ids[b])
            block_ids[b] = RELEASED

    def _let_go(self, block: int):
        if block == RELEASED:
            return
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"KV block {block} freed more often than it was taken")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free[block] = None
            self.free.move_to_end(block, last=block in self.block_key)

    def _evict(self, block: int):
        key = self.block_key.pop(block, None)
        if key is not None:
            del self.cached[key[0]]

    # ---- the prefix cache --------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], hashes: list[int], salt=None) -> list[int]:
        """The cached blocks that hold the longest block-aligned prefix of `token_ids`, leaving at least its
        last token to compute; each is taken (a reference per request). `hashes` receives their chained
        hashes. `salt`: what else the KV depends on (a LoRA adapter's id), the first block's parent in the chain:
        blocks cached under another salt never match."""
        if not self.enable_prefix_caching:
            return []
        bs, extra = self.block_size, self.key_overlap
        blocks, parent = [], salt
        for b in range((len(token_ids) - 1 - extra) // bs):
            tokens = tuple(token_ids[b * bs:(b + 1) * bs + extra])
            h = block_hash(parent, tokens)
            block = self.cached.get(h)
            if block is None or self.block_key[block][1] != tokens:   # a hash collision is a miss
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1
        return blocks

    def record_lookup(self, num_tokens: int, num_hit: int):
        """A request was admitted: `num_tokens` looked up, `num_hit` of them found in the cache."""
        if not self.enable_prefix_caching:
            return
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit

    def cache_blocks(self, block_ids: list[int], token_ids: list[int], hashes: list[int], num_final: int,
                     salt=None):
        """Registers the request's blocks that are full of tokens whose KV is final: the first `num_final`
        tokens of `token_ids`. `hashes` holds the chained hashes of its blocks registered so far (extended
        here); `salt` as `match_prefix`'s. A block whose tokens another cached block already holds stays
        unregistered."""
        if not self.enable_prefix_caching:
            return
        bs, extra = self.block_size, self.key_overlap
        for b in range(len(hashes), min(num_final // bs, (len(token_ids) - extra) // bs, len(block_ids))):
            tokens = tuple(token_ids[b * bs:(b + 1) * bs + extra])
            h = block_hash(hashes[-1] if hashes else salt, tokens)
            block = block_ids[b]
            if block != RELEASED and h not in self.cached and block not in self.block_key:
                self.cached[h] = block
                self.block_key[block] = (h, tokens)
            hashes.append(h)

    def stats(self) -> dict:
        q, h = self.queried_tokens, self.hit_tokens
        return {"enabled": self.enable_prefix_caching, "cached_blocks": len(self.cached), "queried_tokens": q,
                "hit_tokens": h, "hit_rate": h / q if q else 0.0}

    # ---- slots -------------------------------------------------------------------------------------
    def take_slot(self) -> int | None:
        return self.free_slots.popleft() if self.free_slots else None

    def free_slot(self, slot: int):
        self.free_slots.append(slot)
