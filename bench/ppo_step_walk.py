"""Walk one PPO step through the code: the files and folders it passes and the calls that climb back up.

Runs a tiny PPO-GAE run on the CPU (one process) with a profiler hook and records, from the first rollout's
generation (``sampling.py::_round``, in ``tidal/trainers/ppo/``; before issue #35 ``stream.py::_generate``, before issue #33 in ``tidal/placement/``) to the end of the first ``train_step``, every call
from one tidal folder into another (each distinct caller function → callee function once, in the order
first seen). A call *climbs back up* when the callee's folder sits in a higher layer than the caller's
(``LAYERS`` of tests/test_imports.py): code of a lower layer running code of a higher one it cannot
import (a callback, or an object handed down), e.g. the engine running the rollout role's generation
function (``take_turns``), or a critic in ``placement`` running the trainer's update. Calling down and returning are
the layers' normal direction. Prints one JSON line: distinct calls, files, folder-to-folder calls,
climbs; ``--calls`` lists the folder-to-folder calls first (``^`` marks a climb)::

    python bench/ppo_step_walk.py [--calls]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_imports import LAYERS  # noqa: E402 (the layer order the import test checks)

from tidal.cli.train_ppo import parse_run  # noqa: E402
from tidal.testing import build_tiny_model  # noqa: E402
from tidal.trainers.ppo import run_ppo  # noqa: E402

PACKAGE = str(ROOT / "tidal") + "/"
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
REWARD = "import torch\n\ndef reward_func(queries, prompts, labels, **kwargs):\n    return {'rewards': torch.ones(len(queries))}\n"


def where(code) -> tuple[str, str] | None:
    """``(folder, "file.py::function")`` of a tidal function, None outside tidal."""
    if not code.co_filename.startswith(PACKAGE):
        return None
    rel = code.co_filename[len(PACKAGE) :]
    return rel.split("/")[0].removesuffix(".py"), f"{rel}::{code.co_name}"


class Walk:
    """The profiler hook: records the distinct calls from one tidal folder into another."""

    def __init__(self) -> None:
        self.recording, self.done = False, False
        self.calls: list[tuple[tuple[str, str], tuple[str, str]]] = []
        self.seen: set = set()

    def __call__(self, frame, event, arg) -> None:
        if self.done or event not in ("call", "return"):
            return
        callee = where(frame.f_code)
        if callee is None:
            return
        name = callee[1]
        if event == "call" and not self.recording and name.endswith("sampling.py::_round"):
            self.recording = True
        if event == "return" and self.recording and name.endswith("trainer.py::train_step"):
            self.done = True
        if event != "call" or not self.recording:
            return
        caller_frame = frame.f_back
        while caller_frame is not None and where(caller_frame.f_code) is None:
            caller_frame = caller_frame.f_back
        caller = where(caller_frame.f_code) if caller_frame is not None else None
        if caller is None or caller[0] == callee[0]:
            return
        if (caller[1], name) not in self.seen:
            self.seen.add((caller[1], name))
            self.calls.append((caller, callee))

    def climbs(self) -> list[bool]:
        return [LAYER[callee[0]] > LAYER[caller[0]] for caller, callee in self.calls]

    def summary(self) -> dict:
        files = {f.split("::")[0] for call in self.calls for _, f in call}
        return {"folder_calls": len(self.calls), "files": len(files), "climbs": sum(self.climbs())}


def main(show_calls: bool) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model = build_tiny_model(d / "model", "qwen2", seed=0)
        (d / "reward.py").write_text(REWARD)
        rng = random.Random(0)
        with (d / "prompts.jsonl").open("w") as f:
            f.writelines(
                json.dumps({"prompt": f"{rng.randint(0, 9)}>", "label": "1"}) + "\n" for _ in range(8)
            )
        run = parse_run([
            "--pretrain", str(model), "--prompt_data", str(d / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--remote_rm_url", str(d / "reward.py"), "--advantage_estimator", "gae",
            "--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--train_batch_size", "8",
            "--micro_train_batch_size", "8", "--generate_max_len", "4", "--prompt_max_len", "8",
            "--init_kl_coef", "0.01", "--save_path", str(d / "out"), "--max_samples", "4",
        ])  # fmt: skip
        walk = Walk()
        sys.setprofile(walk)
        try:
            run_ppo(run)
        finally:
            sys.setprofile(None)
    if show_calls:
        for (caller, callee), up in zip(walk.calls, walk.climbs(), strict=True):
            print(f"{'^' if up else ' '} {caller[1]} -> {callee[1]}")
    print(json.dumps(walk.summary()))


if __name__ == "__main__":
    main("--calls" in sys.argv[1:])
