"""load_agent_executor: the seed README's agent file, tidal's example agent, and clear load errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tidal.agents import AgentError, MultiTurnAgentExecutor, load_agent_executor
from tidal.rollout import SamplingParams
from tidal.testing import AdditionTask

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# The seed README's agent_func.py verbatim, except the import (openrlhf.utils.agent -> tidal.agents).
SEED_AGENT = """
import random
from typing import Any, Dict

import torch
from tidal.agents import AgentInstanceBase, MultiTurnAgentExecutor


# A simple n-step random environment
class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = random.randint(1, 3)  # 1-3 steps

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}  # Return original text observation

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        print(f"step_idx: {self.step_idx}, max_steps: {self.max_steps}")

        observation_text = states["observation_text"]
        action_text = states["action_text"]
        label = states["label"]

        # Check if episode is done
        done = self.step_idx >= self.max_steps
        reward = torch.randint(0, 2, (1,)).float() if done else torch.tensor(0)

        # Generate environment feedback based on whether episode is done
        environment_feedback = (
            "\\n\\nHuman: [CORRECT]\\n</s>"
            if done
            else "\\n\\nHuman: [INCORRECT]\\nPlease analyze the issues and try again.\\n</s>\\n\\nAssistant: "
        )

        self.step_idx += 1

        return {
            "rewards": reward,  # Rewards for advantage calculation
            "scores": reward,  # Scores for dynamic filtering (0-1 reward)
            "environment_feedback": environment_feedback,  # Environment feedback text
            "done": done,  # Boolean indicating if the episode is complete
            "sampling_params": states.get("sampling_params", None),  # Parameters for vLLM sampling in next step
            "extra_logs": {"dummy_scores": reward},  # Additional logging information
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_seed_readme_agent_runs(tmp_path, spy, tokenizer):
    path = tmp_path / "agent_func.py"
    path.write_text(SEED_AGENT)
    executor = load_agent_executor(path)
    assert isinstance(executor, MultiTurnAgentExecutor)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    trajs = executor.run(spy, tokenizer, ["1+2=", "3+4="], ["3", "7"], params, max_length=512)
    assert len(trajs) == 4
    for traj in trajs:
        assert 2 <= traj.num_turns <= 4 and traj.finish_reason == "done"  # max_steps in 1..3, done after it
        assert traj.reward in (0.0, 1.0) and traj.score == traj.reward and "dummy_scores" in traj.extra_logs
        assert len(traj.token_ids) == len(traj.action_mask) == len(traj.rollout_logprobs)
        assert "[CORRECT]" in traj.response_text and sum(traj.action_mask) > 0


def test_example_agent_on_addition_task(spy, tokenizer):
    executor = load_agent_executor(EXAMPLES / "agent_func.py")
    samples = AdditionTask(digits=2, seed=0).samples(3)
    prompts, labels = [s["prompt"] for s in samples], [s["answer"] for s in samples]
    trajs = executor.run(
        spy, tokenizer, prompts, labels, SamplingParams(n=2, max_new_tokens=4), max_length=128
    )
    assert len(trajs) == 6 and all(t.finish_reason == "done" for t in trajs)
    for traj in trajs:  # an untrained model is almost never right: two turns, reward 0
        assert traj.num_turns in (1, 2) and traj.reward in (0.0, 0.5, 1.0)
        if traj.num_turns == 2:
            assert "Incorrect, try again." in traj.response_text
            assert traj.extra_logs["turns"] == 2.0


def test_example_agent_rewards_correct_answers():
    import asyncio
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_agent", EXAMPLES / "agent_func.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    async def episode(actions):
        env = module.ArithmeticEnv()
        await env.reset({"observation": "2+2=", "label": "4"})
        return [await env.step({"action_text": a, "label": "4"}) for a in actions]

    assert asyncio.run(episode(["4"]))[-1]["rewards"] == 1.0
    wrong_then_right = asyncio.run(episode(["5", "4 "]))
    assert wrong_then_right[0]["environment_feedback"] == "\nIncorrect, try again.\n2+2="
    assert wrong_then_right[-1]["rewards"] == 0.5 and wrong_then_right[-1]["done"]
    assert asyncio.run(episode(["5", "6"]))[-1]["rewards"] == 0.0


def write(tmp_path, body):
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(AgentError, match=r"--agent_func_path .*missing.py does not exist"):
        load_agent_executor(tmp_path / "missing.py")
    path = write(tmp_path, "class Executor:\n    pass\n")
    with pytest.raises(AgentError, match=rf"{path} defines no class AgentExecutor"):
        load_agent_executor(path)
    path = write(tmp_path, "class AgentExecutor:\n    pass\n")
    with pytest.raises(
        AgentError, match=rf"AgentExecutor in {path} is .* not a subclass of tidal.agents.AgentExecutorBase"
    ):
        load_agent_executor(path)
    path = write(tmp_path, "raise RuntimeError('bad import')\n")
    with pytest.raises(AgentError, match=r"importing --agent_func_path .*RuntimeError: bad import"):
        load_agent_executor(path)


def test_custom_execute_returning_garbage_is_explained(tmp_path, spy, tokenizer):
    path = write(
        tmp_path,
        """
        from tidal.agents import AgentExecutorBase, Trajectory

        class AgentExecutor(AgentExecutorBase):
            async def execute(self, prompt, label, sampling_params, llm, tokenizer, max_length):
                return Trajectory(prompt, label, [1, 2, 3], [0, 1], [0.0, 0.0, 0.0], 1, "")
        """,
    )
    with pytest.raises(
        AgentError, match=r"AgentExecutor \(.*agent.py\)\.execute returned a malformed Trajectory"
    ):
        load_agent_executor(path).run(spy, tokenizer, ["1+1="], ["2"], SamplingParams(), max_length=16)
