"""``tidal ppo`` with ``--dynamic_filtering`` (the batch refilled to ``--rollout_batch_size`` groups, as
OpenRLHF) and over-sampling (``--vllm_generate_batch_size`` > ``--rollout_batch_size``: every prompt
of the episode trained exactly once). The steps' prompts are recorded from ``PPOTrainer.train_step``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from tidal.cli.train_ppo import parse_run
from tidal.trainers.ppo import run_ppo
from tidal.trainers.ppo.trainer import PPOTrainer

N = 4
SOLVED = {"0", "5"}  # prompts whose groups always score 1: dynamic filtering drops every one of them

# Score 1 for SOLVED prompts; else the parity of the response's length, so most groups are mixed.
REWARD = textwrap.dedent(
    f"""
    import torch

    def reward_func(queries, prompts, labels, **kwargs):
        scores = [1.0 if label in {sorted(SOLVED)!r} else float(len(q) % 2) for q, label in zip(queries, labels)]
        return {{"rewards": torch.tensor(scores), "scores": torch.tensor(scores)}}
    """
)


@pytest.fixture
def task(tmp_path) -> tuple[Path, Path]:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}>", "label": str(i)}) + "\n" for i in range(12)))
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return data, reward


def flags(model, task, out, *extra) -> list[str]:
    data, reward = task
    return [
        "--pretrain", str(model), "--prompt_data", str(data), "--input_key", "prompt", "--label_key", "label",
        "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm", "--n_samples_per_prompt", str(N),
        "--rollout_batch_size", "2", "--train_batch_size", "8", "--micro_train_batch_size", "8",
        "--micro_rollout_batch_size", "8", "--generate_max_len", "3", "--prompt_max_len", "8", "--init_kl_coef",
        "0", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), "--seed", "5", *extra,
    ]  # fmt: skip


@pytest.fixture
def steps(monkeypatch) -> list:
    """Each step's rollout batch, as ``train_step`` receives it."""
    seen = []
    original = PPOTrainer.train_step

    def recording(self, generated, step):
        seen.append(generated)
        return original(self, generated, step)

    monkeypatch.setattr(PPOTrainer, "train_step", recording)
    return seen


def test_dynamic_filtering_refills_every_batch(tiny_qwen2, task, tmp_path, steps):
    history = run_ppo(parse_run(flags(tiny_qwen2, task, tmp_path, "--dynamic_filtering")))
    assert len(history) == len(steps) >= 1
    trained = [label for s in steps for label in (p.label for p in s.job.prompts)]
    assert not SOLVED & set(trained) and len(set(trained)) == len(trained)
    for s, h in zip(steps, history, strict=True):
        assert len(s.exp) == 2 * N  # a full batch, not what was left after the filter
        means = s.exp.scores.view(-1, N).mean(-1)
        assert ((means > 0) & (means < 1)).all()
        assert h["dynamic_filter/filtered"] == h["dynamic_filter/refilled"]  # one new prompt per drop
    # all 12 prompts were drawn in the episode: trained, filtered, or left in an unfilled last batch
    filtered = sum(h["dynamic_filter/filtered"] for h in history)
    assert filtered >= 2 and len(trained) + filtered <= 12


def test_over_sampling_trains_every_prompt_once(tiny_qwen2, task, tmp_path, steps):
    history = run_ppo(parse_run(flags(tiny_qwen2, task, tmp_path, "--vllm_generate_batch_size", "6",
                                      "--async_train", "--async_queue_size", "2")))  # fmt: skip
    assert len(history) == 6
    assert sorted((p.label for s in steps for p in s.job.prompts), key=int) == [str(i) for i in range(12)]
    # two generation calls of six prompts: the buffered groups wait, so a batch's position says so
    assert [len(s.position.pending) for s in steps] == [4, 2, 0, 4, 2, 0]
    # the first call's three batches were all generated with the initial weights
    assert [h["async/staleness_max"] for h in history[:3]] == [0, 1, 2]


def test_partial_rollouts_train_with_async(tiny_qwen2, task, tmp_path, steps):
    history = run_ppo(parse_run(flags(tiny_qwen2, task, tmp_path, "--async_train", "--partial_rollout",
                                      "--async_queue_size", "2")))  # fmt: skip
    assert len(history) == 6 and all(0 <= h["async/stale_token_share"] <= 1 for h in history)
    assert sorted((p.label for s in steps for p in s.job.prompts), key=int) == [str(i) for i in range(12)]
    assert all(s.exp.weight_updates is not None for s in steps)


def test_max_staleness_bounds_the_over_sampled_groups(tiny_qwen2, task, tmp_path):
    history = run_ppo(parse_run(flags(tiny_qwen2, task, tmp_path, "--vllm_generate_batch_size", "4",
                                      "--async_train", "--async_queue_size", "3", "--max_staleness", "1")))  # fmt: skip
    assert len(history) == 6 and max(h["async/staleness_max"] for h in history) <= 1


@pytest.mark.parametrize(
    "extra",
    [
        ["--vllm_generate_batch_size", "6"],  # over-sampling needs --async_train, as in OpenRLHF
        ["--max_staleness", "1"],  # without --async_train
        ["--async_train", "--vllm_generate_batch_size", "6", "--max_staleness", "1"],  # a call spans 3 steps
        ["--partial_rollout_enable"],  # partial rollouts need --async_train
        [
            "--async_train",
            "--train.partial_rollout_enable",
            "--vllm_num_engines",
            "1",
        ],  # and the local engine
    ],
)
def test_sampling_flags_refused(tiny_qwen2, task, tmp_path, extra):
    from tidal.config.args import ConfigError

    with pytest.raises((ConfigError, SystemExit)):
        parse_run(flags(tiny_qwen2, task, tmp_path, *extra))


def test_dynamic_filtering_resumes_exactly(tiny_qwen2, task, tmp_path, steps, crash_after):
    """A resume goes on after the prompts the filter consumed, with the generation rounds' own seeds: the
    same batches, samples and scores as the run that was not interrupted."""
    common = ["--dynamic_filtering", "--save_steps", "1"]
    whole = run_ppo(parse_run(flags(tiny_qwen2, task, tmp_path / "whole", *common)))
    assert len(whole) >= 3 and whole[0]["dynamic_filter/filtered"] > 0  # rounds run ahead of steps
    whole_steps = [(s.prompt_ids, s.exp.sequences) for s in steps]
    restore = crash_after(PPOTrainer, "update", 1)
    with pytest.raises(KeyboardInterrupt):
        run_ppo(parse_run(flags(tiny_qwen2, task, tmp_path / "cut", *common)))
    restore()
    steps.clear()
    resumed = run_ppo(parse_run(flags(tiny_qwen2, task, tmp_path / "cut", *common, "--load_checkpoint")))
    assert [h["step"] for h in resumed] == [h["step"] for h in whole[1:]]
    for (ids, sequences), s in zip(whole_steps[1:], steps, strict=True):
        assert s.prompt_ids == ids and torch.equal(s.exp.sequences, sequences)
    for a, b in zip(whole[1:], resumed, strict=True):
        assert a["score"] == b["score"] and a["dynamic_filter/filtered"] == b["dynamic_filter/filtered"]
