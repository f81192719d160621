"""Every trainer and inference command's defaults equal OpenRLHF v0.9.2's for the same flag, except the
deliberate differences in ``tidal.cli.openrlhf.DEFAULT_DIFFERENCES`` (each with OpenRLHF's default and
the reason, shown in the flag's ``--help`` and listed in docs/openrlhf.md, "Defaults").

The reference is v0.9.2 in ``tests/cli/openrlhf_flags.json`` (OpenRLHF's own argparse defaults per CLI).
A flag tidal spells differently (an alias in ``tidal.cli.openrlhf.ALIASES``) is compared through the
flag it is rewritten to.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from tidal.cli import main
from tidal.cli.openrlhf import (
    DEFAULT_DIFFERENCES,
    EVERY,
    LATER_DEFAULT_DIFFERENCES,
    OPENRLHF_MODULES,
    aliases,
    default_difference,
)
from tidal.config.run import run_flags

TABLE = json.loads((Path(__file__).parent / "openrlhf_flags.json").read_text())["v0.9.2"]
TRAINERS = ("train_sft", "train_rm", "train_prm", "train_dpo", "train_kto", "train_kd", "train_ppo_ray")
INFERENCE = ("batch_inference", "interactive_chat", "serve_rm")
CLIS = TRAINERS + INFERENCE


def _parser(cli: str):
    """The command's argparse parser (an OpenRLHF CLI name → tidal's module for it)."""
    return importlib.import_module(main.COMMANDS[OPENRLHF_MODULES[cli]][0]).build_parser()


def _same(tidal, openrlhf) -> bool:
    if isinstance(tidal, tuple | list) and not isinstance(openrlhf, list):
        tidal = " ".join(map(str, tidal))  # nargs flags: OpenRLHF's one-string default (target_modules)
    if isinstance(tidal, tuple):
        tidal = list(tidal)
    if isinstance(tidal, bool) or isinstance(openrlhf, bool):
        return tidal is openrlhf
    if isinstance(openrlhf, str) and isinstance(tidal, int | float):
        return str(tidal) == openrlhf  # argparse converts a string default through type= (serve_rm --max_len)
    return tidal == openrlhf


def differences(cli: str) -> dict[str, tuple]:
    """Flag -> (tidal default, OpenRLHF default) for every shared flag whose defaults differ."""
    actions = _parser(cli)._option_string_actions
    renamed = {name: argv[0] for name, argv in aliases(cli).items() if len(argv) == 1}
    out = {}
    for entry in TABLE[cli]:
        name = entry["flags"][0][2:]
        action = actions.get(f"--{name}") or actions.get(renamed.get(name, ""))
        reference = entry["default"]
        if entry["action"] == "store_true" and reference is None:
            reference = False  # OpenRLHF's ``default=None`` switches are off, as False
        if action is not None and not _same(action.default, reference):
            out[name] = (action.default, reference)
    return out


@pytest.mark.parametrize("cli", CLIS)
def test_defaults_equal_openrlhf_v0_9_2_unless_deliberate(cli):
    unexplained = {n: d for n, d in differences(cli).items() if default_difference(cli, n) is None}
    assert unexplained == {}


def test_every_deliberate_difference_is_still_a_difference():
    """A default that now matches must leave the table (a stale reason would mislead)."""
    found = {(cli, name) for cli in CLIS for name in differences(cli)}
    stale = [
        key
        for key in DEFAULT_DIFFERENCES
        if not any((cli, key[1]) in found for cli in (CLIS if key[0] == EVERY else (key[0],)))
    ]
    assert stale == []


def test_docs_list_every_deliberate_difference():
    docs = (Path(__file__).parents[2] / "docs" / "openrlhf.md").read_text()
    section = docs.split("## Defaults", 1)[1].split("\n## ", 1)[0]
    for (cli, name), diff in DEFAULT_DIFFERENCES.items():
        assert f"| `--{name}` | {cli} | {diff.openrlhf} | {diff.reason} |" in section, name


def _shown(value) -> str:
    """OpenRLHF's default as the table writes it."""
    return "unset" if value is None else "off" if value is False else str(value)


def test_stated_openrlhf_defaults_are_openrlhf_v0_9_2s():
    """Each single-CLI entry states OpenRLHF's actual default (every-command entries describe theirs)."""
    for (cli, name), diff in DEFAULT_DIFFERENCES.items():
        if cli != EVERY:
            reference = next(e["default"] for e in TABLE[cli] if e["flags"][0] == f"--{name}")
            assert diff.openrlhf == _shown(reference), (cli, name)


