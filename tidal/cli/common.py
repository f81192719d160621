"""Shared pieces of the command-line entry points: parser construction and clean error exits."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from tidal.cli.openrlhf import aliases, default_notes, dotted_aliases, openrlhf_module, refusals
from tidal.config.args import (
    ConfigError,
    FlagParser,
    accept_negative_numbers,
    add_config_group,
    add_override_group,
    config_from_args,
    config_problems,
    deferred_checks,
    flag_name,
    override_flags,
    raise_problems,
)
from tidal.config.run import run_defaults, run_flags


def error_kinds() -> tuple[tuple[type, ...], tuple[type, ...], type]:
    """(user errors, training failures, interruption): errors in the user's input or files, not bugs
    (one line naming the flag/file, exit status 2); training that cannot go on (diverged, disk full,
    unusable checkpoint: one line, exit status 1); SIGTERM/SIGINT. Imported here, not at the top, so
    that building a parser (``--help``) does not import torch and datasets through these modules."""
    from tidal.agents.base import AgentError
    from tidal.checkpoint import CheckpointError, TrainingInterrupted
    from tidal.data import DataError
    from tidal.rewards.base import RewardError
    from tidal.trainers.optim import NonFiniteError

    user = (ConfigError, DataError, FileNotFoundError, RewardError, AgentError)
    return user, (CheckpointError, NonFiniteError), TrainingInterrupted


def make_parser(
    prog: str, description: str, groups: Sequence[tuple], command: str | None = None
) -> argparse.ArgumentParser:
    """A parser with one ``--help`` group per config dataclass, defaults shown.

    Each group is ``(ConfigClass, title)`` or ``(ConfigClass, title, excluded_field_names)``.
    ``command``: the tidal command (``sft``), whose OpenRLHF counterpart's flags that tidal does not
    define are aliased or refused with a reason (``tidal.cli.openrlhf``).
    """
    module = openrlhf_module(command) if command else None
    parser = FlagParser(
        prog=prog,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        refused=refusals(module) if module else None,
        aliases=aliases(module) if module else None,
        renames=partial(dotted_aliases, module) if module else None,
        notes=default_notes(module) if module else None,
    )
    accept_negative_numbers(parser)
    for cls, title, *rest in groups:
        add_config_group(parser, cls, title, exclude=set(rest[0]) if rest else frozenset())
    add_launcher_flags(parser)
    return parser


def add_launcher_flags(parser: argparse.ArgumentParser) -> None:
    """``--local_rank``, which DeepSpeed's launcher (``deepspeed --module openrlhf.cli.X``) passes to every
    command, where the command does not define it already (the trainers' distributed group does): it is
    read and ignored, because each process takes its rank from the ``LOCAL_RANK`` environment variable,
    which torchrun and deepspeed both set (``tidal.distributed.world``)."""
    if "--local_rank" in parser._option_string_actions:
        return
    group = parser.add_argument_group("launcher", "set by launchers; read from the environment instead")
    group.add_argument(
        "--local_rank",
        type=int,
        default=-1,
        help="set by deepspeed's launcher; ignored: tidal reads LOCAL_RANK from the environment "
        "(torchrun and deepspeed set it)",
    )


def run_command(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, body: Callable[[argparse.Namespace], object]
):
    """Parse ``argv`` and run ``body``; user errors print ``prog: error: ...`` (one line per problem)
    and exit with status 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ns = parser.parse_args(argv)
    user_errors, training_failures, interrupted = error_kinds()
    try:
        return body(ns)
    except user_errors as err:
        lines = str(err).splitlines() or [type(err).__name__]
        parser.exit(2, "".join(f"{parser.prog}: error: {line}\n" for line in lines))
    except training_failures as err:
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    except interrupted as err:  # SIGTERM/SIGINT: 143/130, as shells expect
        parser.exit(err.exit_code, f"{parser.prog}: {err}\n")


# Output flags that name folders tidal writes into.
OUTPUT_FOLDER_FLAGS = ("save_path", "ckpt_path")


def output_path_problems(configs: Sequence[object]) -> list[str]:
    """An output folder flag naming an existing file would fail at the final save, after training."""
    problems = []
    for cfg in configs:
        for name in OUTPUT_FOLDER_FLAGS:
            value = getattr(cfg, name, None)
            if isinstance(value, str) and value and os.path.exists(value) and not os.path.isdir(value):
                problems.append(
                    f"--{name} {value} is an existing file; it must be a folder (or not exist yet)"
                )
    return problems


def module_main(main: Callable[[list[str] | None], object]) -> None:
    """``python -m tidal.cli.X`` entry: run ``main`` on ``sys.argv``."""
    main(sys.argv[1:])


@dataclass(frozen=True)
class TrainerCommand:
    """A trainer's command line, derived from its run dataclass (one ``--help`` group per config field).

    ``titles`` maps each config field of ``run_cls`` to its group title, in ``--help`` order. Flag
    names and defaults come from the run only (``tidal.config.run``: the run's default config per
    field and its flag renames), so ``parse_run`` on the required flags gives the run that
    ``run_cls`` builds from the same required values. Each ``tidal.cli.train_*`` module is one of
    these plus its ``python -m`` entry.

    ``runner`` names the function that trains the run, ``"module:function"``, imported only when the
    command runs: the run classes are light (``tidal.config.supervised``, ``tidal.config.ppo``),
    so ``--help`` imports no torch, transformers or datasets.

    ``roles`` maps a config field that shares its flags with another config of its class to a role
    prefix (PPO: ``actor_optim`` → ``actor``): each shared flag ``--x`` then also has ``--<role>_x``, which
    sets it for that config only (OpenRLHF HEAD's ``--actor.adam.betas`` beside v0.9.2's shared
    ``--adam_betas``).
    """

    name: str
    description: str
    run_cls: type
    runner: str
    titles: dict[str, str]
    roles: dict[str, str] = dataclasses.field(default_factory=dict)

    def role_flags(self, field: dataclasses.Field) -> dict[str, str]:
        """Field name → its per-role override flag, for a config in ``roles`` (flags the run already
        gives this config alone, such as ``--actor_learning_rate``, have none)."""
        prefix = self.roles.get(field.name)
        if prefix is None:
            return {}
        cls, renamed = self._class(field), run_flags(field)
        return {
            f.name: f"{prefix}_{flag_name(f)}"
            for f in dataclasses.fields(cls)
            if f.init and f.name not in renamed
        }

    def _class(self, field: dataclasses.Field) -> type:
        return typing.get_type_hints(self.run_cls)[field.name]

    def _flags(self, field: dataclasses.Field, ns: argparse.Namespace) -> dict[str, str]:
        """The config's flag renames: the run's, plus the per-role overrides set in ``ns``."""
        return {**run_flags(field), **override_flags(ns, self.role_flags(field))}

    def _fields(self) -> list[tuple[dataclasses.Field, type]]:
        """The run's config fields in ``--help`` order, with their config classes."""
        hints = typing.get_type_hints(self.run_cls)
        fields = {f.name: f for f in dataclasses.fields(self.run_cls)}
        return [(fields[name], hints[name]) for name in self.titles]

    def build_parser(self, prog: str | None = None) -> argparse.ArgumentParser:
        parser = make_parser(prog or f"tidal {self.name}", self.description, [], command=self.name)
        defaults = run_defaults(self.run_cls)
        for field, cls in self._fields():
            add_config_group(parser, cls, self.titles[field.name], flags=run_flags(field),
                             defaults=defaults.get(field.name))  # fmt: skip
        for field, cls in self._fields():
            if field.name in self.roles:
                role = self.roles[field.name]
                add_override_group(parser, cls, f"{role}'s optimizer", f"each sets one shared optimizer flag "
                                   f"for the {role} only (unset: the shared flag)", self.role_flags(field))  # fmt: skip
        add_launcher_flags(parser)
        return parser

    def run_from_namespace(self, ns: argparse.Namespace):
        """The run described by parsed flags, every flag checked before anything loads: one
        ``ConfigError`` lists all problems, one line each (each config's, then across configs)."""
        configs, problems = {}, []
        with deferred_checks():
            for field, cls in self._fields():
                try:  # a config that is not ``Checked`` raises its own problems when built
                    configs[field.name] = config_from_args(cls, ns, self._flags(field, ns))
                except ConfigError as err:
                    problems.extend(str(err).splitlines())
                    continue
                if override_flags(ns, self.role_flags(field)):  # name a per-role flag as typed, here
                    problems.extend(config_problems(configs[field.name], self._flags(field, ns)))
            paths = output_path_problems(list(configs.values()))
            if problems:
                raise_problems(problems + paths)
            run = self.run_cls(**configs)
        raise_problems(run.problems() + paths)
        return run

    def parse_run(self, argv: Sequence[str]):
        """Flags → the run, without training (for scripts and tests)."""
        return self.run_from_namespace(self.build_parser().parse_args(argv))

    def train(self, run: Any) -> Any:
        """Train ``run`` with the ``runner`` function (its module is imported here)."""
        module, _, function = self.runner.partition(":")
        return getattr(importlib.import_module(module), function)(run)

    def main(self, argv: Sequence[str] | None = None, prog: str | None = None):
        return run_command(self.build_parser(prog), argv, lambda ns: self.train(self.run_from_namespace(ns)))

    def module_main(self) -> None:
        """``python -m tidal.cli.train_<name>``."""
        module_main(lambda argv: self.main(argv, prog=f"python -m tidal.cli.train_{self.name}"))


# Group titles shared by the trainers (a command adds its own for its specific configs).
COMMON_TITLES = {
    "model": "model",
    "datasets": "datasets",
    "train": "training",
    "optim": "optimizer",
    "ckpt": "checkpoints",
    "logging": "logging",
    "dist": "distributed (FSDP2)",
}
