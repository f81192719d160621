"""Every trainer and inference command's defaults equal OpenRLHF v0.9.2's for the same flag, except the
deliberate differences in ``DELIBERATE`` (each with its reason, also listed in docs/openrlhf.md, "Defaults").

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
from tidal.cli.openrlhf import OPENRLHF_MODULES, aliases

TABLE = json.loads((Path(__file__).parent / "openrlhf_v0_9_2_flags.json").read_text())
TRAINERS = ("train_sft", "train_rm", "train_prm", "train_dpo", "train_kto", "train_kd", "train_ppo_ray")
INFERENCE = ("batch_inference", "interactive_chat", "serve_rm")
CLIS = TRAINERS + INFERENCE
EVERY = "every command"

# (OpenRLHF CLI or EVERY, flag) -> why tidal's default differs on purpose.
DELIBERATE: dict[tuple[str, str], str] = {
    (EVERY, "param_dtype"): (
        "auto: bf16 on a GPU (OpenRLHF's default) and float32 on the CPU, where bf16 is slow and imprecise"
    ),
    (EVERY, "attn_implementation"): (
        "sdpa ships with torch; flash-attn is optional in tidal (passing flash_attention_2 without it "
        "falls back to sdpa and tidal's varlen path)"
    ),
    (
        EVERY,
        "max_samples",
    ): "unset means every sample; OpenRLHF's cap (1e6, PPO 1e8) is a large number meaning the same",
    (
        EVERY,
        "wandb_project",
    ): "runs are logged to the W&B project 'tidal' rather than OpenRLHF's per-script names",
    (EVERY, "wandb_run_name"): (
        "unset: tidal names the run itself; OpenRLHF's default is a Python expression, not a value"
    ),
    ("train_sft", "output_key"): (
        "'output': OpenRLHF's unset key fails on single-turn data; with --multiturn/--pretrain_mode "
        "tidal accepts it unset"
    ),
    ("train_kto", "output_key"): "'output': OpenRLHF's unset key fails when a response is read",
    ("train_kto", "pretrain"): "--pretrain is required (OpenRLHF's default downloads bigscience/bloomz-1b7)",
    ("train_prm", "placeholder_token"): (
        "'ки' (Math-Shepherd's step marker, which OpenRLHF's PRM example passes); OpenRLHF's unset "
        "marker cannot train"
    ),
    ("train_ppo_ray", "actor_num_gpus_per_node"): (
        "1: tidal's default PPO run uses one device; OpenRLHF's 8 assumes a full node"
    ),
    ("train_ppo_ray", "ref_num_nodes"): "unset: the reference follows the actor's placement",
    ("train_ppo_ray", "ref_num_gpus_per_node"): "unset: the reference follows the actor's placement",
    ("train_ppo_ray", "reward_num_nodes"): "unset: the reward model follows the actor's placement",
    ("train_ppo_ray", "reward_num_gpus_per_node"): "unset: the reward model follows the actor's placement",
    ("train_ppo_ray", "critic_num_nodes"): "unset: the critic follows the actor's placement",
    ("train_ppo_ray", "critic_num_gpus_per_node"): "unset: the critic follows the actor's placement",
    ("train_ppo_ray", "vllm_gpu_memory_utilization"): (
        "0.5 of the free memory: tidal's engine sizes its KV cache from what is free and by default "
        "shares the device with training (vLLM's 0.95 is of the total, on a dedicated GPU)"
    ),
    ("train_ppo_ray", "ckpt_path"): (
        "./ckpt/checkpoints_ppo, named after tidal's command, so existing tidal PPO checkpoints still resume"
    ),
    ("batch_inference", "max_len"): (
        "unset: the model's context length bounds prompt + response (tidal's engine sizes its cache to it)"
    ),
    ("batch_inference", "micro_batch_size"): (
        "unset means 16 as OpenRLHF; unset lets tidal refuse the flag outside --eval_task rm, where it does nothing"
    ),
    ("batch_inference", "rollout_batch_size"): (
        "unset means 2048 prompts per --iter as OpenRLHF; set, it also caps the prompts per engine call"
    ),
    ("batch_inference", "value_head_prefix"): (
        "'score': the head name train_rm saves by default (OpenRLHF's batch_inference default does not match "
        "its own train_rm)"
    ),
    ("batch_inference", "tp_size"): (
        "1: one process on one device; OpenRLHF's default spans every visible GPU (tidal's engine runs on the CPU too)"
    ),
    ("interactive_chat", "max_len"): "unset: the model's context length bounds the conversation",
    ("interactive_chat", "apply_chat_template"): (
        "auto: the tokenizer's chat template when it has one, else plain text (OpenRLHF: off unless passed)"
    ),
    (
        "serve_rm",
        "host",
    ): "127.0.0.1: an unauthenticated server listens on loopback unless --host says otherwise",
    ("serve_rm", "batch_size"): (
        "16: bounded memory per forward (tidal coalesces concurrent requests); OpenRLHF's unset is one "
        "forward per request, however large"
    ),
}


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


def _deliberate(cli: str, name: str) -> str | None:
    return DELIBERATE.get((cli, name)) or DELIBERATE.get((EVERY, name))


@pytest.mark.parametrize("cli", CLIS)
def test_defaults_equal_openrlhf_v0_9_2_unless_deliberate(cli):
    unexplained = {n: d for n, d in differences(cli).items() if _deliberate(cli, n) is None}
    assert unexplained == {}


def test_every_deliberate_difference_is_still_a_difference():
    """A default that now matches must leave the table (a stale reason would mislead)."""
    found = {(cli, name) for cli in CLIS for name in differences(cli)}
    stale = [
        key
        for key in DELIBERATE
        if not any((cli, key[1]) in found for cli in (CLIS if key[0] == EVERY else (key[0],)))
    ]
    assert stale == []


def test_docs_list_every_deliberate_difference():
    docs = (Path(__file__).parents[2] / "docs" / "openrlhf.md").read_text()
    section = docs.split("## Defaults", 1)[1].split("\n## ", 1)[0]
    for (cli, name), reason in DELIBERATE.items():
        assert f"| `--{name}` | {cli} | {reason} |" in section, name


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
