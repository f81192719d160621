"""The stepping of ``HFEngine`` (hf_engine.py): transformers' forward and KV cache, tidal's sampler.

Each admitted group (the ``n`` samples of one prompt) is a ``Cohort``: its live samples are the rows of
one cache of the transformers model, all at the same length. A step prefills the newly admitted groups
(one forward of the prompt, its cache then repeated to ``n`` rows, so the samples share the prefill) and
advances every earlier cohort by one token (one forward of its rows' last tokens). Cohorts are not padded
into one batch: rows of one cohort share a length, so no attention mask or position shift is needed, and
recurrent (Mamba-style) layers, whose state has no length to pad, work unchanged. The last-position
logits of all rows are then sampled together by ``tidal.rollout.runner.sampler`` with the same per-row tensors
the native engine builds (``sampling_tensors``), so a seeded request samples the same tokens from the
same logits. The stop rules are the scheduler's own (``StopRules``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from tidal.rollout.runner.sampler import Sampler, SamplingTensors, penalty_tensors, top_logprobs
from tidal.rollout.scheduling.scheduler import Detokenize, Scheduler
from tidal.rollout.scheduling.sequence import Sequence, SequenceStatus


class StopRules(Scheduler):
    """Only the stop rules of ``Scheduler`` (``_resolve_stop_rules``, ``_check_stop`` and the stop-string
    window), so that the fallback ends samples exactly where the native engine does. It keeps no queues
    or blocks: ``HFEngine`` schedules, so ``Scheduler.__init__`` (which needs a block manager) is skipped."""

    def __init__(self, max_model_len: int, eos_token_ids: set[int], detokenize: Detokenize | None):
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize

    def resolve(self, seq: Sequence) -> None:
        self._resolve_stop_rules(seq)

    def check(self, seq: Sequence) -> bool:
        """Finish ``seq`` if its last token ends it; whether it did."""
        return self._check_stop(seq)


def sampling_tensors(seqs: list[Sequence], vocab: int, device: torch.device) -> SamplingTensors:
    """The per-row sampling settings of ``seqs`` as the native model runner builds them
    (``ModelRunner._build_sampling_tensors``): seeds and output positions key the noise, stop ids are
    suppressed below ``min_new_tokens``, repetition penalties over each row's distinct tokens."""
    params = [seq.params for seq in seqs]
    suppress = [
        (row, token)
        for row, seq in enumerate(seqs)
        if seq.num_output_tokens < seq.params.min_new_tokens
        for token in sorted(seq.stop_ids)
        if token < vocab
    ]
    ints = lambda data: torch.tensor(data, dtype=torch.int64, device=device)  # noqa: E731
    extra: dict[str, Any] = {"num_top_logprobs": min(max(p.num_top_logprobs for p in params), vocab)}
    if suppress:
        extra["suppress_rows"] = ints([r for r, _ in suppress])
        extra["suppress_tokens"] = ints([t for _, t in suppress])
    extra.update(penalty_tensors(seqs, lambda data, dtype: torch.tensor(data, dtype=dtype, device=device)))
    if all(p.greedy for p in params):
        return SamplingTensors(all_greedy=True, **extra)
    floats = lambda data: torch.tensor(data, dtype=torch.float32, device=device)  # noqa: E731
    return SamplingTensors(
        all_greedy=False,
        any_truncation=any(p.needs_truncation and not p.greedy for p in params),
        temperatures=floats([p.temperature for p in params]),
        top_k=ints([p.top_k if p.top_k > 0 else vocab for p in params]),
        top_p=floats([p.top_p for p in params]),
        min_p=floats([p.min_p for p in params]),
        seeds=ints([seq.noise_seed for seq in seqs]),
        positions=ints([seq.num_output_tokens for seq in seqs]),
        **extra,
    )


@dataclass
class Cohort:
    """The live samples of one request, in the row order of their transformers cache (all of one length:
    the cache holds every token but the last, the next step's input)."""

    seqs: list[Sequence]
    cache: Any

    def drop_finished(self) -> bool:
        """Remove the finished rows (from the cache too); whether any row is left."""
        keep = [row for row, seq in enumerate(self.seqs) if not seq.is_finished]
        if len(keep) < len(self.seqs) and keep:
            self.cache.reorder_cache(torch.tensor(keep, dtype=torch.int64))
        self.seqs = [self.seqs[row] for row in keep]
        return bool(keep)


StepResult = tuple[list[Sequence], list[int], list[float], list[list[tuple[int, float]] | None]]


class HFStepper:
    """Runs a transformers causal LM over cohorts and samples one token per live row."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        params = inspect.signature(model.forward).parameters
        # transformers 5 names the cache argument ``cache``; earlier versions ``past_key_values``.
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.keeps_last_logits = "logits_to_keep" in params
        # Positions are always passed: some models (bamba) count them from 0 at every call without them.
        self.takes_positions = "position_ids" in params
        self.sampler = Sampler()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _last_logits(self, input_ids: torch.Tensor, cache, start: int) -> torch.Tensor:
        """Float32 logits at the last position of every row (whose tokens sit at positions ``start`` on),
        the cache extended in place."""
        kwargs = {self.cache_arg: cache, "use_cache": True}
        if self.takes_positions:
            positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
            kwargs["position_ids"] = positions.expand(input_ids.shape[0], -1)
        if self.keeps_last_logits:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, **kwargs)
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def step(self, admitted: list[list[Sequence]], cohorts: list[Cohort]) -> tuple[list[Cohort], StepResult]:
        """Prefill ``admitted`` groups into new cohorts (returned) and decode one token for every row of
        ``cohorts``; sample every row. Returns the new cohorts and (rows, tokens, log-probs, top)."""
        device = self.device
        new, seqs, logits = [], [], []
        for group in admitted:
            cache = self._new_cache()
            prompt = torch.tensor([group[0].token_ids], dtype=torch.int64, device=device)
            row = self._last_logits(prompt, cache, 0)
            if len(group) > 1:  # the samples share the prompt's prefill
                cache.reorder_cache(torch.zeros(len(group), dtype=torch.int64))
            for seq in group:
                seq.status = SequenceStatus.RUNNING
            new.append(Cohort(list(group), cache))
            seqs += group
            logits.append(row.expand(len(group), -1))
        for cohort in cohorts:
            last = torch.tensor([[seq.last_token] for seq in cohort.seqs], dtype=torch.int64, device=device)
            seqs += cohort.seqs
            logits.append(self._last_logits(last, cohort.cache, cohort.seqs[0].num_tokens - 1))
        return new, self._sample(seqs, torch.cat(logits))

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> StepResult:
        st = sampling_tensors(seqs, logits.shape[-1], logits.device)
        tokens, logprobs = self.sampler(logits, st)
        top: list[list[tuple[int, float]] | None] = [None] * len(seqs)
        if st.num_top_logprobs:
            ids, values = top_logprobs(logits, st, st.num_top_logprobs)
            for row, (seq, row_ids, row_values) in enumerate(
                zip(seqs, ids.tolist(), values.tolist(), strict=True)
            ):
                if seq.params.num_top_logprobs:
                    top[row] = list(zip(row_ids, row_values, strict=True))
        return seqs, tokens.tolist(), logprobs.double().tolist(), top
