"""What the model runner moves between host, device and tensor-parallel ranks: the ``PrefillStep`` and
``DecodeStep`` a batch becomes (host arrays, sent as they are to the other ranks), the ``LaunchedStep`` whose
result is read later, the block tables of decode rows (``BlockTables``, ``fill_decode_inputs``), and the
paged cache's per-slot layout (``kv_cache_layout``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from tidal.rollout.scheduling.sequence import Sequence

# What a step returns per sampled row: token ids, their log-probs and, when any row asks, each row's
# (token id, log-prob) alternatives (None for a row that did not ask); see ``ModelRunner.run``.
StepResult = tuple[list[int], list[float], list[list[tuple[int, float]] | None] | None]


@dataclass
class PrefillStep:
    """A prefill's model inputs as host arrays: one row per group (its first sequence's tokens)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    lens: list[int]
    rows: list[int]  # the logits row of each sampled sequence
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Linear-attention families: each group's state slot (its first sequence's), and the (src, dst) slots
    # the samples of a group copy their prompt's state between after the prefill.
    state_slots: list[int] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # Vision families: the step's images and decode deltas (multimodal.PrefillImages); positions are then
    # [3, tokens] M-RoPE triples.
    images: object | None = None


@dataclass
class DecodeStep:
    """A decode step's staged int32 inputs (``fill_decode_inputs``, then each row's read and write state
    slots for a family with recurrent states: ``StateCache.decode_slots``) and its row counts."""

    staged: np.ndarray
    num_seqs: int
    rows: int
    width: int
    use_graph: bool
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    buffer: int = 0  # the staging buffer it is in
    # A step launched ahead (async scheduling): each row's input id is the previous step's sampled id at
    # the row staged in place of the token (``fill_decode_inputs``), read on the device.
    ahead: torch.Tensor | None = None
    # Tensor parallelism, set in the copy the other ranks receive (``for_peers``): how many sampled ids
    # ``ahead`` held (0: not launched ahead) and the rank that sampled them, which broadcasts them.
    ahead_rows: int = 0
    root: int = 0

    def for_peers(self, rank: int) -> DecodeStep:
        """The step as rank ``rank`` (the driver) sends it to the other ranks of a tensor-parallel engine:
        without ``ahead`` (the ids are on this rank's device only), with their count and this rank."""
        if self.ahead is None:
            return self
        return replace(self, ahead=None, ahead_rows=len(self.ahead), root=rank)


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are enqueued and whose copy to the host has started."""

    tokens: torch.Tensor | None  # [rows] sampled ids on the device (a step launched ahead reads them)
    host: torch.Tensor | None  # [rows, 2 + 2k] float64: token, log-prob, k alternative ids, k log-probs
    ready: torch.cuda.Event | None  # CUDA: recorded after the copy to the host
    top_rows: list[bool] | None = None  # k > 0: which rows asked for alternatives

    def result(self) -> StepResult:
        """Wait for the copy to the host; the step's tokens, log-probs and top alternatives."""
        if self.host is None:  # nothing sampled (every group of a chunked prefill is between chunks)
            return [], [], None
        if self.ready is not None:
            self.ready.synchronize()
        packed = self.host.numpy()
        tokens, logprobs = packed[:, 0].astype(np.int64).tolist(), packed[:, 1].tolist()
        if self.top_rows is None:
            return tokens, logprobs, None
        k = (packed.shape[1] - 2) // 2
        top_ids, top_values = packed[:, 2 : 2 + k].astype(np.int64).tolist(), packed[:, 2 + k :].tolist()
        top = [
            list(zip(row_ids, row_values, strict=True)) if asked else None
            for asked, row_ids, row_values in zip(self.top_rows, top_ids, top_values, strict=True)
        ]
        return tokens, logprobs, top


class StepPeers(Protocol):
    """The other ranks of a tensor-parallel engine, as rank 0's runner sees them."""

    def send_step(self, step: PrefillStep | DecodeStep) -> None: ...


