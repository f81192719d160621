"""What every reward source returns (``RewardResult``), the ``RewardSource`` protocol, and validation.

A reward source maps a batch of ``queries`` (prompt + response text), ``prompts`` and ``labels`` to one
reward per sample. User code (``reward_func.py``) and remote servers return loosely typed values
(tensors, lists, numpy arrays, 0-d tensors inside lists); ``to_reward_result`` turns them into a
``RewardResult`` or raises a ``RewardError`` that says who returned what.

``check_finite`` is the one check every reward source goes through (reward functions, reward
servers, reward models, agents' ``step`` and trajectories): a NaN or ±inf reward or score is refused
with a one-line message naming the source and the sample, instead of training on NaN (or clipping an
inf for training while logging it as inf).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


class RewardError(RuntimeError):
    """A reward source failed or returned something unusable; the message names the source."""


@dataclass
class RewardResult:
    """``rewards`` [N] float32 (used for advantages), ``scores`` [N] (dynamic filtering), scalar logs."""

    rewards: torch.Tensor
    scores: torch.Tensor | None = None
    extra_logs: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scores is None:
            self.scores = self.rewards


@runtime_checkable
class RewardSource(Protocol):
    """Anything that scores a batch: ``RewardFunction``, ``RemoteReward``, a reward model wrapper."""

    def __call__(self, queries: list[str], prompts: list[str], labels: list) -> RewardResult: ...


def to_reward_result(value: Any, n: int, source: str) -> RewardResult:
    """Validate what ``source`` returned for ``n`` samples (a dict, or bare rewards) as a RewardResult."""
    if not isinstance(value, dict):
        if _looks_numeric_sequence(value):
            value = {"rewards": value}
        else:
            raise RewardError(
                f"{source} returned a {type(value).__name__}; expected a dict with 'rewards' "
                "(and optional 'scores', 'extra_logs') or a tensor/list of rewards"
            )
    if "rewards" not in value:
        raise RewardError(f"{source} returned a dict without 'rewards' (keys: {sorted(value)})")
    rewards = check_finite(to_vector(value["rewards"], n, f"{source} returned rewards"), "reward", source)
    scores = value.get("scores")
    if scores is not None:
        scores = check_finite(to_vector(scores, n, f"{source} returned scores"), "score", source)
    logs = to_scalar_logs(value.get("extra_logs") or {}, f"{source} returned extra_logs")
    return RewardResult(rewards, scores, logs)


def check_finite(
    values: Any, what: str, source: str | None = None, where: Callable[[int], str] | None = None
) -> torch.Tensor:
    """``values`` (a tensor or numbers, one per sample) as a float32 vector, or a ``RewardError``:
    "<source> returned a non-finite <what> (nan) for sample 3 of 8 (2 samples in all: [3, 5])".

    ``where(i)`` names sample ``i`` when the caller knows more (an agent's prompt, sample and turn);
    without ``source`` the message starts at "a non-finite ..." for a caller that names the source.
    """
    vector = torch.as_tensor(values, dtype=torch.float32).detach().reshape(-1).cpu()
    bad = (~torch.isfinite(vector)).nonzero().flatten().tolist()
    if not bad:
        return vector
    name = where or (lambda i: f"sample {i} of {vector.numel()}")
    first = bad[0]
    message = f"a non-finite {what} ({vector[first].item()}) for {name(first)}"
    if len(bad) > 1:
        message += f" ({len(bad)} samples in all: {bad[:10]}{'...' if len(bad) > 10 else ''})"
    raise RewardError(f"{source} returned {message}" if source else message)


def to_vector(value: Any, n: int, what: str) -> torch.Tensor:
    """A float32 tensor of shape [n] from a tensor / numpy array / list of numbers or 0-d tensors."""
    try:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().to("cpu", torch.float32)
        elif isinstance(value, (list, tuple)):
            tensor = torch.tensor([_as_float(v) for v in value], dtype=torch.float32)
        else:  # numpy arrays and other array-likes
            tensor = torch.as_tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as err:
        raise RewardError(f"{what} of type {type(value).__name__} that is not numeric: {err}") from err
    if tensor.dim() == 2 and tensor.shape[1] == 1:  # a column vector, e.g. a reward model's [N, 1] head
        tensor = tensor[:, 0]
    if tensor.dim() != 1:
        raise RewardError(f"{what} of shape {list(tensor.shape)} for {n} samples; expected [{n}]")
    if tensor.numel() != n:
        raise RewardError(f"{what} of length {tensor.numel()} for {n} samples")
    return tensor


def to_scalar_logs(logs: Any, what: str) -> dict[str, float]:
    """Reduce each log value to a float (tensors and lists by their mean)."""
    if not isinstance(logs, dict):
        raise RewardError(f"{what} of type {type(logs).__name__}; expected a dict of scalars or tensors")
    out = {}
    for key, value in logs.items():
        try:
            if isinstance(value, (list, tuple)):
                value = [_as_float(v) for v in value]
            out[str(key)] = float(torch.as_tensor(value, dtype=torch.float32).mean().item())
        except (TypeError, ValueError, RuntimeError) as err:
            raise RewardError(f"{what}[{key!r}] = {value!r} is not a number or tensor") from err
    return out


def _as_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"an element is a tensor of shape {list(value.shape)}, not a scalar")
        return float(value.item())
    # float("1.5") would parse text: a string reward is a bug in the reward code, not a number.
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"element {value!r} is a {type(value).__name__}")
    return float(value)


def _looks_numeric_sequence(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, list, tuple)) or type(value).__module__ == "numpy"
