"""On-policy distillation (``tidal ppo --teacher_model``): the teacher takes the reference's place,
so the per-token KL penalty on the student's own samples pulls the student to the teacher."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.cli.train_ppo import parse_run
from tidal.cli.train_sft import parse_run as parse_sft
from tidal.config.args import ConfigError
from tidal.testing import build_tiny_model
from tidal.trainers.ppo import run_ppo
from tidal.trainers.sft import run_sft


def sft(base, data, out):
    run_sft(parse_sft([
        "--pretrain", str(base), "--dataset", str(data), "--input_key", "prompt", "--output_key", "answer",
        "--max_len", "16", "--train_batch_size", "32", "--micro_train_batch_size", "32", "--packing_samples",
        "--max_epochs", "2", "--learning_rate", "3e-3", "--save_path", str(out),
        "--input_template", "{}",  # RL prompts are raw: SFT on them untemplated
    ]))  # fmt: skip


@pytest.fixture(scope="module")
def echo_models(tiny_qwen2, tmp_path_factory):
    """The task '7>' → '7': a teacher trained on right answers, a student on answers right half the
    time (so the student's samples hold both, and the teacher's log-probs tell them apart)."""
    d = tmp_path_factory.mktemp("distill")
    rng = random.Random(0)
    for name, wrong in (("teacher", 0.0), ("student", 0.5)):
        with (d / f"{name}.jsonl").open("w") as f:
            for _ in range(512):
                x = rng.randint(0, 9)
                y = rng.choice([v for v in range(10) if v != x]) if rng.random() < wrong else x
                f.write(json.dumps({"prompt": f"{x}>", "answer": str(y)}) + "\n")
        sft(tiny_qwen2, d / f"{name}.jsonl", d / name)
    with (d / "prompts.jsonl").open("w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"{i % 10}>"}) + "\n")
    return d


def distill_flags(data, out, *extra):
    return [
        "--pretrain", str(data / "student"), "--teacher_model", str(data / "teacher"), "--prompt_data",
        str(data / "prompts.jsonl"), "--input_key", "prompt", "--init_kl_coef", "1", "--advantage_estimator",
        "reinforce", "--gamma", "0", "--n_samples_per_prompt", "8", "--rollout_batch_size", "16",
        "--train_batch_size", "128", "--micro_train_batch_size", "128", "--micro_rollout_batch_size", "128",
        "--generate_max_len", "4", "--prompt_max_len", "8", "--actor_learning_rate", "1e-3",
        "--lr_warmup_ratio", "0", "--seed", "3", "--save_path", str(out / "final"), "--ckpt_path",
        str(out / "ckpt"), *extra,
    ]  # fmt: skip


def next_token_kl(student, teacher, tokenizer) -> float:
    """Exact KL(student || teacher) of the first response token, averaged over the task's prompts."""
    kls = []
    with torch.no_grad():
        for x in range(10):
            ids = tokenizer(f"{x}>", return_tensors="pt").input_ids
            s, t = (torch.log_softmax(m(ids).logits[0, -1].float(), -1) for m in (student, teacher))
            kls.append(float((s.exp() * (s - t)).sum()))
    return sum(kls) / len(kls)


def test_student_moves_towards_the_teacher(echo_models, tmp_path):
    history = run_ppo(parse_run(distill_flags(echo_models, tmp_path, "--num_episodes", "2")))
    assert all(h["reward"] == 0.0 for h in history)  # no task reward: the teacher's signal only
    assert history[0]["kl"] > 0.3  # the reference is the teacher (a copy of the student would start at 0)
    load = AutoModelForCausalLM.from_pretrained
    teacher, tokenizer = load(echo_models / "teacher"), AutoTokenizer.from_pretrained(echo_models / "teacher")
    before = next_token_kl(load(echo_models / "student"), teacher, tokenizer)
    after = next_token_kl(load(tmp_path / "final"), teacher, tokenizer)
    assert after < 0.6 * before, (before, after, [h["kl"] for h in history])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--init_kl_coef", "0"], "--teacher_model distils through the KL penalty"),
    ],
)
def test_bad_distillation_flags(echo_models, tmp_path, extra, message):
    flags = distill_flags(echo_models, tmp_path, *extra)
    with pytest.raises(ConfigError, match=message):
        parse_run(flags)


def test_teacher_with_another_tokenizer_is_refused(echo_models, tmp_path):
    other = build_tiny_model(tmp_path / "other", "llama", vocab_size=300, seed=1)
    flags = distill_flags(echo_models, tmp_path)
    flags[flags.index("--teacher_model") + 1] = str(other)
    with pytest.raises(ConfigError, match="--teacher_model .* has a different tokenizer than --pretrain"):
        run_ppo(parse_run(flags))
