"""A stream of rollouts for the RL loop, generated and scored in order, optionally ahead of training (on
this thread, or on a background thread while the trainer trains).

Synchronous (default): each rollout is generated when the loop asks for it, with the latest
weights. ``--async_train``: a background thread generates up to ``--async_queue_size`` rollouts
ahead while the trainer trains, so samples may come from weights up to that many updates old
(the mismatch correction ``--enable_vllm_is_correction`` accounts for it). The engine is shared, so
generation and weight sync take turns on the rollout's lock.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from tidal.data.prompts import PromptSample
from tidal.experience.experience import Experience


@dataclass(frozen=True)
class RolloutJob:
    """One rollout to generate: its index in the episode, prompts, sample count, temperature, seed."""

    index: int
    prompts: Sequence[PromptSample]
    n: int
    temperature: float
    seed: int


@dataclass
class RolloutResult:
    """A generated rollout: its job, ``Experience`` with rewards, the reward logs, generation seconds."""

    job: RolloutJob
    exp: Experience
    reward_logs: dict
    seconds: float


# One rollout's experience: the trainer's ``RolloutRole.generate`` then ``RewardScorer.experience``.
MakeExperience = Callable[[RolloutJob], tuple[Experience, dict]]


def _generate(make: MakeExperience, job: RolloutJob) -> RolloutResult:
    start = time.perf_counter()
    exp, logs = make(job)
    return RolloutResult(job, exp, logs, time.perf_counter() - start)


def rollout_stream(
    make: MakeExperience, jobs: Sequence[RolloutJob], ahead: int | None
) -> Iterator[RolloutResult]:
    """Results of ``jobs`` in order (``make`` runs each: generate, then score); ``ahead`` (async) lets a
    thread run up to that many rollouts early."""
    if not ahead:
        for job in jobs:
            yield _generate(make, job)
        return
    results: queue.Queue = queue.Queue(maxsize=ahead)
    stop = threading.Event()

    def produce() -> None:
        try:
            for job in jobs:
                if stop.is_set():
                    return
                results.put(_generate(make, job))
        except BaseException as err:  # surface generation errors in the training thread
            results.put(err)

    thread = threading.Thread(target=produce, name="tidal-rollout", daemon=True)
    thread.start()
    try:
        for _ in jobs:
            item = results.get()
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            with contextlib.suppress(queue.Empty):
                results.get(timeout=0.1)
