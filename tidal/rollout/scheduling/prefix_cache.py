"""Prefix caching: full KV blocks indexed by their content, so a new sequence reuses a cached prefix.

A *full* block (``block_size`` tokens) is keyed by a hash chained over the sequence so far:
``block_hash(parent, tokens)`` with ``parent`` the hash of the block before it (``None`` for the first),
so a key names the block's tokens *and* every token before them, i.e. the exact K/V the block holds for
given weights. ``PrefixCache`` maps keys to block ids. ``BlockManager`` (block_manager.py) owns the
policy around it:

- a new sequence looks up the longest chain of its prompt's full blocks (leaving at least one token to
  compute, whose logits sample the first new token) and shares those blocks by reference count; they
  are never written again (decode and prefill write only past them);
- blocks are registered once their K/V is computed: after each prefill chunk, and when a sequence is
  freed (blocks filled while decoding, e.g. an agent's previous answer, serve the next turn);
- a freed block keeps its key while its reference count is 0: it sits in the free queue (least recently
  freed first) until the allocator takes it for new tokens, which evicts the key;
- ``update_weights`` and ``sleep`` clear the whole index (cached K/V was computed with other weights, or
  is gone).

Hashes are Python's (deterministic for ints and tuples, 64-bit): a collision between two different
prefixes is possible in principle, as with vLLM's default hash, but negligible in practice.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq


def block_hash(parent: int | None, tokens: Seq[int]) -> int:
    """Key of a full block: its token ids, chained to the key of the block before it."""
    return hash((parent, tuple(tokens)))


def extend_block_hashes(hashes: list[int], token_ids: Seq[int], block_size: int, num_blocks: int) -> None:
    """Grow ``hashes`` (a sequence's keys so far, in place) to its first ``num_blocks`` full blocks."""
    for index in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else None
        hashes.append(block_hash(parent, token_ids[index * block_size : (index + 1) * block_size]))


class PrefixCache:
    """Key → block id of every cached full block, and the reverse (to evict a block's key)."""

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self.keys: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, hashes: Seq[int]) -> list[int]:
        """Block ids of the longest cached chain of ``hashes`` (a prefix of them)."""
        found = []
        for key in hashes:
            block = self.blocks.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def register(self, block: int, key: int) -> None:
        """Cache ``block`` under ``key``, unless either is cached already (then the first one stays)."""
        if key not in self.blocks and block not in self.keys:
            self.blocks[key] = block
            self.keys[block] = key

    def evict(self, block: int) -> None:
        """Forget ``block``'s key (the allocator is about to write other tokens into it)."""
        key = self.keys.pop(block, None)
        if key is not None:
            del self.blocks[key]

    def clear(self) -> None:
        self.blocks.clear()
        self.keys.clear()
