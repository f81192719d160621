"""Tensor parallelism for the rollout engine's models: the TP group handle and the parallel layers.

An engine with ``tp_size`` N runs N processes; each holds a shard of every large weight and runs the
whole forward on its shard (``tidal.rollout.runner.tp_worker`` starts and drives them):

- ``ColumnParallelLinear`` (packed ``qkv_proj``, ``gate_up_proj``): each rank keeps its rows of every
  packed part — its q heads and the KV heads they read, its slice of the intermediate size — so the
  attention and the activation run on local heads / columns with no communication;
- ``RowParallelLinear`` (``o_proj``, ``down_proj``): each rank multiplies its input columns, the partial
  sums are all-reduced, then the (replicated) bias is added once;
- MoE experts (``moe.Experts``): every rank holds every expert's slice of the expert intermediate size
  (gate/up rows as a column-parallel layer, down columns as a row-parallel one; vLLM's default MoE
  split) and the replicated router picks the same experts on every rank; the block's partial output
  (with a shared expert's, ``defer_reduce``) is all-reduced once;
- ``VocabParallelEmbedding``: each rank holds a slice of the vocabulary rows; tokens outside it read
  zeros and an all-reduce sums the one non-zero row per token;
- ``ParallelLMHead``: each rank computes its vocabulary slice of the logits; they are all-gathered so
  that sampling sees the full row and runs unchanged (same code, same seeds) on rank 0.

Linear attention (Qwen3.5's Gated DeltaNet, ``qwen3_5.py``): each rank keeps 1/N of the key heads and
the value heads grouped with them; its rows of the q | k | v channels are one ``JoinedRows``.

KV heads: with N <= ``num_key_value_heads`` each rank keeps ``num_key_value_heads / N`` of them; with
more ranks than KV heads each rank keeps (a replica of) the one KV head its q heads attend with, so the
per-rank KV cache holds only the heads that rank reads.

Every layer takes a ``TPGroup``; with size 1 (``SINGLE``) each one is the plain ``torch.nn`` layer (same
forward, no collective), so the single-device engine is unchanged. Each parallel layer knows its rank's
rows (``Rows``) and takes its shard of a full checkpoint tensor itself (``take``), which is how the
loader and ``update_weights`` slice weights as they load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel engine: ``rank`` of ``size``, and the process group of
    the collectives (a ``torch.distributed`` ProcessGroup built on a store of its own; None for size 1)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __deepcopy__(self, memo) -> TPGroup:
        return self  # a handle on the engine's process group: copies of a model share it

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (identity for size 1)."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Rank ``root``'s ``x`` on every rank, in place."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, 0
            self.group.broadcast([x], opts).wait()
        return x


SINGLE = TPGroup()


class TPLayoutError(ValueError):
    """A tensor-parallel size the model's shapes cannot be split by."""


