"""``tidal dpo`` / ``python -m tidal.cli.train_dpo``: DPO, IPO (``--ipo``) and cDPO
(``--label_smoothing``) on preference pairs, with the seed's flags."""

from tidal.cli.common import COMMON_TITLES, TrainerCommand
from tidal.config.supervised import DPORun

COMMAND = TrainerCommand(
    "dpo",
    "Direct preference optimisation (DPO, IPO, cDPO).",
    DPORun,
    "tidal.trainers.dpo:run_dpo",
    {
        **COMMON_TITLES,
        "model": "model (the policy)",
        "ref": "reference model",
        "dpo": "DPO loss",
        "data": "preference pairs",
        "vision": "images (vision-language models)",
    },  # fmt: skip
)
build_parser, parse_run, main = COMMAND.build_parser, COMMAND.parse_run, COMMAND.main

if __name__ == "__main__":
    COMMAND.module_main()
