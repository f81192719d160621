"""Run trainers under torchrun (or alone) and write rank 0's per-step metrics as JSON.

``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/dist_runner.py
RUNS.json``: RUNS.json lists ``{"kind": ..., "out": path, "argv": [trainer flags]}`` run in order in
one process group, so the processes start once. Kinds: ``sft``, ``rm``, ``kd``, ``ppo`` (the trainers' CLI ``main``);
``ppo`` with ``"check_sync": true`` also checks after every weight sync that the engine holds
exactly the policy's full (gathered) weights; ``truncate`` makes ``{"ckpt": path, "step": k}``'s
``latest`` point at ``global_step_k`` (a run that stopped there) for a resume.
"""

from __future__ import annotations

import copy
import importlib
import json
import sys
from pathlib import Path

import torch

from tidal.distributed import barrier, init_world, shutdown
from tidal.distributed.weight_sync import engine_weights


def train(kind: str, argv: list[str]) -> list[dict]:
    """The trainer's CLI entry point (``python -m tidal.cli.train_<kind>``'s ``main``): its history."""
    module = importlib.import_module(f"tidal.cli.train_{kind}")
    return module.main(argv)


def expected_weights(engine_model, policy) -> dict[str, torch.Tensor]:
    """The policy's full weights loaded into a zeroed copy of an engine model (its fused names)."""
    expected = copy.deepcopy(engine_model)
    for p in expected.parameters():
        p.data.zero_()
    with engine_weights(policy) as named:
        expected.load_weights((n, t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in named)
    return dict(expected.named_parameters())


def mismatches(expected: dict, actual: dict) -> list[str]:
    return [n for n, p in expected.items() if not torch.equal(p, actual[n])]


def sync_mismatches(run, rollout, policy) -> list[str]:
    """Parameters of this rank's engine(s) that differ from the policy's full weights."""
    rollout = getattr(rollout, "local", rollout)  # a DataParallelRollout's own share
    if hasattr(rollout, "engine"):
        return mismatches(
            expected_weights(rollout.engine.model, policy), dict(rollout.engine.model.named_parameters())
        )
    from tidal.rollout import EngineConfig, LLMEngine

    # separate engines: compare their weights with a local engine model of the same checkpoint
    local = LLMEngine(run.actor.pretrain, EngineConfig(device="cpu", num_kv_blocks=4))
    expected = expected_weights(local.model, policy)
    return [n for actual in rollout.engine_parameters() for n in mismatches(expected, actual)]


def check_syncs(report: list) -> None:
    """Wrap the trainer's weight sync so each one is checked (the gather is collective: all ranks)."""
    from tidal.trainers.ppo.trainer import PPOTrainer

    original = PPOTrainer.sync_weights

    def checked(self, step):
        original(self, step)
        report.append(sync_mismatches(self.run, self.parts.rollout, self.parts.actor.model))

    PPOTrainer.sync_weights = checked


def truncate(ckpt: str, step: int) -> None:
    (Path(ckpt) / "latest").write_text(f"global_step_{step}")


def main() -> None:
    torch.set_num_threads(1)
    world = init_world()
    for spec in json.loads(Path(sys.argv[1]).read_text()):
        if spec["kind"] == "truncate":
            if world.is_main:
                truncate(spec["ckpt"], spec["step"])
            barrier(world)
            continue
        syncs: list = []
        if spec.get("check_sync"):
            check_syncs(syncs)
        history = train(spec["kind"], spec["argv"])
        if world.is_main:
            Path(spec["out"]).write_text(json.dumps({"history": history, "syncs": syncs}))
    shutdown(world)


if __name__ == "__main__":
    main()
