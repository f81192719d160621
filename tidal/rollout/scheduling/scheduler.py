"""``Scheduler``: continuous batching over waiting and running sequences.

Every engine step is either one prefill batch or one decode batch:

- *prefill* when waiting groups fit (sequence slots, the batched-token budget and free KV blocks):
  each admitted group (the ``n`` samples of a prompt, or one preempted sequence) is prefilled once;
- otherwise *decode*: every running sequence advances one token. When the KV pool runs out, the most
  recently admitted sequence is preempted: its blocks are freed and it goes back to the front of the
  queue to be recomputed later (prompt + the outputs it already has), so no work is lost but time.

After each step ``postprocess`` appends the sampled tokens, applies the stop rules and frees the blocks
of finished sequences, so finished sequences leave and waiting ones join at every step.

*Context prefill* (prefix caching or chunked prefill on; ``_schedule_context_prefill``): a prefill
computes each group's tokens ``[start, end)`` (``ScheduledBatch.chunks``) while attending to the K/V of
``[0, start)`` already in the cache, ``start`` being the cached prefix (prefix caching) or what earlier
chunks computed. With ``chunked_prefill`` a prefill step computes at most ``max_num_batched_tokens``
tokens: a longer prompt is split over several steps (its group waits in ``prefilling``, holding all its
blocks from admission, so it never needs more), and only a group whose last chunk ran samples a token.
While both are pending, prefill chunks and decode steps alternate (a step is one or the other, no mixed
step), so a long prompt delays the running sequences by one chunk at a time instead of one whole prefill.
Linear-attention families with prefix caching (``BlockManager.saved_states``): a prompt's last chunk is
cut at its last block boundary before its last token, so that the recurrent state there is saved for
later prompts sharing that prefix (``state_cache.py``); the rest (at most one block) is prefilled in the
next prefill step. Each step carries the saved-state copies to run before and after its forward.

*Look-ahead* (async scheduling, ``plan_ahead``): right after a decode step is launched, the next decode
step is planned before its tokens are known, assuming that no sequence stops on the token being sampled
(one reaching its length limit is left out), so that the engine can launch it while the device still
runs the first. Its blocks are taken for the launch only and given back at once (``release_ahead``);
when the engine schedules that step for real, ``Lookahead.matches`` tells whether it is the one that ran
ahead (then its results are used) or not (a sequence stopped, a request came or went: it is discarded).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tidal.rollout.scheduling.block_manager import BlockManager
from tidal.rollout.scheduling.sequence import Sequence, SequenceStatus

Detokenize = Callable[[list[int], bool], str]
_NO_IDS: frozenset[int] = frozenset()


@dataclass
class ScheduledBatch:
    """One step's work. Prefill: each group's tokens run once, then one token is sampled per member."""

    is_prefill: bool
    groups: list[list[Sequence]]
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Context prefill: each group's [start, end) token range; None: whole prompts from position 0.
    chunks: list[tuple[int, int]] | None = None
    final: list[bool] | None = None  # context prefill: whether the group's prompt ends with this chunk
    # Context prefill: KV block copies (src, dst) to run before the forward (``BlockManager.copies_before``).
    copies_before: list[tuple[int, int]] = field(default_factory=list)
    # Linear-attention families with prefix caching: saved states to copy into slots (row, slot) before
    # the forward, and slots to save into rows (slot, row) after it (``state_cache.py``).
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # The sequences that sample a token in this step (default: from ``groups`` and ``final``). A field,
    # not a property: the runner, the look-ahead and ``postprocess`` each read it at every step.
    seqs: list[Sequence] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.seqs is not None:
            return
        if self.final is not None:
            groups = [group for group, last in zip(self.groups, self.final, strict=True) if last]
        else:
            groups = self.groups
        self.seqs = [seq for group in groups for seq in group]

    @classmethod
    def decode(cls, seqs: list[Sequence]) -> ScheduledBatch:
        """One decode token for each of ``seqs`` (a group each)."""
        return cls(False, [[seq] for seq in seqs], seqs=seqs)


@dataclass
class Lookahead:
    """A decode step planned ahead (``Scheduler.plan_ahead``): its sequences, each one's row in the step
    before (whose sampled id is its input) and the blocks taken for it, in the order taken."""

    seqs: list[Sequence]
    rows: list[int]
    blocks: list[tuple[Sequence, int]]

    def matches(self, batch: ScheduledBatch) -> bool:
        """Whether ``batch``, scheduled once the step before was post-processed, is this step: the same
        sequences in the same order (each one token longer) with the same blocks, so the same inputs."""
        return (
            not batch.is_prefill
            # A decode batch has one sequence per group; lists of Sequences compare by identity.
            and batch.seqs == self.seqs
            and all(seq.block_table[-1] == block for seq, block in self.blocks)
        )


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int],
        detokenize: Detokenize | None = None,
        chunked_prefill: bool = False,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.waiting: deque[list[Sequence]] = deque()
        self.running: deque[Sequence] = deque()
        # Counters for benchmarks and tests: prompt tokens computed by prefills, and taken from the cache.
        self.num_prefill_tokens = 0
        self.num_cached_tokens = 0
        self.chunked_prefill = chunked_prefill
        self.context_prefill = chunked_prefill or block_manager.prefix_cache is not None
        self.prefilling: deque[list[Sequence]] = deque()  # context prefill: groups between chunks
        self._last_was_prefill = False

    def add(self, group: list[Sequence]) -> None:
        for seq in group:
            self._resolve_stop_rules(seq)
        self.waiting.append(group)

    def _resolve_stop_rules(self, seq: Sequence) -> None:
        """Give ``seq`` the length limit and stop ids ``_check_stop`` applies, so that the checks at every
        step are one comparison each."""
        params = seq.params
        seq.max_num_tokens = min(seq.num_prompt_tokens + params.max_new_tokens, self.max_model_len)
        seq.min_stop_tokens = seq.num_prompt_tokens + params.min_new_tokens
        # Shared sets where no request adds stop ids (the common case: fewer distinct objects per step).
        eos = _NO_IDS if params.ignore_eos else self.eos_token_ids
        seq.stop_ids = eos.union(params.stop_token_ids) if params.stop_token_ids else eos

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def abort_all(self) -> None:
        """Drop every queued and running sequence and free its blocks (after an interrupted step)."""
        # The interrupted step may have written part of its K/V: cache nothing (first, so that the
        # sequences freed below do not register their blocks either).
        self.block_manager.invalidate_prefix_cache()
        for seq in self.running:
            self.block_manager.free(seq)
        self.running.clear()
        self.waiting.clear()
        self.drop_prefilling(None)

    def drop_prefilling(self, seq_ids: set[int] | None) -> None:
        """Free the groups between prefill chunks whose sequences are in ``seq_ids`` (None: all)."""
        kept = deque()
        for group in self.prefilling:
            if seq_ids is None or any(seq.seq_id in seq_ids for seq in group):
                for seq in group:
                    self.block_manager.free(seq, group[0].num_computed_tokens)
            else:
                kept.append(group)
        self.prefilling = kept

    def schedule(self) -> ScheduledBatch:
        if self.context_prefill:
            batch = self._schedule_context()
        else:
            batch = self._schedule_prefill() or self._schedule_decode()
        if batch is None:  # the engine checks at add time that any single sequence fits, so this is a bug
            raise RuntimeError("scheduler could not schedule any sequence (KV cache too small?)")
        return batch

    def _schedule_prefill(self) -> ScheduledBatch | None:
        groups, copies = [], []
        num_seqs, num_tokens = len(self.running), 0
        while self.waiting:
            group = self.waiting[0]
            group_tokens = group[0].num_tokens
            if num_seqs + len(group) > self.max_num_seqs:
                break
            # A prompt longer than the token budget still runs, alone, rather than never.
            if groups and num_tokens + group_tokens > self.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(group):
                break
            self.waiting.popleft()
            self.num_prefill_tokens += group_tokens
            copies += self.block_manager.allocate(group)
            for seq in group:
                seq.status = SequenceStatus.RUNNING
            self.running.extend(group)
            groups.append(group)
            num_seqs += len(group)
            num_tokens += group_tokens
        return ScheduledBatch(True, groups, copies) if groups else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        blocks = self.block_manager
        block_size = blocks.block_size
        # The common case: the sequences that need a new block (``needs_new_block``, inlined: this runs
        # over every sequence at every step) all get one, nothing is preempted, all run in their order.
        needing = [seq for seq in self.running if len(seq.block_table) * block_size < seq.num_tokens]
        if len(needing) <= blocks.num_free_blocks and self.running:
            for seq in needing:
                blocks.append_slot(seq)
            return ScheduledBatch.decode(list(self.running))
        return self._schedule_decode_preempting()

    def _schedule_decode_preempting(self) -> ScheduledBatch | None:
        """``_schedule_decode`` when the free blocks run out: in order, each sequence that needs a block
        gets one, the most recently admitted ones being preempted (recomputed later) to free them."""
        scheduled: list[Sequence] = []
        blocks = self.block_manager
        while self.running:
            seq = self.running.popleft()
            if not blocks.needs_new_block(seq):
                scheduled.append(seq)
                continue
            while not blocks.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
        self.running.extend(scheduled)
        if not scheduled:
            return self._schedule_context_prefill() if self.context_prefill else self._schedule_prefill()
        return ScheduledBatch.decode(scheduled)

    def _schedule_context(self) -> ScheduledBatch | None:
        # Chunked prefill: after a prefill step, the running sequences get their decode step first.
        if self.chunked_prefill and self._last_was_prefill and self.running:
            batch = self._schedule_decode() or self._schedule_context_prefill()
        else:
            batch = self._schedule_context_prefill() or self._schedule_decode()
        self._last_was_prefill = batch is not None and batch.is_prefill
        return batch

    def _chunk_end(self, seq: Sequence, start: int, budget: int, first: bool = False) -> int:
        end = min(seq.num_tokens, start + budget) if self.chunked_prefill else seq.num_tokens
        if self.block_manager.saved_states is not None:
            end = self._state_boundary(seq, start, end, first)
        return end if seq.mm is None else seq.mm.chunk_end(start, end)  # whole images per chunk

    def _state_boundary(self, seq: Sequence, start: int, end: int, first: bool) -> int:
        """Where a linear-attention family's chunk ``[start, end)`` stops to save its state (module doc):
        a ``first`` chunk at the end of its cached KV prefix when no state was saved there (a prefix now
        shared by two prompts, e.g. a system prompt: the next prompt resumes there), a last chunk at the
        prompt's last block boundary before its last token (and before any image it would cut)."""
        if first:
            matched = self.block_manager.matched_tokens(seq)
            if start < matched < end:
                return matched
        if end == seq.num_tokens:
            size = self.block_manager.block_size
            boundary = (seq.num_tokens - 1) // size * size
            if seq.mm is not None:  # not inside an image: at the last boundary before it
                boundary = seq.mm.block_start(boundary, size)
            if boundary > start:
                return boundary
        return end

    def _uncached_tokens(self, seq: Sequence) -> int:
        blocks = self.block_manager
        cached = len(blocks.cached_prefix(seq)) if blocks.prefix_cache is not None else 0
        return seq.num_tokens - cached * blocks.block_size

    def _schedule_context_prefill(self) -> ScheduledBatch | None:
        """Continue the groups between chunks, then admit waiting groups, within the token budget."""
        groups, chunks, final, copies = [], [], [], []
        budget = self.max_num_batched_tokens
        for group in self.prefilling:  # admitted earlier: their blocks are allocated
            if budget <= 0:
                break
            start = group[0].num_computed_tokens
            end = self._chunk_end(group[0], start, budget)
            groups.append(group)
            chunks.append((start, end))
            budget -= end - start
        num_seqs = len(self.running) + sum(len(g) for g in self.prefilling)
        while self.waiting and budget > 0:
            group = self.waiting[0]
            if num_seqs + len(group) > self.max_num_seqs:
                break
            if not self.block_manager.can_allocate(group):
                break
            # Without chunking a prompt longer than the budget still runs, alone, rather than never.
            if not self.chunked_prefill and groups and self._uncached_tokens(group[0]) > budget:
                break
            self.waiting.popleft()
            group[0].pending_copies = self.block_manager.allocate(group)
            self.num_cached_tokens += group[0].num_computed_tokens
            start = group[0].num_computed_tokens
            end = self._chunk_end(group[0], start, budget, first=True)
            for seq in group:
                seq.status = SequenceStatus.RUNNING
            self.prefilling.append(group)
            groups.append(group)
            chunks.append((start, end))
            budget -= end - start
            num_seqs += len(group)
        if not groups:
            return None
        # Saved states are reserved after every admission of this step looked its prefix up, so that none
        # resumes from a state this step has yet to save. By row: the last save into a row wins.
        saves: dict[int, int] = {}
        for group, (start, end) in zip(groups, chunks, strict=True):
            save = self.block_manager.plan_state_save(group[0], end)
            if save is not None:
                saves[save[1]] = save[0]
            self.num_prefill_tokens += end - start
            last = end == group[0].num_tokens
            final.append(last)
            if last:  # the group leaves ``prefilling`` and decodes from the next step on
                copies += group[0].pending_copies
                group[0].pending_copies = []
                self.prefilling.remove(group)
                self.running.extend(group)
        before = self.block_manager.take_copies_before()
        batch = ScheduledBatch(True, groups, copies, chunks, final, copies_before=before)
        batch.state_loads = self.block_manager.take_state_loads()
        batch.state_saves = [(slot, row) for row, slot in saves.items()]
        return batch

    def plan_ahead(self, batch: ScheduledBatch) -> Lookahead | None:
        """The decode step after ``batch`` as ``schedule`` will make it if no sequence of ``batch`` stops
        on the token it samples, with a block taken for each new token that needs one; None where that
        step cannot be known or taken now (the rule that keeps async scheduling synchronous):

        - ``batch`` is a prefill (chunks, prompt sharing and the first decode step follow synchronously);
        - a waiting group would be admitted (the next step is a prefill), or any context prefill is
          pending (chunked prefill or prefix caching: groups between chunks, or any waiting group);
        - a sequence has a repetition penalty (its next step needs the token sampled now on the host);
        - a new token needs a block and none is free (``schedule`` would preempt, unless one stops);
        - every sequence reaches its length limit now.
        """
        if batch.is_prefill or self.prefilling or self.block_manager.prefix_cache is not None:
            return None
        if self.waiting and (self.context_prefill or self._admits(self.waiting[0])):
            return None
        seqs = batch.seqs
        blocks = self.block_manager
        block_size = blocks.block_size
        taken: list[tuple[Sequence, int]] = []
        ending, params = False, None
        for seq in seqs:  # one pass: it runs over every sequence at every step
            if seq.params is not params:  # shared by a request's samples (often by all): checked once a run
                params = seq.params
                if params.penalizes_repetition:
                    self._give_back(taken)
                    return None
            if seq.num_tokens + 1 >= seq.max_num_tokens:  # the token it samples now ends it by length
                ending = True
                continue
            # The next step writes the KV of position num_tokens (the token being sampled now).
            if len(seq.block_table) * block_size <= seq.num_tokens:
                if not blocks.num_free_blocks:
                    self._give_back(taken)
                    return None
                taken.append((seq, blocks.take_block(seq)))
        if not ending:  # the common case: every sequence goes on, in its row
            return Lookahead(seqs, list(range(len(seqs))), taken)
        rows = [row for row, seq in enumerate(seqs) if seq.num_tokens + 1 < seq.max_num_tokens]
        return Lookahead([seqs[row] for row in rows], rows, taken) if rows else None

    def release_ahead(self, plan: Lookahead) -> None:
        """Give back the blocks ``plan_ahead`` took (the step is launched: its inputs are staged), in
        reverse order, so that ``schedule`` takes the same ones again if it schedules the same step."""
        self._give_back(plan.blocks)

    def _give_back(self, taken: list[tuple[Sequence, int]]) -> None:
        for seq, _ in reversed(taken):
            self.block_manager.return_block(seq)

    def _admits(self, group: list[Sequence]) -> bool:
        """Whether ``_schedule_prefill`` admits ``group`` (first in line) now."""
        return len(self.running) + len(group) <= self.max_num_seqs and self.block_manager.can_allocate(group)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft([seq])

    def postprocess(
        self,
        batch: ScheduledBatch,
        token_ids: list[int],
        logprobs: list[float],
        top_logprobs: list[list[tuple[int, float]] | None] | None = None,
    ) -> list[Sequence]:
        """Append sampled tokens (and the top alternatives of the rows that asked for them), apply stop
        rules; return the sequences that finished this step."""
        if batch.chunks is not None:
            self._record_chunks(batch)
        finished = []
        seqs = batch.seqs
        states = self.block_manager.state_slots
        if states is not None and not batch.is_prefill:  # the step is kept: its written states are current
            states.flip(seqs)
        tops = top_logprobs if top_logprobs is not None else [None] * len(seqs)
        for seq, token, logprob, top in zip(seqs, token_ids, logprobs, tops, strict=True):
            seq.append(token, logprob, top)
            if self._check_stop(seq):
                self.block_manager.free(seq)
                finished.append(seq)
        if finished:
            self.running = deque(seq for seq in self.running if not seq.is_finished)
        return finished

    def _record_chunks(self, batch: ScheduledBatch) -> None:
        """After a context prefill: how far each group's prompt is computed; cache its full blocks."""
        cache = self.block_manager.prefix_cache is not None
        for group, (_, end) in zip(batch.groups, batch.chunks, strict=True):
            for seq in group:
                seq.num_computed_tokens = end
            if cache:  # at once, so that prompts admitted from the next step on share these blocks
                self.block_manager.register(group[0], end)

    def _check_stop(self, seq: Sequence) -> bool:
        """Finish ``seq`` if its last token ends it; whether it did. The rules, resolved per sequence by
        ``_resolve_stop_rules``: after ``min_new_tokens`` outputs an eos id (unless ``ignore_eos``), a stop
        id or a stop string ends it; ``max_new_tokens`` or ``max_model_len`` does in any case."""
        num_tokens = seq.num_tokens
        if num_tokens >= seq.min_stop_tokens:
            token = seq.token_ids[-1]
            if token in seq.stop_ids:
                seq.finish("stop", token)
                return True
            if seq.params.stop:
                stop = self._find_stop_string(seq)
                if stop is not None:
                    seq.finish("stop", stop)
                    return True
        if num_tokens >= seq.max_num_tokens:
            seq.finish("length")
            return True
        return False

    def _find_stop_string(self, seq: Sequence) -> str | None:
        # Decode only a tail window: a stop string made of k characters spans at most about k tokens,
        # and decoding the whole output at every step would be quadratic.
        window = max(len(s) for s in seq.params.stop) + 3
        text = self.detokenize(seq.output_token_ids[-window:], seq.params.skip_special_tokens)
        return next((s for s in seq.params.stop if s in text), None)
