"""Registration by decorator: each registry entry is declared beside the function that implements it.

    POLICY_LOSSES: dict[str, PolicyLoss] = {}

    @register(POLICY_LOSSES, "ppo")
    def ppo_policy_loss(...): ...

Adding a loss, KL estimator, aggregation or correction is one decorated function in one file; the
trainers read the registries. A flag's ``choices`` are the registry's names kept in
``tidal.config.registries`` (``--help`` imports no torch): add the name there too, a test checks they
match. (Entries that carry facts besides the function have their own decorator: advantage estimators
``advantages.advantage_estimator``, policy losses ``policy_loss.policy_loss`` with their default
aggregation.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def register(table: dict[str, Callable], name: str) -> Callable[[F], F]:
    """Decorator: ``table[name] = fn``; refuses a name registered twice (a typo would shadow silently)."""

    def add(fn: F) -> F:
        if name in table:
            raise ValueError(f"{name!r} is registered twice ({table[name].__qualname__}, {fn.__qualname__})")
        table[name] = fn
        return fn

    return add
