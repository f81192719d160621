"""Per-sequence recurrent state for linear-attention layers (Qwen3.5's Gated DeltaNet), beside the KV cache.

A linear-attention layer carries, per sequence, a fixed-size state instead of one K/V entry per token: the
last ``width - 1`` inputs of its causal convolution and its delta-rule matrix per value head. The engine
keeps them in a pool of slots, like KV blocks but one slot (or one pair of slots) per sequence:

- ``StateSlots`` (host, owned by the ``BlockManager``) hands a slot to every sequence it allocates blocks
  for and takes it back when it frees them, so the slot lives exactly as long as the sequence's KV blocks:
  given when a sequence is admitted, returned when it finishes, is aborted or is preempted (the engine
  preempts by recomputation: the re-admitted sequence gets a fresh slot and recomputes its state in its
  new prefill, as it recomputes its K/V);
- ``StateCache`` (device, owned by the ``ModelRunner``) holds the tensors, indexed by slot, so a step
  reads and writes a batch's states by index tensors: a decode step's read and write slots are int32
  inputs staged with its tokens and block tables, which a CUDA graph carries in static buffers
  (``cuda_graph.py``). Padding rows of a graph's batch bucket read and write the extra scratch slot
  (``pad_slot``), never a live sequence's. The ``n`` samples of a prompt each get a slot: the prompt is
  prefilled once into the first sample's slot and copied into the others' after the prefill (``copy``),
  as its last KV block is.

Double buffering (``double``, with async scheduling): a decode step launched ahead may be discarded while
its sequences go on (another sequence stopped, a request came or went, new weights between steps), so it
must not have changed the state the replacement step starts from. Each sequence then holds a pair of
slots ``(2i, 2i + 1)``: ``Sequence.state_slot`` is the one holding its state after its last kept step; a
decode step reads it and writes the other (``decode_slots``), and only a kept step (``Scheduler.postprocess``)
flips ``state_slot`` to the other (``flip``). A step launched ahead of step t, before t is kept, reads what
t writes and writes what t read (t has read it by then: the device runs steps in order). Discarding it
leaves t's output intact; the replacement step rewrites its write slot. Prefills (never launched ahead)
read and write ``state_slot`` in place. Without async scheduling a step updates the state in place.

A slot holds nothing that must survive a sleep: the engine frees the KV cache on ``sleep`` (no request
survives it), and frees and reallocates these tensors with it. A prefill that starts a sequence reads
zeros, not the slot (a slot is not cleared when it is returned); a later chunk of a chunked prefill
continues from the state its earlier chunks left in the slot.

Saved states (prefix caching): a cached KV prefix is of no use to a linear-attention layer without its
state after that prefix, so the pool has ``saved`` more rows after the scratch slot, each holding the
state of a sequence at the end of one cached full block, keyed by that block's key (``prefix_cache.py``;
the key names every token up to the block's end, hence the state too). ``SavedStates`` (host, owned by
the ``BlockManager``) maps keys to rows, least recently used first. A prefill chunk that ends on a block
boundary saves its state there (the scheduler cuts a prompt's prefill at its last boundary before its
last token for that: ``Scheduler._chunk_end``); a cache hit is cut back to the longest matched prefix
whose state was saved, which is copied into the sequence's slot before its first chunk. A saved state is
dropped with its block's key (evicted by the allocator, or ``update_weights``/``sleep`` clearing the
cache) or, the pool being full, when a newer one needs its row (least recently used first). Decode
steps save nothing: a state every block of every sequence would cost one row copy per block, and most
would never be read; a next turn (prompt + answer + more) resumes at its previous prompt's saved state
and recomputes the answer's tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StateSpec:
    """The per-sequence state of a model's linear-attention layers (``CausalLM.state_spec``)."""

    num_layers: int  # linear-attention layers (each has its ``state_index`` among them)
    conv_channels: int  # q, k and v channels of the causal convolution
    conv_history: int  # inputs kept: the convolution's width - 1
    num_heads: int  # value heads, each with a [k_dim, v_dim] state
    k_dim: int
    v_dim: int


