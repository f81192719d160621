"""Where a supervised run is in its data, and where a resumed run continues when its batch size or dataset
changed since the checkpoint.

Each checkpoint records the dataset's size and how many samples of the current epoch were trained
(``DataPosition``, saved with the loop state). The order of an epoch depends only on (dataset size,
seed, epoch) (``tidal.data.batching``), so a resume continues after exactly those samples:

- same dataset, another ``--train_batch_size``: the same order goes on from the same sample in batches
  of the new size (exact: no sample is repeated or skipped; the epoch's last partial batch is left out
  as always);
- a dataset of another size: its epoch order is a new shuffle, so which samples the checkpoint had
  trained is unknown; the epoch goes on after as many samples as were trained (some may repeat, some be
  missed) and, when fewer than one batch is left, ends there and the next epoch starts.

Each case is said in one warning with the numbers. A checkpoint written before the position was recorded
counts its steps in the epoch times the checkpoint's ``--train_batch_size``. ``tidal ppo`` does the same with
its prompts, episodes and ``--rollout_batch_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.checkpoint import LoopState
from tidal.data import epoch_permutation, step_batches
from tidal.logging import get_logger

log = get_logger(__name__)


@dataclass
class DataPosition:
    """The dataset size and the samples of the current epoch trained so far (a checkpoint ``Stateful``)."""

    samples: int = 0
    offset: int = 0
    resumed: bool = False  # loaded from a checkpoint that recorded it

    def state_dict(self) -> dict:
        return {"samples": self.samples, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.resumed = "samples" in state
        self.samples, self.offset = int(state.get("samples", 0)), int(state.get("offset", 0))


def epoch_batches(
    n: int, batch: int, seed: int, epoch: int, world_size: int, rank: int, offset: int = 0
) -> list[list[int]]:
    """This rank's share of each optimizer step of ``epoch`` after its first ``offset`` samples."""
    if offset == 0:
        return step_batches(n, batch, seed, epoch, world_size, rank)
    order, share = epoch_permutation(n, seed, epoch), batch // world_size
    starts = range(offset, n - batch + 1, batch)
    return [order[s + rank * share : s + (rank + 1) * share] for s in starts]


def resume_offset(
    saved: DataPosition,
    loop: LoopState,
    n: int,
    batch: int,
    saved_batch: int | None,
    flag: str = "--train_batch_size",
) -> int:
    """Samples of ``loop.epoch`` a resumed run skips (``n`` once the epoch is over); warns, with the
    numbers, when the batch size (``flag``) or the dataset changed (see the module docstring)."""
    if saved.resumed:
        offset, before = saved.offset, saved.samples
    else:  # an older checkpoint: its steps in the epoch were of its own batch size
        offset, before = loop.step_in_epoch * (saved_batch or batch), n
    epoch = loop.epoch
    if before == n:
        if offset % batch or (saved_batch and saved_batch != batch):
            left = (n - offset) // batch
            log.warning(
                "resuming epoch %d after its first %d of %d samples with %s %d (the checkpoint's was %s): "
                "the same sample order goes on from there, %d more step(s) this epoch",
                epoch, offset, n, flag, batch, saved_batch or "another", left,
            )  # fmt: skip
        return offset
    if offset + batch > n:
        log.warning(
            "the dataset has %d samples now, %d when the checkpoint was written, and epoch %d had already "
            "trained %d: fewer than one %s (%d) is left, so the rest of epoch %d is skipped "
            "and training goes on with epoch %d",
            n, before, epoch, offset, flag, batch, epoch, epoch + 1,
        )  # fmt: skip
        return n
    log.warning(
        "the dataset has %d samples now, %d when the checkpoint was written: epoch %d is a new shuffle for "
        "this size, so going on after its first %d samples may repeat or miss some; %d more step(s) this epoch",
        n, before, epoch, offset, (n - offset) // batch,
    )  # fmt: skip
    return offset
