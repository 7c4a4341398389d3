"""Paged KV-cache bookkeeping: fixed-size blocks, a free list, reference counts and shared prefixes.

Pure Python: the K/V tensors live in the backend, indexed by the block ids handed out here. Fixed
blocks mean any free block fits any sequence, so memory never fragments between sequences; the only
waste is the unfilled tail of each sequence's last block, reported as `fragmentation`.

NOTE: with prefix caching on, a block may be in several block tables at once (its reference count);
only full blocks whose every token is computed are ever named (prefix_cache.py) or shared, and a
sequence only writes at or after its `num_computed`, so a shared block is never written. A block
is exactly one of: referenced, free, or idle (unreferenced but holding a named prefix, reused on a
hit or evicted least recently used when the free list is empty). `check` asserts all of it.

NOTE (sliding windows): when every layer of the model attends only to the last `window` positions
(Mistral), no future query can read a key before position num_computed - window + 1, so the blocks
wholly before it are given back as the sequence advances (`release_passed`), and a sequence holds about
window + one step's tokens however long it grows, as in vLLM. A block table stays positional: entry i
covers positions [i * block_size, (i + 1) * block_size), and a given-back entry holds RELEASED. A named
block given back is parked like any other, so a later prompt with the same prefix still finds it, and
is admitted referencing only the hit blocks inside its own window (`admit`).
A model that mixes full and sliding layers keeps every block (its full layers read them all).
"""

from __future__ import annotations

from collections import deque

from server.scheduling.prefix_cache import PrefixCache, prefix_hashes
from server.scheduling.sequence import Sequence


