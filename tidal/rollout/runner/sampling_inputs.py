"""The ``SamplingTensors`` of a step (per-row temperature, top-k/p, min-p, seeds, positions, suppressed
tokens, repetition penalties), built on the host once and reused with positions advanced on the device
while a decode batch keeps the same sequences."""

from __future__ import annotations

import torch

from tidal.rollout.runner.sampler import SamplingTensors, penalty_tensors
from tidal.rollout.scheduling.sequence import Sequence


class SamplingInputs:
    """A mixin of ``ModelRunner`` (it reads the runner's vocabulary size, eos ids, never-sampled tokens,
    ``_tensor`` and ``_last_sampling``)."""

    def _sampling_tensors(self, seqs: list[Sequence], ahead: int = 0) -> SamplingTensors:
        """Per-row settings; a decode step over the same sequences as the previous one reuses its tensors
        with every position advanced by one (on device), instead of rebuilding them from Python.
        ``ahead``: tokens each sequence has sampled beyond what the host holds (a step launched ahead)."""
        cached = self._last_sampling
        if (
            cached is not None
            and cached[0] == seqs  # each of these sequences got exactly one token since (identity compare)
            and cached[1].suppress_rows is None
            and cached[1].penalty_rows is None  # the seen tokens change every step
            # A row's output count only grows while it stays in the batch: none that had reached its
            # ``min_new_tokens`` when the tensors were built can be under it now.
            and not (
                cached[2] and any(seq.num_output_tokens + ahead < seq.params.min_new_tokens for seq in seqs)
            )
        ):
            st = cached[1]
            if st.positions is not None:
                st.positions.add_(1)
            return st
        st = self._build_sampling_tensors(seqs, ahead)
        under_min = any(seq.num_output_tokens + ahead < seq.params.min_new_tokens for seq in seqs)
        self._last_sampling = (list(seqs), st, under_min)
        return st

    def _build_sampling_tensors(self, seqs: list[Sequence], ahead: int = 0) -> SamplingTensors:
        vocab = self.args.vocab_size
        params = [seq.params for seq in seqs]
        suppress = [
            (row, token)
            for row, seq in enumerate(seqs)
            if seq.num_output_tokens + ahead < seq.params.min_new_tokens
            for token in self._stop_ids(seq)
            if token < vocab
        ]
        suppress += [(row, token) for row in range(len(seqs)) for token in self.never_sample]
        suppress_rows = self._tensor([r for r, _ in suppress]) if suppress else None
        suppress_tokens = self._tensor([t for _, t in suppress]) if suppress else None
        penalty = penalty_tensors(seqs, self._tensor)
        top = min(max(p.num_top_logprobs for p in params), vocab)
        if all(p.greedy for p in params):
            return SamplingTensors(
                all_greedy=True,
                suppress_rows=suppress_rows,
                suppress_tokens=suppress_tokens,
                num_top_logprobs=top,
                **penalty,
            )
        # Two host-to-device copies for all per-row settings, not one per field.
        ints = self._tensor(
            [
                [p.top_k if p.top_k > 0 else vocab for p in params],
                [seq.noise_seed for seq in seqs],
                [seq.num_output_tokens + ahead for seq in seqs],
            ]
        )
        # One row per field, so each field is a contiguous [rows] view (the fused sampling kernel
        # reads row i at offset i; a column view of a [rows, 3] tensor gave it other fields' values).
        floats = self._tensor(
            [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
            torch.float32,
        )
        return SamplingTensors(
            all_greedy=False,
            any_truncation=any(p.needs_truncation and not p.greedy for p in params),
            temperatures=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[2],
            seeds=ints[1],
            positions=ints[2],
            suppress_rows=suppress_rows,
            suppress_tokens=suppress_tokens,
            num_top_logprobs=top,
            **penalty,
        )

    def _stop_ids(self, seq: Sequence) -> list[int]:
        eos = [] if seq.params.ignore_eos else self.eos_token_ids
        return sorted(set(eos) | set(seq.params.stop_token_ids))
