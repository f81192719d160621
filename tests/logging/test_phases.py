"""``tidal.logging.phases``: a phase logs its start and end; ``Progress`` logs done/total with a token rate,
at most once per interval and at the end; ranks other than 0 stay quiet."""

from __future__ import annotations

import logging

from tidal.logging.phases import Progress, phase, size_text


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tidal.progress"]


def test_phase_logs_start_and_end(caplog):
    caplog.set_level(logging.INFO)
    with phase("loading weights"):
        pass
    start, end = messages(caplog)
    assert start == "loading weights ..."
    assert end.startswith("loading weights: done in ") and end.endswith(" s")


def test_progress_counts_items_and_tokens(caplog):
    caplog.set_level(logging.INFO)
    with Progress("generation", 3, "requests", interval=float("inf")) as progress:
        for _ in range(3):
            progress.update(1, tokens=10)
    first, last = messages(caplog)  # the interval is never reached: the start and the end only
    assert first == "generation: 0/3 requests"
    assert (
        last.startswith("generation: 3/3 requests in ") and ", 30 tokens (" in last and last.endswith("done")
    )


def test_progress_logs_every_interval(caplog):
    caplog.set_level(logging.INFO)
    progress = Progress("training", None, "micro-batches", interval=0.0)
    progress.update(2)
    assert messages(caplog)[-1].startswith("training: 2 micro-batches in ")


def test_other_ranks_are_quiet(caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("RANK", "1")
    with phase("loading weights"), Progress("training", 2, "micro-batches") as progress:
        progress.update(2)
    assert messages(caplog) == []


def test_sizes():
    assert size_text(3 * 2**30 + 2**29) == "3.5 GiB"
    assert size_text(2**20) == "1.0 MiB"
    assert size_text(12) == "12 B"
