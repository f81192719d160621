"""Build argparse flags from typed dataclass configs, and configs back from parsed flags.

Each component owns a small dataclass (``ModelConfig``, ``OptimConfig``, ...). A field's
``metadata`` carries its help text and argparse details, so the flag and its documentation live
next to the typed value. ``add_config_group`` turns one dataclass into one ``--help`` group;
``config_from_args`` reads it back. Flags keep the seed's (OpenRLHF's) names.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A flag value that tidal cannot honour; the message names the flag and what was expected."""


def arg(default: Any = dataclasses.MISSING, help: str = "", **argparse_kwargs: Any) -> Any:
    """A dataclass field that is also a documented command-line flag.

    ``argparse_kwargs`` are passed to ``add_argument`` (``choices``, ``nargs``, ``aliases`` for
    extra flag names, ``metavar``). Mutable defaults (lists) are copied per instance.
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
    meta = {k: v for k, v in field.metadata.items() if k != "aliases"}
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


def config_from_args(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    """Instantiate ``cls`` from the parsed namespace (fields missing from it keep their defaults)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(ns, f.name)}
    values.update(overrides)
    for key, value in values.items():
        if (
            isinstance(value, list)
            and typing.get_origin(_unwrap_optional(typing.get_type_hints(cls)[key])[0]) is tuple
        ):
            values[key] = tuple(value)
    return cls(**values)


def parse_bool(text: str) -> bool:
    """Parse flag text like ``true``/``false``/``1``/``0``."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
