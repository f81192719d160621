"""Run model-written Python against test cases in a bubblewrap sandbox (code rewards).

    from tidal.rewards.sandbox import TestCase, run_tests, run_many
    run_tests("def add(a, b):\\n    return a + b", "assert add(1, 2) == 3\\nassert add(2, 2) == 5")
    # SandboxResult(passed=1, total=2, status='failed',
    #               message='1/2 passed; test 2 (assert add(2, 2) == 5): AssertionError: got 4')
    run_tests("print(sum(map(int, input().split())))", [TestCase("1 2\\n", "3\\n")], timeout_s=2)

Tests are either a string of ``assert`` statements (HumanEval/MBPP style: each top-level ``assert`` is
one test, other statements are setup run in order) or ``TestCase(stdin, stdout)`` pairs (the program
runs once per case as ``__main__`` with that stdin; its stdout must match up to trailing whitespace).

Where each part lives (docs/recipes.md, "Code rewards in a sandbox", is the user's view):

- ``config``: ``TestCase``, ``SandboxLimits``, ``SandboxResult``, the statuses, ``SandboxUnavailable``;
- ``runner``: ``run_tests`` / ``run_many``: one sandbox per sample, deadline, output cap, kill;
- ``isolation``: the bubblewrap command (what the code can see and do), the ``isolation="none"`` opt-out;
- ``seccomp``: the system-call filter (libseccomp); ``cgroup``: the pids cgroup when the trainer is root;
- ``harness``: the script that runs inside the sandbox; ``verdict``: what goes in, and the score from
  what comes out, decided outside the sandbox from facts the code cannot fake;
- ``reward``: ``extract_code``, ``parse_tests`` and the ``code_reward`` reward function.
"""

from tidal.rewards.sandbox.config import (
    SCORED_STATUSES,
    STATUSES,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    TestCase,
)
from tidal.rewards.sandbox.reward import code_reward, extract_code, parse_tests
from tidal.rewards.sandbox.runner import run_many, run_tests

__all__ = [
    "SCORED_STATUSES",
    "STATUSES",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "TestCase",
    "code_reward",
    "extract_code",
    "parse_tests",
    "run_many",
    "run_tests",
]
