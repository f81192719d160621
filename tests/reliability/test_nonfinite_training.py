"""Non-finite training: a step with a NaN/inf loss or gradient norm is skipped and counted
(``train/nonfinite_steps``), ``--max_nonfinite_steps`` in a row stop the run with one line, and
nothing non-finite is exported; a learning rate that blows the model up ends in that error."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tidal.cli.train_sft import main as sft_main
from tidal.cli.train_sft import parse_run
from tidal.distributed.world import World
from tidal.experience.experience import Experience
from tidal.models.precision import Precision
from tidal.testing import AdditionTask
from tidal.trainers import sft as sft_module
from tidal.trainers.optim import NonFiniteError, NonFiniteGuard
from tidal.trainers.optimization import Optimization
from tidal.trainers.ppo.update import StepShape, train_on_experience
from tidal.trainers.sft import run_sft

NAN = float("nan")


def test_guard_skips_counts_resets_and_stops_at_the_limit():
    guard = NonFiniteGuard(limit=3)
    assert guard.allow(1.0, 2.0)
    assert not guard.allow(NAN, 2.0) and not guard.allow(1.0, float("inf"))
    assert guard.allow(1.0, 2.0) and guard.in_a_row == 0 and guard.skipped == 2
    assert guard.allow(1.0, float("inf"), scaled=True)  # fp16: the grad scaler skips overflow steps itself
    assert not guard.allow(2.5, 0.0)  # zero gradient at a real loss: the model overflowed inside
    assert guard.allow(0.0, 0.0)  # nothing to learn is fine
    guard.allow(NAN, NAN)
    guard.allow(NAN, NAN)
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row had a non-finite loss \(nan\)"):
        guard.allow(NAN, NAN)


def _experience(n: int = 4, width: int = 5) -> Experience:
    attn = torch.ones(n, width, dtype=torch.long)
    action = attn.clone()
    action[:, :2] = 0
    zeros = torch.zeros(n, width)
    return Experience(
        torch.ones(n, width, dtype=torch.long), attn, action, zeros, torch.zeros(n), torch.zeros(n)
    )


def test_ppo_update_skips_nonfinite_steps_and_stops_at_the_limit():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    opt = Optimization(model, optimizer, scheduler, Precision.create("fp32", torch.device("cpu")), 1.0,
                       NonFiniteGuard(limit=3))  # fmt: skip
    scale = {"value": NAN}

    def loss_fn(m, mb, norm):
        loss = m.weight.sum() * scale["value"] + m.bias.sum()
        return loss, {"policy/loss": loss.detach()}

    shape = StepShape(step_size=2, micro_size=1)  # two optimizer steps per call
    before = [p.detach().clone() for p in model.parameters()]
    stats = train_on_experience(opt, _experience(), loss_fn, shape, World(), torch.Generator().manual_seed(0))
    assert opt.guard.skipped == 2 and all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )
    assert stats["grad_norm"] != stats["grad_norm"]  # NaN is reported, not hidden
    scale["value"] = 1.0
    train_on_experience(opt, _experience(), loss_fn, shape, World(), torch.Generator().manual_seed(0))
    assert opt.guard.in_a_row == 0 and not torch.equal(before[0], model.weight)
    scale["value"] = NAN
    with pytest.raises(NonFiniteError):
        for _ in range(2):
            train_on_experience(opt, _experience(), loss_fn, shape, World(), torch.Generator().manual_seed(0))
    assert opt.guard.skipped == 5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return AdditionTask(digits=2, seed=6).write_jsonl(tmp_path_factory.mktemp("nf") / "train.jsonl", 24)


def flags(model, data, out, *extra) -> list[str]:
    return [
        "--pretrain", str(model), "--dataset", str(data), "--input_key", "prompt", "--output_key", "answer",
        "--max_len", "48", "--train_batch_size", "4", "--micro_train_batch_size", "2", "--lr_warmup_ratio", "0",
        "--max_samples", "24", "--max_epochs", "1", "--logging_steps", "1", "--save_path", str(out / "final"),
        "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


def _nan_loss_on(monkeypatch, steps: set[int]) -> None:
    """SFT losses are NaN on the given optimizer steps (2 micro-batches per step)."""
    original = sft_module.SFTObjective.loss
    calls = {"n": 0}

    def loss(self, *args):
        calls["n"] += 1
        value, metrics = original(self, *args)
        return (value * NAN, metrics) if (calls["n"] + 1) // 2 in steps else (value, metrics)

    monkeypatch.setattr(sft_module.SFTObjective, "loss", loss)


def test_sft_skips_an_isolated_nan_step_and_logs_it(tiny_qwen2, data, tmp_path, monkeypatch):
    _nan_loss_on(monkeypatch, {2, 4})
    history = run_sft(parse_run(flags(tiny_qwen2, data, tmp_path, "--learning_rate", "1e-3")))
    assert [h["nonfinite_steps"] for h in history] == [0, 1, 1, 2, 2, 2]
    records = [json.loads(x) for x in (tmp_path / "final" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/nonfinite_steps"] for r in records if "train/nonfinite_steps" in r] == [0, 1, 1, 2, 2, 2]
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_sft_with_nan_every_step_stops_and_saves_nothing(tiny_qwen2, data, tmp_path, monkeypatch, capsys):
    _nan_loss_on(monkeypatch, set(range(1, 7)))
    with pytest.raises(SystemExit) as exc:
        sft_main(flags(tiny_qwen2, data, tmp_path, "--max_nonfinite_steps", "2"))
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "Traceback" not in err
    assert (
        "error: 2 optimizer steps in a row had a non-finite loss (nan): stopping (--max_nonfinite_steps 2)"
        in err
    )
    assert not (tmp_path / "final" / "model.safetensors").exists()


def test_sft_learning_rate_that_blows_up_the_model_ends_in_an_error(tiny_qwen2, data, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        sft_main(flags(tiny_qwen2, data, tmp_path, "--learning_rate", "1e3"))
    err = capsys.readouterr().err
    assert exc.value.code == 1, err[-2000:]
    assert "optimizer steps in a row had" in err and "--learning_rate" in err
    assert not (tmp_path / "final" / "model.safetensors").exists()
