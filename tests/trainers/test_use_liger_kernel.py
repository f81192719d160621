"""``--use_liger_kernel`` (OpenRLHF's switch for its fused kernels) turns on tidal's fused LM-head loss in
KD (the student's head chunk by chunk inside the loss) and PRM (the head only at step markers, on the
reward tokens' rows): the same steps as the full-logit path, up to float rounding. SFT, DPO, KTO and
PPO always use the fused head and refuse the flag with that reason."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.trainers.test_prm import flags as prm_flags
from tests.trainers.test_prm import prm_model as prm_model  # noqa: F401 (fixture)
from tests.trainers.test_prm import step_rows, write_jsonl
from tidal.cli.train_sft import main as sft_main
from tidal.testing import AdditionTask
from tidal.trainers import kd as kd_module
from tidal.trainers import prm as prm_module


@pytest.fixture(scope="module")
def teacher(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_llama), dtype=torch.float32)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(path)
    return path


def counting_head_output(module, monkeypatch) -> list:
    """Count the forwards that ran through the fused head."""
    calls, real = [], module.head_output

    def spy(head, fn):
        calls.append(head)
        return real(head, fn)

    monkeypatch.setattr(module, "head_output", spy)
    return calls


def close(a: list[dict], b: list[dict], keys) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for key in keys:
            assert x[key] == pytest.approx(y[key], abs=2e-5, rel=1e-5), key


def test_kd_fused_head_takes_the_full_logit_steps(tiny_llama, teacher, tmp_path, monkeypatch):
    from tidal.cli.train_kd import parse_run

    data = AdditionTask(digits=2).write_jsonl(tmp_path / "train.jsonl", 16)

    def run(out, *extra):
        return kd_module.run_kd(parse_run([
            "--pretrain", str(tiny_llama), "--teacher_model", str(teacher), "--dataset", str(data),
            "--input_key", "prompt", "--output_key", "answer", "--max_len", "64", "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--learning_rate", "3e-3", "--lr_warmup_ratio", "0",
            "--save_path", str(tmp_path / out), "--ckpt_path", str(tmp_path / out / "ckpt"),
            "--kd_coef", "0.5", "--seed", "3", *extra,
        ]))  # fmt: skip

    plain = run("plain")
    calls = counting_head_output(kd_module, monkeypatch)
    fused = run("fused", "--use_liger_kernel")
    assert len(calls) == 4  # 2 steps × 2 micro-batches, all through the fused head
    close(plain, fused, ("loss", "teacher_kl"))  # step 2 also checks step 1's gradients


def test_prm_fused_head_takes_the_full_logit_steps(prm_model, tmp_path, monkeypatch):  # noqa: F811
    from tidal.cli.train_prm import parse_run

    data = write_jsonl(tmp_path / "train.jsonl", step_rows(32, 0))
    plain = prm_module.run_prm(parse_run(prm_flags(prm_model, data, tmp_path / "plain")))
    calls = counting_head_output(prm_module, monkeypatch)
    fused = prm_module.run_prm(
        parse_run(prm_flags(prm_model, data, tmp_path / "fused", "--use_liger_kernel"))
    )
    assert len(calls) == 4
    close(plain, fused, ("loss", "acc"))


def test_trainers_that_always_fuse_refuse_the_flag_with_the_reason(capsys):
    with pytest.raises(SystemExit) as exc:
        sft_main(["--pretrain", "x", "--dataset", "d", "--use_liger_kernel"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--use_liger_kernel is not supported" in err and "always computes" in err
