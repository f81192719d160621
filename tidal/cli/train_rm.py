"""``tidal rm`` / ``python -m tidal.cli.train_rm``: reward-model training with the seed's flags."""

from tidal.cli.common import COMMON_TITLES, TrainerCommand
from tidal.config.supervised import RMRun

COMMAND = TrainerCommand(
    "rm",
    "Train a reward model on pairwise preference data.",
    RMRun,
    "tidal.trainers.rm:run_rm",
    {
        **COMMON_TITLES,
        "data": "preference data",
        "rm": "reward model",
        "vision": "images (vision-language models)",
    },
)
build_parser, parse_run, main = COMMAND.build_parser, COMMAND.parse_run, COMMAND.main

if __name__ == "__main__":
    COMMAND.module_main()
