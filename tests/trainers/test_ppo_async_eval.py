"""Evaluation during ``--async_train`` (``--eval_dataset`` / ``--eval_steps``) and the best checkpoint by an eval
metric (``--best_metric_key``): the evaluation logs at its steps with the weights of that step and trains
nothing differently (same seeds: bit-equal losses); the best checkpoint survives ``--max_ckpt_num`` rotation
and a resumed run keeps comparing against the best value its checkpoint recorded."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tidal.checkpoint.resumable import damage
from tidal.cli.train_ppo import parse_run
from tidal.placement.rollout import LocalRollout
from tidal.trainers.ppo import run_ppo
from tidal.trainers.ppo.trainer import PPOTrainer

# Training prompts score the parity of the response's length; each evaluation call (its prompt's label is
# "eval") scores its 2 samples by the next row of EVAL_SCORES, counted in a file that outlives a crash.
EVAL_SCORES = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]  # pass@1 0.5, 1.0 (the best), 0.0, 0.5
REWARD = textwrap.dedent(
    """
    import json, os, torch

    def reward_func(queries, prompts, labels, **kwargs):
        if labels[0] != "eval":
            scores = [float(len(q) % 2) for q in queries]
        else:
            counter = os.path.join(os.path.dirname(__file__), "eval_calls")
            calls = int(open(counter).read()) if os.path.exists(counter) else 0
            open(counter, "w").write(str(calls + 1))
            scores = {table}[calls]
        return {{"rewards": torch.tensor(scores), "scores": torch.tensor(scores)}}
    """
).format(table=EVAL_SCORES)


def task(tmp_path: Path, prompts: int) -> list[str]:
    data, evals, reward = tmp_path / "prompts.jsonl", tmp_path / "eval.jsonl", tmp_path / "reward.py"
    data.write_text("".join(json.dumps({"prompt": f"{i}>", "label": str(i)}) + "\n" for i in range(prompts)))
    evals.write_text(json.dumps({"prompt": "9>", "label": "eval"}) + "\n")
    reward.write_text(REWARD)
    return [
        "--prompt_data", str(data), "--input_key", "prompt", "--label_key", "label", "--remote_rm_url",
        str(reward), "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--generate_max_len",
        "2", "--prompt_max_len", "8", "--init_kl_coef", "0", "--seed", "3", "--eval_n_samples_per_prompt", "2",
    ]  # fmt: skip


def with_eval(tmp_path: Path, steps: int) -> list[str]:
    return ["--eval_dataset", str(tmp_path / "eval.jsonl"), "--eval_steps", str(steps)]


def out_flags(out: Path) -> list[str]:
    return ["--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt")]


def eval_rows(out: Path) -> dict[int, dict]:
    rows = map(json.loads, (out / "final/run/metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in rows if "eval/pass@1" in r}


def training(history: list[dict]) -> list[dict]:
    """Each step's logged statistics, less wall times."""
    return [{k: v for k, v in h.items() if not k.startswith("time/")} for h in history]


def test_async_evaluation_logs_at_its_steps_and_trains_bit_equal(tiny_qwen2, tmp_path, monkeypatch):
    # Over-sampling (one generation call of 4 prompts feeds 2 steps) with --max_staleness 1: the second call
    # starts once step 2 is synced, so each batch's weights are fixed and the run is deterministic, while its
    # second batch still trains 1 step after its weights (real async). 8 prompts, 4 steps.
    base = [f"--pretrain={tiny_qwen2}", *task(tmp_path, 8), "--rollout_batch_size", "2",
            "--vllm_generate_batch_size", "4", "--async_train", "--async_queue_size", "2", "--max_staleness",
            "1", "--train_batch_size", "4", "--micro_train_batch_size", "4"]  # fmt: skip
    plain = run_ppo(parse_run([*base, *out_flags(tmp_path / "plain")]))

    syncs, evals_at = [], []  # weight syncs so far when each evaluation generated
    sync, trajectories = LocalRollout.sync_weights, LocalRollout.trajectories

    def counting_sync(self, policy):
        syncs.append(1)
        return sync(self, policy)

    def recording(self, prompts, params, first_index):
        if prompts[0].label == "eval":
            evals_at.append(len(syncs))
        return trajectories(self, prompts, params, first_index)

    monkeypatch.setattr(LocalRollout, "sync_weights", counting_sync)
    monkeypatch.setattr(LocalRollout, "trajectories", recording)
    out = tmp_path / "evaluated"
    evaluated = run_ppo(parse_run([*base, *with_eval(tmp_path, 2), *out_flags(out)]))

    assert [h["async/staleness_max"] for h in plain] == [0, 1, 0, 1]
    assert training(evaluated) == training(plain)  # the same losses, rewards, KL..., bit for bit
    assert sorted(eval_rows(out)) == [2, 4] and evals_at == [2, 4]  # after step N's sync, before N + 1's
    # the default --best_metric_key (pass@1: 0.5 then 1.0) kept step 4's, beside no rolling checkpoint
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["best_global_step_4"]


def test_best_checkpoint_survives_rotation_and_resume_keeps_its_value(tiny_qwen2, tmp_path, crash_after):
    flags = [f"--pretrain={tiny_qwen2}", *task(tmp_path, 4), *with_eval(tmp_path, 1), *out_flags(tmp_path),
             "--rollout_batch_size", "1", "--train_batch_size", "2", "--micro_train_batch_size", "2",
             "--save_steps", "1", "--max_ckpt_num", "1", "--best_metric_key", "eval_default_pass1"]  # fmt: skip
    restore = crash_after(PPOTrainer, "train_step", 3)
    with pytest.raises(KeyboardInterrupt):
        run_ppo(parse_run(flags))
    ckpt = tmp_path / "ckpt"
    # pass@1 0.5 (step 1), 1.0 (step 2: the best, step 1's removed), 0.0 (step 3); one rolling checkpoint
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["best_global_step_2", "global_step_3"]
    assert damage(ckpt / "best_global_step_2") is None  # a whole resumable checkpoint
    assert (ckpt / "latest").read_text() == "global_step_3"

    restore()
    run_ppo(parse_run([*flags, "--load_checkpoint"]))
    # step 4's pass@1 0.5 is below the restored 1.0 (a run that forgot it would keep step 4's)
    assert eval_rows(tmp_path)[4]["eval/pass@1"] == 0.5
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["best_global_step_2", "global_step_4"]
