"""Agents: turn prompts into trajectories (token ids + action mask + rollout log-probs).

from tidal.agents import AgentInstanceBase, MultiTurnAgentExecutor      # in a user's agent_func.py
from tidal.agents import SingleTurnAgentExecutor, load_agent_executor   # in the trainer

executor = load_agent_executor(path) if path else SingleTurnAgentExecutor()
trajectories = executor.run(engine, tokenizer, prompts, labels, SamplingParams(n=4), max_length=1024)
"""

from tidal.agents.base import (
    AgentError,
    AgentExecutorBase,
    AgentInstanceBase,
    Trajectory,
    create_instance,
)
from tidal.agents.client import LLMClient
from tidal.agents.loader import load_agent_executor
from tidal.agents.multi_turn import MultiTurnAgentExecutor
from tidal.agents.single_turn import SingleTurnAgentExecutor

__all__ = [
    "AgentError",
    "AgentExecutorBase",
    "AgentInstanceBase",
    "LLMClient",
    "MultiTurnAgentExecutor",
    "SingleTurnAgentExecutor",
    "Trajectory",
    "create_instance",
    "load_agent_executor",
]
