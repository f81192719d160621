"""DPO and KTO over 2 CPU processes (FSDP2, gloo) match 1 process: the step normaliser, the
sharded separate reference and KTO's KL reference point are all reduced over devices."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.cli import train_dpo, train_kto
from tidal.testing import AdditionTask
from tidal.testing.tolerance import assert_same_steps, tiny_parameter_count
from tidal.trainers.dpo import run_dpo
from tidal.trainers.kto import run_kto


def write_data(folder: Path) -> tuple[Path, Path]:
    """Pairs (correct vs wrong sum) and the same answers as unpaired desirable/undesirable rows."""
    pairs, unpaired = folder / "pairs.jsonl", folder / "unpaired.jsonl"
    with pairs.open("w") as p, unpaired.open("w") as u:
        for i, s in enumerate(AdditionTask(digits=2, seed=3).samples(16)):
            wrong = str(int(s["answer"]) + 1 + i % 5)
            p.write(json.dumps({"prompt": s["prompt"], "chosen": s["answer"], "rejected": wrong}) + "\n")
            good = i % 2 == 0
            u.write(
                json.dumps({"input": s["prompt"], "output": s["answer"] if good else wrong, "label": good})
                + "\n"
            )
    return pairs, unpaired


def test_two_processes_match_one(tiny_llama, perturbed_llama, tmp_path, ranks):
    reference = perturbed_llama
    pairs, unpaired = write_data(tmp_path)

    def argv(kind: str, out: Path) -> list[str]:
        data = (
            ["--dataset", str(pairs), "--prompt_key", "prompt"]
            if kind == "dpo"
            else ["--dataset", str(unpaired)]
        )
        return [
            "--pretrain", str(tiny_llama), "--ref_pretrain", str(reference), *data, "--max_len", "64",
            "--train_batch_size", "8", "--micro_train_batch_size", "2", "--learning_rate", "2e-3",
            "--lr_warmup_ratio", "0", "--beta", "0.1", "--zero_stage", "3", "--seed", "5",
            "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        ]  # fmt: skip

    one = {
        "dpo": run_dpo(train_dpo.parse_run(argv("dpo", tmp_path / "dpo1"))),
        "kto": run_kto(train_kto.parse_run(argv("kto", tmp_path / "kto1"))),
    }
    specs = [
        {"kind": k, "out": str(tmp_path / f"{k}2.json"), "argv": argv(k, tmp_path / f"{k}2")} for k in one
    ]
    (tmp_path / "runs.json").write_text(json.dumps(specs))
    ranks.launch(Path(__file__).with_name("dist_preference.py"), tmp_path / "runs.json")
    keys = {"dpo": ("loss", "reward_margin", "reward_accuracy"), "kto": ("loss", "kl", "desirable_reward")}
    for kind, history in one.items():
        two = json.loads((tmp_path / f"{kind}2.json").read_text())
        assert len(history) == len(two) == 2
        assert history[0]["kl" if kind == "kto" else "reward_margin"] != 0.0  # the reference differs
        assert_same_steps(history, two, keys[kind], tiny_parameter_count("qwen2"))
