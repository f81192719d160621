"""PPO-ptx (``--ptx_coef`` with ``--pretrain_data``): a next-token loss on pretraining text mixed into
the policy update, so RL does not erode what the model knew (InstructGPT, arXiv 2203.02155 §3.5).

As OpenRLHF did while it had the feature (v0.7; v0.9.2 keeps only the ``--ptx_coef`` flag): after
each policy micro-batch's backward, one micro-batch of ``--micro_train_batch_size`` pretraining
samples gets its own backward of ``ptx_coef · (token-mean NLL + aux_loss_coef · MoE aux loss)``
before the optimizer step. tidal weighs each by ``1 / micro-batches of the step``, so the step's
gradient is that of ``policy loss + ptx_coef · mean ptx loss`` whatever the micro-batching (the
policy loss is already a step mean). The samples are SFT samples in pretrain mode
(``tidal.data.sft``: every token of the ``--input_key`` text is trained), collated as SFT batches.

``PtxStream`` hands out the micro-batches: a fixed shuffle per pass over the samples, rank ``r`` of
``w`` taking every ``w``-th micro-batch, and its position saved in the checkpoint so a resumed run
continues with the same text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tidal.data import SFTSample
from tidal.models.precision import Precision
from tidal.trainers.loop import to_device
from tidal.trainers.sft import SFTObjective


@dataclass
class PtxStream:
    """Endless micro-batches of pretraining samples for one rank (see the module docstring)."""

    samples: list[SFTSample]
    micro_size: int
    seed: int
    rank: int = 0
    world_size: int = 1
    position: int = 0  # micro-batches this rank has taken
    _orders: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("the ptx stream needs at least one pretraining sample")

    def _index(self, i: int) -> int:
        """The sample at position ``i`` of the endless stream (pass ``i // n``, shuffled per pass)."""
        n = len(self.samples)
        epoch = i // n
        if epoch not in self._orders:
            self._orders = {
                epoch: torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
            }
        return self._orders[epoch][i % n]

    def next(self) -> list[SFTSample]:
        start = (self.position * self.world_size + self.rank) * self.micro_size
        self.position += 1
        return [self.samples[self._index(start + j)] for j in range(self.micro_size)]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int((state or {}).get("position", 0))


@dataclass
class PtxLoss:
    """``ptx_coef · next-token loss`` of the next pretraining micro-batch, as one policy micro-batch's
    share of the step (``micro_batches`` of them)."""

    coef: float
    stream: PtxStream
    objective: SFTObjective  # token-mean NLL over the micro-batch (+ MoE aux loss), no temperature
    precision: Precision
    device: torch.device

    def __call__(self, model: nn.Module, micro_batches: int) -> tuple[Tensor, dict[str, Tensor]]:
        samples = self.stream.next()
        batch = to_device(self.objective.collate(samples), self.device)
        trained = sum(self.objective.weight(s) for s in samples)
        loss, metrics = self.objective.loss(model, batch, max(trained, 1.0), self.precision)
        return self.coef * loss / micro_batches, {"policy/ptx_loss": metrics["loss"] / micro_batches}
