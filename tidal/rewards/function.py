"""``RewardFunction``: rewards computed by a user's ``reward_func.py`` (``--remote_rm_url path.py``).

The file defines ``reward_func(queries, prompts, labels, **kwargs)`` (the seed's example takes only the
three lists) returning a dict with ``rewards``, optional ``scores`` and ``extra_logs``; a bare
tensor/list is accepted as the rewards. Every failure names the file and says what was returned.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

from tidal.rewards.base import RewardError, RewardResult, to_reward_result


def load_python_file(path: str | Path, flag: str, error: type[Exception] = ValueError) -> ModuleType:
    """Import a user's Python file by path (as a uniquely named module); ``flag`` names it in errors."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise error(f"{flag} {path} does not exist or is not a file")
    # A name unique per file, registered in sys.modules so dataclasses and pickling inside it work.
    name = f"tidal_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise error(f"{flag} {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        del sys.modules[name]
        if (err.name or "").split(".")[0] == "openrlhf":  # a file written for OpenRLHF
            raise error(
                f"{flag} {path} imports {err.name}, which is OpenRLHF's: import the same names from "
                f"tidal.agents instead (e.g. `from tidal.agents import AgentInstanceBase, MultiTurnAgentExecutor`)"
            ) from err
        raise error(f"importing {flag} {path} failed: {type(err).__name__}: {err}") from err
    except Exception as err:
        del sys.modules[name]
        raise error(f"importing {flag} {path} failed: {type(err).__name__}: {err}") from err
    return module


class RewardFunction:
    """Score batches with ``reward_func`` from a Python file."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().resolve()
        module = load_python_file(self.path, "reward function file", RewardError)
        func = getattr(module, "reward_func", None)
        if not callable(func):
            raise RewardError(
                f"{self.path} defines no function reward_func(queries, prompts, labels, **kwargs)"
            )
        self.func = func
        self._accepts = _accepted_kwargs(func)

    def __call__(self, queries: list[str], prompts: list[str], labels: list, **kwargs) -> RewardResult:
        n = len(queries)
        if len(prompts) != n or len(labels) != n:
            raise ValueError(f"got {n} queries, {len(prompts)} prompts and {len(labels)} labels")
        if self._accepts is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self._accepts}
        try:
            value = self.func(list(queries), list(prompts), list(labels), **kwargs)
        except Exception as err:
            raise RewardError(f"reward_func in {self.path} raised {type(err).__name__}: {err}") from err
        return to_reward_result(value, n, f"reward_func in {self.path}")

    def __repr__(self) -> str:
        return f"RewardFunction({str(self.path)!r})"


def _accepted_kwargs(func) -> set[str] | None:
    """Names of extra keyword arguments ``func`` takes; None when it takes ``**kwargs`` (all of them)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: pass nothing extra
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    positional = list(params)[3:]  # queries, prompts, labels
    return {p.name for p in positional if p.kind is not inspect.Parameter.VAR_POSITIONAL}
