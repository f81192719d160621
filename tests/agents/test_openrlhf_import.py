"""An agent file written for OpenRLHF (``from openrlhf.utils.agent import ...``) fails with one line
naming the tidal import to use, not a bare ModuleNotFoundError."""

from __future__ import annotations

import pytest

from tidal.agents import load_agent_executor
from tidal.agents.base import AgentError


def test_agent_file_importing_openrlhf_names_the_tidal_import(tmp_path):
    path = tmp_path / "agent_func.py"
    path.write_text("from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase\n")
    with pytest.raises(AgentError) as info:
        load_agent_executor(path)
    message = str(info.value)
    assert "\n" not in message
    assert "imports openrlhf, which is OpenRLHF's" in message
    assert "from tidal.agents import AgentInstanceBase, MultiTurnAgentExecutor" in message


def test_other_missing_modules_keep_their_message(tmp_path):
    path = tmp_path / "agent_func.py"
    path.write_text("import no_such_module_here\n")
    with pytest.raises(AgentError, match="ModuleNotFoundError: No module named 'no_such_module_here'"):
        load_agent_executor(path)
