"""What ``LLMEngine.generate`` returns: one ``RequestOutput`` per prompt, ``n`` ``CompletionOutput`` each."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class CompletionOutput:
    """One sample: the sampled ids, their log-probs (see ``SamplingParams``) and why it ended."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None  # "stop" (eos, stop token or stop string), "length"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    # With ``EngineConfig.record_routing`` on a MoE model: ``[prompt + output tokens - 1, MoE layers, k]``
    # int expert ids each token was routed to (every token but the last, which no forward read).
    routed_experts: np.ndarray | None = None
    # With ``SamplingParams.logprobs`` = k > 0: per output token, its k most likely alternatives as
    # (token id, log-prob) pairs, most likely first (the distribution of ``logprobs``); None otherwise.
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.logprobs))


@dataclass
class RequestOutput:
    """All samples of one prompt, in the order of the prompts given to ``generate``."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
