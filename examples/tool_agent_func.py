"""A tool-using agent for ``--agent_func_path examples/tool_agent_func.py``: multiply with a calculator.

Prompts are products like "37*58=" with labels "2146". The model may call ``multiply`` in the Hermes
format (``<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 58}}</tool_call>``); the result
comes back as a ``tool`` message rendered by the chat template, and the model's next message without
a call is its answer. Score: 1.0 when the answer's first integer is the product, else 0.0; the reward
adds ``TOOL_CALL_REWARD`` to an episode that answered after a call that ran (a format reward: it gets a
small model to use the tool at all; set it to 0 to train on the score alone).

``write_data(folder)`` writes the task's files: ``prompts.jsonl`` for RL and ``sft.jsonl``, chat
demonstrations in which HALF the answers use the tool (and are right) and half guess a number (and
are wrong), so that after SFT the model knows the call format and RL has a choice to learn:


    tidal sft --pretrain MODEL --dataset DIR/sft.jsonl --input_key prompt --output_key answer ...
    tidal ppo --pretrain SFT_MODEL --prompt_data DIR/prompts.jsonl --input_key prompt --label_key label \\
        --agent_func_path examples/tool_agent_func.py --generate_max_len 64 ...
"""

import json
import random
import re
from pathlib import Path

from tidal.agents import ToolAgentExecutor

# A real instruct model reads the tools from the prompt; the tiny test model learns the call format
# from the SFT demonstrations instead, and a ~300-token tool list would only slow it down on CPU.
TOOLS_IN_PROMPT = False
TOOL_CALL_REWARD = 0.2


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def exact_answer(answer: str, label) -> float:
    """1.0 when the first integer of the final answer is the label."""
    match = re.search(r"-?\d+", answer)
    return float(match is not None and match.group(0) == str(label).strip())


class AgentExecutor(ToolAgentExecutor):
    def __init__(self):
        super().__init__(
            tools=[multiply],
            reward_fn=exact_answer,
            parser="hermes",
            max_turns=2,
            tools_in_prompt=TOOLS_IN_PROMPT,
            tool_call_reward=TOOL_CALL_REWARD,
        )


def write_data(
    folder,
    n_sft: int = 512,
    n_prompts: int = 256,
    seed: int = 0,
    tool_fraction: float = 0.5,
    operands: tuple[int, int] = (10, 99),
):
    """Write ``sft.jsonl`` (rendered with the ChatML template of tidal.testing's tiny Qwen2 models) and
    ``prompts.jsonl`` into ``folder``, with factors drawn from ``operands`` (inclusive); return the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with (folder / "sft.jsonl").open("w") as f:
        for _ in range(n_sft):
            a, b = rng.randint(*operands), rng.randint(*operands)
            prompt = f"<|im_start|>user\n{a}*{b}=<|im_end|>\n<|im_start|>assistant\n"
            if rng.random() < tool_fraction:
                call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}, separators=(",", ":"))
                answer = (
                    f"<tool_call>{call}</tool_call><|im_end|>\n<|im_start|>tool\n{a * b}<|im_end|>\n"
                    f"<|im_start|>assistant\n{a * b}"
                )
            else:  # a guess of the right size, almost always wrong
                answer = str(rng.randint(1, operands[1] ** 2))
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    with (folder / "prompts.jsonl").open("w") as f:
        for _ in range(n_prompts):
            a, b = rng.randint(*operands), rng.randint(*operands)
            f.write(json.dumps({"prompt": f"{a}*{b}=", "label": str(a * b)}) + "\n")
    return folder
