"""Synthetic tasks with exact answers, for learning tests and the demo.

``AdditionTask`` makes "a+b=" prompts with their sums, checks answers, and writes JSONL files
in the shapes the trainers read (SFT input/output pairs, RL prompts with labels).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AdditionTask:
    """Sums of two non-negative integers with up to ``digits`` digits each."""

    digits: int = 2
    seed: int = 0

    def samples(self, n: int, split: str = "train", wrong_fraction: float = 0.0) -> list[dict]:
        """``n`` samples ``{"prompt", "answer"}``; train and test splits use disjoint random streams.

        ``wrong_fraction`` replaces that share of answers by a wrong sum (off by 1-9): SFT on such data
        gives a model that is right about as often, a controlled starting point for RL tests.
        """
        rng = random.Random(f"{self.seed}-{split}")
        hi = 10**self.digits - 1
        out = []
        for _ in range(n):
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            answer = a + b
            if rng.random() < wrong_fraction:
                answer = abs(answer + rng.choice([-1, 1]) * rng.randint(1, 9))
                answer = answer if answer != a + b else answer + 1
            out.append({"prompt": f"{a}+{b}=", "answer": str(answer), "label": str(a + b)})
        return out

    @staticmethod
    def is_correct(response: str, answer: str) -> bool:
        """The first integer in the response must equal the answer."""
        match = re.search(r"\d+", response)
        return match is not None and match.group(0) == answer

    def write_jsonl(
        self, path: str | Path, n: int, split: str = "train", wrong_fraction: float = 0.0
    ) -> Path:
        """Write ``n`` samples as JSONL: ``prompt``, ``answer`` (the SFT target) and ``label`` (the true sum)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for sample in self.samples(n, split, wrong_fraction):
                f.write(json.dumps(sample) + "\n")
        return path


def digit_credit(response: str, answer: str) -> float:
    """1.0 for the exact answer; otherwise half the share of digits right (aligned from the units)."""
    match = re.search(r"\d+", response)
    if match is None:
        return 0.0
    got = match.group(0)
    if got == answer:
        return 1.0
    width = max(len(got), len(answer))
    same = sum(a == b for a, b in zip(got.rjust(width), answer.rjust(width), strict=True))
    return 0.5 * same / width


def addition_reward(queries, prompts, labels, **kwargs):
    """A ``reward_func`` for the addition task with partial credit per digit (denser than 0/1).

    ``scores`` are exact-match 0/1 (what accuracy and ``--dynamic_filtering`` look at).
    """
    import torch

    responses = [q[len(p) :] for q, p in zip(queries, prompts, strict=True)]
    rewards = [digit_credit(r, str(lbl)) for r, lbl in zip(responses, labels, strict=True)]
    exact = [float(r == 1.0) for r in rewards]
    return {
        "rewards": torch.tensor(rewards),
        "scores": torch.tensor(exact),
        "extra_logs": {"accuracy": sum(exact) / len(exact)},
    }
