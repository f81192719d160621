"""Async scheduling's pieces (the engine's ``async_scheduling``): which settings keep the synchronous loop
(``async_fallback``), when to launch decode steps ahead (``AheadPolicy``), the counts (``AheadStats``), and a
step launched ahead with its plan (``Ahead``). The loop itself is ``LLMEngine._advance``."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.rollout.engine.config import EngineConfig
from tidal.rollout.runner.steps import LaunchedStep
from tidal.rollout.scheduling.scheduler import Lookahead


def async_fallback(config: EngineConfig) -> str | None:
    """Why an engine with these settings runs every step synchronously (None: async scheduling applies):
    router replay (routing is read back after each step) and prefix caching (taking a block evicts a
    cached one, which cannot be undone when a step launched ahead is discarded). Per step,
    ``Scheduler.plan_ahead`` names the steps that stay synchronous. Tensor-parallel engines launch ahead
    too: the other ranks receive the step's input ids from the driver's device (``ModelRunner``)."""
    if config.record_routing:
        return "record_routing"
    if config.enable_prefix_caching:
        return "enable_prefix_caching"
    return None


@dataclass
class AheadPolicy:
    """Whether to launch decode steps ahead. One that is used saves the host's share of a step (~1 ms);
    one that is discarded costs a device step (2.2 ms at 0.5B, 8 ms at 7B on an H200, docs/benchmarks.md),
    so launching pays while fewer than about host / device time of the steps are discarded (~0.5 at 0.5B,
    ~0.2 at 7B). Discards come from sequences stopping on a sampled token (eos, stop ids or strings: in RL,
    at many steps of a large batch), so their rate is tracked over recent decode steps, whether or not a
    step was launched ahead, and steps are launched while it is at most ``max_miss_rate``."""

    max_miss_rate: float = 0.2
    decay: float = 1 / 16  # weight of the latest step in the running rate (about the last 16 steps)
    miss_rate: float = 0.0

    @property
    def launch(self) -> bool:
        return self.miss_rate <= self.max_miss_rate

    def update(self, missed: bool) -> None:
        self.miss_rate += self.decay * (float(missed) - self.miss_rate)


@dataclass
class AheadStats:
    """Async scheduling's counts: decode steps launched ahead, and those used (the rest were discarded)."""

    launched: int = 0
    used: int = 0


@dataclass
class Ahead:
    """A decode step launched ahead, and the scheduler's plan it was launched for."""

    plan: Lookahead
    launched: LaunchedStep
