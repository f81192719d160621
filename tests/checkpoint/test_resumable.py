"""Resumable checkpoints: rotation scoped to a run, a bad ``latest`` falls back to the newest intact
checkpoint, foreign checkpoints are refused, changed settings warn, ``--max_ckpt_num`` >= 1."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.checkpoint.parts import Part, make_part
from tidal.checkpoint import (
    CheckpointError,
    LoopState,
    RunCheckpoints,
    RunIdentity,
    latest_checkpoint,
    resumable,
)
from tidal.checkpoint.manager import model_fingerprint
from tidal.config import CheckpointConfig, ConfigError
from tidal.distributed.world import World

WORLD = World()


def save(path: Path, step: int, lineage: str, part: Part | None = None, keep: int = 3) -> Path:
    meta = {"trainer": "sft", "lineage": lineage}
    return resumable.save_checkpoint(
        path, {"model": part or make_part()}, LoopState(step), WORLD, keep, meta=meta
    )


def names(path: Path) -> list[str]:
    return sorted(
        (p.name for p in path.iterdir() if p.name.startswith("global_step_")), key=lambda n: int(n[12:])
    )


def test_rotation_never_deletes_a_new_runs_checkpoints_for_an_older_runs(tmp_path):
    for step in (80, 120, 160):
        save(tmp_path, step, "old")
    save(tmp_path, 2, "new")
    save(tmp_path, 4, "new")
    assert names(tmp_path) == [
        "global_step_2",
        "global_step_4",
        "global_step_80",
        "global_step_120",
        "global_step_160",
    ]
    assert latest_checkpoint(tmp_path) == tmp_path / "global_step_4"
    # keep=2 of this run: its oldest goes, the older run's stay, the one just written is kept
    save(tmp_path, 6, "new", keep=2)
    assert names(tmp_path) == [
        "global_step_4",
        "global_step_6",
        "global_step_80",
        "global_step_120",
        "global_step_160",
    ]
    save(tmp_path, 8, "new", keep=1)
    assert names(tmp_path) == ["global_step_8", "global_step_80", "global_step_120", "global_step_160"]


def test_max_ckpt_num_below_one_is_a_config_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match="--max_ckpt_num"):
        CheckpointConfig(max_ckpt_num=0)
    from tidal.cli.train_sft import main

    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--pretrain",
                str(tmp_path / "none"),
                "--dataset",
                str(tmp_path / "none.jsonl"),
                "--max_ckpt_num",
                "0",
            ]
        )
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--max_ckpt_num" in err and "Traceback" not in err


@pytest.fixture
def two_checkpoints(tmp_path):
    parts = [make_part(seed) for seed in (1, 2)]
    save(tmp_path, 2, "run", parts[0])
    save(tmp_path, 4, "run", parts[1])
    return tmp_path


def _damage_dcp_data(folder: Path) -> None:
    data = next((folder / "model_optim").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:10])


@pytest.mark.parametrize(
    "breakage",
    [
        lambda p: (p / "latest").write_text("global_step_99"),  # names a missing folder
        lambda p: (p / "latest").write_text(""),  # empty
        lambda p: (p / "latest").unlink(),  # missing
        lambda p: _damage_dcp_data(p / "global_step_4"),  # newest checkpoint truncated
        lambda p: (p / "global_step_4" / "model_optim" / ".metadata").unlink(),
        lambda p: (p / "global_step_4" / "trainer_state_rank0.pt").write_bytes(b"PK\x03\x04"),
        lambda p: (p / "global_step_4" / "meta.json").unlink(),
    ],
    ids=["dangling", "empty", "missing", "truncated-shards", "no-dcp-metadata", "truncated-state", "no-meta"],
)
def test_bad_latest_falls_back_to_newest_intact_checkpoint(two_checkpoints, breakage, caplog):
    breakage(two_checkpoints)
    intact_4 = resumable.damage(two_checkpoints / "global_step_4") is None
    with caplog.at_level(logging.WARNING):
        chosen = latest_checkpoint(two_checkpoints)
    assert chosen == two_checkpoints / ("global_step_4" if intact_4 else "global_step_2")
    assert "newest intact checkpoint" in caplog.text
    part = make_part(seed=9)
    resumable.load_checkpoint(chosen, {"model": part}, WORLD)
    expected = make_part(seed=2 if intact_4 else 1)
    torch.testing.assert_close(part.model.weight, expected.model.weight, rtol=0, atol=0)


def test_no_intact_checkpoint_refuses_instead_of_starting_over(two_checkpoints):
    for step in (2, 4):
        (two_checkpoints / f"global_step_{step}" / "model_optim" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        latest_checkpoint(two_checkpoints)


def _checkpoints(path: Path, identity: RunIdentity, load: bool = False) -> RunCheckpoints:
    cfg = CheckpointConfig(ckpt_path=str(path), save_steps=1, load_checkpoint=load)
    return RunCheckpoints(cfg, identity, WORLD)


def test_checkpoint_of_another_trainer_is_refused_naming_both(tmp_path):
    part = make_part()
    fp = {"model": model_fingerprint(part.model)}
    _checkpoints(tmp_path, RunIdentity("sft", fp)).save({"model": part}, LoopState(3))
    with pytest.raises(CheckpointError, match=r"written by `tidal sft` and this is `tidal dpo`"):
        _checkpoints(tmp_path, RunIdentity("dpo", fp), load=True).resume({"model": make_part()})


def test_checkpoint_for_another_architecture_or_lora_is_refused(tiny_llama, tmp_path):
    from tidal.config import ModelConfig
    from tidal.models import load_causal_lm

    def part(lora_rank: int, alpha: int = 16) -> Part:
        cfg = ModelConfig(pretrain=str(tiny_llama), lora_rank=lora_rank, lora_alpha=alpha)
        model = load_causal_lm(cfg, torch.device("cpu"))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        return Part(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))

    def identity(p: Part) -> RunIdentity:
        return RunIdentity("sft", {"model": model_fingerprint(p.model)})

    full = part(0)
    _checkpoints(tmp_path, identity(full)).save({"model": full}, LoopState(2))
    lora = part(4)
    with pytest.raises(CheckpointError) as err:
        _checkpoints(tmp_path, identity(lora), load=True).resume({"model": lora})
    message = str(err.value)
    assert "no LoRA" in message and "LoRA rank 4" in message and "\n" not in message
    # same shapes, other LoRA alpha: still another model
    lora_a = part(4)
    _checkpoints(tmp_path / "lora", identity(lora_a)).save({"model": lora_a}, LoopState(2))
    lora_b = part(4, alpha=32)
    with pytest.raises(CheckpointError, match="alpha 16.*alpha 32"):
        _checkpoints(tmp_path / "lora", identity(lora_b), load=True).resume({"model": lora_b})


def test_changed_settings_warn_and_keep_the_checkpoints_learning_rate(tmp_path, caplog):
    part = make_part(lr=1e-3)
    fp = {"model": model_fingerprint(part.model)}
    saved = {"optim.learning_rate": 1e-3, "train.train_batch_size": 16}
    _checkpoints(tmp_path, RunIdentity("sft", fp, saved)).save({"model": part}, LoopState(5, 1, 2))
    changed = {"optim.learning_rate": 5e-2, "train.train_batch_size": 8}
    new = make_part(lr=5e-2)
    with caplog.at_level(logging.WARNING):
        loop, _ = _checkpoints(tmp_path, RunIdentity("sft", fp, changed), load=True).resume({"model": new})
    assert loop == LoopState(5, 1, 2)
    assert (
        "optim.learning_rate 0.001 -> 0.05" in caplog.text and "train.train_batch_size 16 -> 8" in caplog.text
    )
    assert "keeps the checkpoint's weights" in caplog.text
    assert new.optimizer.param_groups[0]["lr"] == pytest.approx(part.optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("kind", ["sft", "rm", "prm", "dpo", "kto", "kd", "ppo"])
def test_each_trainer_has_its_own_default_ckpt_path(kind):
    """OpenRLHF v0.9.2's defaults, so `tidal dpo --load_checkpoint` never finds an SFT run's state."""
    import importlib

    parser = importlib.import_module(f"tidal.cli.train_{kind}").build_parser()
    assert parser.get_default("ckpt_path") == f"./ckpt/checkpoints_{kind}"
