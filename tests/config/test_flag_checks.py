"""Every flag is checked before anything loads, and all problems are reported at once (one line each);
negative numbers in exponent form parse in two-value flags."""

from __future__ import annotations

import argparse

import pytest

from tidal.cli import train_ppo, train_sft
from tidal.config.args import ConfigError, Range, accept_negative_numbers, flag_problems
from tidal.config.rl import RewardConfig, RolloutConfig
from tidal.config.training import OptimConfig

# The model and data paths do not exist: every failure below must come before either is opened.
PPO = ["--pretrain", "no/such/model", "--prompt_data", "no_such.jsonl", "--remote_rm_url", "r.py"]


def error_lines(capsys, main, argv) -> list[str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_ppo_reports_every_bad_flag_at_once_one_line_each(capsys):
    bad = ["--generate_max_len", "0", "--temperature", "-1", "--top_p", "0", "--adam_betas", "1.5", "0.9",
           "--actor_learning_rate", "0", "--critic_learning_rate", "nan"]  # fmt: skip
    lines = error_lines(capsys, train_ppo.main, PPO + bad)
    assert all(line.startswith("tidal ppo: error: --") for line in lines)
    flags = [line.split()[3] for line in lines]
    assert sorted(flags) == sorted(
        ["--generate_max_len", "--temperature", "--top_p", "--adam_betas", "--actor_learning_rate",
         "--critic_learning_rate"]
    )  # fmt: skip
    assert any("--critic_learning_rate must be a finite number, got nan" in line for line in lines)
    assert any("--top_p must be in (0, 1], got 0.0" in line for line in lines)


def test_learning_rate_nan_is_rejected_by_name(capsys):
    argv = ["--pretrain", "m", "--dataset", "d.jsonl", "--learning_rate", "nan"]
    assert error_lines(capsys, train_sft.main, argv) == [
        "tidal sft: error: --learning_rate must be a finite number, got nan"
    ]


@pytest.mark.parametrize(
    ("flag", "values", "message"),
    [
        ("--adam_betas", ["0.9", "-1e-3"], "--adam_betas each value must be in [0, 1), got 0.9 -0.001"),
        ("--eps_clip_low_high", ["0.2", "-1e-1"], "--eps_clip_low_high each value must be > 0, got 0.2 -0.1"),
    ],
)
def test_negative_exponent_numbers_parse_then_fail_the_range_check(capsys, flag, values, message):
    lines = error_lines(capsys, train_ppo.main, PPO + [flag, *values])
    assert lines == [f"tidal ppo: error: {message}"]


def test_negative_exponent_numbers_are_accepted_where_in_range():
    run = train_ppo.parse_run(
        PPO + ["--reward_clip_range", "-1e1", "1E+1", "--eps_clip_low_high", "2e-1", ".3"]
    )
    assert run.algorithm.reward_clip_range == (-10.0, 10.0)
    assert run.algorithm.eps_clip_low_high == (0.2, 0.3)


def test_accept_negative_numbers_leaves_options_alone():
    parser = argparse.ArgumentParser()
    accept_negative_numbers(parser)
    parser.add_argument("--pair", type=float, nargs=2)
    parser.add_argument("--flag", action="store_true")
    ns = parser.parse_args(["--pair", "-1.5e-3", "-.5", "--flag"])
    assert ns.pair == [-1.5e-3, -0.5] and ns.flag


def test_save_path_that_is_an_existing_file_fails_before_training(capsys, tmp_path):
    target = tmp_path / "model.bin"
    target.write_text("not a folder")
    argv = ["--pretrain", "m", "--dataset", "d.jsonl", "--save_path", str(target)]
    assert error_lines(capsys, train_sft.main, argv) == [
        f"tidal sft: error: --save_path {target} is an existing file; it must be a folder (or not exist yet)"
    ]
    assert target.read_text() == "not a folder"


def test_cross_config_checks_still_run_after_field_checks(capsys):
    lines = error_lines(capsys, train_ppo.main, PPO + ["--reward_clip_range", "5", "-5"])
    assert lines == ["tidal ppo: error: --reward_clip_range needs LOW < HIGH, got 5.0 -5.0"]


def test_flag_problems_on_configs_and_ranges():
    assert flag_problems(RolloutConfig, {"generate_max_len": 1024, "top_k": -1, "max_len": None}) == []
    assert flag_problems(RolloutConfig, {"top_k": -3}) == ["--top_k must be >= 1 or -1 or 0, got -3"]
    assert flag_problems(RewardConfig, {"timeout": float("inf")}) == [
        "--remote_rm_timeout must be a finite number, got inf"
    ]
    assert Range(0, 1, high_open=True).accepts(0.0) and not Range(0, 1, high_open=True).accepts(1.0)
    with pytest.raises(ConfigError, match="adam_betas"):  # direct construction is checked too
        OptimConfig(adam_betas=(0.9, 1.0))


def test_generate_reports_problems_of_every_config(capsys):
    from tidal.cli import generate

    argv = [
        "--pretrain",
        "m",
        "--dataset",
        "d.jsonl",
        "--output_path",
        "o.jsonl",
        "--top_p",
        "0",
        "--max_samples",
        "0",
    ]
    assert error_lines(capsys, generate.main, argv) == [
        "tidal generate: error: --top_p must be in (0, 1], got 0.0",
        "tidal generate: error: --max_samples must be >= 1 or -1, got 0",
    ]
