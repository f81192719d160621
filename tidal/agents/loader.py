"""``load_agent_executor``: the ``AgentExecutor`` class of a user's ``--agent_func_path`` file.

A file written for OpenRLHF imports ``from openrlhf.utils.agent import AgentInstanceBase,
MultiTurnAgentExecutor`` (or ``AgentExecutorBase``), and maybe the math helpers of ``openrlhf.utils``:
while it loads, and when OpenRLHF is not installed, those names are tidal's (``OPENRLHF_AGENT``,
``tidal.rewards.openrlhf_compat``)."""

from __future__ import annotations

from pathlib import Path

from tidal.agents.base import AgentError, AgentExecutorBase, AgentInstanceBase
from tidal.agents.multi_turn import MultiTurnAgentExecutor
from tidal.rewards.function import load_python_file
from tidal.rewards.openrlhf_compat import StandIn, openrlhf_imports

# The names OpenRLHF's agent examples import from openrlhf.utils.agent, as tidal's classes.
OPENRLHF_AGENT = {
    "openrlhf.utils.agent": StandIn(
        "tidal.agents",
        {
            "AgentInstanceBase": AgentInstanceBase,
            "AgentExecutorBase": AgentExecutorBase,
            "MultiTurnAgentExecutor": MultiTurnAgentExecutor,
        },
    )
}


def load_agent_executor(agent_func_path: str | Path) -> AgentExecutorBase:
    """Import the file and instantiate its ``AgentExecutor()`` (a subclass of ``AgentExecutorBase``)."""
    path = Path(agent_func_path).expanduser().resolve()
    with openrlhf_imports(OPENRLHF_AGENT):
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
