"""Let reward and agent files written for OpenRLHF import OpenRLHF's names, served by tidal's code.

OpenRLHF's examples import a handful of helpers: the math reward ``from openrlhf.utils import
extract_boxed_answer, grade_answer``, the agents ``from openrlhf.utils.agent import AgentInstanceBase,
MultiTurnAgentExecutor`` (older ones ``AgentExecutorBase``). While tidal loads a user's file, and only
when the real ``openrlhf`` package is not installed, ``openrlhf_imports`` puts an import hook (a
``sys.meta_path`` finder) first on the import path that answers exactly those names with tidal's
equivalents (``tidal.rewards.math_grading``, ``tidal.agents``); any other ``openrlhf`` module or name
fails with one line naming what tidal provides and where.

Why a scoped finder rather than a permanent ``sys.modules['openrlhf']`` alias: nothing outside the
user's file ever sees a fake ``openrlhf`` (another library probing ``import openrlhf`` still finds it
missing), and an installed OpenRLHF is never shadowed. The cost: the names must be imported when the
file loads (at its top, as OpenRLHF's examples do); an ``import openrlhf...`` inside a function that
runs later meets the plain ``ModuleNotFoundError``. The stand-in modules are removed from
``sys.modules`` when loading ends (the file keeps the objects it imported).

Reward files get ``openrlhf.utils``; agent files (``tidal.agents.loader``) also ``openrlhf.utils.agent``,
passed in by the agents package (``tidal.rewards`` cannot import ``tidal.agents``, which builds on it).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from tidal.rewards.math_grading import extract_boxed_answer, grade_answer


class StandIn(NamedTuple):
    """One OpenRLHF module tidal stands in for: the tidal module the names come from, and the names."""

    tidal_module: str
    names: Mapping[str, Any]


# What reward files get (OpenRLHF's openrlhf/utils/__init__.py exports these from math_utils).
REWARD_STAND_INS: dict[str, StandIn] = {
    "openrlhf.utils": StandIn(
        "tidal.rewards.math_grading",
        {"extract_boxed_answer": extract_boxed_answer, "grade_answer": grade_answer},
    ),
}


def _provided(stand_ins: Mapping[str, StandIn]) -> str:
    """``openrlhf.utils (extract_boxed_answer, grade_answer: tidal.rewards.math_grading); ...``."""
    return "; ".join(f"{name} ({', '.join(s.names)}: {s.tidal_module})" for name, s in stand_ins.items())


class _StandInLoader(importlib.abc.Loader):
    """Builds the stand-in module: the provided names, a ``__getattr__`` refusing every other one."""

    def __init__(self, stand_ins: Mapping[str, StandIn]):
        self.stand_ins = stand_ins

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        stand_in = self.stand_ins.get(name)
        # Every stand-in is a package, so that a submodule import (``openrlhf.utils.agent`` in a reward
        # file) reaches this hook's refusal rather than Python's "'openrlhf.utils' is not a package".
        module.__path__ = []
        if stand_in is not None:
            module.__dict__.update(stand_in.names)
        provided = _provided(self.stand_ins)

        def __getattr__(attr: str) -> Any:  # an ImportError passes through "from x import attr" unchanged
            if attr.startswith("__"):
                raise AttributeError(attr)
            raise ImportError(
                f"{name}.{attr} is OpenRLHF's and has no tidal stand-in (OpenRLHF is not installed); "
                f"tidal provides only {provided}"
            )

        module.__getattr__ = __getattr__


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Answers ``openrlhf`` and the stand-in modules; refuses every other ``openrlhf.*`` module."""

    def __init__(self, stand_ins: Mapping[str, StandIn]):
        self.stand_ins = stand_ins
        self.loader = _StandInLoader(stand_ins)
        self.packages = {".".join(n.split(".")[:i]) for n in stand_ins for i in range(1, n.count(".") + 1)}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != "openrlhf" and not fullname.startswith("openrlhf."):
            return None
        if fullname in self.stand_ins or fullname in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self.loader, is_package=True)
        raise ImportError(
            f"{fullname} is OpenRLHF's and has no tidal stand-in (OpenRLHF is not installed); "
            f"tidal provides only {_provided(self.stand_ins)}"
        )


def openrlhf_installed() -> bool:
    """Whether the real ``openrlhf`` package can be imported (then it is used, never shadowed)."""
    return "openrlhf" in sys.modules or importlib.util.find_spec("openrlhf") is not None


@contextlib.contextmanager
def openrlhf_imports(extra: Mapping[str, StandIn] | None = None) -> Iterator[None]:
    """While the block runs (loading a user's file), ``import openrlhf.utils`` & co. resolve to tidal's
    stand-ins (``REWARD_STAND_INS`` plus ``extra``), unless OpenRLHF itself is installed."""
    if openrlhf_installed():
        yield
        return
    finder = _StandInFinder({**REWARD_STAND_INS, **(extra or {})})
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n, m in sys.modules.items() if getattr(m, "__loader__", None) is finder.loader]:
            del sys.modules[name]
