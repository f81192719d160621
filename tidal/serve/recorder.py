"""Token-in-token-out recording of served requests, grouped by episode.

Every completed request that names an episode (header ``X-Episode-Id``, else the body's ``user``) is
recorded as the engine saw it: the prompt's token ids, and per sample the sampled ids, their
log-probs (``SamplingParams``' semantics), the finish reason and, when the engine records routing (MoE
router replay), the experts each token of the request was routed to. An RL integration turns an episode's
requests into a trajectory from these ids directly, so no text is ever re-tokenized. Requests are kept
in the order the server received them (an agent's turns), whatever order they finished in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from tidal.rollout import RequestOutput


@dataclass(frozen=True)
class RecordedSample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    # ``CompletionOutput.routed_experts`` (prompt + sampled tokens - 1 rows); None unless recorded
    routed_experts: Any = None


@dataclass(frozen=True)
class RecordedRequest:
    """One engine request (one prompt) of an episode and its ``n`` samples."""

    order: int  # arrival order at the server, across all episodes
    endpoint: str  # "chat.completions" or "completions"
    prompt_token_ids: list[int]
    samples: list[RecordedSample]


class RequestRecorder:
    """Thread-safe store of recorded requests by episode id (handlers record, the trainer pops)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._episodes: dict[str, list[RecordedRequest]] = {}
        self._order = 0

    def next_order(self) -> int:
        """Reserve the arrival number of a request (taken when it is received, used when it completes)."""
        with self._lock:
            self._order += 1
            return self._order

    def record(self, episode_id: str, order: int, endpoint: str, output: RequestOutput) -> None:
        samples = [
            RecordedSample(
                list(c.token_ids), list(c.logprobs), c.finish_reason, getattr(c, "routed_experts", None)
            )
            for c in sorted(output.outputs, key=lambda c: c.index)
        ]
        request = RecordedRequest(order, endpoint, list(output.prompt_token_ids), samples)
        with self._lock:
            requests = self._episodes.setdefault(episode_id, [])
            requests.append(request)
            requests.sort(key=lambda r: r.order)

    def episode(self, episode_id: str) -> list[RecordedRequest]:
        """The episode's requests so far, in arrival order (empty if none)."""
        with self._lock:
            return list(self._episodes.get(episode_id, []))

    def pop(self, episode_id: str) -> list[RecordedRequest]:
        """The episode's requests, forgotten by the recorder (call once the episode is over)."""
        with self._lock:
            return self._episodes.pop(episode_id, [])

    def episode_ids(self) -> list[str]:
        with self._lock:
            return list(self._episodes)
