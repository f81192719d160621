"""Build argparse flags from typed dataclass configs, configs back from parsed flags, and check them.

Each component owns a small dataclass (``ModelConfig``, ``OptimConfig``, ...). A field's
``metadata`` carries its help text and argparse details, so the flag and its documentation live
next to the typed value. ``add_config_group`` turns one dataclass into one ``--help`` group;
``config_from_args`` reads it back. Flags keep the seed's (OpenRLHF's) names: a field whose tidal
name differs from its flag says so (``arg(..., flag="critic_pretrain")``), and a run can rename a
config's flags where two configs of one class share a command (``config_field(flags=...)``: the
actor's and critic's ``OptimConfig`` read ``--actor_learning_rate`` / ``--critic_learning_rate`` and
share every other optimizer flag).

Checking is one pass that reports every problem, one line each. A field may declare its allowed
range (``arg(..., check=POSITIVE)``); ``flag_problems`` checks every declared range and that every
float is finite. A ``Checked`` config adds its own cross-field problems in ``problems``; a run
(``tidal.config.run.RunConfig``) gathers its configs' problems and those across configs. Building a
config or run directly raises all of its problems at once; a command builds every config under
``deferred_checks()`` and then raises everything in one ``ConfigError``, before anything loads.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A flag value that tidal cannot honour; the message names the flag and what was expected."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric flag accepts: ``low``/``high`` bounds (inclusive unless ``*_open``) plus
    ``also`` (special values such as ``-1`` for "off"). List and tuple flags check every element."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple = ()

    def accepts(self, value: float) -> bool:
        if value in self.also:
            return True
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        lo = "" if self.low is None else ("(" if self.low_open else "[") + f"{self.low:g}"
        hi = "" if self.high is None else f"{self.high:g}" + (")" if self.high_open else "]")
        if self.low is not None and self.high is not None:
            text = f"in {lo}, {hi}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            text = f"{'<' if self.high_open else '<='} {self.high:g}"
        return text + "".join(f" or {v}" for v in self.also)


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)
UNIT = Range(0, 1)  # [0, 1]
PROBABILITY_OPEN_LOW = Range(0, 1, low_open=True)  # (0, 1]


def arg(default: Any = dataclasses.MISSING, help: str = "", **argparse_kwargs: Any) -> Any:
    """A dataclass field that is also a documented command-line flag.

    ``argparse_kwargs`` are passed to ``add_argument`` (``choices``, ``nargs``, ``aliases`` for
    extra flag names, ``metavar``), except ``check``: a ``Range`` the value must lie in (see
    ``flag_problems``), and ``flag``: the flag's name (without ``--``) where it is not the field's
    own (OpenRLHF's name for a field tidal names by its component). Mutable defaults (lists) are
    copied per instance.
    """
    metadata = {"help": help, **argparse_kwargs}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``Optional[X]`` → (X, True); anything else → (tp, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


# field metadata that is tidal's, not add_argument's
NOT_ARGPARSE = ("aliases", "check", "flag", "cli", "engine")  # engine: tidal.config.engine.engine_knobs


def flag_name(field: dataclasses.Field, flags: Mapping[str, str] | None = None) -> str:
    """The flag (without ``--``) of a config field: the run's rename, else the field's ``flag``, else its name."""
    return (flags or {}).get(field.name) or field.metadata.get("flag") or field.name


def flag_default(config: object, name: str) -> Any:
    """A config instance's value for field ``name`` as a flag default: the value as given where the
    config's ``__post_init__`` filled in an unset field (it records those in ``flag_values``, e.g.
    ``RolloutConfig.generate_max_len`` from ``--max_len``), else the field's value."""
    given = getattr(config, "flag_values", {})
    return given[name] if name in given else getattr(config, name)


def _argparse_kwargs(field: dataclasses.Field, tp: Any, defaults: object | None = None) -> dict[str, Any]:
    meta = {k: v for k, v in field.metadata.items() if k not in NOT_ARGPARSE}
    default = field.default if field.default is not dataclasses.MISSING else None
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = field.default_factory()  # type: ignore[misc]
    if defaults is not None:  # the run's default of this config
        default = flag_default(defaults, field.name)
    base, _ = _unwrap_optional(tp)
    kwargs: dict[str, Any] = {"default": default, **meta}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        return kwargs
    origin = typing.get_origin(base)
    if origin in (list, tuple):
        inner = typing.get_args(base)[0]
        kwargs.setdefault("nargs", "+")
        kwargs["type"] = inner
    elif base in (int, float, str):
        kwargs["type"] = base
    if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:  # type: ignore[misc]
        kwargs["required"] = True
        kwargs.pop("default")
    return kwargs


