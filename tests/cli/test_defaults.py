"""Every trainer and inference command's defaults equal OpenRLHF v0.9.2's for the same flag, except the
deliberate differences in ``tidal.cli.openrlhf.DEFAULT_DIFFERENCES`` (each with OpenRLHF's default and
the reason, shown in the flag's ``--help`` and listed in docs/openrlhf.md, "Defaults").

The reference is ``tests/cli/openrlhf_v0_9_2_flags.json`` (OpenRLHF's own argparse defaults per CLI).
A flag tidal spells differently (an alias in ``tidal.cli.openrlhf.ALIASES``) is compared through the
flag it is rewritten to.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from tidal.cli import main
from tidal.cli.openrlhf import DEFAULT_DIFFERENCES, EVERY, OPENRLHF_MODULES, aliases, default_difference

TABLE = json.loads((Path(__file__).parent / "openrlhf_v0_9_2_flags.json").read_text())
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
