"""``python -m tidal.cli.interactive_chat`` / ``tidal interactive_chat``: OpenRLHF's module name for
``tidal chat`` (same flags; OpenRLHF's others are aliased or refused by ``tidal.cli.openrlhf``)."""

from tidal.cli.chat import main
from tidal.cli.common import module_main

if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.interactive_chat"))
