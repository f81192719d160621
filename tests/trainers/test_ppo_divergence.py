"""PPO stops on a model that overflowed inside, as SFT and DPO do: an absurd ``--actor_learning_rate``
leaves finite weights whose gradient is exactly 0 while the loss still sends gradient into the
log-probs (the advantages are not 0). PPO's loss is near 0 by design, so the guard's loss rule alone
missed it and the run saved a garbage model with exit status 0 (issue #30 §4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.cli.train_ppo import main as ppo_main
from tidal.trainers.optim import NonFiniteGuard, bad_step

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_zero_gradient_with_gradient_into_the_outputs_is_an_overflow():
    assert bad_step(0.0, 0.0, scaled=False) is None  # loss 0, nothing measured: nothing to say
    assert "overflowed" in bad_step(0.0, 0.0, scaled=False, into_outputs=0.04)  # PPO's centred loss
    assert bad_step(0.0, 0.3, scaled=False, into_outputs=0.04) is None  # a real gradient
    guard = NonFiniteGuard(limit=3)
    guard.observe_loss(0.0, into_outputs=0.04)
    assert not guard.allow(guard.take_loss(), 0.0) and guard.in_a_row == 1
    guard.observe_loss(0.0, flat=True, into_outputs=0.0)  # e.g. every reward 0: no evidence either way
    assert guard.allow(guard.take_loss(), 0.0) and guard.in_a_row == 1  # applied, count kept


def test_absurd_learning_rate_stops_the_run(tiny_qwen2, tmp_path, capsys):
    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"{i % 10}>", "label": str(i % 10)}) + "\n")
    with pytest.raises(SystemExit) as exc:
        ppo_main([
            "--pretrain", str(tiny_qwen2), "--prompt_data", str(tmp_path / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--remote_rm_url", str(EXAMPLES / "reward_func.py"), "--advantage_estimator",
            "group_norm", "--n_samples_per_prompt", "8", "--rollout_batch_size", "8", "--train_batch_size", "64",
            "--micro_train_batch_size", "64", "--micro_rollout_batch_size", "64", "--generate_max_len", "4",
            "--prompt_max_len", "8", "--actor_learning_rate", "1e3", "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
            "--max_nonfinite_steps", "2", "--save_path", str(tmp_path / "final"), "--seed", "3",
        ])  # fmt: skip
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "2 optimizer steps in a row had a zero gradient although the loss sends gradient" in err
    assert not (tmp_path / "final" / "model.safetensors").exists()