@dataclass(frozen=True)
class Rows:
    """A rank's rows ``[start, start + length)`` of a dimension of ``full`` rows; ``size`` rows are held
    locally (more than ``length`` only for a padded vocabulary slice)."""

    full: int
    start: int
    length: int
    size: int

    def take(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor.narrow(dim, self.start, self.length)


def whole(full: int) -> Rows:
    return Rows(full, 0, full, full)


@dataclass(frozen=True)
class JoinedRows(Rows):
    """A rank's rows of a dimension made of consecutive segments (``pieces``, each a ``Rows`` of its own
    segment), e.g. Gated DeltaNet's q | k | v channels, each split by heads: the rank holds its rows of
    every segment, in order. ``start`` is unused (the rows are not one range): read them with ``take``."""

    pieces: tuple[Rows, ...] = ()

    def take(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        out, base = [], 0
        for piece in self.pieces:
            out.append(tensor.narrow(dim, base + piece.start, piece.length))
            base += piece.full
        return torch.cat(out, dim)


def joined_rows(*pieces: Rows) -> Rows:
    """The rows of ``pieces`` (consecutive segments of one dimension) held together, in order: ``whole``
    rows when every piece is whole (no tensor parallelism)."""
    if all(p.length == p.full == p.size for p in pieces):
        return whole(sum(p.full for p in pieces))
    length = sum(p.length for p in pieces)
    return JoinedRows(sum(p.full for p in pieces), -1, length, sum(p.size for p in pieces), tuple(pieces))


def take_rows(rows: Rows, param: torch.Tensor, tensor: torch.Tensor, name: str):
    """(``param``, the rank's ``rows`` of ``tensor`` along its first dimension): the ``take`` of a plain
    parameter sharded by rows (a depthwise convolution's channels, per-head vectors)."""
    check_full(tensor, (rows.full, *param.shape[1:]), name)
    return param, rows.take(tensor, 0)


def even_rows(full: int, tp: TPGroup, what: str) -> Rows:
    """An equal split of ``full`` rows; ``what`` names the config field in the error."""
    if full % tp.size:
        raise TPLayoutError(f"tensor-parallel size {tp.size} does not divide {what}={full}")
    per = full // tp.size
    return Rows(full, tp.rank * per, per, per)


def check_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Refuse a TP size that cannot split the attention heads (see ``head_rows``)."""
    if num_heads % tp_size:
        raise TPLayoutError(f"tensor-parallel size {tp_size} does not divide num_attention_heads={num_heads}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise TPLayoutError(
            f"tensor-parallel size {tp_size} neither divides nor is a multiple of "
            f"num_key_value_heads={num_kv_heads}"
        )


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds (and caches): an equal share, or one replica when they are fewer."""
    check_heads(num_heads, num_kv_heads, tp_size)
    return max(1, num_kv_heads // tp_size)


def head_rows(num_heads: int, num_kv_heads: int, head_dim: int, tp: TPGroup) -> tuple[Rows, Rows]:
    """The rank's rows of the q projection and of the k (and v) projection.

    q heads are split evenly. KV heads are split evenly too when there are at least as many as ranks;
    otherwise rank r keeps KV head ``r * num_kv_heads // size``, the one its q heads are grouped with
    (q head h reads KV head ``h // (num_heads / num_kv_heads)``)."""
    check_heads(num_heads, num_kv_heads, tp.size)
    q_per = num_heads // tp.size
    q = Rows(num_heads * head_dim, tp.rank * q_per * head_dim, q_per * head_dim, q_per * head_dim)
    kv_per = kv_heads_per_rank(num_heads, num_kv_heads, tp.size)
    first = tp.rank * kv_per if num_kv_heads >= tp.size else tp.rank * num_kv_heads // tp.size
    kv = Rows(num_kv_heads * head_dim, first * head_dim, kv_per * head_dim, kv_per * head_dim)
    return q, kv


def vocab_rows(vocab_size: int, tp: TPGroup) -> Rows:
    """The rank's vocabulary slice: ``ceil(vocab / size)`` rows held, the last rank's padded."""
    per = -(-vocab_size // tp.size)
    start = min(tp.rank * per, vocab_size)
    return Rows(vocab_size, start, min(per, vocab_size - start), per)


def check_full(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {shape}")


class ColumnParallelLinear(nn.Linear):
    """A linear layer whose output rows are the rank's rows of each packed part (q, k, v or gate, up)."""

    def __init__(self, in_features: int, parts: Sequence[Rows], bias: bool):
        super().__init__(in_features, sum(p.size for p in parts), bias=bias)
        self.parts = tuple(parts)

    def take(self, param: torch.Tensor, kind: str, part: int | None, tensor: torch.Tensor, name: str):
        """(destination view of ``param``, the rank's rows of ``tensor``): one packed part's full tensor
        (``part``) or the whole packed tensor (``None``, e.g. Phi-3's fused checkpoint weights)."""
        tail = tuple(param.shape[1:])
        if part is not None:
            rows = self.parts[part]
            check_full(tensor, (rows.full, *tail), name)
            offset = sum(p.size for p in self.parts[:part])
            return param.narrow(0, offset, rows.length), rows.take(tensor, 0)
        check_full(tensor, (sum(p.full for p in self.parts), *tail), name)
        pieces, base = [], 0
        for rows in self.parts:
            pieces.append(tensor.narrow(0, base + rows.start, rows.length))
            base += rows.full
        return param, pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class RowParallelLinear(nn.Linear):
    """A linear layer over the rank's input columns; partial outputs are all-reduced, then biased.

    ``defer_reduce()``: the forward returns the rank's partial output and the caller all-reduces it
    together with other partial sums (a MoE block's shared expert and routed experts: one reduction)."""

    def __init__(self, cols: Rows, out_features: int, bias: bool, tp: TPGroup):
        super().__init__(cols.size, out_features, bias=bias)
        self.cols, self.tp = cols, tp
        self.reduce = True

    def defer_reduce(self) -> None:
        if self.bias is not None:  # a bias must be added once, after the reduction the caller owns
            raise ValueError("RowParallelLinear.defer_reduce: the layer has a bias")
        self.reduce = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        out = F.linear(x, self.weight)
        if not self.reduce:
            return out
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def take(self, param: torch.Tensor, kind: str, part: int | None, tensor: torch.Tensor, name: str):
        if kind == "bias":  # added once, after the reduction: every rank holds all of it
            check_full(tensor, tuple(param.shape), name)
            return param, tensor
        check_full(tensor, (param.shape[0], self.cols.full), name)
        return param, self.cols.take(tensor, 1)


class _VocabSlice:
    """Loading for a weight whose rows are the vocabulary (embedding, LM head, tied or not)."""

    rows: Rows

    def take(self, param: torch.Tensor, kind: str, part: int | None, tensor: torch.Tensor, name: str):
        check_full(tensor, (self.rows.full, *param.shape[1:]), name)
        param.narrow(0, self.rows.length, self.rows.size - self.rows.length).zero_()  # padding rows
        return param.narrow(0, 0, self.rows.length), self.rows.take(tensor, 0)


class VocabParallelEmbedding(_VocabSlice, nn.Embedding):
    """An embedding over the rank's vocabulary slice; other tokens read zeros, summed over ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        rows = vocab_rows(vocab_size, tp)
        nn.Embedding.__init__(self, rows.size, hidden_size)
        self.rows, self.tp = rows, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.rows.start
        inside = (local >= 0) & (local < self.rows.length)
        out = F.embedding(local.masked_fill(~inside, 0), self.weight) * inside[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(_VocabSlice, nn.Linear):
    """The LM head over the rank's vocabulary slice; the slices are all-gathered into full logits."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup):
        rows = vocab_rows(vocab_size, tp)
        nn.Linear.__init__(self, hidden_size, rows.size, bias=False)
        self.rows, self.tp = rows, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[..., : self.rows.full]
