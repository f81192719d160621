"""CUDA graphs of the decode forward: one graph per batch-size bucket, captured lazily, replayed per step.

A decode step of a small model is hundreds of tiny kernels; launched one by one from Python the GPU
mostly waits for the CPU. A graph replays the whole forward (embedding -> layers -> lm_head) with one
launch. Graphs need fixed shapes and fixed addresses, so:

- the batch is padded up to a bucket (1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``); padding
  rows have context length 0: they write their KV into the cache's reserved padding slot and read none;
- inputs live in static device buffers (token ids, context lengths, block tables of the full
  ``max_model_len`` width); positions and KV slots are derived from them inside the graph;
- the host stages a step's inputs in one pinned int32 buffer, copied with one host-to-device transfer,
  then spread into the static buffers by three device copies before the replay. A family with
  per-sequence recurrent states (``state_cache.py``, Qwen3.5) stages each row's read and write state
  slots after the block tables, into a fourth static buffer: padding rows (and the warm-up and capture
  runs) read and write the state cache's scratch slot. A step launched ahead
  (async scheduling) takes its input ids from the previous step's sampled ids on the device instead
  (``ahead_input_ids``), so nothing waits for them to reach the host.

Graphs are captured on the first step that needs a bucket (a warm-up run first compiles the Triton
kernels and picks cuBLAS algorithms). They capture the KV cache's and the weights' addresses:
``update_weights`` copies in place and keeps them valid, ``sleep`` drops them (``clear``).

Memory: all graphs share one memory pool, so the cost is about that of the largest captured bucket's
activations, dominated by its ``[bucket, vocab]`` logits (bf16 Qwen2.5-0.5B, bucket 256: ~80 MB; the
benchmark prints the measured figure as ``graph_pool_mb``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch

from tidal.logging.console import get_logger

log = get_logger(__name__)
DecodeForward = Callable[..., torch.Tensor]  # (input ids, context lens, block tables[, state slots])


def ahead_input_ids(prev_tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A step launched ahead: its int32 input ids, gathered on the device from the previous step's sampled
    ids at ``rows``; row ``len(prev_tokens)`` (padding) gives token 0, as a step staged on the host has."""
    padded = torch.cat((prev_tokens, prev_tokens.new_zeros(1)))
    return padded.index_select(0, rows).to(torch.int32)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes with a graph: powers of two to 8, then every multiple of 16, then the max."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return [*buckets, max_num_seqs]


class DecodeGraphs:
    """Static input buffers plus one captured decode forward per bucket."""

    def __init__(
        self,
        forward: DecodeForward,
        device: torch.device,
        max_num_seqs: int,
        max_blocks: int,
        pad_state_slot: int | None = None,
    ):
        """``pad_state_slot``: the state cache's scratch slot, for families with recurrent states (their
        rows' int32 [read, write] state slots are staged after the block tables); None: no states."""
        self.forward = forward
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks = max_blocks
        rows = self.buckets[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self.pad_state_slot = pad_state_slot
        self.state_slots = None  # [2 (read, write), rows] int32
        if pad_state_slot is not None:
            self.state_slots = torch.full((2, rows), pad_state_slot, dtype=torch.int32, device=device)
        state_size = 0 if pad_state_slot is None else 2 * rows
        self.stage = torch.zeros(rows * (2 + max_blocks) + state_size, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, batch: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def clear(self) -> None:
        """Forget every graph (their captured KV-cache / weight addresses are about to go stale)."""
        self.graphs.clear()
        self.pool = None

    def run(
        self,
        host_stage: torch.Tensor,
        batch: int,
        rows: int,
        width: int,
        ahead: torch.Tensor | None = None,
        copied: torch.cuda.Event | None = None,
    ) -> torch.Tensor:
        """Replay the bucket's graph on inputs staged as ``[ids rows][ctx rows][tables rows x width]``
        (then ``[read state slots rows][write state slots rows]`` for a family with recurrent states).

        ``ahead``: the previous step's sampled ids, which the staged ids index (``ahead_input_ids``);
        ``copied``: recorded once the host buffer is read (it may then be rewritten)."""
        graph, logits = self.graphs.get(rows) or self._capture(rows)
        stage = self.stage[: host_stage.numel()]
        stage.copy_(host_stage, non_blocking=True)
        if copied is not None:
            copied.record()
        self.input_ids[:rows].copy_(stage[:rows] if ahead is None else ahead_input_ids(ahead, stage[:rows]))
        self.context_lens[:rows].copy_(stage[rows : 2 * rows])
        tables_end = 2 * rows + rows * width
        self.block_tables[:rows, :width].copy_(stage[2 * rows : tables_end].view(rows, width))
        if self.state_slots is not None:
            self.state_slots[:, :rows].copy_(stage[tables_end:].view(2, rows))
        graph.replay()
        return logits[:batch]

    def inputs(self, rows: int) -> tuple[torch.Tensor, ...]:
        """The static input buffers of a bucket of ``rows``, as the forward takes them."""
        inputs = (self.input_ids[:rows], self.context_lens[:rows], self.block_tables[:rows])
        return inputs if self.state_slots is None else (*inputs, self.state_slots[:, :rows])

    def _capture(self, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        start = time.perf_counter()
        inputs = self.inputs(rows)
        # Context length 0 everywhere: the warm-up and capture runs write only the padding slot, never a
        # live sequence's KV (nor, reading and writing the scratch slot, its recurrent state).
        self.input_ids.zero_()
        self.context_lens.zero_()
        if self.state_slots is not None:
            self.state_slots.fill_(self.pad_state_slot)
        self.forward(*inputs)  # warm-up outside the capture: Triton compilation, cuBLAS handles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: with --async_train the trainer runs in another thread while the engine captures;
        # the default (global) mode makes its cudaMalloc calls fail the capture (and the trainer's step).
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self.forward(*inputs)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[rows] = (graph, logits)
        # captured lazily during generation: a line per batch size says where the first steps' time goes
        log.info("engine: CUDA graph for decode batches of %d captured (%d of %d batch sizes, %.1f s)", rows,
                 len(self.graphs), len(self.buckets), time.perf_counter() - start)  # fmt: skip
        return graph, logits
