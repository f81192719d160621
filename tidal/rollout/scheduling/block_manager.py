"""``BlockManager``: hands out fixed-size KV cache blocks to sequences, with reference counts.

The KV cache is a pool of ``num_blocks`` blocks of ``block_size`` token slots. A sequence's
``block_table`` lists its blocks in order, so token position ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

Prompt sharing for ``n > 1``: the ``n`` samples of a prompt are allocated as a group. The prompt is
prefilled once into the first sample's blocks; the others point at the same *full* blocks (reference
count + 1) and get a private copy of the last, partially filled block (a copy-on-write done eagerly: the
model runner copies that block right after the prefill). Full blocks are never written again, so decode
never touches a shared block.

With prefix caching (``prefix_cache``, see prefix_cache.py) a sequence's leading full blocks may come
from the cache instead (shared the same way); the free queue then doubles as the LRU of cached blocks
that no sequence uses: a block freed first is evicted (reused for new tokens) first.

Vision families (``private_first_block``) look up each sequence's decode rotary delta by its first block
(``models/qwen2_5_vl.py``), and two prompts sharing a cached first block may have different deltas (other
images later on): there a cache hit's first block is copied into a block of the group's own before the
prefill (``copies_before``, run by the model runner ahead of the forward) instead of being shared. A
cached prefix also never ends inside an image's placeholder tokens (``PromptImages.block_start``): it is
cut back to the block holding the image's first token (further back while that block ends inside an
earlier image), so the prefill computes that image whole (the vision tower runs on whole images only,
and skips those entirely cached).

Linear-attention families with prefix caching (``saved_states``, state_cache.py): a cached prefix is also
cut back to the longest one whose recurrent state was saved at its end; allocating a group then queues
the copy of that state into the group's slot (``state_loads``, run before its first chunk), and a chunk
ending on a block boundary saves the state there (``plan_state_save``). Evicting a block's key drops
the state saved under it.
"""

from __future__ import annotations

from collections import OrderedDict

