"""Partial rollouts (``--partial_rollout_enable`` with ``--async_train``): a weight update does not wait for
the rollout being generated on the background thread to finish. The trainer's ``sync_weights`` posts the
policy and waits; the engine applies it between two of its steps (``LLMEngine.between_steps``), and the
unfinished sequences go on under the new weights, keeping their KV cache (a sequence preempted later is
re-prefilled under the weights of that moment). When no generation runs, the update is applied at once.

Each token records how many updates had reached the engine, since its rollout started, when it was
sampled (``Trajectory.weight_updates``); its behaviour log-prob is the engine's, as always, so the
importance-sampling corrections divide by the policy that sampled it. With no update during a rollout
nothing differs from plain ``--async_train``: the hook only looks at an empty slot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class PartialUpdates:
    """Weight updates landing between engine steps; ``load(policy)`` puts the policy's weights in the engine."""

    def __init__(self, engine, load: Callable[[Any], int]):
        self.engine, self.load = engine, load
        self._cond = threading.Condition()
        self._pending: Any = None
        self._loaded = 0
        self._generating = False
        # per (request, sample) of the running rollout: (output tokens before the update, updates so far)
        self._boundaries: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._updates = 0

    def generate(self, run: Callable[[], Any]) -> tuple[Any, dict[tuple[int, int], list[tuple[int, int]]]]:
        """``run()`` (one ``engine.generate`` of the rollout) with updates allowed between its steps; its
        result and, per (request, sample), where updates landed (``token_updates`` reads them)."""
        with self._cond:
            self._generating, self._boundaries, self._updates = True, {}, 0
        self.engine.between_steps = self._between_steps
        try:
            result = run()
        finally:
            self.engine.between_steps = None
            with self._cond:
                self._generating = False
                if self._pending is not None:  # posted after the last step: nothing left to interrupt
                    self._apply([])
        return result, self._boundaries

    def sync(self, policy) -> int:
        """Load ``policy``'s weights now, or (during a rollout) at the engine's next step; returns the count."""
        with self._cond:
            if not self._generating:
                return self.load(policy)
            self._pending = policy
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._pending is None)
            return self._loaded

    def _between_steps(self, groups) -> None:
        with self._cond:
            if self._pending is not None:
                self._apply(groups)

    def _apply(self, groups) -> None:
        """Load the posted weights (the condition held); record where each running sequence was."""
        self._updates += 1
        for r, group in enumerate(groups):
            for k, seq in enumerate(group):
                if not seq.is_finished:
                    self._boundaries.setdefault((r, k), []).append((seq.num_output_tokens, self._updates))
        self._loaded = self.load(self._pending)
        self._pending = None
        self._cond.notify_all()


def token_updates(boundaries: list[tuple[int, int]], tokens: int) -> list[int]:
    """Per output token, the updates that had reached the engine when it was sampled (``boundaries``:
    ``(tokens already sampled, updates then)`` in order)."""
    out, updates, start = [], 0, 0
    for count, after in [*boundaries, (tokens, None)]:
        count = min(count, tokens)
        out += [updates] * (count - start)
        start = max(start, count)
        updates = after if after is not None else updates
    return out
