"""``BlockManager``: hands out fixed-size KV cache blocks to sequences, with reference counts.

The KV cache is a pool of ``num_blocks`` blocks of ``block_size`` token slots. A sequence's
``block_table`` lists its blocks in order, so token position ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

Prompt sharing for ``n > 1``: the ``n`` samples of a prompt are allocated as a group. The prompt is
prefilled once into the first sample's blocks; the others point at the same *full* blocks (reference
count + 1) and get a private copy of the last, partially filled block (a copy-on-write done eagerly: the
model runner copies that block right after the prefill). Full blocks are never written again, so decode
never touches a shared block.
"""

from __future__ import annotations

from collections import deque

from tidal.rollout.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    """Free list + reference counts over the block ids of the engine's KV cache."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def group_blocks_needed(self, num_tokens: int, n: int) -> int:
        """Blocks to prefill ``num_tokens`` once and fork it into ``n`` samples."""
        partial = 1 if num_tokens % self.block_size else 0
        return blocks_needed(num_tokens, self.block_size) + (n - 1) * partial

    def can_allocate(self, group: list[Sequence]) -> bool:
        return self.group_blocks_needed(group[0].num_tokens, len(group)) <= self.num_free_blocks

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def allocate(self, group: list[Sequence]) -> list[tuple[int, int]]:
        """Give every sequence of a group (same tokens) its blocks; return (src, dst) blocks to copy."""
        parent = group[0]
        num_tokens = parent.num_tokens
        assert all(not s.block_table and s.num_tokens == num_tokens for s in group)
        parent.block_table = [self._take() for _ in range(blocks_needed(num_tokens, self.block_size))]
        num_full = num_tokens // self.block_size
        copies = []
        for child in group[1:]:
            shared = parent.block_table[:num_full]
            for block in shared:
                self.ref_counts[block] += 1
            child.block_table = list(shared)
            if num_full < len(parent.block_table):
                child.block_table.append(self._take())
                copies.append((parent.block_table[-1], child.block_table[-1]))
        return copies

    def needs_new_block(self, seq: Sequence) -> bool:
        # The next decode step writes the KV of position num_tokens - 1.
        return len(seq.block_table) * self.block_size < seq.num_tokens

    def can_append(self, seq: Sequence) -> bool:
        return not self.needs_new_block(seq) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        if self.needs_new_block(seq):
            seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []
