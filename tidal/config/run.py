"""The base of a run: one dataclass of component configs, its defaults, and one check pass.

A run (``SFTRun``, ``PPORun``...) is a ``RunConfig`` whose fields are component configs declared with
``config_field``: the run owns their defaults (``config_field(lambda: TrainConfig(micro_train_batch_size=4))``),
so a run built in Python is the run its command builds from the same required flags, and the command
reads its flag defaults from the run (``tidal.cli.common.TrainerCommand``). ``problems`` lists every
problem of every config plus the run's own checks across configs (``cross_problems``); ``check``
raises them all in one ``ConfigError``, one line each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from tidal.config.args import checks_deferred, config_problems, raise_problems


def config_field(factory: Callable[[], Any] | None = None, *, flags: Mapping[str, str] | None = None) -> Any:
    """A run's component config: ``factory`` builds the run's default (none: the config has required
    flags); ``flags`` renames some of its fields' flags in this run (``{"learning_rate":
    "actor_learning_rate"}``), its other flags are shared with any earlier config of the same class."""
    metadata = {"flags": dict(flags or {})}
    if factory is None:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default_factory=factory, metadata=metadata)


def run_flags(field: dataclasses.Field) -> dict[str, str]:
    """The flag renames a run declares for one of its configs."""
    return field.metadata.get("flags", {})


def run_defaults(run_cls: type) -> dict[str, Any]:
    """The run's default config per field (only the configs that have one)."""
    return {
        f.name: f.default_factory()
        for f in dataclasses.fields(run_cls)
        if f.default_factory is not dataclasses.MISSING
    }


class RunConfig:
    """Base of a run dataclass: one check pass over its configs and across them."""

    def cross_problems(self, world: Any = None) -> list[str]:
        """Problems across configs (a subclass extends this); ``world`` (a ``tidal.distributed.World``),
        when given, adds those that depend on the number of processes."""
        return []

    def problems(self, world: Any = None) -> list[str]:
        """Every problem of the run, one line each: each config's (in field order), then across them."""
        found = []
        for field in dataclasses.fields(self):
            cfg = getattr(self, field.name)
            if dataclasses.is_dataclass(cfg):
                found += config_problems(cfg, run_flags(field))
        return found + self.cross_problems(world)

    def check(self, world: Any = None) -> None:
        """Raise every problem at once (one ``ConfigError``, one line per problem)."""
        raise_problems(self.problems(world))

    def __post_init__(self) -> None:
        if not checks_deferred():
            self.check()
