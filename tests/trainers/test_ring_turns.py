"""Ring-attention turns when the ranks of a ring hold different numbers of micro-batches: every rank
runs every rank's micro-batches, so the gradient sync belongs on the ring's final turn, not on the
turn this rank's own count would make last. One SFT step over 2 gloo processes (rank counts 2 vs 1 and
1 vs 0) updates the model as one process does on all of the samples."""

from __future__ import annotations

from pathlib import Path

from tidal.models.ring_attention import turns
from tidal.testing import AdditionTask

WORKER = Path(__file__).with_name("ring_turns_worker.py")


def test_without_a_ring_every_item_is_a_turn_of_this_rank():
    schedule = turns(["a", "b", "c"], None)
    assert schedule.total == 3
    assert list(schedule) == [(True, "a"), (True, "b"), (True, "c")]


def test_uneven_ring_counts_update_like_one_process(tiny_llama, tmp_path, ranks):
    data = AdditionTask(digits=3, seed=4).write_jsonl(tmp_path / "sft.jsonl", 8)
    ranks.launch(WORKER, tiny_llama, data, tmp_path)
