"""SIGTERM / SIGINT during training: the step finishes, a checkpoint is written, the command exits
with one line and 143 / 130, and ``--load_checkpoint`` continues exactly (SFT in a subprocess; the
RL loop in-process); a second signal exits at once."""

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

from tidal.checkpoint import StopSignals, TrainingInterrupted
from tidal.checkpoint.interrupt import active
from tidal.cli.train_ppo import parse_run as parse_ppo
from tidal.cli.train_sft import parse_run
from tidal.distributed.world import World
from tidal.testing import AdditionTask
from tidal.trainers.ppo import run_ppo
from tidal.trainers.ppo import trainer as trainer_module
from tidal.trainers.sft import run_sft

# Runs ``python -m tidal.cli.train_sft ARGS``; step 2 waits until a stop signal has arrived, so the
# signal always lands mid-run however slow the machine is (no timing assumptions).
CHILD = textwrap.dedent(
    """
    import runpy, sys, time
    from tidal.checkpoint import interrupt
    from tidal.trainers import loop

    original = loop.SupervisedTrainer.train_step
    calls = [0]

    def held_step(self, samples):
        calls[0] += 1
        while calls[0] == 2 and interrupt.active().received is None:
            time.sleep(0.01)
        return original(self, samples)

    loop.SupervisedTrainer.train_step = held_step
    sys.argv = ["tidal.cli.train_sft", *sys.argv[1:]]
    runpy.run_module("tidal.cli.train_sft", run_name="__main__")
    """
)


def flags(model, data, out, *extra) -> list[str]:
    return [
        "--pretrain", str(model), "--dataset", str(data), "--input_key", "prompt", "--output_key", "answer",
        "--max_len", "48", "--train_batch_size", "4", "--micro_train_batch_size", "4", "--learning_rate", "3e-3",
        "--lr_warmup_ratio", "0", "--max_samples", "16", "--max_epochs", "1", "--seed", "3", "--logging_steps", "1",
        "--save_steps", "100", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


def logged_steps(metrics) -> list[int]:
    if not metrics.exists():
        return []
    return [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "train/loss" in r]


def test_sigterm_finishes_the_step_saves_and_resumes_exactly(tiny_qwen2, tmp_path):
    data = AdditionTask(digits=2, seed=2).write_jsonl(tmp_path / "train.jsonl", 16)
    full = run_sft(parse_run(flags(tiny_qwen2, data, tmp_path / "full")))
    assert len(full) == 4

    out = tmp_path / "cut"
    child = subprocess.Popen([sys.executable, "-c", CHILD, *flags(tiny_qwen2, data, out)], stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        metrics = out / "final" / "run" / "metrics.jsonl"
        while 1 not in logged_steps(metrics) and child.poll() is None:
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=300)
    finally:
        child.kill()
    lines = [x for x in err.splitlines() if "stopped by" in x]
    assert child.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    assert lines == [f"python -m tidal.cli.train_sft: stopped by SIGTERM after step 2: checkpoint "
                     f"{out / 'ckpt' / 'global_step_2'} saved; resume with --load_checkpoint"]  # fmt: skip
    assert (out / "ckpt" / "latest").read_text() == "global_step_2"
    assert json.loads((out / "ckpt" / "global_step_2" / "meta.json").read_text())["trainer"] == "sft"
    assert not list((out / "ckpt").glob(".tmp_*")) and not (out / "final" / "model.safetensors").exists()

    resumed = run_sft(parse_run(flags(tiny_qwen2, data, out, "--load_checkpoint")))
    assert [h["step"] for h in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6) and b["lr"] == pytest.approx(a["lr"], rel=1e-9)


def test_stop_request_is_recorded_and_maps_to_shell_exit_codes():
    previous = signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        assert active() is stop and stop.requested(World()) is None
        os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt without the handler
        assert stop.requested(World()) == signal.SIGINT
    assert active() is None and signal.getsignal(signal.SIGINT) is previous
    assert StopSignals.interrupted(signal.SIGINT, 7, None).exit_code == 130
    stopped = StopSignals.interrupted(signal.SIGTERM, 7, "ck/global_step_7")
    assert stopped.exit_code == 143 and str(stopped).startswith("stopped by SIGTERM after step 7")


def test_a_second_signal_exits_at_once():
    script = textwrap.dedent(
        """
        import os, signal, time
        from tidal.checkpoint import StopSignals, TrainingInterrupted
        with StopSignals():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130
    assert "second SIGINT: exiting now without saving" in proc.stderr and "Traceback" not in proc.stderr


def test_ppo_finishes_the_rollout_step_and_saves_on_sigterm(tiny_qwen2, tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{i % 10}>", "label": str(i % 10)}) + "\n" for i in range(16))
    )
    reward = Path(__file__).resolve().parents[2] / "examples" / "reward_func.py"
    original = trainer_module.PPOTrainer.after_step

    def signalled_after_step(self, loop, *args):
        original(self, loop, *args)
        if loop.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives between steps, as from a scheduler

    monkeypatch.setattr(trainer_module.PPOTrainer, "after_step", signalled_after_step)
    run = parse_ppo([
        "--pretrain", str(tiny_qwen2), "--prompt_data", str(prompts), "--input_key", "prompt", "--label_key", "label",
        "--remote_rm_url", str(reward), "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
        "--train_batch_size", "8", "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "8",
        "--generate_max_len", "2", "--prompt_max_len", "8", "--init_kl_coef", "0", "--save_steps", "100",
        "--advantage_estimator", "group_norm", "--save_path", str(tmp_path / "final"),
        "--ckpt_path", str(tmp_path / "ckpt"),
    ])  # fmt: skip
    with pytest.raises(TrainingInterrupted) as stopped:
        run_ppo(run)
    assert stopped.value.exit_code == 143 and "stopped by SIGTERM after step 1" in str(stopped.value)
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step_1"
    assert json.loads((tmp_path / "ckpt" / "global_step_1" / "meta.json").read_text())["trainer"] == "ppo"
    assert not (tmp_path / "final" / "model.safetensors").exists()
