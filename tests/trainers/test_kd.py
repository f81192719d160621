"""Knowledge distillation: the student moves towards a frozen teacher; flags and errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tidal.cli.train_kd import main as kd_main
from tidal.cli.train_kd import parse_run
from tidal.testing import AdditionTask
from tidal.trainers.kd import run_kd


@pytest.fixture(scope="module")
def teacher(tiny_llama, tmp_path_factory):
    """A differently initialised model with the student's tokenizer."""
    path = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_llama), dtype=torch.float32)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return AdditionTask(digits=2).write_jsonl(tmp_path_factory.mktemp("kd") / "train.jsonl", 64)


def flags(student, teacher, data, out, *extra):
    return [
        "--pretrain", str(student), "--teacher_model", str(teacher), "--dataset", str(data),
        "--input_key", "prompt", "--output_key", "answer", "--max_len", "64", "--train_batch_size", "8",
        "--micro_train_batch_size", "4", "--learning_rate", "3e-3", "--lr_warmup_ratio", "0",
        "--lr_scheduler", "constant", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        "--kd_coef", "1.0", "--seed", "3", *extra,
    ]  # fmt: skip


def test_kd_lowers_kl_to_teacher(tiny_llama, teacher, data, tmp_path):
    history = run_kd(parse_run(flags(tiny_llama, teacher, data, tmp_path, "--max_epochs", "2")))
    assert len(history) == 16
    first = sum(h["teacher_kl"] for h in history[:2]) / 2
    last = sum(h["teacher_kl"] for h in history[-2:]) / 2
    assert last < 0.6 * first, (first, last)
    # kd_coef 1: the loss is the cross-entropy to the teacher, i.e. the KL plus the teacher's entropy.
    assert all(h["loss"] > h["teacher_kl"] for h in history)


def test_kd_offload_and_packing_give_the_same_step(tiny_llama, teacher, data, tmp_path):
    common = ("--max_samples", "8", "--kd_coef", "0.5")
    a = run_kd(parse_run(flags(tiny_llama, teacher, data, tmp_path / "a", *common)))
    b = run_kd(
        parse_run(
            flags(
                tiny_llama, teacher, data, tmp_path / "b", *common, "--teacher_offload", "--packing_samples"
            )
        )
    )
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], abs=1e-5)
    assert a[0]["teacher_kl"] == pytest.approx(b[0]["teacher_kl"], abs=1e-5)


def test_kd_lora_saves_adapters(tiny_llama, teacher, data, tmp_path):
    run_kd(parse_run(flags(tiny_llama, teacher, data, tmp_path, "--max_samples", "8", "--lora_rank", "4")))
    saved = {p.name for p in (tmp_path / "final").iterdir()}
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--kd_coef", "1.5"], "--kd_coef")],  # --aux_loss_coef on a dense model adds 0: test_aux_loss_dense.py
)
def test_kd_bad_flags(tiny_llama, teacher, data, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        kd_main(flags(tiny_llama, teacher, data, tmp_path, "--max_samples", "8", *extra))
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_kd_teacher_with_other_vocab_fails(tiny_llama, data, tmp_path, capsys):
    other = tmp_path / "other"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.resize_token_embeddings(600)
    model.save_pretrained(other)
    with pytest.raises(SystemExit):
        kd_main(flags(tiny_llama, other, data, tmp_path, "--max_samples", "8"))
    err = capsys.readouterr().err
    assert "--teacher_model" in err and "vocabulary size 600" in err
