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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    """A generated rollout: its job, ``Experience`` with rewards, the reward logs, generation seconds; a
    batch of ``trainers/ppo/sampling.py`` also names its prompts (indices into the run's), the episode's
    position after it (a ``BatchPosition``) and its ``dynamic_filter/*`` metrics."""

    job: RolloutJob
    exp: Experience
    reward_logs: dict
    seconds: float
    prompt_ids: list[int] = field(default_factory=list)
    position: Any = None
    stats: dict = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)  # per prompt: steps trained when it was generated


# One rollout's experience: the trainer's ``RolloutRole.generate`` then ``RewardScorer.experience``.
MakeExperience = Callable[[RolloutJob], tuple[Experience, dict]]


def rollout_stream(results: Iterator[RolloutResult], ahead: int | None) -> Iterator[RolloutResult]:
    """``results`` in order (each generated and scored when the iterator yields it); ``ahead`` (async)
    lets a thread run up to that many rollouts early."""
    if not ahead:
        yield from results
        return
    queued: queue.Queue = queue.Queue(maxsize=ahead)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for result in results:
                if stop.is_set():
                    return
                queued.put(result)
            queued.put(done)
        except BaseException as err:  # surface generation errors in the training thread
            queued.put(err)

    thread = threading.Thread(target=produce, name="tidal-rollout", daemon=True)
    thread.start()
    try:
        while (item := queued.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            with contextlib.suppress(queue.Empty):
                queued.get(timeout=0.1)
