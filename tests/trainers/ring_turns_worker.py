"""One SFT optimizer step under ``--ring_attn_size 2`` (2 gloo processes) when the ring's ranks hold
different numbers of micro-batches (or none), against the same step on one process over all of their
samples; then the evaluation of the trained models, whose shards by rank are as uneven.
Run by ``test_ring_turns.py`` under torchrun; every rank checks the whole updated model and exits
non-zero on a mismatch (the assertion's message names the case).

The optimizer is SGD with learning rate 1 and no clipping, so the update is minus the step's gradient
and a parameter mismatch is a gradient mismatch (Adam's first step would amplify rounding noise).

``python -m torch.distributed.run --standalone --nproc_per_node 2 ring_turns_worker.py MODEL DATA.jsonl OUT``
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from tidal.cli import train_sft
from tidal.distributed import World, init_world, parallelize, shutdown
from tidal.distributed.mesh import ring_group
from tidal.models import Precision, load_causal_lm, load_tokenizer
from tidal.models.ring_attention import turns, use_ring
from tidal.trainers.common import train_and_eval_samples
from tidal.trainers.loop import SupervisedTrainer
from tidal.trainers.optimization import Optimization
from tidal.trainers.sft import SFTObjective, load_sft_samples

# Sample indices each ring rank trains on in one step (micro-batches of 2): rank 0 has 2 micro-batches
# and rank 1 one (3 turns: FSDP2 must reduce-scatter on the third), then rank 1 has nothing at all.
CASES = {"2 vs 1 micro-batches": ([0, 1, 2], [3]), "1 vs 0 micro-batches": ([4], [])}
EVAL_SIZES = (5, 1)


def parse(model: str, data: str, out: Path):
    return train_sft.parse_run([
        "--pretrain", model, "--dataset", data, "--input_key", "prompt", "--output_key", "answer",
        "--max_len", "64", "--train_batch_size", "2", "--micro_train_batch_size", "2", "--zero_stage", "2",
        "--packing_samples", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
    ])  # fmt: skip


def sgd_trainer(run, world: World, tokenizer, out: Path) -> SupervisedTrainer:
    """A supervised SFT trainer of a freshly loaded model whose update is ``-gradient``."""
    precision = Precision.create(run.model.param_dtype, world.device)
    model = parallelize(load_causal_lm(run.model, world.device), run.dist, world, precision.dtype)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    constant = torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0)
    opt = Optimization(model, sgd, constant, precision, max_norm=0.0)
    objective = SFTObjective(tokenizer.pad_token_id, packing=True)
    return SupervisedTrainer(objective, opt, tokenizer, world, run.train, run.ckpt, run.logging, out)


def full_parameters(model) -> dict[str, Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def check_totals(ring) -> None:
    """Every rank is told the same number of turns, its own count or not."""
    schedule = turns(["x"] * (2 - ring.rank), ring)
    assert schedule.total == 3, schedule.total
    assert len(list(schedule)) == 3


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a mismatched sync fails, not hangs
    world = init_world()
    model_dir, data, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    run = parse(model_dir, data, out)
    tokenizer = load_tokenizer(run.model.pretrain, run.model)
    samples, _ = train_and_eval_samples(load_sft_samples, run.datasets, tokenizer, run.data, 0)
    ring = ring_group(world, 2)
    check_totals(ring)
    for case, shares in CASES.items():
        ring_run = sgd_trainer(run, world, tokenizer, out / "ring")
        with use_ring(ring):
            ring_run.train_step([samples[i] for i in shares[world.rank]])
        trained = full_parameters(ring_run.opt.model)
        one = sgd_trainer(run, World(), tokenizer, out / f"one{world.rank}")
        one.train_step([samples[i] for share in shares for i in share])
        expected = full_parameters(one.opt.model)
        for name, value in expected.items():
            torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=1e-5, msg=f"{case}: {name}")
        start = full_parameters(sgd_trainer(run, World(), tokenizer, out / "start").opt.model)
        assert any(not torch.equal(start[n], v) for n, v in expected.items()), f"{case}: no update"
    for n in EVAL_SIZES:  # evaluation shards by rank: 3 vs 2 samples (2 vs 1 micro-batches), 1 vs 0
        with use_ring(ring):
            got = ring_run.evaluate(samples[:n])
        want = one.evaluate(samples[:n])
        assert got.keys() == want.keys() and abs(got["loss"] - want["loss"]) <= 1e-5, (n, got, want)
    shutdown(world)


if __name__ == "__main__":
    main()
