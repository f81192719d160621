"""pass@k evaluation: the unbiased estimator, per-prompt grouping, and a reward function as an eval task.

A sample *passes* when its score reaches a threshold (``--eval_pass_threshold``, default 1.0: a
correct answer under 0/1 or correctness-scored reward functions). With ``n`` samples of a prompt of
which ``c`` pass, pass@k is estimated without bias by ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021,
"Evaluating Large Language Models Trained on Code") and averaged over prompts. Scores, not shaped
rewards, decide passing: a reward function's ``scores`` say how good an answer is, while its
``rewards`` may carry format bonuses or penalties. The RL trainer's evaluation (``eval/pass@1``,
``eval/pass@k`` with k = ``--eval_n_samples_per_prompt``) and ``tidal generate --eval_task`` use the
same functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_PASS_THRESHOLD = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n`` (``c`` of
    them passing) passes: ``1 - C(n-c, k) / C(n, k)``."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:  # every draw of k contains a passing sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_counts(scores: Sequence[float], n: int, threshold: float) -> list[int]:
    """Passing samples per prompt; ``scores`` are prompt-major (``n`` consecutive samples a prompt)."""
    if n < 1 or len(scores) % n:
        raise ValueError(f"{len(scores)} scores are not whole groups of {n} samples per prompt")
    return [sum(s >= threshold for s in scores[i : i + n]) for i in range(0, len(scores), n)]


def pass_at_k_stats(scores: Sequence[float], n: int, threshold: float = DEFAULT_PASS_THRESHOLD) -> dict:
    """``pass@1`` and ``pass@n`` averaged over prompts (one key when ``n`` is 1)."""
    counts = pass_counts([float(s) for s in scores], n, threshold)
    if not counts:
        return {}
    return {f"pass@{k}": sum(pass_at_k(n, c, k) for c in counts) / len(counts) for k in sorted({1, n})}