class StateSlots:
    """Which of ``num_seqs`` sequences' state slots are free (host bookkeeping, lowest id first).
    ``double``: each sequence takes a pair of slots, ``(2i, 2i + 1)``, and holds its first."""

    def __init__(self, num_seqs: int, double: bool = False):
        self.double = double
        self.num_slots = num_seqs * (2 if double else 1)
        self.free = list(range(num_seqs - 1, -1, -1))  # a stack: pop() gives the lowest id

    @property
    def num_free(self) -> int:
        """Sequences that can still get their slot(s)."""
        return len(self.free)

    def take(self) -> int:
        if not self.free:  # the scheduler admits at most max_num_seqs sequences: a bug if reached
            raise RuntimeError("no free recurrent-state slot (more running sequences than max_num_seqs)")
        return self.free.pop() * (2 if self.double else 1)

    def give_back(self, slot: int) -> None:
        """Return a sequence's slot (either of its pair: the pair goes back)."""
        self.free.append(slot // 2 if self.double else slot)

    def flip(self, seqs: list) -> None:
        """After a kept decode step of ``seqs``: each one's state is now in the slot the step wrote."""
        if self.double:
            for seq in seqs:
                seq.state_slot ^= 1


class SavedStates:
    """Which rows of the state pool hold a saved state, by block key, least recently used first (module
    doc). ``first_row``: the pool's first saved row (after the slots and the scratch slot)."""

    def __init__(self, capacity: int, first_row: int):
        self.rows: OrderedDict[int, int] = OrderedDict()
        self.free = list(range(first_row + capacity - 1, first_row - 1, -1))  # pop() gives the lowest

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key: int) -> bool:
        return key in self.rows

    def use(self, key: int) -> int:
        """The row of ``key``'s saved state (which must be saved), now the most recently used."""
        self.rows.move_to_end(key)
        return self.rows[key]

    def reserve(self, key: int) -> int | None:
        """A row to save ``key``'s state into (the least recently used one's when none is free); None when
        it is saved already (the same tokens give the same state)."""
        if key in self.rows:
            return None
        row = self.free.pop() if self.free else self.rows.popitem(last=False)[1]
        self.rows[key] = row
        return row

    def drop(self, key: int) -> None:
        """Forget ``key``'s saved state, if any (its block's key left the prefix cache)."""
        row = self.rows.pop(key, None)
        if row is not None:
            self.free.append(row)

    def clear(self) -> None:
        self.free.extend(self.rows.values())
        self.rows.clear()


def saved_state_rows(max_num_seqs: int, prefix_caching: bool) -> int:
    """Rows of saved states for prefix caching: one per sequence slot, as many as the sequences' own slots
    (without double buffering) and out of the same KV-cache budget. At transformers' default Qwen3.5
    shape (24 linear layers, 32 value heads of 128 x 128) a state is ~49 MiB: 256 rows take ~12.6 GiB.
    Any size is correct: within one step, loads run before the forward and saves after it, and two saves
    into one row keep the later (``Scheduler._schedule_context_prefill``)."""
    return max_num_seqs if prefix_caching else 0


class StateCache:
    """The slots' tensors: ``conv`` [layers, slots + 1 + saved, channels, history] in the model dtype and
    ``recurrent`` [layers, slots + 1 + saved, heads, k_dim, v_dim] in float32 (the rule accumulates in
    float32). Slot ``slots`` is scratch for padding rows, like the KV cache's extra block; the ``saved``
    rows after it hold prefix caching's saved states (``SavedStates``). ``double``: a pair of slots per
    sequence (``StateSlots``), for ``num_seqs`` sequences."""

    def __init__(
        self,
        spec: StateSpec,
        num_seqs: int,
        dtype: torch.dtype,
        device: torch.device,
        double: bool = False,
        saved: int = 0,
    ):
        self.spec, self.dtype, self.device, self.double = spec, dtype, device, double
        self.num_slots = num_seqs * (2 if double else 1)
        self.saved = saved
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None
        self.allocate()

    @property
    def pad_slot(self) -> int:
        return self.num_slots

    def allocate(self) -> None:
        s, rows = self.spec, self.num_slots + 1 + self.saved
        conv = (s.num_layers, rows, s.conv_channels, s.conv_history)
        self.conv = torch.zeros(conv, dtype=self.dtype, device=self.device)
        recurrent = (s.num_layers, rows, s.num_heads, s.k_dim, s.v_dim)
        self.recurrent = torch.zeros(recurrent, dtype=torch.float32, device=self.device)

    def free(self) -> None:
        self.conv = self.recurrent = None

    def decode_slots(self, seqs: list, rows: int, ahead: bool, out: np.ndarray) -> None:
        """Write a decode step's int32 ``[read slots rows][write slots rows]`` into ``out``; padding rows
        (past ``len(seqs)``) read and write ``pad_slot``. Double buffered, a step reads ``state_slot`` and
        writes the other of its pair; ``ahead`` (launched before the step before it is kept): the reverse.
        Otherwise both are ``state_slot`` (in place)."""
        n = len(seqs)
        out[: 2 * rows] = self.pad_slot
        current = [seq.state_slot for seq in seqs]
        if not self.double:
            out[:n] = out[rows : rows + n] = current
            return
        other = [slot ^ 1 for slot in current]
        out[:n], out[rows : rows + n] = (other, current) if ahead else (current, other)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` into slots ``dst`` (index tensors) in every layer (samples of one prompt; a
        saved state into a sequence's slot, or a sequence's state into a saved row)."""
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]

    @staticmethod
    def bytes_per_slot(spec: StateSpec, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        conv = spec.conv_channels * spec.conv_history * elem
        return spec.num_layers * (conv + spec.num_heads * spec.k_dim * spec.v_dim * 4)
