"""``load_agent_executor``: the ``AgentExecutor`` class of a user's ``--agent_func_path`` file."""

from __future__ import annotations

from pathlib import Path

from tidal.agents.base import AgentError, AgentExecutorBase
from tidal.rewards.function import load_python_file


def load_agent_executor(agent_func_path: str | Path) -> AgentExecutorBase:
    """Import the file and instantiate its ``AgentExecutor()`` (a subclass of ``AgentExecutorBase``)."""
    path = Path(agent_func_path).expanduser().resolve()
    module = load_python_file(path, "--agent_func_path", AgentError)
    cls = getattr(module, "AgentExecutor", None)
    if cls is None:
        raise AgentError(
            f"--agent_func_path {path} defines no class AgentExecutor "
            "(e.g. class AgentExecutor(MultiTurnAgentExecutor) with __init__ calling super().__init__(AgentInstance))"
        )
    if not isinstance(cls, type) or not issubclass(cls, AgentExecutorBase):
        raise AgentError(
            f"AgentExecutor in {path} is {cls!r}, not a subclass of tidal.agents.AgentExecutorBase "
            "(or MultiTurnAgentExecutor)"
        )
    try:
        executor = cls()
    except Exception as err:
        raise AgentError(f"AgentExecutor() in {path} raised {type(err).__name__}: {err}") from err
    executor.source_path = path
    return executor
