"""What a long phase is doing and how far it got, as log lines: ``phase`` and ``Progress``.

A run's start-up (loading weights, wrapping, starting the engine) and each RL step's phases (generation,
scoring, training, weight sync) can each take seconds to minutes on a 7B model; a user watching the
console, or a log file, must see which one is running. ``phase("loading ...")`` logs one line when it
starts and one with its duration when it ends; ``Progress`` counts the items of a phase (files, micro-
batches, requests) and logs ``done/total`` at most every ``interval`` seconds and once at the end, with a
rate (``Throughput``) where it counts tokens. Both go through ``tidal.logging.console`` (``tqdm.write``,
so they never break the run's progress bar) and print on the main process only: rank 0 of torchrun's or
Ray's ``RANK`` (``quiet`` unset), since every rank runs the same phases.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tidal.logging.console import get_logger
from tidal.logging.progress import Throughput

log = get_logger("tidal.progress")

INTERVAL = 5.0  # seconds between two progress lines of one phase


def on_main_process() -> bool:
    """Rank 0 (``RANK`` unset: one process)."""
    return os.environ.get("RANK", "0") == "0"


def size_text(nbytes: float) -> str:
    """``"14.2 GiB"``: bytes in the largest binary unit they fill."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


@contextmanager
def phase(what: str, quiet: bool | None = None, logger: logging.Logger | None = None) -> Iterator[None]:
    """Log ``"<what> ..."`` now and ``"<what>: done in 3.2 s"`` when the block ends (not on an exception:
    the error says what happened)."""
    logger = logger or log
    quiet = not on_main_process() if quiet is None else quiet
    start = time.perf_counter()
    if not quiet:
        logger.info("%s ...", what)
    yield
    if not quiet:
        logger.info("%s: done in %.1f s", what, time.perf_counter() - start)


class Progress:
    """``done/total <unit>`` of a phase, logged at most every ``interval`` seconds and at ``close``.

    ``update(n, tokens=...)`` counts ``n`` items (and the tokens they produced, for a tokens/s rate)."""

    def __init__(
        self,
        what: str,
        total: int | None,
        unit: str,
        quiet: bool | None = None,
        interval: float = INTERVAL,
        logger: logging.Logger | None = None,
    ):
        self.what, self.total, self.unit, self.interval = what, total, unit, interval
        self.quiet = not on_main_process() if quiet is None else quiet
        self.logger = logger or log
        self.done, self.tokens = 0, 0
        self._start = self._last = time.perf_counter()
        self._rate = Throughput(window=1_000_000)  # the whole phase: its average tokens/s
        if not self.quiet:
            self.logger.info("%s: 0/%s %s", what, "?" if total is None else total, unit)

    def update(self, n: int = 1, tokens: int = 0) -> None:
        self.done += n
        if tokens:
            self.tokens += tokens
            self._rate.update(tokens)
        now = time.perf_counter()
        if not self.quiet and now - self._last >= self.interval:
            self._last = now
            self.logger.info("%s: %s", self.what, self._status(now))

    def close(self) -> None:
        if not self.quiet:
            self.logger.info("%s: %s, done", self.what, self._status(time.perf_counter()))

    def _status(self, now: float) -> str:
        total = "" if self.total is None else f"/{self.total}"
        text = f"{self.done}{total} {self.unit} in {now - self._start:.1f} s"
        if self.tokens:
            text += f", {self.tokens} tokens ({self._rate.rate:.0f} tokens/s)"
        return text

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