from tidal.rollout.scheduling.prefix_cache import PrefixCache, extend_block_hashes
from tidal.rollout.scheduling.sequence import Sequence
from tidal.rollout.scheduling.state_cache import SavedStates, StateSlots


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    """Free list + reference counts over the block ids of the engine's KV cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = False,
        state_slots: StateSlots | None = None,
        private_first_block: bool = False,
        saved_states: int = 0,
    ):
        self.num_blocks = num_blocks
        # Linear-attention families: each sequence holding blocks also holds a recurrent-state slot.
        self.state_slots = state_slots
        self.block_size = block_size
        # Free block ids, oldest first (an ordered dict: a cached block can leave from the middle).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.prefix_cache = PrefixCache() if prefix_caching else None
        # Vision families: a cache hit's first block is copied, not shared (module doc); the (cached, own)
        # block pairs to copy before the next prefill's forward, taken by the scheduler.
        self.private_first_block = private_first_block
        self.copies_before: list[tuple[int, int]] = []
        # Bumped by each invalidation: a sequence allocated before it holds K/V of other weights (or of
        # an interrupted step), which must never enter the cache when it is freed.
        self.cache_epoch = 0
        # Linear-attention families with prefix caching: states saved at cached blocks' ends (module doc),
        # in the rows after the slots and the scratch slot; (saved row, slot) copies due before the next
        # prefill's forward.
        self.saved_states = None
        if prefix_caching and state_slots is not None and saved_states:
            self.saved_states = SavedStates(saved_states, first_row=state_slots.num_slots + 1)
        self.state_loads: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def group_blocks_needed(self, num_tokens: int, n: int) -> int:
        """Blocks to prefill ``num_tokens`` once and fork it into ``n`` samples."""
        partial = 1 if num_tokens % self.block_size else 0
        return blocks_needed(num_tokens, self.block_size) + (n - 1) * partial

    def can_allocate(self, group: list[Sequence]) -> bool:
        need = self.group_blocks_needed(group[0].num_tokens, len(group))
        if self.prefix_cache is not None:
            cached = self.cached_prefix(group[0])
            if self.private_first_block:  # the first one is copied into a new block
                cached = cached[1:]
            # Cached blocks cost nothing, unless they are free (then they leave the free queue).
            need -= sum(1 for block in cached if self.ref_counts[block] > 0)
        if self.state_slots is not None and self.state_slots.num_free < len(group):
            return False
        return need <= self.num_free_blocks

    def _take(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        if self.prefix_cache is not None:
            key = self.prefix_cache.evict(block)
            if key is not None and self.saved_states is not None:
                self.saved_states.drop(key)
        self.ref_counts[block] = 1
        return block

    def _share(self, block: int) -> int:
        """One more reference to a cached block (revived from the free queue if no one used it)."""
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1
        return block

    def _kv_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks of the longest prefix of ``seq``, leaving at least its last token to compute (and
        ending before any image it would cut: module doc)."""
        usable = (seq.num_tokens - 1) // self.block_size
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, usable, seq.mm)
        found = self.prefix_cache.match(seq.block_hashes[:usable])
        if seq.mm is not None:
            size = self.block_size
            found = found[: seq.mm.block_start(len(found) * size, size) // size]
        return found

    def matched_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s longest cached KV prefix, whether or not a state was saved at its end."""
        return len(self._kv_prefix(seq)) * self.block_size

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks ``seq`` starts from: its longest cached KV prefix (``_kv_prefix``), for a
        linear-attention family cut back to the longest one whose state was saved."""
        found = self._kv_prefix(seq)
        if self.saved_states is not None:  # a linear-attention family resumes only at a saved state
            saved = self.saved_states
            while found and seq.block_hashes[len(found) - 1] not in saved:
                found = found[:-1]
        return found

    def register(self, seq: Sequence, num_computed: int) -> None:
        """Cache the full blocks among ``seq``'s first ``num_computed`` tokens (their K/V is written)."""
        if seq.cache_epoch != self.cache_epoch:
            return
        full = min(num_computed // self.block_size, len(seq.block_table))
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, full, seq.mm)
        for block, key in zip(seq.block_table[:full], seq.block_hashes, strict=False):
            self.prefix_cache.register(block, key)

    def invalidate_prefix_cache(self) -> None:
        """Forget every cached block (new weights, or a freed KV cache); blocks in use stay allocated."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            self.cache_epoch += 1
        if self.saved_states is not None:
            self.saved_states.clear()

    def allocate(self, group: list[Sequence]) -> list[tuple[int, int]]:
        """Give every sequence of a group (same tokens) its blocks; return (src, dst) blocks to copy."""
        parent = group[0]
        num_tokens = parent.num_tokens
        assert all(not s.block_table and s.num_tokens == num_tokens for s in group)
        for seq in group:
            seq.cache_epoch = self.cache_epoch
            if self.state_slots is not None:
                seq.state_slot = self.state_slots.take()
        cached = [] if self.prefix_cache is None else self._share_prefix(parent)
        fresh = blocks_needed(num_tokens, self.block_size) - len(cached)
        parent.block_table = cached + [self._take() for _ in range(fresh)]
        parent.num_computed_tokens = len(cached) * self.block_size
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

    def _share_prefix(self, seq: Sequence) -> list[int]:
        """The leading blocks of ``seq``'s table from the cache: shared, but for a vision family the first
        one copied into a block of its own (``copies_before``; the copy runs before any write, so the
        cached block is intact then even if it was free and just handed out again)."""
        cached = self.cached_prefix(seq)
        if cached and self.saved_states is not None:
            # The prefix's saved state, into the slot the prefill goes on from; its row is read now, as a
            # take below may evict the block's key and its state (the copy runs before any save reuses it).
            row = self.saved_states.use(seq.block_hashes[len(cached) - 1])
            self.state_loads.append((row, seq.state_slot))
        if not (cached and self.private_first_block):
            return [self._share(block) for block in cached]
        shared = [self._share(block) for block in cached[1:]]
        first = self._take()
        if first != cached[0]:  # else the free cached block itself was taken: its K/V is in place
            self.copies_before.append((cached[0], first))
        return [first, *shared]

    def plan_state_save(self, seq: Sequence, end: int) -> tuple[int, int] | None:
        """The (slot, saved row) copy that saves ``seq``'s state after a prefill chunk ending at ``end``,
        if that is the end of a full block whose state is not saved yet (None otherwise). The row is
        reserved now; the block's key is cached when the chunk is recorded (``register``)."""
        if (
            self.saved_states is None
            or end % self.block_size
            or not end
            or seq.cache_epoch != self.cache_epoch
        ):
            return None
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, end // self.block_size, seq.mm)
        row = self.saved_states.reserve(seq.block_hashes[end // self.block_size - 1])
        return None if row is None else (seq.state_slot, row)

    def take_state_loads(self) -> list[tuple[int, int]]:
        """The saved-state copies (row, slot) the next prefill must run before its forward (and forget them)."""
        loads, self.state_loads = self.state_loads, []
        return loads

    def take_copies_before(self) -> list[tuple[int, int]]:
        """The block copies the next prefill must run before its forward (and forget them)."""
        copies, self.copies_before = self.copies_before, []
        return copies

    def needs_new_block(self, seq: Sequence) -> bool:
        # The next decode step writes the KV of position num_tokens - 1.
        return len(seq.block_table) * self.block_size < seq.num_tokens

    def can_append(self, seq: Sequence) -> bool:
        return not self.needs_new_block(seq) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        if self.needs_new_block(seq):
            seq.block_table.append(self._take())

    def take_block(self, seq: Sequence) -> int:
        """Give ``seq`` one more block (async scheduling: the slot of a token not sampled yet)."""
        block = self._take()
        seq.block_table.append(block)
        return block

    def return_block(self, seq: Sequence) -> None:
        """Undo ``take_block``: the block goes back to the front of the free queue, so that returning the
        blocks taken in reverse order restores the queue exactly (the next takes hand out the same ids).
        Not with prefix caching, whose eviction on take cannot be undone."""
        *seq.block_table, block = seq.block_table  # a new list: tables only grow in place (``Sequence``)
        self.ref_counts[block] = 0
        self.free_blocks[block] = None
        self.free_blocks.move_to_end(block, last=False)

    def free(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Release ``seq``'s blocks. With prefix caching its computed full blocks are cached first
        (``num_computed``: tokens with K/V written; default all but the last, as for a running sequence)."""
        blocks = seq.block_table
        if self.prefix_cache is not None:
            self.register(seq, seq.num_tokens - 1 if num_computed is None else num_computed)
            blocks = blocks[::-1]  # the tail queues first, so a shared prefix is evicted last
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        if self.state_slots is not None and seq.state_slot >= 0:
            self.state_slots.give_back(seq.state_slot)
            seq.state_slot = -1
