"""Loss recorder for refactors: tiny SFT, DPO, GRPO-with-KL and PPO-GAE runs on the CPU, per-step metrics as JSON.

A refactor that should not change behaviour keeps these bytes equal. Record before the change, again after,
and compare the files::

    python bench/reshape_losses.py /tmp/before.json
    ... refactor ...
    python bench/reshape_losses.py /tmp/after.json && cmp /tmp/before.json /tmp/after.json

Every run is seeded, float32, one process; floats are written with ``repr`` (exact round trip), so equal
files mean bit-identical losses. Wall-clock metrics (``time/...``, throughput) are dropped: they are the
one thing allowed to differ. About a minute on one core.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import torch

from tidal.cli.train_dpo import parse_run as parse_dpo
from tidal.cli.train_ppo import parse_run as parse_ppo
from tidal.cli.train_sft import parse_run as parse_sft
from tidal.testing import AdditionTask, build_tiny_model
from tidal.trainers.dpo import run_dpo
from tidal.trainers.ppo import run_ppo
from tidal.trainers.sft import run_sft

# A reward that varies between a random model's samples (the examples' math reward is 0 for all of them, which
# would leave GRPO's advantages and losses at zero and the recorder blind to them).
REWARD = """
import torch

def reward_func(queries, prompts, labels, **kwargs):
    rewards = [sum(map(ord, q[len(p):])) % 5 / 4 for q, p in zip(queries, prompts)]
    return {"rewards": torch.tensor(rewards)}
"""
TIMING = ("time", "throughput", "tokens_per_s", "samples_per_s", "elapsed", "sec")


def write_data(d: Path) -> Path:
    """Addition SFT rows, DPO pairs (a wrong sum rejected) and echo RL prompts ('7>' → '7')."""
    rows = AdditionTask(digits=2, seed=1).samples(64)
    with (d / "sft.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with (d / "pairs.jsonl").open("w") as f:
        for i, r in enumerate(rows):
            pair = {
                "prompt": r["prompt"],
                "chosen": r["answer"],
                "rejected": str(int(r["answer"]) + 1 + i % 7),
            }
            f.write(json.dumps(pair) + "\n")
    rng = random.Random(0)
    with (d / "prompts.jsonl").open("w") as f:
        for _ in range(64):
            x = rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"{x}>", "label": str(x)}) + "\n")
    (d / "reward.py").write_text(REWARD)
    return d


def rl_flags(model: Path, d: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--pretrain", str(model), "--prompt_data", str(d / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(d / "reward.py"),
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--train_batch_size", "32",
        "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "16", "--generate_max_len", "4",
        "--prompt_max_len", "8", "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), "--seed", "3", "--max_samples", "24",
        *extra,
    ]  # fmt: skip


def runs(model: Path, d: Path, out: Path) -> dict[str, list[dict]]:
    common = ["--pretrain", str(model), "--max_len", "64", "--micro_train_batch_size", "4", "--seed", "5",
              "--lr_warmup_ratio", "0", "--max_samples", "32"]  # fmt: skip
    sft = parse_sft([*common, "--dataset", str(d / "sft.jsonl"), "--input_key", "prompt", "--output_key", "answer",
                     "--train_batch_size", "8", "--learning_rate", "3e-3", "--save_path", str(out / "sft")])  # fmt: skip
    dpo = parse_dpo([*common, "--dataset", str(d / "pairs.jsonl"), "--prompt_key", "prompt", "--chosen_key",
                     "chosen", "--rejected_key", "rejected", "--train_batch_size", "8", "--learning_rate", "2e-3",
                     "--save_path", str(out / "dpo")])  # fmt: skip
    grpo = parse_ppo(rl_flags(model, d, out / "grpo", "--advantage_estimator", "group_norm", "--init_kl_coef",
                              "0.01", "--use_kl_loss", "--kl_estimator", "k3"))  # fmt: skip
    gae = parse_ppo(rl_flags(model, d, out / "gae", "--advantage_estimator", "gae", "--init_kl_coef", "0.01",
                             "--critic_learning_rate", "1e-3"))  # fmt: skip
    return {"sft": run_sft(sft), "dpo": run_dpo(dpo), "grpo_kl": run_ppo(grpo), "ppo_gae": run_ppo(gae)}


def steady(history: list[dict]) -> list[dict]:
    """Each step's metrics without the wall-clock ones."""
    return [{k: v for k, v in sorted(h.items()) if not any(t in k for t in TIMING)} for h in history]


def main(out_file: str) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model", "qwen2", seed=0)
        data = write_data(root)
        histories = {name: steady(h) for name, h in runs(model, data, root / "out").items()}
    Path(out_file).write_text(json.dumps(histories, indent=1) + "\n")
    print(json.dumps({name: len(h) for name, h in histories.items()}))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/reshape_losses.py OUT.json")
    main(sys.argv[1])
