"""Prefix caching: full KV blocks indexed by their content, so a new sequence reuses a cached prefix.

A *full* block (``block_size`` tokens) is keyed by a hash chained over the sequence so far:
``block_hash(parent, tokens)`` with ``parent`` the hash of the block before it (``None`` for the first),
so a key names the block's tokens *and* every token before them, i.e. the exact K/V the block holds for
given weights. Image placeholder tokens (vision families) all have one id, so a block holding some also
keys, per image, the image's content hash and the placeholders' offsets within it (``BlockKeys``:
``multimodal.PromptImages.block_key``): the same text with the same image shares blocks, with another
image only the blocks before its first placeholder. ``PrefixCache`` maps keys to block ids.
``BlockManager`` (block_manager.py) owns the policy around it:

- a new sequence looks up the longest chain of its prompt's full blocks (leaving at least one token to
  compute, whose logits sample the first new token) and shares those blocks by reference count; they
  are never written again (decode and prefill write only past them);
- blocks are registered once their K/V is computed: after each prefill chunk, and when a sequence is
  freed (blocks filled while decoding, e.g. an agent's previous answer, serve the next turn);
- a freed block keeps its key while its reference count is 0: it sits in the free queue (least recently
  freed first) until the allocator takes it for new tokens, which evicts the key;
- ``update_weights`` and ``sleep`` clear the whole index (cached K/V was computed with other weights, or
  is gone);
- linear-attention families (Qwen3.5) also need the recurrent state at the end of a cached prefix: a
  match is cut back to the longest prefix whose state was saved (``state_cache.SavedStates``), and a
  saved state goes when its block's key is evicted.

Hashes are Python's (deterministic for ints and tuples, 64-bit): a collision between two different
prefixes is possible in principle, as with vLLM's default hash, but negligible in practice.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol


class BlockKeys(Protocol):
    """What a sequence's images add to the keys of its blocks (``multimodal.PromptImages``)."""

    def block_key(self, start: int, end: int) -> tuple: ...


def block_hash(parent: int | None, tokens: Seq[int], images: tuple = ()) -> int:
    """Key of a full block: its token ids (and what ``images`` says of its image tokens), chained to the
    key of the block before it. A text block's key is the same with or without images in the engine."""
    return hash((parent, tuple(tokens), images) if images else (parent, tuple(tokens)))


def extend_block_hashes(
    hashes: list[int], token_ids: Seq[int], block_size: int, num_blocks: int, images: BlockKeys | None = None
) -> None:
    """Grow ``hashes`` (a sequence's keys so far, in place) to its first ``num_blocks`` full blocks;
    ``images``: the sequence's images, if any."""
    for index in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else None
        start, end = index * block_size, (index + 1) * block_size
        extra = images.block_key(start, end) if images is not None else ()
        hashes.append(block_hash(parent, token_ids[start:end], extra))


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

    def evict(self, block: int) -> int | None:
        """Forget ``block``'s key (the allocator is about to write other tokens into it); return the key
        (None: it had none), so that a state saved at the block's end goes with it (``state_cache.py``)."""
        key = self.keys.pop(block, None)
        if key is not None:
            del self.blocks[key]
        return key

    def clear(self) -> None:
        self.blocks.clear()
        self.keys.clear()
