"""Resuming with another batch size or dataset size (issue #30 §4: it warned, then silently skipped the
rest of the epoch). The checkpoint records the dataset size and the samples of the epoch trained; the same
dataset with another ``--train_batch_size`` continues exactly after them, and a dataset of another size says
in one warning what happens to the epoch (tidal.trainers.data_position, docs/checkpoints.md)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tidal.checkpoint import LoopState
from tidal.cli.train_sft import parse_run
from tidal.data import epoch_permutation
from tidal.trainers import loop as loop_module
from tidal.trainers.data_position import DataPosition, epoch_batches, resume_offset
from tidal.trainers.sft import run_sft

SEED = 7


def test_same_data_other_batch_size_goes_on_after_the_trained_samples(caplog):
    with caplog.at_level(logging.WARNING):
        offset = resume_offset(DataPosition(32, 16, resumed=True), LoopState(2, 0, 2), 32, 4, saved_batch=8)
    assert offset == 16
    assert (
        "resuming epoch 0 after its first 16 of 32 samples with --train_batch_size 4 (the checkpoint's was 8)"
        in (caplog.text)
    )
    assert "4 more step(s) this epoch" in caplog.text
    order = epoch_permutation(32, SEED, 0)
    rest = epoch_batches(32, 4, SEED, 0, 1, 0, offset)
    assert [i for b in rest for i in b] == order[16:]  # nothing repeated, nothing skipped
    # two data-parallel ranks split each step as they would without the resume
    assert [
        a + b for a, b in zip(*(epoch_batches(32, 4, SEED, 0, 2, r, offset) for r in (0, 1)), strict=True)
    ] == rest


def test_older_checkpoint_counts_steps_of_its_own_batch_size(caplog):
    with caplog.at_level(logging.WARNING):
        assert resume_offset(DataPosition(), LoopState(2, 0, 2), 32, 4, saved_batch=8) == 16
    assert "after its first 16 of 32 samples" in caplog.text


def test_smaller_dataset_says_what_happens_to_the_epoch(caplog):
    with caplog.at_level(logging.WARNING):
        assert (
            resume_offset(DataPosition(32, 24, resumed=True), LoopState(3, 0, 3), 20, 8, saved_batch=8) == 20
        )
    assert (
        "the dataset has 20 samples now, 32 when the checkpoint was written, and epoch 0 had already trained 24: "
        "fewer than one --train_batch_size (8) is left, so the rest of epoch 0 is skipped and training goes on "
        "with epoch 1"
    ) in caplog.text
    assert epoch_batches(20, 8, SEED, 0, 1, 0, 20) == []
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert resume_offset(DataPosition(32, 8, resumed=True), LoopState(1, 0, 1), 24, 8, saved_batch=8) == 8
    assert (
        "epoch 0 is a new shuffle for this size" in caplog.text and "2 more step(s) this epoch" in caplog.text
    )


def test_sft_resumed_with_half_the_batch_size_trains_each_sample_once(tiny_qwen2, tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(32))
    )

    def flags(batch, *extra):
        return ["--pretrain", str(tiny_qwen2), "--dataset", str(data), "--input_key", "prompt", "--output_key",
                "answer", "--max_len", "64", "--train_batch_size", batch, "--micro_train_batch_size", "4",
                "--save_path", str(tmp_path / "final"), "--ckpt_path", str(tmp_path / "ckpt"), "--save_steps", "2", "--max_epochs", "1",
                "--seed", str(SEED), *extra]  # fmt: skip

    seen: list[int] = []
    crash = [True]
    original = loop_module.SupervisedTrainer.train_step

    def recording_step(self, samples):
        if (
            crash[0] and len(seen) >= 16
        ):  # a crash during step 3 (batch 8): the checkpoint of step 2 holds 16 samples
            raise KeyboardInterrupt
        seen.extend(s.row for s in samples)
        return original(self, samples)

    monkeypatch.setattr(loop_module.SupervisedTrainer, "train_step", recording_step)
    with pytest.raises(KeyboardInterrupt):
        run_sft(parse_run(flags("8")))
    crash[0] = False
    resumed = run_sft(parse_run(flags("4", "--load_checkpoint")))
    assert [h["step"] for h in resumed] == [3, 4, 5, 6]
    assert sorted(seen) == list(range(32))  # every sample of the epoch trained exactly once


def test_ppo_resumed_with_half_the_rollout_batch_trains_each_prompt_once(tiny_qwen2, tmp_path, monkeypatch):
    from tidal.cli.train_ppo import parse_run as parse_ppo
    from tidal.trainers.ppo import run_ppo
    from tidal.trainers.ppo.trainer import PPOTrainer

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}>", "label": str(i)}) + "\n" for i in range(16)))
    reward = Path(__file__).resolve().parents[2] / "examples" / "reward_func.py"

    def flags(batch, *extra):
        return ["--pretrain", str(tiny_qwen2), "--prompt_data", str(data), "--input_key", "prompt", "--label_key",
                "label", "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm",
                "--n_samples_per_prompt", "2", "--rollout_batch_size", batch, "--train_batch_size", "8",
                "--micro_train_batch_size", "8", "--generate_max_len", "2", "--prompt_max_len", "8",
                "--save_path", str(tmp_path / "final"), "--ckpt_path", str(tmp_path / "ckpt"), "--save_steps", "1",
                "--seed", str(SEED), *extra]  # fmt: skip

    seen: list[str] = []
    crash = [True]
    original = PPOTrainer.train_step

    def recording_step(self, generated, step):
        if (
            crash[0] and len(seen) >= 8
        ):  # a crash during rollout 2 (8 prompts): the checkpoint holds rollout 1
            raise KeyboardInterrupt
        seen.extend(p.label for p in generated.job.prompts)
        return original(self, generated, step)

    monkeypatch.setattr(PPOTrainer, "train_step", recording_step)
    with pytest.raises(KeyboardInterrupt):
        run_ppo(parse_ppo(flags("8")))
    crash[0] = False
    resumed = run_ppo(parse_ppo(flags("4", "--load_checkpoint")))
    assert [h["step"] for h in resumed] == [2, 3]
    assert sorted(seen, key=int) == [str(i) for i in range(16)]  # every prompt of the episode once
