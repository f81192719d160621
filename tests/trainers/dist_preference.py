"""Run preference trainers under torchrun and write rank 0's per-step metrics as JSON.

Used by the 1-vs-2-process test: ``python -m torch.distributed.run --standalone --nproc_per_node 2
tests/trainers/dist_preference.py RUNS.json`` where RUNS.json lists ``{"kind": "dpo"|"kto", "out":
path, "argv": [trainer flags]}``; the runs share one process group, so processes start once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tidal.distributed import init_world, shutdown


def run(kind: str, argv: list[str]) -> list[dict]:
    if kind == "dpo":
        from tidal.cli.train_dpo import parse_run
        from tidal.trainers.dpo import run_dpo

        return run_dpo(parse_run(argv))
    from tidal.cli.train_kto import parse_run
    from tidal.trainers.kto import run_kto

    return run_kto(parse_run(argv))


def main() -> None:
    torch.set_num_threads(1)
    world = init_world()
    for spec in json.loads(Path(sys.argv[1]).read_text()):
        history = run(spec["kind"], spec["argv"])
        if world.is_main:
            with open(spec["out"], "w") as f:
                json.dump(history, f)
    shutdown(world)


if __name__ == "__main__":
    main()
