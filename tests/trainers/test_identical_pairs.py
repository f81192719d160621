"""Preference pairs whose chosen and rejected sides are identical hold no preference: DPO trained on
them sat at loss log 2 with a zero gradient, silently (issue #30 §4). All identical: refused with one
line; some: a warning naming how many and which rows."""

from __future__ import annotations

import json
import logging

import pytest

from tidal.cli.train_dpo import main as dpo_main
from tidal.config.sample_data import PairDataConfig
from tidal.models import load_tokenizer
from tidal.trainers.rm import load_pair_samples


def write_pairs(path, same: list[bool]):
    with path.open("w") as f:
        for i, identical in enumerate(same):
            rejected = f"answer {i}" if identical else f"not {i}"
            f.write(json.dumps({"prompt": f"q{i}", "chosen": f"answer {i}", "rejected": rejected}) + "\n")
    return path


def test_all_identical_pairs_are_refused(tiny_llama, tmp_path, capsys):
    data = write_pairs(tmp_path / "pairs.jsonl", [True] * 4)
    with pytest.raises(SystemExit) as exc:
        dpo_main(["--pretrain", str(tiny_llama), "--dataset", str(data), "--prompt_key", "prompt",
                  "--train_batch_size", "2", "--micro_train_batch_size", "2", "--save_path", str(tmp_path / "o")])  # fmt: skip
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{data}: chosen and rejected are identical in all 4 pairs (--chosen_key chosen" in err


def test_some_identical_pairs_are_counted(tiny_llama, tmp_path, caplog):
    data = write_pairs(tmp_path / "pairs.jsonl", [False, True, False, True])
    cfg = PairDataConfig(prompt_key="prompt")
    with caplog.at_level(logging.WARNING):
        samples = load_pair_samples(str(data), None, "train", None, load_tokenizer(str(tiny_llama)), cfg, 0)
    assert len(samples) == 4  # kept: the warning says they dilute the others
    assert "identical in 2 of 4 pairs (rows 1, 3)" in caplog.text
