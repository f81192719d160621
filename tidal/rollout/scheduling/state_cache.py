"""Per-sequence recurrent state for linear-attention layers (Qwen3.5's Gated DeltaNet), beside the KV cache.

A linear-attention layer carries, per sequence, a fixed-size state instead of one K/V entry per token: the
last ``width - 1`` inputs of its causal convolution and its delta-rule matrix per value head. The engine
keeps them in a pool of slots, like KV blocks but one slot per sequence:

- ``StateSlots`` (host, owned by the ``BlockManager``) hands a slot to every sequence it allocates blocks
  for and takes it back when it frees them, so the slot lives exactly as long as the sequence's KV blocks:
  given when a sequence is admitted, returned when it finishes, is aborted or is preempted (the engine
  preempts by recomputation: the re-admitted sequence gets a fresh slot and recomputes its state in its
  new prefill, as it recomputes its K/V);
- ``StateCache`` (device, owned by the ``ModelRunner``) holds the tensors, indexed by slot, so a step
  reads and writes a batch's states by one index tensor (a CUDA graph could read slots by index too).
  The ``n`` samples of a prompt each get a slot: the prompt is prefilled once into the first sample's
  slot and copied into the others' after the prefill (``copy``), as its last KV block is.

A slot holds nothing that must survive a sleep: the engine frees the KV cache on ``sleep`` (no request
survives it), and frees and reallocates these tensors with it. A prefill that starts a sequence reads
zeros, not the slot (a slot is not cleared when it is returned); a later chunk of a chunked prefill
continues from the state its earlier chunks left in the slot.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """Which of ``num_slots`` state slots are free (host bookkeeping, lowest id first)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # a stack: pop() gives the lowest id

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self) -> int:
        if not self.free:  # the scheduler admits at most max_num_seqs sequences: a bug if reached
            raise RuntimeError("no free recurrent-state slot (more running sequences than max_num_seqs)")
        return self.free.pop()

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


class StateCache:
    """The slots' tensors: ``conv`` [layers, slots + 1, channels, history] in the model dtype and
    ``recurrent`` [layers, slots + 1, heads, k_dim, v_dim] in float32 (the rule accumulates in float32).
    The extra last slot is scratch for padding rows, like the KV cache's extra block."""

    def __init__(self, spec: StateSpec, num_slots: int, dtype: torch.dtype, device: torch.device):
        self.spec, self.num_slots, self.dtype, self.device = spec, num_slots, dtype, device
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None
        self.allocate()

    @property
    def pad_slot(self) -> int:
        return self.num_slots

    def allocate(self) -> None:
        s, rows = self.spec, self.num_slots + 1
        conv = (s.num_layers, rows, s.conv_channels, s.conv_history)
        self.conv = torch.zeros(conv, dtype=self.dtype, device=self.device)
        recurrent = (s.num_layers, rows, s.num_heads, s.k_dim, s.v_dim)
        self.recurrent = torch.zeros(recurrent, dtype=torch.float32, device=self.device)

    def free(self) -> None:
        self.conv = self.recurrent = None

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` into slots ``dst`` (index tensors) in every layer (samples of one prompt)."""
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]

    @staticmethod
    def bytes_per_slot(spec: StateSpec, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        conv = spec.conv_channels * spec.conv_history * elem
        return spec.num_layers * (conv + spec.num_heads * spec.k_dim * spec.v_dim * 4)
