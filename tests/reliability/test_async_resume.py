"""``kill -9`` of an ``--async_train`` run that over-samples, then ``--load_checkpoint``: every prompt of the
episode is trained exactly once, in the batches of an uninterrupted run. The checkpoint holds the
buffered (generated, untrained) groups and where the episode's prompts stood; the rollouts the
generation thread had made ahead of the kill are generated again (trainers/ppo/sampling.py). The kill
lands inside a step's training, or inside an evaluation (``--eval_steps``: holding the rollout turn the
generation thread waits for) before that step's checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tidal.cli.train_ppo import parse_run
from tidal.trainers.ppo import run_ppo
from tidal.trainers.ppo.trainer import PPOTrainer

HOLD_AT = 4  # the child trains steps 1-3 (a checkpoint after step 2), then holds in step 4 until killed

# ``python -m tidal.cli.train_ppo ARGS`` recording each trained step's prompts (fsynced) to $RECORD; at step
# HOLD_AT ($HOLD "train": before training it; "eval": in its evaluation, after the samples are made) it
# writes "hold" and waits, so the kill lands there on any machine (no timing assumptions).
CHILD = textwrap.dedent(
    f"""
    import json, os, runpy, sys, time
    from tidal.trainers.ppo.evaluation import RLEvaluation
    from tidal.trainers.ppo.trainer import PPOTrainer

    original, evaluate = PPOTrainer.train_step, RLEvaluation.evaluate

    def write(line):
        with open(os.environ["RECORD"], "a") as f:
            f.write(line + "\\n")
            f.flush()
            os.fsync(f.fileno())

    def hold():
        write("hold")
        while True:
            time.sleep(1)

    def recorded_step(self, generated, step):
        if step + 1 == {HOLD_AT} and os.environ["HOLD"] == "train":
            hold()
        stats = original(self, generated, step)
        write(json.dumps({{"step": step + 1, "prompts": [p.label for p in generated.job.prompts]}}))
        return stats

    def held_evaluation(self):
        make = self.make
        self.make = lambda job: (make(job), hold())  # holds the rollout turn, as a long evaluation would
        return evaluate(self)

    PPOTrainer.train_step = recorded_step
    RLEvaluation.evaluate = held_evaluation
    sys.argv = ["tidal.cli.train_ppo", *sys.argv[1:]]
    runpy.run_module("tidal.cli.train_ppo", run_name="__main__")
    """
)


def flags(model, tmp_path: Path, out: Path, *extra) -> list[str]:
    data = tmp_path / "prompts.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"prompt": f"{i}>", "label": str(i)}) + "\n" for i in range(12)))
    reward = Path(__file__).resolve().parents[2] / "examples" / "reward_func.py"
    return [
        "--pretrain", str(model), "--prompt_data", str(data), "--input_key", "prompt", "--label_key", "label",
        "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
        "--rollout_batch_size", "2", "--vllm_generate_batch_size", "6", "--async_train", "--async_queue_size",
        "2", "--train_batch_size", "4", "--micro_train_batch_size", "4", "--generate_max_len", "2",
        "--prompt_max_len", "8", "--init_kl_coef", "0", "--save_steps", "2", "--seed", "4",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


def recorded_in_process(monkeypatch, argv) -> dict[int, list[str]]:
    steps: dict[int, list[str]] = {}
    original = PPOTrainer.train_step

    def recording(self, generated, step):
        steps[step + 1] = [p.label for p in generated.job.prompts]
        return original(self, generated, step)

    monkeypatch.setattr(PPOTrainer, "train_step", recording)
    run_ppo(parse_run(argv))
    monkeypatch.setattr(PPOTrainer, "train_step", original)
    return steps


@pytest.fixture(scope="module")
def whole(tiny_qwen2, tmp_path_factory) -> tuple[Path, dict[int, list[str]]]:
    """The uninterrupted run (no evaluation: it trains the same, tests/trainers/test_ppo_async_eval.py): the
    folder of its data, and the prompts each step trained."""
    data = tmp_path_factory.mktemp("async_resume")
    with pytest.MonkeyPatch.context() as monkeypatch:
        steps = recorded_in_process(monkeypatch, flags(tiny_qwen2, data, data / "whole"))
    assert len(steps) == 6 and sorted(sum(steps.values(), []), key=int) == [str(i) for i in range(12)]
    return data, steps


@pytest.mark.parametrize("where", ["train", "eval"])
def test_kill_9_in_async_training_then_resume_trains_every_prompt_once(tiny_qwen2, whole, tmp_path, monkeypatch,
                                                                       where):  # fmt: skip
    data, whole = whole
    # --eval_steps 4: the evaluation after step 4, before its checkpoint (--save_steps 2)
    evals = [
        "--eval_dataset",
        str(data / "prompts.jsonl"),
        "--eval_steps",
        "4",
        "--eval_n_samples_per_prompt",
        "1",
    ]
    evals = evals if where == "eval" else []
    out, record = tmp_path / "cut", tmp_path / "record.jsonl"
    env = {**os.environ, "RECORD": str(record), "HOLD": where, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, *flags(tiny_qwen2, data, out, *evals)],
                             stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        while child.poll() is None and not (record.exists() and "hold" in record.read_text()):
            time.sleep(0.05)
        assert child.poll() is None, child.stderr.read()[-3000:]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        child.kill()
        child.stderr.close()
    before = {r["step"]: r["prompts"] for r in map(json.loads, record.read_text().splitlines()[:-1])}
    # steps after the last checkpoint (step 3; with the evaluation held, 3 and 4) are trained again
    assert sorted(before) == ([1, 2, 3] if where == "train" else [1, 2, 3, 4])
    assert (out / "ckpt" / "latest").read_text() == "global_step_2"

    resumed = recorded_in_process(monkeypatch, flags(tiny_qwen2, data, out, *evals, "--load_checkpoint"))
    assert sorted(resumed) == [3, 4, 5, 6]
    trained = {1: before[1], 2: before[2], **resumed}
    assert trained == whole  # the same batches as the uninterrupted run: nothing repeated or skipped
