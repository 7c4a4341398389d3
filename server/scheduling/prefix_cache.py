"""The prefix table of the KV pool: which full block holds which prompt prefix, and which idle ones to evict.

A full block is named by a hash of its tokens chained with the hash of the block before it, so one
name stands for the whole prefix up to the block's end: two sequences with the same name at block i
have the same first (i + 1) * block_size tokens, hence the same K/V there. The chain is a 128-bit
BLAKE2b digest, not Python's `hash`, so no one can craft a prompt that collides with another user's
prefix and reads its cache. Anything else that changes the K/V (weights, dtype) is fixed per pool:
each model version has its own pool, so its prefixes are never mixed with another version's. A LoRA
adapter changes the K/V within one pool, so a sequence's chain starts from its adapter's key (the
sequence's `lora_key`, unique per registration) instead of ROOT: two adapters never share a block.

Blocks whose last reference went away but that still hold a named prefix are "idle": they count as
free, and are handed out again, least recently used first, only when the plain free list is empty.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

ROOT = b""  # the parent of a sequence's first block


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def prefix_hashes(token_ids: list[int], block_size: int, num_blocks: int, parent: bytes = ROOT) -> list[bytes]:
    """The chained names of the first `num_blocks` full blocks of `token_ids`."""
    names = []
    for i in range(num_blocks):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        names.append(parent)
    return names


@dataclass(slots=True)
class PrefixCacheStats:
    """Counts since the pool was made. A query is one admission: its tokens (and full blocks) against
    those the cache supplied."""

    query_tokens: int = 0
    hit_tokens: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    evictions: int = 0


class PrefixCache:
    def __init__(self):
        self._block_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        """Blocks holding a named prefix, in use or idle."""
        return len(self._block_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def lookup(self, name: bytes) -> int | None:
        return self._block_of.get(name)

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def register(self, block: int, name: bytes) -> None:
        """Name a block that was just filled; a prefix already held by another block keeps that one."""
        if name not in self._block_of and block not in self._name_of:
            self._block_of[name] = block
            self._name_of[block] = name

    def park(self, block: int) -> bool:
        """A block lost its last reference: keep it as idle if it holds a named prefix (True)."""
        if block not in self._name_of:
            return False
        self._idle[block] = None
        return True

    def revive(self, block: int) -> None:
        """An idle block is referenced again."""
        del self._idle[block]

    def evict(self) -> int | None:
        """Forget the least recently used idle block and hand it out; None when no block is idle."""
        if not self._idle:
            return None
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._name_of.pop(block)]
        self.stats.evictions += 1
        return block

    def check(self, refs: list[int]) -> None:
        assert len(self._block_of) == len(self._name_of), "prefix table and its inverse differ in size"
        for name, block in self._block_of.items():
            assert self._name_of.get(block) == name, f"block {block}: prefix table and its inverse disagree"
        for block in self._idle:
            assert refs[block] == 0 and block in self._name_of, f"idle block {block}: {refs[block]} refs"
