"""Build argparse flags from typed dataclass configs, and configs back from parsed flags.

Each component owns a small dataclass (``ModelConfig``, ``OptimConfig``, ...). A field's
``metadata`` carries its help text and argparse details, so the flag and its documentation live
next to the typed value. ``add_config_group`` turns one dataclass into one ``--help`` group;
``config_from_args`` reads it back. Flags keep the seed's (OpenRLHF's) names.

A field may declare its allowed range (``arg(..., check=POSITIVE)``); ``flag_problems`` checks every
declared range and that every float is finite, so ``configs_from_args`` can report all bad flags of
a command at once, before anything is loaded, instead of one per run at the first rollout.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import types
import typing
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
    ``flag_problems``). Mutable defaults (lists) are copied per instance.
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


def _argparse_kwargs(field: dataclasses.Field, tp: Any) -> dict[str, Any]:
    meta = {k: v for k, v in field.metadata.items() if k not in ("aliases", "check")}
    default = field.default if field.default is not dataclasses.MISSING else None
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = field.default_factory()  # type: ignore[misc]
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
) -> None:
    """Add one ``--help`` group with a flag per field of the dataclass ``cls`` (minus ``exclude``)."""
    group = parser.add_argument_group(title, description or (cls.__doc__ or "").strip().split("\n")[0])
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init or field.metadata.get("cli") is False or field.name in exclude:
            continue
        names = [f"--{field.name}", *field.metadata.get("aliases", [])]
        kwargs = _argparse_kwargs(field, hints[field.name])
        kwargs.pop("cli", None)
        group.add_argument(*names, dest=field.name, **kwargs)


# argparse takes "-1e-3" for an option (its negative-number pattern has no exponent), so
# "--adam_betas 0.9 -1e-3" failed with "expected 2 arguments"; this pattern accepts any float literal.
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def accept_negative_numbers(parser: argparse.ArgumentParser) -> None:
    """Let multi-value flags take negative numbers in any float form (``-1e-3``, ``-.5``)."""
    parser._negative_number_matcher = NEGATIVE_NUMBER  # private, but unchanged since Python 3.2


def _numbers(value: Any) -> list:
    items = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]


def flag_problems(cls: type, values: dict[str, Any]) -> list[str]:
    """One message per flag of ``cls`` whose value in ``values`` is non-finite or outside its ``Range``."""
    problems = []
    for field in dataclasses.fields(cls):
        if field.name not in values or values[field.name] is None:
            continue
        value, check = values[field.name], field.metadata.get("check")
        numbers = _numbers(value)
        shown = " ".join(str(v) for v in value) if isinstance(value, (list, tuple)) else value
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            problems.append(f"--{field.name} must be a finite number, got {shown}")
        elif check is not None and not all(check.accepts(v) for v in numbers):
            each = "each value " if isinstance(value, (list, tuple)) else ""
            problems.append(f"--{field.name} {each}must be {check.describe()}, got {shown}")
    return problems


def _values(cls: type, ns: argparse.Namespace, overrides: dict[str, Any]) -> dict[str, Any]:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(ns, f.name)}
    values.update(overrides)
    return values


def config_from_args(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    """Instantiate ``cls`` from the parsed namespace (fields missing from it keep their defaults).

    Range and finiteness problems of its flags raise one ``ConfigError`` naming all of them."""
    values = _values(cls, ns, overrides)
    problems = flag_problems(cls, values)
    if problems:
        raise ConfigError("\n".join(problems))
    for key, value in values.items():
        if (
            isinstance(value, list)
            and typing.get_origin(_unwrap_optional(typing.get_type_hints(cls)[key])[0]) is tuple
        ):
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
    if problems:
        raise ConfigError("\n".join(dict.fromkeys(problems)))  # a flag shared by two configs: once
    return configs


def parse_bool(text: str) -> bool:
    """Parse flag text like ``true``/``false``/``1``/``0``."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
