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

    def samples(self, n: int, split: str = "train") -> list[dict]:
        """``n`` samples ``{"prompt", "answer"}``; train and test splits use disjoint random streams."""
        rng = random.Random(f"{self.seed}-{split}")
        hi = 10**self.digits - 1
        out = []
        for _ in range(n):
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            out.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
        return out

    @staticmethod
    def is_correct(response: str, answer: str) -> bool:
        """The first integer in the response must equal the answer."""
        match = re.search(r"\d+", response)
        return match is not None and match.group(0) == answer

    def write_jsonl(self, path: str | Path, n: int, split: str = "train") -> Path:
        """Write ``n`` samples as JSONL with keys ``prompt`` and ``answer``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for sample in self.samples(n, split):
                f.write(json.dumps(sample) + "\n")
        return path
