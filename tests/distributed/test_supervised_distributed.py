"""SFT, reward-model and distillation training over 2 CPU processes (FSDP2 ZeRO-3/2, gloo) match one
process step by step; a DCP checkpoint written by 2 processes resumes exactly (with 2 processes and
with 1), and the HF folder rank 0 exports loads and equals the 1-process model."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from tidal.cli import train_kd, train_rm, train_sft
from tidal.testing import AdditionTask, perturbed_copy
from tidal.trainers.kd import run_kd
from tidal.trainers.rm import run_rm
from tidal.trainers.sft import run_sft

RUN = {"sft": (train_sft, run_sft), "rm": (train_rm, run_rm), "kd": (train_kd, run_kd)}
KEYS = {
    "sft": ("loss", "grad_norm"),
    "rm": ("loss", "acc", "reward_gap", "grad_norm"),
    "kd": ("loss", "grad_norm"),
}


def write_data(folder: Path) -> tuple[Path, Path]:
    sft = AdditionTask(digits=2, seed=4).write_jsonl(folder / "sft.jsonl", 32)
    pairs = folder / "pairs.jsonl"
    with pairs.open("w") as f:
        for i, s in enumerate(AdditionTask(digits=2, seed=5).samples(16)):
            wrong = str(int(s["answer"]) + 1 + i % 5)
            f.write(json.dumps({"prompt": s["prompt"], "chosen": s["answer"], "rejected": wrong}) + "\n")
    return sft, pairs


def flags(kind: str, model: Path, data: dict, out: Path, zero: str, *extra) -> list[str]:
    common = [
        "--pretrain", str(model), "--max_len", "64", "--train_batch_size", "8", "--micro_train_batch_size", "2",
        "--learning_rate", "2e-3", "--lr_warmup_ratio", "0", "--zero_stage", zero, "--seed", "5", "--max_epochs", "1",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip
    if kind == "rm":
        return [*common, "--dataset", str(data["pairs"]), "--prompt_key", "prompt"]
    task = ["--dataset", str(data["sft"]), "--input_key", "prompt", "--output_key", "answer"]
    if kind == "kd":
        return [*common, *task, "--teacher_model", str(data["teacher"]), "--max_samples", "16"]
    return [*common, *task]


# (name, kind, zero stage, extra flags); "sft3" (4 steps) also saves checkpoints for the resume checks;
# the others take 2 steps (the second one after a sharded optimizer update).
CONFIGS = [
    ("sft3", "sft", "3", ["--save_steps", "2", "--max_ckpt_num", "5"]),
    ("sft2", "sft", "2", ["--max_samples", "16"]),
    ("rm3", "rm", "3", []),
    ("kd2", "kd", "2", []),
]


def max_param_diff(a: Path, b: Path, cls=AutoModelForCausalLM) -> float:
    ma, mb = cls.from_pretrained(a), cls.from_pretrained(b)
    pb = dict(mb.named_parameters())
    return max(float((p - pb[n]).abs().max()) for n, p in ma.named_parameters())


def test_two_processes_match_one_and_resume(tiny_llama, tmp_path, dist):
    sft, pairs = write_data(tmp_path)
    data = {
        "sft": sft,
        "pairs": pairs,
        "teacher": perturbed_copy(tiny_llama, tmp_path / "teacher", 0.1, seed=1),
    }
    one = {}
    for name, kind, zero, extra in CONFIGS:
        cli, run = RUN[kind]
        one[name] = run(cli.parse_run(flags(kind, tiny_llama, data, tmp_path / f"{name}_1", zero, *extra)))
    two_dir = tmp_path / "sft3_2"
    specs = [
        {"kind": kind, "out": str(tmp_path / f"{name}_2.json"),
         "argv": flags(kind, tiny_llama, data, tmp_path / f"{name}_2", zero, *extra)}
        for name, kind, zero, extra in CONFIGS
    ]  # fmt: skip

    # Resume the 2-process SFT run from its step-2 checkpoint, with 2 processes.
    def resume(save_path: Path) -> list[str]:
        return flags("sft", tiny_llama, data, two_dir, "3", "--save_steps", "2", "--max_ckpt_num", "5",
                     "--load_checkpoint", "--save_path", str(save_path))  # fmt: skip

    specs += [
        {"kind": "truncate", "ckpt": str(two_dir / "ckpt"), "step": 2},
        {"kind": "sft", "out": str(tmp_path / "resumed_2.json"), "argv": resume(tmp_path / "resumed_2")},
    ]
    dist.torchrun(specs, tmp_path, fork=True)

    for name, kind, _, _ in CONFIGS:
        two = dist.result(tmp_path / f"{name}_2.json")["history"]
        assert len(two) == len(one[name]) >= 2
        dist.assert_steps_match(one[name], two, KEYS[kind])
    # Rank 0's HF export loads and holds the same weights as the 1-process run's.
    assert max_param_diff(tmp_path / "sft3_1" / "final", two_dir / "final") < 1e-5
    rm_diff = max_param_diff(tmp_path / "rm3_1" / "final", tmp_path / "rm3_2" / "final",
                             AutoModelForSequenceClassification)  # fmt: skip
    assert rm_diff < 1e-5

    full = one["sft3"]
    resumed_2 = dist.result(tmp_path / "resumed_2.json")["history"]
    assert [h["step"] for h in resumed_2] == [h["step"] for h in full[2:]]
    dist.assert_steps_match(full[2:], resumed_2, ("loss", "lr"))

    # The same 2-process checkpoint resumes in one process (DCP reshards on load).
    (two_dir / "ckpt" / "latest").write_text("global_step_2")
    resumed_1 = run_sft(train_sft.parse_run(resume(tmp_path / "resumed_1")))
    dist.assert_steps_match(full[2:], resumed_1, ("loss", "lr"))