RELEASED = -1  # a block-table entry whose block was given back: its positions left every layer's window


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False, window: int | None = None):
        """`window`: the sliding window when every layer slides (blocks behind it are given back); None otherwise."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.window = window
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self.cache = PrefixCache()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and idle cached ones."""
        return len(self._free) + self.cache.num_idle

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def peak_blocks(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks one sequence of `num_tokens` ever holds at once, fed at most `step_tokens` a step:
        all of them, unless blocks behind the window are given back (window + a step, over one more block
        where they straddle a boundary)."""
        if self.window is None:
            return self.blocks_for(num_tokens)
        return min(self.blocks_for(num_tokens), self.blocks_for(self.window - 1 + step_tokens) + 1)

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its cache can hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_hold(self, seq: Sequence, num_tokens: int, margin: int = 0) -> bool:
        return self.extra_blocks(seq, num_tokens) + margin <= self.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens`; the caller checked `can_hold`."""
        needed = self.extra_blocks(seq, num_tokens)
        if needed > self.num_free:
            raise MemoryError(f"sequence {seq.seq_id} needs {needed} KV blocks, {self.num_free} are free")
        for _ in range(needed):
            block = self._free.popleft() if self._free else self.cache.evict()
            self._refs[block] = 1
            seq.block_table.append(block)

    # ------------------------------------------------------------ admission with cached prefixes
    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks holding `seq`'s longest cached prefix (read only). The last token is never
        covered: the step that computes it is the one that gives the logits to sample from."""
        if not self.prefix_caching:
            return []
        hit = []
        for name in prefix_hashes(seq.token_ids, self.block_size, (seq.num_tokens - 1) // self.block_size, seq.lora_key):
            block = self.cache.lookup(name)
            if block is None:
                break
            hit.append(block)
        return hit

    def can_admit(self, seq: Sequence, num_tokens: int, hit: list[int], margin: int = 0) -> bool:
        """Like `can_hold` for a waiting sequence that starts with the `hit` blocks: only the blocks past
        them are new, but an idle hit block stops counting as free once it is referenced (hit blocks
        already behind the window are never referenced: `admit`)."""
        revived = sum(1 for block in self._visible(hit) if self.cache.is_idle(block))
        return self.blocks_for(num_tokens) - len(hit) + revived + margin <= self.num_free

    def admit(self, seq: Sequence, num_tokens: int, hit: list[int]) -> None:
        """Give a waiting sequence (no blocks yet) the `hit` blocks, then room up to `num_tokens`. Hit
        blocks that lie behind the window of its first query stay where they are, as RELEASED entries:
        a long cached prompt is resumed with a window's worth of blocks, not its whole length."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds {len(seq.block_table)} KV blocks")
        visible = self._visible(hit)
        for block in visible:
            if self._refs[block] == 0:
                self.cache.revive(block)
            self._refs[block] += 1
        seq.block_table = [RELEASED] * (len(hit) - len(visible)) + visible
        seq.block_hashes = prefix_hashes(seq.token_ids, self.block_size, len(hit), seq.lora_key)
        self.allocate(seq, num_tokens)
        stats = self.cache.stats
        stats.query_tokens += seq.num_tokens
        stats.hit_tokens += len(hit) * self.block_size
        stats.query_blocks += (seq.num_tokens - 1) // self.block_size
        stats.hit_blocks += len(hit)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks `seq` has filled since the last call, so later sequences can share them."""
        if not self.prefix_caching:
            return
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        known = len(seq.block_hashes)
        if full <= known:
            return
        parent = seq.block_hashes[-1] if known else seq.lora_key
        names = prefix_hashes(seq.token_ids[known * self.block_size :], self.block_size, full - known, parent)
        for block, name in zip(seq.block_table[known:full], names):
            self.cache.register(block, name)
        seq.block_hashes.extend(names)

    def _passed(self, num_computed: int) -> int:
        """How many leading blocks no query at or after position `num_computed` can see (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def _visible(self, hit: list[int]) -> list[int]:
        """The `hit` blocks a sequence resuming after them can still see."""
        return hit[self._passed(len(hit) * self.block_size):]

    # ------------------------------------------------------------ release
    def release_passed(self, seq: Sequence) -> int:
        """Give back the blocks no future query of `seq` can see (sliding windows only); how many.
        Given-back entries always form a prefix of the table, so this walks back from the window's edge
        to the last one given back: a block or two a step, however long the sequence."""
        released = 0
        i = min(self._passed(seq.num_computed), len(seq.block_table)) - 1
        while i >= 0 and seq.block_table[i] != RELEASED:
            self._drop(seq.block_table[i])
            seq.block_table[i] = RELEASED
            released += 1
            i -= 1
        return released

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] < 0:
            raise AssertionError(f"block {block} freed more often than it was taken")
        if self._refs[block] == 0 and not self.cache.park(block):
            self._free.append(block)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back `seq`'s blocks past those holding `num_tokens` tokens (rejected speculative drafts'
        room). They lie past `num_computed`, so they are neither shared nor named."""
        keep = self.blocks_for(num_tokens)
        if keep < len(seq.block_hashes):
            raise ValueError(f"sequence {seq.seq_id}: trimming to {keep} blocks would drop named ones")
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            if self._refs[block] != 1:
                raise AssertionError(f"block {block} past sequence {seq.seq_id}'s tokens has {self._refs[block]} refs")
            self._refs[block] = 0
            self._free.append(block)

    def free(self, seq: Sequence) -> None:
        # Last block first: the deepest blocks of a prefix become least recently used, so they are
        # evicted before the blocks they depend on (a child without its parent can never be hit).
        for block in reversed(seq.block_table):
            if block != RELEASED:
                self._drop(block)
        seq.block_table = []
        seq.block_hashes = []

    def fragmentation(self, sequences) -> float:
        """Allocated-but-unfilled token slots / allocated slots, over the given sequences."""
        allocated = filled = 0
        for seq in sequences:
            released = seq.block_table.count(RELEASED) * self.block_size
            allocated += len(seq.block_table) * self.block_size - released
            filled += min(seq.num_computed, len(seq.block_table) * self.block_size) - released
        return (allocated - filled) / allocated if allocated else 0.0

    def check(self, sequences=None) -> None:
        """Invariant check for tests: every block is referenced xor free xor idle, none twice in the
        free list; with the live `sequences`, every count equals the tables holding the block, and
        every shared block is full and computed in each of them."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free list twice"
        for block, refs in enumerate(self._refs):
            assert refs >= 0, f"block {block}: {refs} refs"
            unreferenced = (block in free) + self.cache.is_idle(block)
            assert (refs == 0) == (unreferenced == 1), f"block {block}: {refs} refs, free={block in free}"
        self.cache.check(self._refs)
        if sequences is not None:
            self._check_tables(sequences)

    def _check_tables(self, sequences) -> None:
        counts = [0] * self.num_blocks
        for seq in sequences:
            held = [b for b in seq.block_table if b != RELEASED]
            assert len(set(held)) == len(held), f"sequence {seq.seq_id} holds a block twice"
            assert seq.block_table[len(seq.block_table) - len(held):] == held, \
                f"sequence {seq.seq_id}: given-back entries are not a prefix of its table"
            computed_blocks = seq.num_computed // self.block_size
            for i, block in enumerate(seq.block_table):
                if block == RELEASED:
                    assert i < self._passed(seq.num_computed), f"sequence {seq.seq_id} gave back block {i}, which a query can still see"
                    continue
                counts[block] += 1
                if self._refs[block] > 1:
                    assert i < computed_blocks, f"sequence {seq.seq_id} can write shared block {block}"
        assert counts == self._refs, "reference counts differ from the block tables holding them"
