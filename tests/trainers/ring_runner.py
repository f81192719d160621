"""Run trainer CLIs under torchrun with ``--ring_attn_size`` and write rank 0's per-step metrics as JSON,
with how many packed log-prob forwards and attention layers went through ring attention on this rank
(proof that the ring ran).

``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/trainers/ring_runner.py RUNS.json``
where RUNS.json lists ``{"kind": "sft" | "dpo" | ..., "out": path, "argv": [flags]}``.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch

from tidal.distributed import init_world, shutdown
from tidal.models import forward, ring_attention

CALLS = {"ring": 0, "layers": 0}


def count_ring_forwards() -> None:
    original = forward.ring_token_logprobs
    layer = ring_attention.ring_attention  # looked up at call time by every tidal_ring attention layer

    def counted(*args, **kwargs):
        CALLS["ring"] += 1
        return original(*args, **kwargs)

    def counted_layer(*args, **kwargs):
        CALLS["layers"] += 1
        return layer(*args, **kwargs)

    forward.ring_token_logprobs = counted
    ring_attention.ring_attention = counted_layer


def main() -> None:
    torch.set_num_threads(1)
    world = init_world()
    count_ring_forwards()
    for spec in json.loads(Path(sys.argv[1]).read_text()):
        CALLS.update(ring=0, layers=0)
        module = importlib.import_module(spec.get("module", f"tidal.cli.train_{spec['kind']}"))
        history = module.main(spec["argv"])
        if world.is_main:
            Path(spec["out"]).write_text(
                json.dumps(
                    {"history": history, "ring_forwards": CALLS["ring"], "ring_layers": CALLS["layers"]}
                )
            )
    shutdown(world)


if __name__ == "__main__":
    main()
