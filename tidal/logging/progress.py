"""Console progress: a thin tqdm bar with compact loss/lr/throughput postfix, and ``Throughput``.

``Throughput`` measures tokens/s over a sliding window of recent updates, so the number tracks the
current speed rather than the average since start (which hides slowdowns and warm-up).
"""

from __future__ import annotations

from collections import deque
from time import perf_counter
from typing import Any

from tqdm import tqdm

from tidal.logging.metrics import to_scalar


def format_value(key: str, value: Any) -> str:
    """Compact text for one postfix value: lr in scientific notation, large numbers with k/M."""
    value = to_scalar(key, value)
    if key == "lr" or key.endswith("_lr") or key.startswith("lr_"):
        return f"{value:.2e}"
    if abs(value) >= 1e6:
        return f"{value / 1e6:.2f}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.1f}k"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


class ProgressBar:
    """tqdm over optimizer steps; ``update(n, loss=..., lr=..., tokens_per_s=...)``.

    ``disable`` defaults to ``not is_main`` so only rank 0 draws a bar.
    """

    def __init__(
        self,
        total: int | None,
        initial: int = 0,
        desc: str | None = None,
        is_main: bool = True,
        disable: bool | None = None,
    ) -> None:
        disable = (not is_main) if disable is None else disable
        self._bar = tqdm(total=total, initial=initial, desc=desc, disable=disable, dynamic_ncols=True)

    @property
    def n(self) -> int:
        return self._bar.n

    def update(self, n: int = 1, **postfix: Any) -> None:
        if postfix:
            text = {k: format_value(k, v) for k, v in postfix.items() if v is not None}
            self._bar.set_postfix(text, refresh=False)  # update() below refreshes once
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Throughput:
    """Tokens per second over the last ``window`` updates (``time.perf_counter`` clock)."""

    def __init__(self, window: int = 20) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.reset()

    def reset(self) -> None:
        """Restart timing now, e.g. after an evaluation or checkpoint pause."""
        # Each entry is (time, tokens processed since the previous entry); the first is the start.
        self._events: deque[tuple[float, int]] = deque([(perf_counter(), 0)], maxlen=self.window + 1)

    def update(self, tokens: int) -> float:
        """Count ``tokens`` finished now; return the current tokens/s."""
        self._events.append((perf_counter(), int(tokens)))
        return self.rate

    @property
    def rate(self) -> float:
        elapsed = self._events[-1][0] - self._events[0][0]
        if elapsed <= 0:
            return 0.0
        # The oldest entry only marks the window start; its tokens were done before it.
        return sum(tokens for _, tokens in list(self._events)[1:]) / elapsed
