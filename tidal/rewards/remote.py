"""``RemoteReward``: rewards from HTTP reward servers (``--remote_rm_url http://host:port/get_reward``).

Protocol (docs/architecture.md §5; ``tidal serve_rm`` speaks it): POST JSON ``{"query": [...], "prompts": [...],
"labels": [...]}`` and receive ``{"rewards": [...], "scores": [...], "extra_logs": {...}}``. With
several URLs the batch is split into contiguous chunks, one per URL, sent concurrently from threads,
and the answers are concatenated in order. Connection errors, timeouts, 429 and 5xx answers are
retried with exponential backoff; other 4xx answers fail at once (resending a bad request cannot help).

``--remote_rm_timeout`` (seconds a request may wait on the connection or for each read) and
``--remote_rm_retries`` bound how long a server that accepts and never answers can stall a run:
OpenRLHF's fixed 180 s x 6 attempts stalled it ~18 min; the defaults here (60 s, 2 retries) fail it in
about 3 min while still leaving a slow reward model a minute per batch. While a request waits, a line every
``heartbeat`` seconds (20 s) says on what (URL, attempt, seconds so far), and each failed attempt that
will be retried says why, so a stalled server is visible long before the run ends in its one-line error.

The client is the standard library's ``urllib``: no dependency, and one blocking request per thread
is all this needs.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from tidal.config.registries import DEFAULT_RETRIES, DEFAULT_TIMEOUT  # --remote_rm_timeout/_retries
from tidal.data.batching import contiguous_splits
from tidal.logging import get_logger
from tidal.rewards.base import RewardError, RewardResult, to_reward_result

log = get_logger(__name__)

_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
HEARTBEAT = 20.0  # seconds between the "still waiting" lines of one request


class RemoteReward:
    """Score batches by POSTing them to one or more reward servers."""

    def __init__(
        self,
        urls: list[str] | str,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_RETRIES,
        backoff: float = 1.0,
        heartbeat: float = HEARTBEAT,
    ):
        urls = [u.strip() for u in urls.split(",")] if isinstance(urls, str) else [u.strip() for u in urls]
        if not urls or not all(urls):
            raise ValueError(f"RemoteReward needs at least one non-empty URL, got {urls!r}")
        if max_retries < 0 or timeout <= 0 or backoff < 0 or heartbeat <= 0:
            raise ValueError(
                "RemoteReward: need timeout > 0, max_retries >= 0, backoff >= 0 and heartbeat > 0"
            )
        self.urls, self.timeout, self.max_retries, self.backoff = urls, timeout, max_retries, backoff
        self.heartbeat = heartbeat

    def __call__(self, queries: list[str], prompts: list[str], labels: list) -> RewardResult:
        n = len(queries)
        if len(prompts) != n or len(labels) != n:
            raise ValueError(f"got {n} queries, {len(prompts)} prompts and {len(labels)} labels")
        chunks = [c for c in contiguous_splits(n, len(self.urls)) if c[1] > c[0]]
        if len(chunks) <= 1:
            parts = [self._score(self.urls[0], queries, prompts, labels)] if chunks else []
        else:
            with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
                futures = [
                    pool.submit(self._score, url, queries[lo:hi], prompts[lo:hi], labels[lo:hi])
                    for url, (lo, hi) in zip(self.urls, chunks, strict=False)
                ]
                parts = [f.result() for f in futures]
        return _concat(parts, [hi - lo for lo, hi in chunks])

    def _score(self, url: str, queries: list[str], prompts: list[str], labels: list) -> RewardResult:
        payload = {"query": list(queries), "prompts": list(prompts), "labels": list(labels)}
        try:
            body = json.dumps(payload).encode()
        except TypeError as err:
            raise RewardError(f"cannot send the batch to reward server {url} as JSON: {err}") from err
        answer = self._post_with_retries(url, body)
        return to_reward_result(answer, len(queries), f"reward server {url}")

    def _post_with_retries(self, url: str, body: bytes):
        last, timed_out, start = None, False, time.monotonic()
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            if attempt:
                delay = self.backoff * 2 ** (attempt - 1)
                log.warning(
                    "reward server %s: attempt %d/%d failed (%s) after %.0f s in all; retrying in %g s",
                    url, attempt, attempts, last, time.monotonic() - start, delay,
                )  # fmt: skip
                time.sleep(delay)
            try:
                with self._waiting(url, attempt + 1, attempts, start):
                    return self._post(url, body)
            except urllib.error.HTTPError as err:
                last = f"HTTP {err.code}: {_body_text(err)}"
                if err.code not in _RETRYABLE_STATUS:
                    raise RewardError(f"reward server {url} answered {last}") from err
            except (
                urllib.error.URLError,
                OSError,
                http.client.HTTPException,
            ) as err:  # refused, reset, timeout
                reason = getattr(err, "reason", err)
                timed_out = isinstance(reason, TimeoutError)
                last = f"{type(err).__name__}: {reason}"
        tried = f"{attempts} attempts, {time.monotonic() - start:.0f} s in all"
        if timed_out:
            raise RewardError(
                f"reward server {url} did not answer within {self.timeout:g} s ({tried}); check the server "
                "or raise --remote_rm_timeout/--remote_rm_retries"
            )
        raise RewardError(f"reward server {url} failed after {tried}; last error: {last}")

    @contextlib.contextmanager
    def _waiting(self, url: str, attempt: int, attempts: int, start: float):
        """Log a line every ``heartbeat`` seconds until the request in the ``with`` block returns."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.heartbeat):
                log.info(
                    "waiting for reward server %s: attempt %d/%d, %.0f s so far (--remote_rm_timeout %g s "
                    "per attempt)", url, attempt, attempts, time.monotonic() - start, self.timeout,
                )  # fmt: skip

        thread = threading.Thread(target=beat, name="reward-wait", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _post(self, url: str, body: bytes):
        request = urllib.request.Request(
            url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            raw = response.read()
        try:
            return json.loads(raw)
        except json.JSONDecodeError as err:
            raise RewardError(f"reward server {url} answered non-JSON: {raw[:200]!r}") from err

    def __repr__(self) -> str:
        return f"RemoteReward({self.urls!r})"


def _concat(parts: list[RewardResult], sizes: list[int]) -> RewardResult:
    if not parts:
        return RewardResult(torch.zeros(0), torch.zeros(0), {})
    rewards = torch.cat([p.rewards for p in parts])
    scores = torch.cat([p.scores for p in parts])
    # Each server's logs are batch means: weight them by the chunk they describe.
    logs = {}
    for key in {k for p in parts for k in p.extra_logs}:
        pairs = [(p.extra_logs[key], s) for p, s in zip(parts, sizes, strict=True) if key in p.extra_logs]
        logs[key] = sum(v * s for v, s in pairs) / max(sum(s for _, s in pairs), 1)
    return RewardResult(rewards, scores, logs)


def _body_text(err: urllib.error.HTTPError) -> str:
    try:
        return err.read()[:200].decode(errors="replace")
    except Exception:  # the body is best-effort context for the message only
        return ""
