"""The reference and reward models on devices of their own (separate workers), or with the policy.

When ``--ref_num_*`` (or, for on-policy distillation's teacher in the reference's place,
``--teacher_num_*``) / ``--reward_num_*`` give them devices of their own (``tidal.config.placement``),
each trainer drives its share of the workers: it splits its samples over them (contiguous rows) and
collects log-probs or rewards. Both sides are the roles of ``tidal.placement.protocols``:

- ``ReferenceRole``: ``LocalReference`` (the model on this device, optionally offloaded between
  uses) or ``RemoteReference`` (``ReferenceWorker`` processes / Ray actors);
- ``RewardRole``: ``tidal.experience.reward_models.RewardModels`` here, or ``RemoteRewardModels``
  (``RewardWorker``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tidal.config import ModelConfig
from tidal.experience.experience import Experience
from tidal.experience.maker import forward_logprobs
from tidal.experience.reward_models import RewardModels
from tidal.models import load_causal_lm
from tidal.models.frozen import FrozenModel
from tidal.models.precision import Precision
from tidal.models.value_model import load_value_model
from tidal.placement.workers import scatter
from tidal.rewards.base import RewardResult


@dataclass
class FrozenSpec:
    """A frozen model's worker: the model config(s), precision, device and torch threads (picklable)."""

    models: tuple[ModelConfig, ...]  # one for a reference; one per --reward_pretrain path
    param_dtype: str
    device: str = "auto"  # auto: cuda if available (a Ray actor sees its own GPU as cuda:0)
    num_threads: int = 1
    value_head_prefix: str = "score"
    normalize_reward: bool = False
    micro_size: int = 8

    def on_device(self, device: str) -> FrozenSpec:
        return dataclasses.replace(self, device=device)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def reference_source(run) -> str:
    """The model in the reference's place: on-policy distillation's teacher (``--teacher_model``), else
    the policy's initial weights; the same whether it runs here or on workers of its own."""
    return run.reward.teacher_model or run.actor.pretrain


def _setup(spec: FrozenSpec) -> torch.device:
    torch.set_num_threads(spec.num_threads)
    device = spec.torch_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class ReferenceWorker:
    """The reference policy on its own device: per-token log-probs of the experiences it is sent."""

    def __init__(self, spec: FrozenSpec):
        self.device = _setup(spec)
        model = FrozenModel(load_causal_lm(spec.models[0], self.device), self.device)
        self.reference = LocalReference(model, Precision.create(spec.param_dtype, self.device))

    def logprobs(self, exp: Experience, micro: int, packing: bool, temperature: float, max_tokens) -> Tensor:
        return self.reference.logprobs(exp.to(self.device), micro, packing, temperature, max_tokens).cpu()


class RewardWorker:
    """Reward models on their own device: the summed score of the experiences it is sent."""

    def __init__(self, spec: FrozenSpec):
        device = _setup(spec)
        models = [
            load_value_model(
                cfg, device, spec.value_head_prefix, normalize_reward=spec.normalize_reward, trained_head=True
            )
            for cfg in spec.models
        ]  # fmt: skip
        self.reward_models = RewardModels(models, Precision.create(spec.param_dtype, device), spec.micro_size)

    def rewards(self, exp: Experience) -> RewardResult:
        return self.reward_models(exp)


def _scatter(workers: Sequence, method: str, exp: Experience, *args) -> list:
    """Send contiguous row slices of ``exp`` (on the CPU, each trimmed to its longest row) to ``workers``;
    their results in row order."""
    cpu = exp.to(torch.device("cpu"))
    return scatter(
        list(workers), len(exp), method, lambda start, stop: (cpu.select(torch.arange(start, stop)), *args)
    )


class LocalReference:
    """The reference model in this process (offloaded: in host memory between uses, ``--ref_reward_offload``)."""

    def __init__(self, model: FrozenModel, precision: Precision):
        self.frozen, self.precision = model, precision

    def logprobs(self, exp: Experience, micro: int, packing: bool, temperature: float, max_tokens) -> Tensor:
        with self.frozen.use() as model:
            return forward_logprobs(model, exp, micro, packing, temperature, self.precision, max_tokens)

    def close(self) -> None:
        """Nothing to release: the model lives in this process."""


class RemoteReference:
    """The reference model on this trainer's separate workers (``ReferenceWorker`` handles)."""

    def __init__(self, workers: list):
        self.workers = workers

    def logprobs(self, exp: Experience, micro: int, packing: bool, temperature: float, max_tokens) -> Tensor:
        parts = _scatter(self.workers, "logprobs", exp, micro, packing, temperature, max_tokens)
        width = exp.sequences.shape[1]  # slices come back trimmed: pad them to the batch's width
        parts = [nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
        return torch.cat(parts).to(exp.sequences.device)

    def close(self) -> None:
        for w in self.workers:
            w.close()


class RemoteRewardModels:
    """Reward models on this trainer's separate workers (``RewardWorker`` handles)."""

    def __init__(self, workers: list):
        self.workers = workers

    def __call__(self, exp: Experience) -> RewardResult:
        parts: list[RewardResult] = _scatter(self.workers, "rewards", exp)
        logs = {
            k: sum(p.extra_logs[k] * len(p.rewards) for p in parts) / len(exp) for k in parts[0].extra_logs
        }
        return dataclasses.replace(
            parts[0], rewards=torch.cat([p.rewards for p in parts]), scores=torch.cat([p.scores for p in parts]),
            extra_logs=logs,
        )  # fmt: skip

    def close(self) -> None:
        for w in self.workers:
            w.close()
