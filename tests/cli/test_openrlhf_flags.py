"""Every OpenRLHF flag of a CLI tidal mirrors, in each of OpenRLHF v0.9.2, v0.10.1.post2, v0.11.0 and
HEAD, is honoured by the tidal command (defined, or aliased to the tidal flag that does the same) or
refused by tidal's one-line error naming the flag and the reason, never argparse's bare "unrecognized
arguments"; and OpenRLHF's module names run.

``openrlhf_flags.json`` holds each version's flags (names, types, defaults, choices) per CLI, read from
OpenRLHF's argparse tables (flags defined in loops included); the later versions' dotted names
(``--actor.adam.lr``) and v0.10's flat ones are rewritten to v0.9.2's or tidal's names first.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from tidal.cli import batch_inference, main
from tidal.cli.openrlhf import (
    DOTTED_REFUSED,
    DOTTED_REFUSED_BY_MODULE,
    OPENRLHF_MODULES,
    REFUSED,
    aliases,
    openrlhf_module,
    refusals,
)

TABLES = json.loads((Path(__file__).parent / "openrlhf_flags.json").read_text())
VERSIONS = [k for k in TABLES if not k.startswith("_")]  # v0.9.2 (tidal's reference) ... HEAD
TABLE = TABLES["v0.9.2"]
CLIS = sorted(k for k in TABLE if not k.startswith("_"))
VERSION_CLIS = [(v, cli) for v in VERSIONS for cli in TABLES[v] if not cli.startswith("_")]


def _parser(cli: str):
    return importlib.import_module(main.COMMANDS[OPENRLHF_MODULES[cli]][0]).build_parser()


def _flag_names(cli: str, version: str = "v0.9.2") -> list[str]:
    return [flag[2:] for entry in TABLES[version].get(cli, []) for flag in entry["flags"]]


def _every_version_names(cli: str) -> set[str]:
    return {name for version in VERSIONS for name in _flag_names(cli, version)}


def test_the_table_covers_every_cli_tidal_mirrors():
    assert set(CLIS) == set(OPENRLHF_MODULES)


@pytest.mark.parametrize("cli", CLIS)
def test_every_flag_is_honoured_aliased_or_refused(cli):
    parser = _parser(cli)
    unhandled = [
        name
        for name in _flag_names(cli)
        if f"--{name}" not in parser._option_string_actions
        and name not in aliases(cli)
        and name not in refusals(cli)
        and not (cli == "batch_inference" and name == "eval_task")  # its OpenRLHF modes: batch_inference.py
    ]
    assert unhandled == []


@pytest.mark.parametrize("cli", CLIS)
def test_no_stale_table_entries(cli):
    """A flag the command now defines must leave the refusal/alias tables (its own flag wins anyway)."""
    known = _parser(cli)._option_string_actions
    assert [n for n in [*refusals(cli), *aliases(cli)] if f"--{n}" in known] == []
    openrlhf = {name for other in CLIS for name in _every_version_names(other)}  # shared trainer tables
    dotted = set(DOTTED_REFUSED) | set(DOTTED_REFUSED_BY_MODULE.get(cli, {}))
    assert set(refusals(cli)) - dotted <= openrlhf and set(aliases(cli)) <= _every_version_names(cli)
    for replacement in aliases(cli).values():  # an alias rewrites to a flag the command defines
        for argv in replacement.values() if isinstance(replacement, dict) else [replacement]:
            assert isinstance(argv, str) or argv == () or argv[0] in known  # str: a refused value


@pytest.mark.parametrize("cli", CLIS)
def test_refused_flags_fail_with_one_line_naming_the_flag_and_reason(cli, capsys):
    for name, reason in refusals(cli).items():
        with pytest.raises(SystemExit) as exit_info:
            _parser(cli).parse_args([f"--{name}", "1"])  # before any required-flag check
        err = capsys.readouterr().err
        assert exit_info.value.code == 2
        assert err == f"{_parser(cli).prog}: error: --{name} is not supported: {reason}\n"


def test_all_refused_flags_are_reported_at_once(capsys):
    with pytest.raises(SystemExit):
        _parser("train_sft").parse_args(["--use_ms", "--max_ckpt_mem=5", "--pretrain", "x"])
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" is not")[0] for line in lines] == [
        "tidal sft: error: --use_ms",
        "tidal sft: error: --max_ckpt_mem",
    ]


def test_aliases_parse_to_the_tidal_flag():
    ns = _parser("train_sft").parse_args(["--pretrain", "m", "--dataset", "d", "--train_split", "dev"])
    assert ns.dataset_split == "dev"
    chat = _parser("interactive_chat").parse_args(["--pretrain", "m", "--greedy_sampling", "--max_len=99"])
    assert (chat.temperature, chat.max_model_len) == (0.0, 99)


def test_unknown_flag_gets_argparse_message_with_a_suggestion(capsys):
    with pytest.raises(SystemExit):
        _parser("train_sft").parse_args(["--pretrain", "m", "--dataset", "d", "--learnig_rate", "1"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --learnig_rate (did you mean --learning_rate?) 1" in err


def test_a_flag_the_command_defines_wins_over_the_tables():
    parser = _parser("train_sft")
    parser.refused["learning_rate"] = "should not be seen"
    assert (
        parser.parse_args(["--pretrain", "m", "--dataset", "d", "--learning_rate", "0.5"]).learning_rate
        == 0.5
    )


def test_batch_inference_reads_openrlhf_eval_task_modes():
    argv = ["--pretrain", "m", "--eval_task", "generate_vllm", "--eval_task=generate", "--eval_task", "f.py"]
    assert batch_inference.split_eval_task(argv) == (["--pretrain", "m", "--eval_task", "f.py"], False)
    rm = ["--eval_task", "rm", "--pretrain", "m"]
    assert batch_inference.split_eval_task(rm) == (["--pretrain", "m"], True)


@pytest.mark.parametrize("cli", CLIS)
def test_openrlhf_module_names_run(cli, capsys):
    """``tidal <openrlhf name> --help`` and ``python -m tidal.cli.<openrlhf name>`` (the module exists)."""
    with pytest.raises(SystemExit) as exit_info:
        main.main([cli, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: tidal {cli}")
    assert importlib.util.find_spec(f"tidal.cli.{cli}") is not None
    assert openrlhf_module(OPENRLHF_MODULES[cli]) == cli


def test_docs_list_every_alias_and_refusal():
    docs = (Path(__file__).parents[2] / "docs" / "openrlhf.md").read_text()
    for cli in CLIS:
        for name, reason in refusals(cli).items():
            assert f"| `--{name}` |" in docs and reason in docs, name
        for name in aliases(cli):
            assert f"`--{name}" in docs, name


@pytest.mark.parametrize(("version", "cli"), VERSION_CLIS)
def test_every_flag_of_every_version_is_renamed_honoured_or_refused(version, cli):
    """Each name of each flag, in OpenRLHF's style of that version (HEAD: ``--actor.model_name_or_path``)."""
    parser = _parser(cli)
    known = parser._option_string_actions
    renames = parser.renames([o[2:] for o in known if o.startswith("--")])
    unhandled = []
    for name in _flag_names(cli, version):
        target = renames[name][0][2:] if name in renames else name
        if f"--{target}" not in known and target not in aliases(cli) and target not in refusals(cli):
            unhandled.append(name)
    assert unhandled == []


