"""``tidal kto`` / ``python -m tidal.cli.train_kto``: KTO on unpaired desirable/undesirable samples."""

from tidal.cli.common import COMMON_TITLES, TrainerCommand
from tidal.config.supervised import KTORun

COMMAND = TrainerCommand(
    "kto",
    "Kahneman-Tversky optimisation on unpaired desirable/undesirable samples.",
    KTORun,
    "tidal.trainers.kto:run_kto",
    {
        **COMMON_TITLES,
        "model": "model (the policy)",
        "ref": "reference model",
        "kto": "KTO loss",
        "data": "unpaired samples",
    },  # fmt: skip
)
build_parser, parse_run, main = COMMAND.build_parser, COMMAND.parse_run, COMMAND.main

if __name__ == "__main__":
    COMMAND.module_main()