class BlockTables:
    """The block tables of the last decode step staged, one int32 row per batch row, kept between steps so
    that a step rewrites only the rows whose table changed (a sequence got a block, or another sequence
    is in that row now) instead of converting every table from Python at every step.

    A row holds a reference to the list it was written from and that list's length then: a
    ``Sequence.block_table`` only grows in place (any other change assigns a new list, see ``Sequence``),
    so the same list at the same length has the same blocks."""

    def __init__(self, max_rows: int, max_blocks: int):
        self.array = np.zeros((max_rows, max_blocks), dtype=np.int32)  # unused entries: block 0
        self.held: list[list[int] | None] = [None] * max_rows  # the list each row was written from
        self.held_len = [0] * max_rows  # its length then
        self.lengths = np.zeros(max_rows, dtype=np.int64)  # held_len, to take the longest in one call

    def update(self, seqs: list[Sequence], rows: int) -> tuple[np.ndarray, int]:
        """``[rows, max_blocks]``: the tables of ``seqs``, then empty padding rows; and the longest one."""
        held, held_len = self.held, self.held_len
        for row, seq in enumerate(seqs):
            table = seq.block_table
            if held[row] is not table or held_len[row] != len(table):
                self._write(row, table)
        for row in range(len(seqs), rows):
            if held_len[row]:
                self._write(row, [])
        return self.array[:rows], int(self.lengths[:rows].max())

    def _write(self, row: int, table: list[int]) -> None:
        size, old = len(table), self.held_len[row]
        if self.held[row] is table and size == old + 1:  # the common change: one block appended
            self.array[row, old] = table[old]
        else:
            if size < old:
                self.array[row, size:old] = 0
            self.array[row, :size] = table
        self.held[row], self.held_len[row], self.lengths[row] = table, size, size


def fill_decode_inputs(
    seqs: list[Sequence],
    rows: int,
    width: int,
    out: np.ndarray,
    ahead: tuple[list[int], int] | None = None,
    tables: np.ndarray | None = None,
) -> np.ndarray:
    """Write ``[last tokens][context lengths][block tables rows x width]`` (int32) into ``out``.

    Rows past ``len(seqs)`` are padding (token 0, context 0); unused table entries are block 0, which
    the torch attention backend may gather but masks out. ``tables``: those rows x at least ``width``
    already (``BlockTables.update``), copied instead of written from the sequences' lists.

    ``ahead = (prev_rows, prev_size)``: a step launched ahead (async scheduling), whose last tokens are
    not on the host yet: the token field holds each sequence's row in the previous step's sampled ids
    (padding rows ``prev_size``, one past their end: token 0, see ``cuda_graph.ahead_input_ids``) and each
    context counts that token too.
    """
    n = len(seqs)
    view = out[: rows * (2 + width)]
    view[: 2 * rows] = 0
    if ahead is None:
        view[:n] = [seq.token_ids[-1] for seq in seqs]
        view[rows : rows + n] = [seq.num_tokens for seq in seqs]
    else:
        prev_rows, prev_size = ahead
        view[:rows] = prev_size
        view[:n] = prev_rows
        view[rows : rows + n] = [seq.num_tokens + 1 for seq in seqs]
    staged = view[2 * rows :].reshape(rows, width)
    if tables is not None:
        staged[:] = tables[:, :width]
        return view
    staged.fill(0)
    for row, seq in zip(staged, seqs, strict=False):
        row[: len(seq.block_table)] = seq.block_table
    return view


def kv_cache_layout(args) -> tuple[int, int, int]:
    """(tensors, heads, dim) the paged cache holds per layer and slot: k and v of each KV head this rank
    computes, unless the family's ``DecoderArgs`` declare a ``kv_cache_layout`` of their own (multi-head
    latent attention caches one latent row per token: ``models/mla.py``)."""
    layout = getattr(args, "kv_cache_layout", None)
    return layout if layout is not None else (2, args.local_kv_heads, args.head_dim)


def state_copies(groups: list[list[Sequence]]) -> list[tuple[int, int]]:
    """(first sample's slot, other sample's slot) of every group with several samples."""
    return [(group[0].state_slot, seq.state_slot) for group in groups for seq in group[1:]]