def test_dotted_ppo_flags_parse_to_the_same_configs():
    argv = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "d", "--algo.advantage.estimator",
            "group_norm", "--algo.kl.init_coef", "0.02", "--rollout.n_samples_per_prompt", "4"]  # fmt: skip
    ns = _parser("train_ppo_ray").parse_args(argv)
    assert (ns.pretrain, ns.prompt_data, ns.advantage_estimator) == ("m", "d", "group_norm")
    assert (ns.init_kl_coef, ns.n_samples_per_prompt) == (0.02, 4)


def test_dotted_flags_parse_to_the_same_configs():
    argv = ["--model.model_name_or_path", "m", "--data.dataset", "d", "--ds.lora.rank", "4", "--adam.lr=0.5",
            "--train.micro_batch_size", "2", "--eval.dataset", "e", "--ds.zero_stage", "2",
            "--ds.ring_attn_head_stride", "2"]  # fmt: skip
    ns = _parser("train_sft").parse_args(argv)
    assert (ns.pretrain, ns.dataset, ns.lora_rank, ns.learning_rate) == ("m", "d", 4, 0.5)
    assert (ns.micro_train_batch_size, ns.eval_dataset, ns.ring_head_stride) == (2, "e", 2)


def test_dotted_refusals_name_the_flag_as_typed(capsys):
    with pytest.raises(SystemExit):
        _parser("train_sft").parse_args(["--ds.use_universal_ckpt", "--ds.experts_implementation", "x"])
    assert capsys.readouterr().err.splitlines() == [
        f"tidal sft: error: --ds.use_universal_ckpt (--use_ds_universal_ckpt) is not supported: {REFUSED['train_sft']['use_ds_universal_ckpt']}",
        f"tidal sft: error: --ds.experts_implementation is not supported: {DOTTED_REFUSED['ds.experts_implementation']}",
    ]
