"""Evaluation on 2 processes of eval sets with fewer samples than ranks, or shares of uneven micro-batch
counts, gives one process's metrics instead of hanging (FSDP2 forwards and metric reductions must line
up across ranks); KTO's KL reference point over a 1-sample eval set works on every rank. The checks run
in ``eval_share_worker.py`` over 2 ranks; the pure helpers are checked here."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.distributed import World
from tidal.testing import AdditionTask
from tidal.trainers.kto import mismatched
from tidal.trainers.loop import pad_turns, with_every_key

WORKER = Path(__file__).with_name("eval_share_worker.py")


def test_pad_turns_fills_uncounted_up_to_the_count():
    assert pad_turns(["a", "b"], 2, "x") == [(True, "a"), (True, "b")]
    assert pad_turns(["a"], 3, "x") == [(True, "a"), (False, "x"), (False, "x")]
    assert pad_turns([], 1, "x") == [(False, "x")]


def test_with_every_key_is_the_identity_on_one_process():
    assert with_every_key({"b": 1.0, "a": 2.0}, World()) == {"b": 1.0, "a": 2.0}


def test_a_one_sample_set_pairs_with_itself():
    class Sample:
        def __init__(self, name):
            self.name = name

        def with_response(self, other):
            return (self.name, other.name)

    assert mismatched([Sample("a")]) == [("a", "a")]
    assert mismatched([Sample(c) for c in "abc"]) == [("a", "b"), ("b", "a"), ("c", "b")]


def write_data(folder: Path) -> None:
    AdditionTask(digits=2, seed=4).write_jsonl(folder / "sft.jsonl", 6)
    with (folder / "pairs.jsonl").open("w") as p, (folder / "unpaired.jsonl").open("w") as u:
        for i, s in enumerate(AdditionTask(digits=2, seed=3).samples(6)):
            wrong = str(int(s["answer"]) + 1 + i)
            p.write(json.dumps({"prompt": s["prompt"], "chosen": s["answer"], "rejected": wrong}) + "\n")
            good = i % 2 == 0
            row = {"input": s["prompt"], "output": s["answer"] if good else wrong, "label": good}
            u.write(json.dumps(row) + "\n")


def test_small_and_uneven_eval_sets_on_two_processes_match_one(tiny_llama, perturbed_llama, tmp_path, ranks):
    reference = perturbed_llama
    write_data(tmp_path)
    ranks.launch(WORKER, tiny_llama, reference, tmp_path)
