"""``Scheduler``: continuous batching over waiting and running sequences.

Every engine step is either one prefill batch or one decode batch:

- *prefill* when waiting groups fit (sequence slots, the batched-token budget and free KV blocks):
  each admitted group (the ``n`` samples of a prompt, or one preempted sequence) is prefilled once;
- otherwise *decode*: every running sequence advances one token. When the KV pool runs out, the most
  recently admitted sequence is preempted: its blocks are freed and it goes back to the front of the
  queue to be recomputed later (prompt + the outputs it already has), so no work is lost but time.

After each step ``postprocess`` appends the sampled tokens, applies the stop rules and frees the blocks
of finished sequences, so finished sequences leave and waiting ones join at every step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tidal.rollout.block_manager import BlockManager
from tidal.rollout.sequence import Sequence, SequenceStatus

Detokenize = Callable[[list[int], bool], str]


@dataclass
class ScheduledBatch:
    """One step's work. Prefill: each group's tokens run once, then one token is sampled per member."""

    is_prefill: bool
    groups: list[list[Sequence]]
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return [seq for group in self.groups for seq in group]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int],
        detokenize: Detokenize | None = None,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.detokenize = detokenize
        self.waiting: deque[list[Sequence]] = deque()
        self.running: deque[Sequence] = deque()

    def add(self, group: list[Sequence]) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_all(self) -> None:
        """Drop every queued and running sequence and free its blocks (after an interrupted step)."""
        for seq in self.running:
            self.block_manager.free(seq)
        self.running.clear()
        self.waiting.clear()

    def schedule(self) -> ScheduledBatch:
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
            copies += self.block_manager.allocate(group)
            for seq in group:
                seq.status = SequenceStatus.RUNNING
            self.running.extend(group)
            groups.append(group)
            num_seqs += len(group)
            num_tokens += group_tokens
        return ScheduledBatch(True, groups, copies) if groups else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        blocks = self.block_manager
        while self.running:
            seq = self.running.popleft()
            if not blocks.needs_new_block(seq):  # the common case: room left in the last block
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
            return self._schedule_prefill()
        return ScheduledBatch(False, [[seq] for seq in scheduled])

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft([seq])

    def postprocess(
        self, batch: ScheduledBatch, token_ids: list[int], logprobs: list[float]
    ) -> list[Sequence]:
        """Append sampled tokens, apply stop rules; return the sequences that finished this step."""
        finished = []
        for seq, token, logprob in zip(batch.seqs, token_ids, logprobs, strict=True):
            seq.append(token, logprob)
            self._check_stop(seq)
            if seq.is_finished:
                self.block_manager.free(seq)
                finished.append(seq)
        if finished:
            self.running = deque(seq for seq in self.running if not seq.is_finished)
        return finished

    def _check_stop(self, seq: Sequence) -> None:
        params, token = seq.params, seq.token_ids[-1]
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens  # called per sequence per step: no properties
        if num_output >= params.min_new_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return seq.finish("stop", token)
            if token in params.stop_token_ids:
                return seq.finish("stop", token)
            if params.stop:
                stop = self._find_stop_string(seq)
                if stop is not None:
                    return seq.finish("stop", stop)
        if num_output >= params.max_new_tokens or num_tokens >= self.max_model_len:
            seq.finish("length")

    def _find_stop_string(self, seq: Sequence) -> str | None:
        # Decode only a tail window: a stop string made of k characters spans at most about k tokens,
        # and decoding the whole output at every step would be quadratic.
        window = max(len(s) for s in seq.params.stop) + 3
        text = self.detokenize(seq.output_token_ids[-window:], seq.params.skip_special_tokens)
        return next((s for s in seq.params.stop if s in text), None)
