"""An agent file written for OpenRLHF (``from openrlhf.utils.agent import AgentInstanceBase,
MultiTurnAgentExecutor``) loads unchanged when OpenRLHF is not installed: the names are tidal's
(``tidal.rewards.openrlhf_compat``); any other OpenRLHF name fails with one line naming what tidal provides."""

from __future__ import annotations

import sys

import pytest

from tidal.agents import AgentInstanceBase, MultiTurnAgentExecutor, load_agent_executor
from tidal.agents.base import AgentError
from tidal.rewards.openrlhf_compat import openrlhf_installed

pytestmark = pytest.mark.skipif(openrlhf_installed(), reason="the real openrlhf is installed")

OPENRLHF_AGENT = """
from openrlhf.utils import grade_answer
from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        reward = float(grade_answer(states["action_text"].strip(), states["label"]))
        return {"rewards": reward, "scores": reward, "environment_feedback": "", "done": True}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_an_openrlhf_agent_file_loads_with_tidals_classes(tmp_path):
    path = tmp_path / "agent_func.py"
    path.write_text(OPENRLHF_AGENT)
    executor = load_agent_executor(path)
    assert isinstance(executor, MultiTurnAgentExecutor)
    assert issubclass(executor.agent_instance_cls, AgentInstanceBase)
    assert not any(name == "openrlhf" or name.startswith("openrlhf.") for name in sys.modules)


def test_other_openrlhf_names_fail_with_one_line(tmp_path):
    path = tmp_path / "agent_func.py"
    path.write_text("from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase, SomethingElse\n")
    with pytest.raises(AgentError) as info:
        load_agent_executor(path)
    message = str(info.value)
    assert "\n" not in message
    assert "openrlhf.utils.agent.SomethingElse is OpenRLHF's and has no tidal stand-in" in message
    assert (
        "openrlhf.utils.agent (AgentInstanceBase, AgentExecutorBase, MultiTurnAgentExecutor: tidal.agents)"
        in message
    )


def test_other_missing_modules_keep_their_message(tmp_path):
    path = tmp_path / "agent_func.py"
    path.write_text("import no_such_module_here\n")
    with pytest.raises(AgentError, match="ModuleNotFoundError: No module named 'no_such_module_here'"):
        load_agent_executor(path)
