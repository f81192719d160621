"""RL evaluation: the unbiased pass@k estimator against hand values, and a PPO run that logs
eval/pass@1 and eval/pass@k computed from the evaluation samples' scores, grouped by prompt."""

from __future__ import annotations

import json

import pytest

from tidal.inference.evaluation import pass_at_k, pass_at_k_stats, pass_counts


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (4, 3, 2, 1.0),  # only one failing sample: every pair holds a pass
        (4, 0, 4, 0.0),
        (4, 1, 4, 1.0),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_arguments():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match="whole groups"):
        pass_counts([1.0, 0.0, 1.0], 2, 1.0)


def test_stats_group_prompt_major_scores_and_use_the_threshold():
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.2, 0.0]  # prompt A: 1 of 4 pass, prompt B: 2 of 4
    assert pass_counts(scores, 4, 1.0) == [1, 2]
    stats = pass_at_k_stats(scores, 4)
    assert stats == pytest.approx({"pass@1": (0.25 + 0.5) / 2, "pass@4": 1.0})
    assert pass_at_k_stats(scores, 4, threshold=0.1)["pass@1"] == pytest.approx((0.25 + 0.75) / 2)
    assert pass_at_k_stats([0.0, 1.0], 1) == {"pass@1": 0.5}  # k = 1: one key


REWARD = """
import json, zlib
import torch

def reward_func(queries, prompts, labels):
    # deterministic 0/1 scores from the response text; every call is recorded for the test
    scores = [float(zlib.crc32(q[len(p):].encode()) % 2) for q, p in zip(queries, prompts)]
    with open({log!r}, "a") as f:
        f.write(json.dumps(scores) + "\\n")
    return {{"rewards": torch.tensor(scores), "scores": torch.tensor(scores)}}
"""


def test_ppo_evaluation_logs_pass_at_k(tiny_qwen2, tmp_path):
    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo import run_ppo

    calls = tmp_path / "calls.jsonl"
    (tmp_path / "reward.py").write_text(REWARD.format(log=str(calls)))
    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(4):
            f.write(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n")
    out = tmp_path / "out"
    run_ppo(parse_run([
        "--pretrain", str(tiny_qwen2), "--prompt_data", str(tmp_path / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(tmp_path / "reward.py"),
        "--eval_dataset", str(tmp_path / "prompts.jsonl"), "--eval_steps", "1", "--eval_n_samples_per_prompt", "3",
        "--eval_temperature", "1.0", "--advantage_estimator", "rloo", "--n_samples_per_prompt", "2",
        "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "8",
        "--generate_max_len", "4", "--prompt_max_len", "8", "--init_kl_coef", "0", "--seed", "5",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
    ]))  # fmt: skip
    metrics = [json.loads(line) for line in (out / "final/run/metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/pass@1" in m]
    assert len(evals) == 1
    # the evaluation call is the one with 4 prompts x 3 samples (training calls score 4 x 2)
    eval_scores = [s for s in map(json.loads, calls.read_text().splitlines()) if len(s) == 12]
    assert len(eval_scores) == 1
    expected = pass_at_k_stats(eval_scores[0], 3)
    assert evals[0]["eval/pass@1"] == pytest.approx(expected["pass@1"])
    assert evals[0]["eval/pass@3"] == pytest.approx(expected["pass@3"])
    assert evals[0]["eval/pass@1"] == pytest.approx(evals[0]["eval/score"])  # 0/1 scores, threshold 1
