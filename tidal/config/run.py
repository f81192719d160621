"""The base of a run: one dataclass of component configs, its defaults, and one check pass.

A run (``SFTRun``, ``PPORun``...) is a ``RunConfig`` whose fields are component configs declared with
``config_field``: the run owns their defaults (``config_field(lambda: TrainConfig(micro_train_batch_size=4))``),
so a run built in Python is the run its command builds from the same required flags, and the command
reads its flag defaults from the run (``tidal.cli.common.TrainerCommand``). ``problems`` lists every
problem of every config plus the run's own checks across configs (``cross_problems``) and the one check
every run shares (``overwrite_problems``: no output folder may be a model folder the run reads, so
``tidal dpo --pretrain ./ckpt`` after ``tidal sft`` cannot overwrite the SFT model with its default
``--save_path ./ckpt``); ``check`` raises them all in one ``ConfigError``, one line each.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tidal.config.args import checks_deferred, config_problems, flag_name, raise_problems

# Flags naming folders a run writes models or checkpoints into, and flags naming models it reads (a flag
# named ``*pretrain``, e.g. ``--pretrain``, ``--ref_pretrain``, ``--reward_pretrain``, or ``--teacher_model``).
OUTPUT_FLAGS = ("save_path", "ckpt_path")
INPUT_SUFFIXES = ("pretrain", "teacher_model")


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
        return found + self.cross_problems(world) + overwrite_problems(self)

    def check(self, world: Any = None) -> None:
        """Raise every problem at once (one ``ConfigError``, one line per problem)."""
        raise_problems(self.problems(world))

    def __post_init__(self) -> None:
        if not checks_deferred():
            self.check()


def _flag_values(run: Any) -> Iterator[tuple[str, Any]]:
    """``(flag, value)`` of every field of the run's component configs, under the run's flag names."""
    for field in dataclasses.fields(run):
        cfg = getattr(run, field.name)
        if dataclasses.is_dataclass(cfg):
            for f in dataclasses.fields(cfg):
                yield flag_name(f, run_flags(field)), getattr(cfg, f.name)


def overwrite_problems(run: Any) -> list[str]:
    """An output folder (``--save_path``, ``--ckpt_path``) that resolves to a local model folder the run
    reads (``--pretrain``...): the run would write over the model it starts from."""
    values = list(_flag_values(run))
    inputs = [(flag, path) for flag, value in values if flag.endswith(INPUT_SUFFIXES) and isinstance(value, str)
              for path in value.split(",") if path.strip() and os.path.isdir(path.strip())]  # fmt: skip
    problems = []
    for out_flag, out in values:
        if out_flag not in OUTPUT_FLAGS or not isinstance(out, str) or not out:
            continue
        for in_flag, path in inputs:
            if os.path.realpath(out) == os.path.realpath(path.strip()):
                problems.append(
                    f"--{out_flag} {out} is the --{in_flag} folder ({os.path.realpath(out)}): the run would "
                    f"write over the model it reads; pass another --{out_flag}"
                )
    return problems
