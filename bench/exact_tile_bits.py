"""Probe (issue #34): does exact mode's GEMM give an output column the same bits whatever the launch's tile
width, warps and row tile, as long as the K step is the same?

The exact engine runs q, k, v, gate and up as five launches because each must round as the trainer's own
GEMM of that weight does (``triton_exact.matmul_config`` picks a launch per weight shape). If a column's
bits depend only on the K step (``block_k``: the order of the K-reduction) and not on ``block_n``,
``block_m`` or ``num_warps``, then q/k/v and gate/up could each run as one packed launch at decode and
stay bit-equal to the trainer: 97 GEMM launches a 0.5B decode step instead of 169.

Per model shape (``--config``), on ``--rows`` random bf16 rows:

- ``variants``: each weight's output under every (block_m, block_n, warps) with its own ``block_k``,
  compared bit for bit with its ``matmul_config`` launch;
- ``control``: the same with another ``block_k`` (a reduction in another order: expected to differ,
  which shows the comparison can fail);
- ``packed``: q/k/v and gate/up packed into one weight and run with each part's launch in turn, each
  part's columns compared with that part's own launch;
- ``split_tiles``: a launch splitting K into 2 or 4 ranges under every tile, compared with the split
  launch of the weight's own tile (does a split column's bits depend only on the K partition too?);
- ``split_order``: each of those with its ranges in parallel programs and in turn in one program.

Prints one JSON line (counts of equal / compared, and the first differing case of each kind).

    PYTHONPATH=$PWD python3 bench/exact_tile_bits.py --config qwen2.5-0.5b qwen2.5-7b
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exact_matmul import SHAPES  # noqa: E402
from train_step import versions  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["qwen2.5-0.5b"], choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, default=256)
    return p.parse_args(argv)


def part_shapes(config: str) -> dict[str, tuple[int, int]]:
    hidden, kv, inter, _, _ = SHAPES[config]
    return {
        "q": (hidden, hidden),
        "k": (kv, hidden),
        "v": (kv, hidden),
        "gate": (inter, hidden),
        "up": (inter, hidden),
    }


class Tally:
    """Equal / compared counts and the first case that differed."""

    def __init__(self):
        self.equal, self.compared, self.first_diff = 0, 0, None

    def add(self, same: bool, case: str) -> None:
        self.compared += 1
        self.equal += same
        if not same and self.first_diff is None:
            self.first_diff = case

    def row(self) -> dict:
        return {"equal": self.equal, "compared": self.compared, "first_diff": self.first_diff}


def run(x: torch.Tensor, w: torch.Tensor, launch, parallel_split=None) -> torch.Tensor | None:
    """``triton_exact.matmul`` with this launch; None where it does not fit the GPU (shared memory)."""
    from triton.runtime.errors import OutOfResources

    from tidal.rollout.kernels.triton_exact import matmul

    try:
        return matmul(x, w, config=launch, parallel_split=parallel_split)
    except OutOfResources:
        return None


def probe(config: str, rows: int) -> dict:
    from tidal.rollout.kernels.triton_exact import matmul, matmul_config

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = part_shapes(config)
    k = shapes["q"][1]
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    weights = {
        name: (torch.randn(n, kk, device="cuda", generator=gen) / kk**0.5).bfloat16()
        for name, (n, kk) in shapes.items()
    }
    own = {name: matmul(x, w) for name, w in weights.items()}
    variants, control, packed, split_tiles, split_order = Tally(), Tally(), Tally(), Tally(), Tally()
    for name, w in weights.items():
        base = matmul_config(*w.shape)
        split_ref = {s: matmul(x, w, config=dataclasses.replace(base, splits=s)) for s in (2, 4)}
        for block_m, block_n, warps in itertools.product((64, 128), (64, 128, 256), (4, 8)):
            cfg = dataclasses.replace(base, block_m=block_m, block_n=block_n, num_warps=warps, num_stages=3)
            other_k = dataclasses.replace(cfg, block_k=128 if base.block_k == 64 else 64)
            for tally, launch in ((variants, cfg), (control, other_k)):
                out = run(x, w, launch)
                if out is not None:  # a launch over the shared memory is left out
                    tally.add(torch.equal(out, own[name]), f"{name} {launch}")
            for splits, ref in split_ref.items():  # a split launch: same bits whatever the tile ...
                launch = dataclasses.replace(cfg, splits=splits)
                out = run(x, w, launch)
                if out is not None:
                    split_tiles.add(torch.equal(out, ref), f"{name} {launch}")
                for parallel in (True, False):  # ... and whether its ranges run in parallel or in turn
                    out = run(x, w, launch, parallel_split=parallel)
                    if out is not None:
                        split_order.add(torch.equal(out, ref), f"{name} {launch} parallel={parallel}")
    for group in (("q", "k", "v"), ("gate", "up")):
        whole = torch.cat([weights[name] for name in group])
        for launch_of in group:
            out = matmul(x, whole, config=matmul_config(*weights[launch_of].shape))
            start = 0
            for name in group:
                n = weights[name].shape[0]
                packed.add(
                    torch.equal(out[:, start : start + n], own[name]),
                    f"{'+'.join(group)} with {launch_of}'s launch: {name}",
                )
                start += n
    return {
        "config": config,
        "variants": variants.row(),
        "control": control.row(),
        "packed": packed.row(),
        "split_tiles": split_tiles.row(),
        "split_order": split_order.row(),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench/exact_tile_bits.py: needs a CUDA GPU (the compiled kernels' bits are the question)"
        )
    results = [probe(config, args.rows) for config in args.config]
    for r in results:
        print(r, file=sys.stderr)
    print(
        json.dumps(
            {
                "bench": "exact_tile_bits",
                "device": torch.cuda.get_device_name(),
                **versions(),
                "rows": args.rows,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
