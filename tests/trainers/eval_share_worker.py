"""Evaluation of eval sets smaller than, or uneven over, the data-parallel ranks (2 gloo processes, FSDP2):
SFT, KTO and reward-model evaluation and the reward model's ``--normalize_reward`` statistics of 1 and 3
samples (micro-batches of 1: shares of 1 vs 0 and 2 vs 1 samples) against one process on the same set.
Run by ``test_eval_share.py`` under torchrun; every rank checks and exits non-zero on a mismatch (the
assertion's message names the case). The 60 s collective timeout makes a mismatched collective (a rank
running fewer FSDP forwards, or reducing other metric keys) fail instead of hanging.

``python -m torch.distributed.run --standalone --nproc_per_node 2 eval_share_worker.py MODEL REF DIR``
(DIR holds sft.jsonl, unpaired.jsonl and pairs.jsonl; outputs go under it too)
"""

from __future__ import annotations

import math
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tidal.cli import train_kto, train_rm, train_sft
from tidal.distributed import World, init_world, shutdown
from tidal.models import load_tokenizer
from tidal.testing.tolerance import reorder_rtol, same_up_to_reordering, tiny_parameter_count
from tidal.trainers.common import Recipe, seed_everything, train_and_eval_samples
from tidal.trainers.kto import KTORecipe
from tidal.trainers.optimization import build_optimization
from tidal.trainers.rm import RMRecipe
from tidal.trainers.sft import SFTRecipe

# Evaluation sums over 1 or 3 processes' shares: equal up to reordering (tidal.testing.tolerance).
RTOL = reorder_rtol(tiny_parameter_count("qwen2"))

EVAL_SIZES = (1, 3)
COMMON = ["--max_len", "64", "--train_batch_size", "2", "--micro_train_batch_size", "1", "--zero_stage", "3"]


def runs(model: str, ref: str, folder: Path) -> dict[str, tuple[Recipe, object]]:
    def flags(name: str, data: list[str]) -> list[str]:
        out = folder / name
        return [
            "--pretrain",
            model,
            *data,
            *COMMON,
            "--save_path",
            str(out),
            "--ckpt_path",
            str(out / "ckpt"),
        ]

    sft = ["--dataset", str(folder / "sft.jsonl"), "--input_key", "prompt", "--output_key", "answer"]
    kto = ["--dataset", str(folder / "unpaired.jsonl"), "--ref_pretrain", ref, "--beta", "0.1"]
    rm = ["--dataset", str(folder / "pairs.jsonl"), "--prompt_key", "prompt"]
    return {
        "sft": (SFTRecipe(), train_sft.parse_run(flags("sft", sft))),
        "kto": (KTORecipe(), train_kto.parse_run(flags("kto", kto))),
        "rm": (RMRecipe(), train_rm.parse_run(flags("rm", rm))),
    }


def build(recipe: Recipe, run, world: World):
    """The recipe's trainer (as ``fit_recipe`` builds it, minus the fit) and its samples."""
    seed_everything(run.train)  # a reward model's fresh value head is the same in both builds
    tokenizer = load_tokenizer(run.model.pretrain, run.model)
    samples, _ = train_and_eval_samples(recipe.load_samples, run.datasets, tokenizer, run.data, 0)
    model = recipe.load_model(run, world)
    frozen = recipe.load_frozen(run, model, world)
    opt = build_optimization(model, run.model, run.optim, run.dist, world, 1)
    objective = recipe.objective(run, tokenizer, samples, frozen)
    folder = Path(run.ckpt.save_path) / f"run{world.world_size}"
    trainer = recipe.trainer_cls(objective, opt, tokenizer, world, run.train, run.ckpt, run.logging, folder)
    return trainer, samples


def assert_same(got: dict, want: dict, case: str) -> None:
    assert got.keys() == want.keys(), (case, sorted(got), sorted(want))
    for k, v in want.items():
        assert math.isfinite(v) and same_up_to_reordering(got[k], v, RTOL), (case, k, got[k], v)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = init_world()
    model, ref, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    for name, (recipe, run) in runs(model, ref, folder).items():
        two, samples = build(recipe, run, world)
        one, _ = build(recipe, run, World())
        for n in EVAL_SIZES:
            case = f"{name} eval of {n}"
            want = one.evaluate(samples[:n])
            assert_same(two.evaluate(samples[:n]), want, case)
            if name == "kto":  # the reference differs from the policy, so the KL point is not trivially 0
                assert want["kl"] > 0, (case, want)
            if name == "rm":
                got, want = two.reward_stats(samples[:n]), one.reward_stats(samples[:n])
                assert_same(dict(enumerate(got)), dict(enumerate(want)), f"rm reward stats of {n}")
    shutdown(world)


if __name__ == "__main__":
    main()
