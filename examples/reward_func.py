"""A rule-based math reward for ``--remote_rm_url examples/reward_func.py`` (works with ``tidal demo``'s
addition task: prompts like "12+34=" and labels like "46").

reward = 1.0 when the first number of the response equals the label, else 0.0, plus a small format
bonus (0.1) for a response that is just a number; ``scores`` is the 0/1 correctness, which
``--dynamic_filtering`` compares against its score range.
"""

import re

import torch

FORMAT_BONUS = 0.1
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(response: str) -> str | None:
    """The first number in the response (the addition task's answer comes first)."""
    match = _NUMBER.search(response)
    return match.group(0) if match else None


def reward_func(queries, prompts, labels, **kwargs):
    correct, formatted = [], []
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        # queries are prompt + response; the reward only looks at the response.
        response = query[len(prompt) :] if query.startswith(prompt) else query
        answer = extract_answer(response)
        correct.append(float(answer is not None and label is not None and answer == str(label).strip()))
        formatted.append(float(re.fullmatch(r"\s*-?\d+\s*", response) is not None))
    correct_t, formatted_t = torch.tensor(correct), torch.tensor(formatted)
    return {
        "rewards": correct_t + FORMAT_BONUS * formatted_t,
        "scores": correct_t,
        "extra_logs": {"accuracy": correct_t.mean(), "format": formatted_t.mean()},
    }
