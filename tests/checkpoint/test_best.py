"""``--best_metric_key``: OpenRLHF's metric names mapped to tidal's, the one-line refusals, and which
evaluations replace the best checkpoint (a stand-in checkpointer records the folders it is asked to write;
the real writes are tests/trainers/test_ppo_async_eval.py's)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tidal.checkpoint.best import BestCheckpoint
from tidal.checkpoint.resumable import LoopState
from tidal.config import CheckpointConfig, ConfigError
from tidal.config.checkpoint import best_key_problems, best_metric_name
from tidal.distributed.world import World


@pytest.mark.parametrize(
    ("key", "metric"),
    [("", "pass@1"), ("none", None), ("NONE", None), ("eval_default_pass1", "pass@1"),
     ("eval_math_pass8", "pass@8"), ("eval/score", "score"), ("reward", "reward")],
)  # fmt: skip
def test_metric_names(key, metric):
    assert best_metric_name(key) == metric


def test_a_named_metric_needs_an_evaluation_and_something_to_save():
    assert best_key_problems("", False, False, False) == []  # OpenRLHF's auto-detection: nothing to find
    assert best_key_problems("none", False, False, False) == []
    assert "add --eval_dataset" in best_key_problems("pass@1", False, False, False)[0]
    assert "leaves nothing to keep" in best_key_problems("pass@1", True, True, False)[0]
    assert best_key_problems("pass@1", True, True, True) == []  # the HF copy alone is kept


class Writer:
    """The part of ``Checkpointer`` ``BestCheckpoint`` uses: each save makes the folder and its meta.json."""

    def __init__(self, root: Path, lineage: str = "run"):
        self.cfg = CheckpointConfig(ckpt_path=str(root))
        self.world, self.hf_copy, self.runs = World(), None, SimpleNamespace(lineage=lineage)

    def save(self, loop: LoopState, name: str) -> Path:
        folder = Path(self.cfg.ckpt_path) / name
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text(json.dumps({"lineage": self.runs.lineage}))
        return folder


def folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_only_a_higher_value_replaces_the_best(tmp_path):
    foreign = tmp_path / "best_global_step_1"  # another run's best in the same folder is left alone
    Writer(tmp_path, lineage="other").save(LoopState(1), foreign.name)
    best = BestCheckpoint("eval/pass@1", Writer(tmp_path))
    for step, value in [(2, 0.25), (3, 0.5), (4, 0.5), (5, float("nan")), (6, 0.1)]:
        best.update({"pass@1": value, "score": 1.0}, LoopState(step))
    assert folders(tmp_path) == ["best_global_step_1", "best_global_step_3"]
    assert best.state_dict() == {"metric": "pass@1", "value": 0.5, "step": 3, "folder": "best_global_step_3"}


def test_resume_keeps_the_best_of_the_same_metric_only(tmp_path):
    saved = {"metric": "pass@1", "value": 0.75, "step": 2, "folder": "best_global_step_2"}
    same = BestCheckpoint("", Writer(tmp_path))
    same.load_state_dict(saved)
    assert same.update({"pass@1": 0.5}, LoopState(3)) is None
    other = BestCheckpoint("score", Writer(tmp_path))
    other.load_state_dict(saved)  # a value of pass@1 says nothing about score
    assert other.update({"score": 0.1}, LoopState(3)) is not None


def test_an_unknown_metric_is_one_line_naming_what_the_evaluation_logs(tmp_path):
    best = BestCheckpoint("eval/accuracy", Writer(tmp_path))
    with pytest.raises(
        ConfigError, match=r"^--best_metric_key eval/accuracy: .*no eval/accuracy .*eval/pass@1"
    ):
        best.update({"pass@1": 1.0, "score": 1.0}, LoopState(1))
