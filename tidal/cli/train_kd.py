"""``tidal kd`` / ``python -m tidal.cli.train_kd``: knowledge distillation from ``--teacher_model``
on SFT data, with the seed's flags."""

from tidal.cli.common import COMMON_TITLES, TrainerCommand
from tidal.config.supervised import KDRun

COMMAND = TrainerCommand(
    "kd",
    "Knowledge distillation from a frozen teacher on SFT data.",
    KDRun,
    "tidal.trainers.kd:run_kd",
    {
        **COMMON_TITLES,
        "model": "model (the student)",
        "kd": "distillation",
        "data": "SFT data",
        "kernels": "kernels",
    },
)
build_parser, parse_run, main = COMMAND.build_parser, COMMAND.parse_run, COMMAND.main

if __name__ == "__main__":
    COMMAND.module_main()
