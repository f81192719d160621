"""``tidal <command> [flags]``: dispatch to the command modules (each also runs as ``python -m``)."""

from __future__ import annotations

import importlib
import sys

# command → (module, one-line description); each module defines main(argv, prog).
COMMANDS = {
    "sft": ("tidal.cli.train_sft", "supervised fine-tuning"),
    "rm": ("tidal.cli.train_rm", "reward-model training on preference pairs"),
    "prm": ("tidal.cli.train_prm", "process reward model training on step labels"),
    "serve_rm": ("tidal.cli.serve_rm", "serve a reward model over HTTP (POST /get_reward)"),
    "serve": ("tidal.cli.serve", "OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions)"),
    "dpo": ("tidal.cli.train_dpo", "direct preference optimisation (DPO, IPO, cDPO)"),
    "kto": ("tidal.cli.train_kto", "Kahneman-Tversky optimisation on unpaired desirable/undesirable data"),
    "kd": ("tidal.cli.train_kd", "knowledge distillation from a teacher model"),
    "ppo": ("tidal.cli.train_ppo", "RL: PPO, REINFORCE++(-baseline), RLOO, GRPO, Dr.GRPO; rewards or agents"),
    "generate": (
        "tidal.cli.generate",
        "batch inference: sample, score with a reward model, rs/csft/iter_dpo",
    ),
    "chat": ("tidal.cli.chat", "interactive multi-turn chat with a model in the terminal"),
    "lora_combiner": ("tidal.cli.lora_combiner", "merge LoRA adapters into their base model"),
    "demo": ("tidal.cli.demo", "end-to-end demo on CPU with a tiny model"),
}


# OpenRLHF's module names that are not tidal command names: each runs its module (same flags as the
# tidal command in tidal.cli.openrlhf.OPENRLHF_MODULES, plus that module's OpenRLHF-only handling).
OPENRLHF_COMMANDS = {
    "train_sft": "tidal.cli.train_sft",
    "train_rm": "tidal.cli.train_rm",
    "train_prm": "tidal.cli.train_prm",
    "train_dpo": "tidal.cli.train_dpo",
    "train_kto": "tidal.cli.train_kto",
    "train_kd": "tidal.cli.train_kd",
    "train_ppo_ray": "tidal.cli.train_ppo_ray",
    "batch_inference": "tidal.cli.batch_inference",
    "interactive_chat": "tidal.cli.interactive_chat",
}


def usage() -> str:
    lines = ["usage: tidal <command> [flags]   (tidal <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:<14} {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "OpenRLHF's module names work too: " + ", ".join(OPENRLHF_COMMANDS)]
    return "\n".join(lines)


def command_module(name: str) -> str | None:
    """The module that runs ``tidal <name>`` (a tidal command or an OpenRLHF module name)."""
    return COMMANDS[name][0] if name in COMMANDS else OPENRLHF_COMMANDS.get(name)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    name, rest = argv[0], argv[1:]
    module_name = command_module(name)
    if module_name is None:
        sys.exit(f"tidal: unknown command {name!r}\n\n{usage()}")
    module = importlib.import_module(module_name)
    module.main(rest, prog=f"tidal {name}")


if __name__ == "__main__":
    main()
