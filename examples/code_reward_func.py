"""A code reward for ``--remote_rm_url examples/code_reward_func.py``: each response's last ```python
block runs against its label's tests in a sandbox (``tidal.rewards.sandbox``); reward = fraction passed.

Labels (``--label_key``) are a string of ``assert`` statements (MBPP/HumanEval style), or stdin/stdout
tests as ``{"inputs": [...], "outputs": [...]}`` (APPS style) or a list of ``{"input", "output"}``,
possibly JSON-encoded. A response without a code block, and any sample that times out, crashes, runs
out of memory, prints without end, writes a huge file, forks or touches the network, scores 0 and
never stops training; ``extra_logs`` count each of those (``sandbox/<status>``, as fractions of the
batch). Copy this file and change the limits below for your task.
"""

from tidal.rewards.sandbox import SandboxLimits, code_reward

LIMITS = SandboxLimits(timeout_s=10.0, memory_mb=1024, max_output_bytes=1 << 20)
CONCURRENCY = None  # samples run at once; None: one per CPU


def reward_func(queries, prompts, labels, **kwargs):
    return code_reward(queries, prompts, labels, LIMITS, CONCURRENCY)
