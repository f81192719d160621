"""``tidal sft`` / ``python -m tidal.cli.train_sft``: supervised fine-tuning with the seed's flags."""

from tidal.cli.common import COMMON_TITLES, TrainerCommand
from tidal.config.supervised import SFTRun

COMMAND = TrainerCommand(
    "sft",
    "Supervised fine-tuning of a causal language model.",
    SFTRun,
    "tidal.trainers.sft:run_sft",
    {**COMMON_TITLES, "data": "SFT data", "vision": "images (vision-language models)"},
)
build_parser, parse_run, main = COMMAND.build_parser, COMMAND.parse_run, COMMAND.main

if __name__ == "__main__":
    COMMAND.module_main()
