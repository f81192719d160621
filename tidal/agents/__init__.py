"""Agents: turn prompts into trajectories (token ids + action mask + rollout log-probs).

from tidal.agents import AgentInstanceBase, MultiTurnAgentExecutor      # in a user's agent_func.py
from tidal.agents import SingleTurnAgentExecutor, load_agent_executor   # in the trainer

executor = load_agent_executor(path) if path else SingleTurnAgentExecutor()
trajectories = executor.run(engine, tokenizer, prompts, labels, SamplingParams(n=4), max_length=1024)

from tidal.agents import ToolAgentExecutor, parse_tool_calls   # tool-using agents (tools.py; parsers: tidal.data.tool_parsers)
"""

from tidal.agents.base import (
    AgentError,
    AgentExecutorBase,
    AgentInstanceBase,
    EpisodeError,
    Trajectory,
    create_instance,
)
from tidal.agents.client import LLMClient
from tidal.agents.loader import load_agent_executor
from tidal.agents.multi_turn import MultiTurnAgentExecutor
from tidal.agents.single_turn import SingleTurnAgentExecutor
from tidal.agents.tools import ToolAgentExecutor, tool_schema
from tidal.data.tool_parsers import (
    TOOL_PARSERS,
    ParsedMessage,
    ToolParseError,
    detect_tool_parser,
    parse_tool_calls,
)

__all__ = [
    "AgentError",
    "AgentExecutorBase",
    "AgentInstanceBase",
    "EpisodeError",
    "LLMClient",
    "MultiTurnAgentExecutor",
    "ParsedMessage",
    "SingleTurnAgentExecutor",
    "TOOL_PARSERS",
    "ToolAgentExecutor",
    "ToolParseError",
    "Trajectory",
    "create_instance",
    "detect_tool_parser",
    "load_agent_executor",
    "parse_tool_calls",
    "tool_schema",
]
