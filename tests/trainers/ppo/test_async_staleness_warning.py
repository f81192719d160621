"""``--async_train`` without an importance-sampling correction is warned about at start, in one line naming
the flags that correct it (bench/async_learning.py: plain async learned worse than synchronous on the
addition task, async with TIS as well); a correction, or a loss whose ratio is taken against the engine's
log-probs (GSPO), silences it."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from tidal.cli.train_ppo import parse_run
from tidal.trainers.ppo.entry import uncorrected_staleness

BASE = ["--pretrain", "unused", "--prompt_data", "unused.jsonl", "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "2", "--rollout_batch_size", "2", "--train_batch_size", "4"]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "warned"),
    [
        ([], False),
        (["--async_train"], True),
        (["--async_train", "--enable_vllm_is_correction"], False),
        (["--async_train", "--enable_vllm_is_correction", "--use_icepop"], False),
        (["--async_train", "--policy_loss_type", "gspo"], False),
    ],
)
def test_async_training_without_a_correction_is_warned_about(flags, warned):
    warning = uncorrected_staleness(parse_run([*BASE, *flags]))
    assert (warning is not None) == warned
    if warned:
        assert "--enable_vllm_is_correction" in warning and "--use_icepop" in warning and "\n" not in warning


class _Stop(Exception):
    """Raised where the run would build its models: the warning comes before."""


def test_an_async_run_logs_the_warning_before_it_builds_anything(tiny_qwen2, tmp_path, monkeypatch, caplog):
    from tidal.trainers.ppo import entry

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{i}>"}}\n' for i in range(4)))
    run = parse_run([*BASE, "--async_train", "--input_key", "prompt", "--save_path", str(tmp_path / "out")])
    run = dataclasses.replace(
        run, actor=dataclasses.replace(run.actor, pretrain=str(tiny_qwen2)),
        data=dataclasses.replace(run.data, prompt_data=str(prompts)),
    )  # fmt: skip

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(entry, "build_parts", stop)
    with caplog.at_level(logging.WARNING), pytest.raises(_Stop):
        entry.train(run, entry.init_world())
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        uncorrected_staleness(run)
    ]
