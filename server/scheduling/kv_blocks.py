"""Paged KV-cache bookkeeping: fixed-size blocks, a free list and reference counts.

Pure Python: the K/V tensors live in the backend, indexed by the block ids handed out here. Fixed
blocks mean any free block fits any sequence, so memory never fragments between sequences; the only
waste is the unfilled tail of each sequence's last block, reported as `fragmentation`.
"""

from __future__ import annotations

from collections import deque

from server.scheduling.sequence import Sequence


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        # Reference counts are kept for prefix caching (a separate issue): shared prompt blocks will be
        # held by several sequences. Today every allocated block has exactly one reference.
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its cache can hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_hold(self, seq: Sequence, num_tokens: int, margin: int = 0) -> bool:
        return self.extra_blocks(seq, num_tokens) + margin <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens`; the caller checked `can_hold`."""
        needed = self.extra_blocks(seq, num_tokens)
        if needed > len(self._free):
            raise MemoryError(f"sequence {seq.seq_id} needs {needed} KV blocks, {len(self._free)} are free")
        for _ in range(needed):
            block = self._free.popleft()
            self._refs[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        seq.block_table = []

    def fragmentation(self, sequences) -> float:
        """Allocated-but-unfilled token slots / allocated slots, over the given sequences."""
        allocated = filled = 0
        for seq in sequences:
            allocated += len(seq.block_table) * self.block_size
            filled += min(seq.num_computed, len(seq.block_table) * self.block_size)
        return (allocated - filled) / allocated if allocated else 0.0

    def check(self) -> None:
        """Invariant check for tests: every block is free xor referenced, none twice in the free list."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free list twice"
        for block, refs in enumerate(self._refs):
            assert (refs == 0) == (block in free), f"block {block}: {refs} refs, free={block in free}"
