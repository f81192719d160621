"""From model responses and dataset labels to sandbox runs: the code block, the tests, the reward."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence

from tidal.rewards.sandbox.config import SCORED_STATUSES, STATUSES, SandboxLimits, SandboxResult, TestCase
from tidal.rewards.sandbox.runner import run_many

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str | None:
    """The last ```python (or ```py) block of a response; else its last unlabelled ``` block; else None."""
    blocks = _FENCE.findall(response)
    for wanted in (("python", "py", "python3"), ("",)):
        chosen = [body for lang, body in blocks if lang.lower() in wanted]
        if chosen:
            return chosen[-1]
    return None


def parse_tests(label, where: str = "label") -> list[TestCase] | str:
    """Tests from a dataset label: a string of asserts; ``{"inputs": [...], "outputs": [...]}`` (APPS);
    a list of ``{"input": ..., "output": ...}``; or either of those as a JSON string."""
    if isinstance(label, str):
        stripped = label.strip()
        if stripped[:1] in "[{":
            try:
                label = json.loads(stripped)
            except ValueError:
                label = stripped  # e.g. a test file starting with a list literal: treat as Python
        if isinstance(label, str):
            return label
    if isinstance(label, dict) and "inputs" in label and "outputs" in label:
        inputs, outputs = label["inputs"], label["outputs"]
        if isinstance(inputs, list) and isinstance(outputs, list) and len(inputs) == len(outputs) and inputs:
            return [TestCase(_text(i), _text(o)) for i, o in zip(inputs, outputs, strict=True)]
    if (
        isinstance(label, list)
        and label
        and all(isinstance(c, dict) and {"input", "output"} <= set(c) for c in label)
    ):
        return [TestCase(_text(c["input"]), _text(c["output"])) for c in label]
    raise ValueError(
        f"{where} is {_clip(repr(label))}; expected a string of assert statements, "
        '{"inputs": [...], "outputs": [...]} of equal non-zero length, or a list of {"input", "output"}'
    )


def _text(value) -> str:
    return (
        value
        if isinstance(value, str)
        else "\n".join(map(str, value))
        if isinstance(value, list)
        else str(value)
    )


def code_reward(
    queries: Sequence[str],
    prompts: Sequence[str],
    labels: Sequence,
    limits: SandboxLimits | None = None,
    concurrency: int | None = None,
) -> dict:
    """A ``reward_func``: the last ```python block of each response runs against its label's tests;
    reward = fraction passed (0 for no code block and for every failure of the sample as a whole).

    ``extra_logs`` has the mean pass rate and the fraction of samples with each status; a one-line
    summary of the failures (count and first message per status) goes to the ``tidal.rewards.sandbox``
    logger at INFO level."""
    samples, results = [], {}
    for i, (query, prompt, label) in enumerate(zip(queries, prompts, labels, strict=True)):
        response = query[len(prompt) :] if query.startswith(prompt) else query
        tests = parse_tests(label, f"label of sample {i}")
        code = extract_code(response)
        if code is None:
            results[i] = SandboxResult(
                0, 1 if isinstance(tests, str) else len(tests), "no_code", "no ``` block"
            )
        else:
            samples.append((i, code, tests))
    ran = run_many([(code, tests) for _, code, tests in samples], limits, concurrency)
    results.update({i: result for (i, _, _), result in zip(samples, ran, strict=True)})
    ordered = [results[i] for i in range(len(queries))]
    rewards = [r.score for r in ordered]
    n = max(len(ordered), 1)
    logs = {"sandbox/pass_rate": sum(rewards) / n}
    logs.update({f"sandbox/{status}": sum(r.status == status for r in ordered) / n for status in STATUSES})
    failures = {}
    for r in ordered:
        if r.status not in SCORED_STATUSES:
            count, message = failures.get(r.status, (0, r.message))
            failures[r.status] = (count + 1, message)
    if failures:
        summary = "; ".join(
            f"{status} x{count} (e.g. {message})" for status, (count, message) in failures.items()
        )
        logging.getLogger("tidal.rewards.sandbox").info("sandbox: %d of %d samples failed: %s", sum(
            c for c, _ in failures.values()), len(ordered), summary)  # fmt: skip
    return {"rewards": rewards, "scores": rewards, "extra_logs": logs}


def _clip(text: str, chars: int = 60) -> str:
    return text if len(text) <= chars else text[: chars - 3] + "..."
