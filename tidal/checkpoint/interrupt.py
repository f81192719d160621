"""Graceful stop on SIGTERM / SIGINT (Ctrl-C): finish the step, save, exit with one line.

While a trainer runs inside ``StopSignals``, the first SIGTERM or SIGINT only records the request
(and says so on stderr). The loop asks ``requested(world)`` after every step: all processes agree
(one tiny all-reduce), so every rank stops after the same step, writes the checkpoint together
and raises ``TrainingInterrupted``, which the command line turns into one line and the exit status
shells expect (130 for SIGINT, 143 for SIGTERM). A second signal exits at once, without saving.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from tidal.distributed.collectives import max_over_world
from tidal.distributed.world import World

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}

_active: StopSignals | None = None


class TrainingInterrupted(Exception):
    """Training stopped on a signal after a completed step; ``exit_code`` is 128 + the signal."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def active() -> StopSignals | None:
    """The ``StopSignals`` currently installed (None outside training)."""
    return _active


class StopSignals:
    """Context manager that turns SIGTERM/SIGINT into a stop request (see the module docstring)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        global _active
        if threading.current_thread() is threading.main_thread():  # Python runs handlers there only
            self._previous = {s: signal.signal(s, self._handle) for s in EXIT_CODES}
            _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if _active is self:
            _active = None

    def _handle(self, signum: int, frame) -> None:
        name = signal_name(signum)
        if self.received is not None:
            sys.stderr.write(f"tidal: second {name}: exiting now without saving\n")
            sys.stderr.flush()
            os._exit(EXIT_CODES[signum])
        self.received = signum
        sys.stderr.write(f"tidal: {name} received: stopping after the current step (again to exit at once)\n")
        sys.stderr.flush()

    def requested(self, world: World) -> int | None:
        """The signal to stop for, the same on every rank (a collective with several processes)."""
        signum = self.received or 0
        if world.distributed:
            signum = max_over_world(signum, world)
        return signum or None

    @staticmethod
    def interrupted(signum: int, step: int, saved: str | None) -> TrainingInterrupted:
        """The exception that ends training after ``step`` (``saved``: the checkpoint written, if any)."""
        where = (
            f"checkpoint {saved} saved; resume with --load_checkpoint"
            if saved
            else "no checkpoint written (--save_steps is off)"
        )
        return TrainingInterrupted(
            f"stopped by {signal_name(signum)} after step {step}: {where}", EXIT_CODES[signum]
        )