@pytest.mark.parametrize(("cli", "flag"), [("train_ppo_ray", "ckpt_path"), ("train_sft", "param_dtype")])
def test_help_states_the_deliberate_difference(cli, flag, capsys):
    """``--help`` ends a deliberately different flag's text with OpenRLHF's default and the reason."""
    with pytest.raises(SystemExit):
        _parser(cli).parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    diff = default_difference(cli, flag)
    assert f"(OpenRLHF's default: {diff.openrlhf}; {' '.join(diff.reason.split())})" in text


@pytest.mark.parametrize(
    ("cli", "flag", "value"),
    [
        ("train_sft", "max_epochs", 2),
        ("train_sft", "input_template", "User: {}\nAssistant: "),
        ("train_kto", "input_template", "User: {}\nAssistant: "),
        ("train_kd", "input_template", "User: {}\nAssistant: "),
        ("train_rm", "input_template", None),
        ("train_rm", "learning_rate", 9e-6),
        ("train_rm", "micro_train_batch_size", 1),
        ("train_rm", "max_len", 512),
        ("train_dpo", "max_len", 512),
        ("train_dpo", "learning_rate", 1e-5),
        ("train_prm", "learning_rate", 1e-6),
        ("train_dpo", "eval_split", "test"),
        ("train_sft", "eval_split", "train"),
        ("batch_inference", "seed", 1234),
    ],
)
def test_examples_of_openrlhf_defaults(cli, flag, value):
    """A few of the defaults the issue names, spelled out (the table test covers all of them)."""
    assert _parser(cli)._option_string_actions[f"--{flag}"].default == value


LATER = json.loads((Path(__file__).parent / "openrlhf_flags.json").read_text())
LATER_CLIS = [
    (v, cli) for v in LATER if v not in ("_source", "v0.9.2") for cli in LATER[v] if not cli.startswith("_")
]


def _shared_default(cli: str, flag: str, actions) -> object:
    """A per-role override flag (``--actor_adam_betas``, unset: the shared flag) has the shared flag's default."""
    if cli == "train_ppo_ray":
        from tidal.cli.train_ppo import COMMAND

        for field in dataclasses.fields(COMMAND.run_cls):
            for name, override in COMMAND.role_flags(field).items():
                if override == flag:
                    return actions[f"--{run_flags(field).get(name, name)}"].default
    return actions[f"--{flag}"].default


def later_differences(version: str, cli: str) -> dict[str, tuple]:
    """tidal flag -> (tidal default, OpenRLHF default) where a later version's default differs."""
    parser = _parser(cli)
    actions = parser._option_string_actions
    renames = parser.renames([o[2:] for o in actions if o.startswith("--")])
    renamed = {name: argv[0][2:] for name, argv in aliases(cli).items() if len(argv) == 1}
    out = {}
    for entry in LATER[version][cli]:
        name = entry["flags"][0][2:]
        target = renames[name][0][2:] if name in renames else name
        target = renamed.get(target, target)
        if f"--{target}" not in actions or entry["action"] == "store_false":  # refused; --no-x switches
            continue
        reference = (
            False if entry["action"] == "store_true" and entry["default"] is None else entry["default"]
        )
        tidal = _shared_default(cli, target, actions)
        if not _same(tidal, reference):
            out[target] = (tidal, reference)
    return out


@pytest.mark.parametrize(("version", "cli"), LATER_CLIS)
def test_later_versions_defaults_equal_unless_deliberate(version, cli):
    """OpenRLHF v0.10.1.post2, v0.11.0 and HEAD: every default (dotted names resolved) equals tidal's,
    except a deliberate difference of v0.9.2's table or of ``LATER_DEFAULT_DIFFERENCES``."""
    unexplained = {
        flag: d
        for flag, d in later_differences(version, cli).items()
        if default_difference(cli, flag) is None and (cli, flag) not in LATER_DEFAULT_DIFFERENCES
    }
    assert unexplained == {}


def test_every_later_difference_is_still_a_difference_and_documented():
    found = {(cli, flag) for version, cli in LATER_CLIS for flag in later_differences(version, cli)}
    assert set(LATER_DEFAULT_DIFFERENCES) <= found
    docs = (Path(__file__).parents[2] / "docs" / "openrlhf.md").read_text()
    section = docs.split("## Defaults of later versions", 1)[1].split("\n## ", 1)[0]
    for (cli, name), diff in LATER_DEFAULT_DIFFERENCES.items():
        assert f"| `--{name}` | {cli} | {diff.openrlhf} | {diff.reason} |" in section, name