def add_config_group(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str,
    description: str = "",
    exclude: set[str] = frozenset(),
    flags: Mapping[str, str] | None = None,
    defaults: object | None = None,
) -> None:
    """Add one ``--help`` group with a flag per field of the dataclass ``cls`` (minus ``exclude``).

    ``flags`` renames fields' flags (a run's ``config_field(flags=...)``); ``defaults``, an instance
    of ``cls``, gives the flags' defaults (a run's default for this config) instead of the class's.
    A flag that an earlier group already added is shared: both configs read it."""
    group = parser.add_argument_group(title, description or (cls.__doc__ or "").strip().split("\n")[0])
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init or field.metadata.get("cli") is False or field.name in exclude:
            continue
        name = flag_name(field, flags)
        if f"--{name}" in parser._option_string_actions:  # shared with an earlier config of the command
            continue
        kwargs = _argparse_kwargs(field, hints[field.name], defaults)
        group.add_argument(f"--{name}", *field.metadata.get("aliases", []), dest=name, **kwargs)


def add_override_group(
    parser: argparse.ArgumentParser, cls: type, title: str, description: str, flags: Mapping[str, str]
) -> None:
    """One ``--help`` group of flags that override fields of ``cls`` for one config only (``flags``: field
    name → override flag, e.g. ``adam_betas`` → ``actor_adam_betas`` beside the shared ``--adam_betas``).
    Each defaults to None: unset, the config reads its shared flag (``override_flags``)."""
    group = parser.add_argument_group(title, description)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        name = flags.get(field.name)
        if name is None or f"--{name}" in parser._option_string_actions:
            continue
        kwargs = _argparse_kwargs(field, hints[field.name])
        kwargs.update(default=None, required=False)
        if kwargs.get("action") == "store_true":  # on or off per config: --x / --no-x
            kwargs["action"] = argparse.BooleanOptionalAction
        group.add_argument(f"--{name}", dest=name, **kwargs)


def override_flags(ns: argparse.Namespace, flags: Mapping[str, str]) -> dict[str, str]:
    """The overrides of ``flags`` (field → override flag) that were set in ``ns``: pass them as the
    config's flag renames, so it reads (and its problems name) the override instead of the shared flag."""
    return {field: name for field, name in flags.items() if getattr(ns, name, None) is not None}


# argparse takes "-1e-3" for an option (its negative-number pattern has no exponent), so
# "--adam_betas 0.9 -1e-3" failed with "expected 2 arguments"; this pattern accepts any float literal.
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def accept_negative_numbers(parser: argparse.ArgumentParser) -> None:
    """Let multi-value flags take negative numbers in any float form (``-1e-3``, ``-.5``)."""
    parser._negative_number_matcher = NEGATIVE_NUMBER  # private, but unchanged since Python 3.2


def _flag_of(token: str) -> str | None:
    """``--name`` or ``--name=value`` → ``name``; anything else (values, ``-h``) → None."""
    if not token.startswith("--") or token == "--":
        return None
    return token[2:].split("=", 1)[0]


def rewrite_aliases(argv: Sequence[str], aliases: Mapping[str, Any], known: Container) -> list[str]:
    """Replace each aliased flag the parser does not define by the argv that does the same
    (``--train_split x`` → ``--dataset_split x``; ``--greedy_sampling`` → ``--temperature 0``). An alias
    that is a mapping is chosen by the flag's value (``--vllm_is_correction_type icepop`` → ``--use_icepop``);
    a value mapped to a string is refused with that reason, and an unknown value is refused naming the
    known ones (``ValueError``, one line)."""
    out: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            return out + tokens[i:]
        name = _flag_of(token)
        if name in aliases and f"--{name}" not in known:
            if isinstance(aliases[name], Mapping):
                inline = "=" in token
                value = token.split("=", 1)[1] if inline else (tokens[i + 1] if i + 1 < len(tokens) else None)
                out += _value_alias(name, value, aliases[name])
                i += 1 if inline else 2
                continue
            replacement = list(aliases[name])
            if "=" in token:  # --train_split=x → --dataset_split=x
                replacement[-1] += token[token.index("=") :]
            out += replacement
        else:
            out.append(token)
        i += 1
    return out


