"""``tidal generate --tp_size 2`` end to end (two CPU processes): the same rows as ``--tp_size 1``; a size
the model's heads cannot be split by exits with one line naming the flag, before any model loads."""

from __future__ import annotations

import json

import pytest

from tidal.cli.generate import main as generate_main
from tidal.testing import AdditionTask


def generate(model, prompts, out, *extra) -> list[dict]:
    generate_main([
        "--pretrain", str(model), "--dataset", str(prompts), "--input_key", "prompt", "--output_path",
        str(out), "--max_new_tokens", "6", "--seed", "7", "--n_samples_per_prompt", "2", *extra,
    ])  # fmt: skip
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_generate_tp2_writes_the_rows_of_one_process(tiny_model, tmp_path):
    prompts = AdditionTask(seed=3).write_jsonl(tmp_path / "prompts.jsonl", 3)
    model = tiny_model("llama")
    single = generate(model, prompts, tmp_path / "tp1.jsonl", "--tp_size", "1")
    assert generate(model, prompts, tmp_path / "tp2.jsonl", "--tp_size", "2") == single
    assert len(single) == 6


def test_generate_tp_size_not_dividing_heads_exits_2(tiny_model, tmp_path, capsys):
    prompts = AdditionTask(seed=3).write_jsonl(tmp_path / "prompts.jsonl", 1)
    with pytest.raises(SystemExit) as exc:
        generate(tiny_model("llama"), prompts, tmp_path / "x.jsonl", "--tp_size", "4")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--tp_size 4: tensor-parallel size 4 does not divide num_attention_heads=6" in err
    assert not (tmp_path / "x.jsonl").exists()
