"""MetricsLogger: exact JSONL records, resume truncation, TensorBoard events, non-main ranks."""

import json

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tidal.logging import LoggingConfig, MetricsLogger


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_time(recs):
    return [{k: v for k, v in r.items() if k != "time"} for r in recs]


def test_jsonl_records_are_exact(tmp_path):
    with MetricsLogger(tmp_path, LoggingConfig()) as logger:
        logger.log(1, {"loss": torch.tensor(0.5), "lr": 1e-5, "tokens": np.int64(7)})
        logger.log(2, {"acc": np.float32(0.25), "ok": True}, prefix="eval")
        logger.log(3, {"raw": 3}, prefix="")
    recs = records(tmp_path / "metrics.jsonl")
    assert without_time(recs) == [
        {"step": 1, "train/loss": 0.5, "train/lr": 1e-5, "train/tokens": 7},
        {"step": 2, "eval/acc": 0.25, "eval/ok": 1},
        {"step": 3, "raw": 3},
    ]
    assert all(isinstance(r["time"], float) for r in recs)
    assert isinstance(recs[0]["train/tokens"], int)


def test_non_scalar_metric_fails_clearly(tmp_path):
    with MetricsLogger(tmp_path, LoggingConfig()) as logger, pytest.raises(TypeError, match="'loss'"):
        logger.log(1, {"loss": torch.ones(3)})


def test_resume_appends_and_drops_later_steps(tmp_path):
    with MetricsLogger(tmp_path, LoggingConfig()) as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train/lo')  # torn line from a crash mid-write
    with MetricsLogger(tmp_path, LoggingConfig(), resume_step=3) as logger:
        logger.log(4, {"loss": 40.0})
    assert [(r["step"], r["train/loss"]) for r in records(tmp_path / "metrics.jsonl")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]


def test_truncate_after_counts_dropped(tmp_path):
    with MetricsLogger(tmp_path, LoggingConfig()) as logger:
        for step in range(4):
            logger.log(step, {"x": step})
        assert logger.truncate_after(1) == 2
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl")] == [0, 1]


def test_fresh_run_replaces_old_metrics(tmp_path):
    for value in (1.0, 2.0):
        with MetricsLogger(tmp_path, LoggingConfig()) as logger:
            logger.log(1, {"loss": value})
    assert [r["train/loss"] for r in records(tmp_path / "metrics.jsonl")] == [2.0]


def scalars(tb_dir):
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("train/loss")]


def test_tensorboard_scalars_read_back(tmp_path):
    cfg = LoggingConfig(use_tensorboard=str(tmp_path / "tb"), wandb_run_name="run1")
    with MetricsLogger(tmp_path / "run", cfg) as logger:
        for step in range(1, 4):
            logger.log(step, {"loss": torch.tensor(step / 4)})
    tb_dir = tmp_path / "tb" / "run1"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    assert scalars(tb_dir) == [(1, 0.25), (2, 0.5), (3, 0.75)]


def test_tensorboard_resume_purges_later_steps_and_reuses_run_name(tmp_path):
    cfg = LoggingConfig(use_tensorboard=str(tmp_path / "tb"))
    with MetricsLogger(tmp_path / "run", cfg) as logger:
        name = logger.run_name
        for step in range(1, 5):
            logger.log(step, {"loss": float(step)})
    with MetricsLogger(tmp_path / "run", cfg, resume_step=2) as logger:
        assert logger.run_name == name
        logger.log(3, {"loss": 30.0})
    assert scalars(tmp_path / "tb" / name) == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_non_main_rank_writes_nothing(tmp_path):
    cfg = LoggingConfig(use_tensorboard=str(tmp_path / "tb"), use_wandb="offline")
    with MetricsLogger(tmp_path / "run", cfg, is_main=False) as logger:
        logger.log(1, {"loss": 1.0})
        assert logger.truncate_after(0) == 0
    assert list(tmp_path.iterdir()) == []