def _value_alias(name: str, value: str | None, choices: Mapping[str, Sequence[str] | str]) -> list[str]:
    """The argv that ``--name value`` stands for (``choices``: value → argv, or → a refusal's reason)."""
    if value not in choices:
        raise ValueError(f"--{name} takes one of {', '.join(choices)}, got {value!r}")
    if isinstance(choices[value], str):
        raise ValueError(f"--{name} {value} is not supported: {choices[value]}")
    return list(choices[value])


def refused_flags(
    argv: Sequence[str], refused: Mapping[str, str], known: Container, typed: Sequence[str] | None = None
) -> list[str]:
    """One ``--flag: reason`` line per refused flag in ``argv`` that the parser does not define;
    ``typed``: the argv as the user wrote it, token for token, to name a renamed flag as typed too."""
    found = []
    for i, token in enumerate(argv):
        if token == "--":
            break
        name = _flag_of(token)
        if name in refused and f"--{name}" not in known:
            original = _flag_of(typed[i]) if typed is not None else name
            shown = f"--{name}" if original == name else f"--{original} (--{name})"
            found.append(f"{shown} is not supported: {refused[name]}")
    return list(dict.fromkeys(found))


def close_flag(token: str, known: Sequence[str]) -> str | None:
    """The defined flag closest to an unknown ``--flag`` (for "did you mean"), if any is close."""
    name = _flag_of(token)
    matches = difflib.get_close_matches(f"--{name}", [k for k in known if k.startswith("--")], n=1)
    return matches[0] if name and matches else None


class FlagParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that knows another tool's flags it does not define (OpenRLHF's, see
    ``tidal.cli.openrlhf``): ``renames`` (given the parser's flag names) first rewrite another
    spelling of a flag name (OpenRLHF's dotted names), then ``refused`` flags fail with their reason,
    one line each, before argparse parses anything, and ``aliases`` are rewritten to the flags that do
    the same; a flag nobody knows still gets argparse's "unrecognized arguments", with the closest
    defined flag suggested. ``notes`` (flag name → text) end those flags' ``--help`` in parentheses
    (where a default differs from the other tool's on purpose)."""

    def __init__(
        self,
        *args: Any,
        refused: Mapping[str, str] | None = None,
        aliases: Mapping[str, Any] | None = None,
        renames: Callable[[list[str]], Mapping[str, Sequence[str]]] | None = None,
        notes: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.refused, self.aliases, self.renames = dict(refused or {}), dict(aliases or {}), renames
        self.notes = dict(notes or {})

    def format_help(self) -> str:
        # Flags are added after construction (by config groups), so the notes join their help here, once.
        for action in self._actions:
            note = next((self.notes.pop(o[2:]) for o in action.option_strings if o[2:] in self.notes), None)
            if note is not None:  # argparse %-formats help text: a literal % must be doubled
                action.help = f"{action.help or ''} ({note.replace('%', '%%')})".lstrip()
        return super().format_help()

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):  # type: ignore[override]
        typed = list(sys.argv[1:] if args is None else args)
        known = self._option_string_actions
        argv = typed
        if self.renames is not None:  # another spelling of a flag name, one token for one token
            names = [option[2:] for option in known if option.startswith("--")]
            argv = rewrite_aliases(typed, self.renames(names), known)
        lines = refused_flags(argv, self.refused, known, typed if len(argv) == len(typed) else None)
        if lines:
            self.exit(2, "".join(f"{self.prog}: error: {line}\n" for line in lines))
        try:
            argv = rewrite_aliases(argv, self.aliases, known)
        except ValueError as err:  # a value alias's refused or unknown value
            self.exit(2, f"{self.prog}: error: {err}\n")
        return super().parse_known_args(argv, namespace)

    def error(self, message: str) -> typing.NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            hints = [
                f"{token} (did you mean {match}?)"
                if (match := close_flag(token, list(self._option_string_actions)))
                else token
                for token in message[len(prefix) :].split()
            ]
            message = prefix + " ".join(hints)
        super().error(message)


def _numbers(value: Any) -> list:
    items = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]


def flag_problems(cls: type, values: dict[str, Any], flags: Mapping[str, str] | None = None) -> list[str]:
    """One message per field of ``cls`` whose value in ``values`` (by field name) is non-finite or
    outside its ``Range``; messages name the field's flag."""
    problems = []
    for field in dataclasses.fields(cls):
        if field.name not in values or values[field.name] is None:
            continue
        value, check, name = values[field.name], field.metadata.get("check"), flag_name(field, flags)
        numbers = _numbers(value)
        shown = " ".join(str(v) for v in value) if isinstance(value, (list, tuple)) else value
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            problems.append(f"--{name} must be a finite number, got {shown}")
        elif check is not None and not all(check.accepts(v) for v in numbers):
            each = "each value " if isinstance(value, (list, tuple)) else ""
            problems.append(f"--{name} {each}must be {check.describe()}, got {shown}")
    return problems


_DEFERRED = contextvars.ContextVar("tidal_deferred_checks", default=False)


@contextlib.contextmanager
def deferred_checks() -> Iterator[None]:
    """Build configs and runs without raising, so a command can collect every problem first."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def checks_deferred() -> bool:
    """Inside ``deferred_checks``: configs and runs are built without raising."""
    return _DEFERRED.get()


def raise_problems(problems: list[str]) -> None:
    """One ``ConfigError``, one line per problem (each once), if there are any."""
    if problems:
        raise ConfigError("\n".join(dict.fromkeys(problems)))


class Checked:
    """Base of a checked config dataclass: ``problems`` lists what is wrong with it (field ranges,
    then the subclass's own cross-field checks, which extend ``problems``); building one raises them
    all at once unless under ``deferred_checks``."""

    def problems(self, flags: Mapping[str, str] | None = None) -> list[str]:
        """Every problem of this config, one line each; ``flags``: the run's renames of its flags."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return flag_problems(type(self), values, flags)

    def __post_init__(self) -> None:
        if not checks_deferred():
            raise_problems(self.problems())


def config_problems(cfg: object, flags: Mapping[str, str] | None = None) -> list[str]:
    """A config's problems: its own ``problems`` if it is ``Checked``, else its field ranges."""
    if isinstance(cfg, Checked):
        return cfg.problems(flags)
    return flag_problems(type(cfg), {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, flags)


def _values(cls: type, ns: argparse.Namespace, flags: Mapping[str, str] | None, overrides: dict) -> dict:
    values = {}
    for f in dataclasses.fields(cls):
        if f.init and hasattr(ns, flag_name(f, flags)):
            values[f.name] = getattr(ns, flag_name(f, flags))
    values.update(overrides)
    return values


def config_from_args(
    cls: type[T], ns: argparse.Namespace, flags: Mapping[str, str] | None = None, **overrides: Any
) -> T:
    """Instantiate ``cls`` from the parsed namespace (fields missing from it keep their defaults).

    Range and finiteness problems of its flags raise one ``ConfigError`` naming all of them (a
    ``Checked`` config under ``deferred_checks`` is built anyway: its ``problems`` report them)."""
    values = _values(cls, ns, flags, overrides)
    if not (checks_deferred() and issubclass(cls, Checked)):
        raise_problems(flag_problems(cls, values, flags))
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if isinstance(value, list) and typing.get_origin(_unwrap_optional(hints[key])[0]) is tuple:
            values[key] = tuple(value)
    return cls(**values)


def configs_from_args(classes: dict[str, type], ns: argparse.Namespace) -> dict[str, Any]:
    """Every config of a command from the namespace, checking all of them before raising: one
    ``ConfigError`` lists each problem on its own line (range checks, then each config's own checks)."""
    configs, problems = {}, []
    for name, cls in classes.items():
        try:
            configs[name] = config_from_args(cls, ns)
        except ConfigError as err:
            problems.extend(str(err).splitlines())
    raise_problems(problems)  # a flag shared by two configs: once
    return configs


def parse_bool(text: str) -> bool:
    """Parse flag text like ``true``/``false``/``1``/``0``."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
