"""``--async_train`` without an importance-sampling correction is warned about at start, in one line naming
the flags that correct it (bench/async_learning.py: plain async learned worse than synchronous on the
addition task, async with TIS as well); a correction, or a loss whose ratio is taken against the engine's
log-probs (GSPO), silences it."""

from __future__ import annotations

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
