"""A small multi-turn agent for ``--agent_func_path examples/agent_func.py`` (works with ``tidal demo``'s
addition task: prompts like "12+34=" and labels like "46").

The model answers; a wrong answer gets the feedback "Incorrect, try again." followed by the question
again, and one more turn. Reward: 1.0 for a correct answer at the first turn, ``DECAY`` times less for
each retry, 0.0 when every turn was wrong. The reward is given on the last step (earlier steps return
0), which is the step the executor takes it from.
"""

import re
from typing import Any

from tidal.agents import AgentInstanceBase, MultiTurnAgentExecutor

MAX_TURNS = 2
DECAY = 0.5


def first_number(text: str) -> str | None:
    match = re.search(r"-?\d+", text)
    return match.group(0) if match else None


class ArithmeticEnv(AgentInstanceBase):
    def __init__(self):
        self.turn = 0
        self.question = ""

    async def reset(self, states: dict, **kwargs) -> dict:
        self.question = states["observation"]
        return {"observation": self.question}

    async def step(self, states: dict, **kwargs) -> dict[str, Any]:
        self.turn += 1
        correct = first_number(states["action_text"]) == str(states["label"]).strip()
        done = correct or self.turn >= MAX_TURNS
        reward = DECAY ** (self.turn - 1) if correct else 0.0
        return {
            "rewards": reward,
            "scores": float(correct),
            # Re-asking the question lets a small model answer in the same format as the first turn.
            "environment_feedback": "" if done else f"\nIncorrect, try again.\n{self.question}",
            "done": done,
            "extra_logs": {"correct": float(correct), "turns": float(self.turn)} if done else {},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(ArithmeticEnv)
