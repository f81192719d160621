"""Bad input fails at the command line in one line (exit status 2), before models load where possible:
a non-UTF-8 data line, an empty prompt in row 40, a model folder without config.json, a tokenizer with
neither pad nor eos, an unsupported architecture in ``tidal ppo`` and a truncated safetensors file."""

from __future__ import annotations

import json
import shutil

import pytest

from tidal.cli import train_ppo, train_sft
from tidal.trainers.ppo import entry as ppo_setup


@pytest.fixture
def model_copy(tiny_llama, tmp_path):
    return shutil.copytree(tiny_llama, tmp_path / "model")


@pytest.fixture
def sft_data(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"input": f"{i}+1=", "output": str(i + 1)}) + "\n" for i in range(8)))
    return path


def fails_with(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if ": error: " in line]  # not datasets' progress bars
    assert len(lines) == 1, err
    return lines[0]


def sft_argv(model, data, tmp_path):
    return ["--pretrain", str(model), "--dataset", str(data), "--save_path", str(tmp_path / "out"),
            "--train_batch_size", "4", "--micro_train_batch_size", "4", "--max_len", "32"]  # fmt: skip


def ppo_argv(model, prompts, tmp_path):
    return ["--pretrain", str(model), "--prompt_data", str(prompts), "--remote_rm_url", "reward.py",
            "--rollout_batch_size", "4", "--train_batch_size", "4", "--micro_train_batch_size", "4",
            "--init_kl_coef", "0", "--save_path", str(tmp_path / "out")]  # fmt: skip


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(ppo_setup, "load_causal_lm", refuse)


def test_non_utf8_data_line(capsys, tiny_llama, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_bytes(b'{"input": "1+1=", "output": "2"}\n{"input": "\xff", "output": "3"}\n')
    line = fails_with(capsys, train_sft.main, sft_argv(tiny_llama, data, tmp_path))
    assert line.startswith(f"tidal sft: error: {data} line 2 is not valid UTF-8 (byte 0xff")


def test_empty_prompt_in_row_40_fails_before_models_load(capsys, tiny_llama, tmp_path, no_model_loads):
    rows = [{"input": f"{i}+1="} for i in range(48)]
    rows[39]["input"] = ""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = fails_with(capsys, train_ppo.main, ppo_argv(tiny_llama, prompts, tmp_path))
    assert line == f"tidal ppo: error: 1 bad row(s) in {prompts}: row 40 of {prompts}: key 'input' is empty"


def test_model_folder_without_config_json(capsys, model_copy, sft_data, tmp_path):
    (model_copy / "config.json").unlink()
    line = fails_with(capsys, train_sft.main, sft_argv(model_copy, sft_data, tmp_path))
    assert line == f"tidal sft: error: --pretrain {model_copy}: no config.json in this folder; " + (
        "expected a Hugging Face model folder"
    )


def test_model_path_that_does_not_exist(capsys, sft_data, tmp_path):
    """Neither a local folder nor reachable on the hub (tests run offline): one line that says so first."""
    missing = tmp_path / "no_such_model"
    line = fails_with(capsys, train_sft.main, sft_argv(missing, sft_data, tmp_path))
    assert line.startswith(
        f"tidal sft: error: --pretrain {missing}: no such local folder, and the Hugging Face hub could not"
    )


def test_tokenizer_without_pad_or_eos(capsys, model_copy, sft_data, tmp_path):
    path = model_copy / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.pop("pad_token")
    config.pop("eos_token")
    path.write_text(json.dumps(config))
    line = fails_with(capsys, train_sft.main, sft_argv(model_copy, sft_data, tmp_path))
    assert line.startswith(
        f"tidal sft: error: --pretrain {model_copy}: the tokenizer has neither a pad token"
    )


def test_fallback_family_refuses_engine_features_in_ppo(capsys, model_copy, tmp_path, no_model_loads):
    # A family outside the engine's registry generates on the transformers fallback, which has no prefix cache.
    path = model_copy / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "model_type": "gpt_neox"}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"{i}+1="}) + "\n" for i in range(4)))
    argv = [*ppo_argv(model_copy, prompts, tmp_path), "--enable_prefix_caching"]
    line = fails_with(capsys, train_ppo.main, argv)
    assert line == (
        f"tidal ppo: error: --pretrain {model_copy}: prefix_caching is not supported for the gpt_neox family: "
        "it is not native to tidal's engine and runs on the transformers fallback, which lacks it"
    )


def test_truncated_safetensors(capsys, model_copy, sft_data, tmp_path):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = fails_with(capsys, train_sft.main, sft_argv(model_copy, sft_data, tmp_path))
    assert line.startswith(
        f"tidal sft: error: --pretrain {model_copy}: a .safetensors weights file is truncated"
    )
    assert not (tmp_path / "out" / "model.safetensors").exists()
