"""``python -m tidal.cli.train_ppo_ray``: the seed's module name for ``tidal ppo`` (same flags)."""

from tidal.cli.common import module_main
from tidal.cli.train_ppo import main

if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.train_ppo_ray"))
