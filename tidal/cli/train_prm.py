"""``tidal prm`` / ``python -m tidal.cli.train_prm``: process-reward-model training (step labels)."""

from tidal.cli.common import COMMON_TITLES, TrainerCommand
from tidal.config.supervised import PRMRun

COMMAND = TrainerCommand(
    "prm",
    "Train a process reward model on per-step labels.",
    PRMRun,
    "tidal.trainers.prm:run_prm",
    {**COMMON_TITLES, "data": "PRM data", "kernels": "kernels"},
)
build_parser, parse_run, main = COMMAND.build_parser, COMMAND.parse_run, COMMAND.main

if __name__ == "__main__":
    COMMAND.module_main()
