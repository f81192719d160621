"""No run writes a model over a model folder it reads: ``tidal dpo --pretrain ./ckpt`` after ``tidal sft``
(both default to ``--save_path ./ckpt``) is refused before anything loads, for every trainer, with one line
naming both flags; the real paths are compared (a symlink or ``a/../b`` is the same folder)."""

from __future__ import annotations

import pytest

from tidal.cli.train_dpo import main as dpo_main
from tidal.cli.train_ppo import parse_run as parse_ppo
from tidal.cli.train_sft import parse_run as parse_sft
from tidal.config import ConfigError


def test_dpo_after_sft_with_default_paths_is_refused(tiny_llama, tmp_path, monkeypatch, capsys):
    (tmp_path / "ckpt").symlink_to(tiny_llama, target_is_directory=True)  # what `tidal sft` left in ./ckpt
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        dpo_main(["--pretrain", "./ckpt", "--dataset", "pairs.jsonl"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--save_path ./ckpt is the --pretrain folder" in err
    assert "pass another --save_path" in err


def test_ckpt_path_and_other_input_models_are_checked(tiny_llama, tmp_path):
    alias = tmp_path / "alias"
    alias.symlink_to(tiny_llama, target_is_directory=True)
    with pytest.raises(ConfigError, match=r"--ckpt_path .* is the --pretrain folder"):
        parse_sft(["--pretrain", str(tiny_llama), "--dataset", "d.jsonl", "--save_path", str(tmp_path / "out"),
                   "--ckpt_path", str(alias)])  # fmt: skip
    with pytest.raises(ConfigError, match=r"--save_path .* is the --reward_pretrain folder"):
        parse_ppo(["--pretrain", str(tmp_path), "--prompt_data", "p.jsonl", "--reward_pretrain",
                   f"{tmp_path},{tiny_llama}", "--save_path", f"{tmp_path}/x/../alias"])  # fmt: skip


def test_other_folders_are_accepted(tiny_llama, tmp_path):
    run = parse_sft(["--pretrain", str(tiny_llama), "--dataset", "d.jsonl", "--save_path", str(tmp_path / "out"),
                     "--ckpt_path", str(tiny_llama / "checkpoints")])  # fmt: skip
    assert run.ckpt.save_path == str(tmp_path / "out")
