"""``Sampler``: turns a batch of last-position logits into tokens and their log-probs, on device.

Per row it applies the repetition penalty (rows that ask for one), temperature, then top-k, top-p and
min-p truncation, and samples with the Gumbel-max trick. The Gumbel noise comes from a counter-based hash of (sequence seed, output position, token id)
computed with integer tensor ops, so:

- every row gets independent noise without a per-row ``torch.Generator`` loop (the decode hot path stays
  a fixed number of batched kernels, which suits CUDA graphs later), and
- a sample's noise does not depend on which other sequences share the batch or on the step number, so a
  seeded request reproduces its output however it was batched or preempted.

The returned log-prob is ``log_softmax(logits / T)`` (raw logits when greedy) of the chosen token,
before truncation, the ``min_new_tokens`` suppression and the repetition penalty (see ``SamplingParams``).
``top_logprobs`` gives the k most likely tokens of that same distribution, for the steps where a request
asks for alternatives (``SamplingParams.logprobs``); other steps never compute it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tidal.accel import triton_available

if TYPE_CHECKING:
    from tidal.rollout.scheduling.sequence import Sequence

_MASK32 = 0xFFFFFFFF
U_MAX = 1.0 - 2.0**-24  # the largest float32 below 1


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser ("lowbias32") on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) float32 noise of shape [rows, vocab], a pure function of (seed, position, token)."""
    row = mix32((seeds & _MASK32) ^ mix32((positions * 0x9E3779B9 + 0x632BE5AB) & _MASK32))
    cols = mix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) * 0x85EBCA6B & _MASK32)
    bits = mix32(row[:, None] ^ cols[None, :])
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # (2**24 - 1) + 0.5 rounds up to 2**24 in float32, so one draw in 2**24 was exactly 1.0: a Gumbel noise
    # of +inf that won the argmax whatever the logits (NaN beside a truncated -inf), about 1% of rows at
    # a 152k vocabulary. Clamp to the largest float32 below 1 (every other value is unchanged).
    return u.clamp_(max=U_MAX)


@dataclass
class SamplingTensors:
    """Per-row sampling settings as device tensors (built once per step by the model runner).

    When every row is greedy only ``suppress_*`` may be set: the sampler then needs nothing else.
    """

    all_greedy: bool
    any_truncation: bool = False
    temperatures: torch.Tensor | None = None  # [rows] float32; 0 = greedy
    top_k: torch.Tensor | None = None  # [rows] int64; vocab size when off
    top_p: torch.Tensor | None = None  # [rows] float32
    min_p: torch.Tensor | None = None  # [rows] float32
    seeds: torch.Tensor | None = None  # [rows] int64, 32-bit values
    positions: torch.Tensor | None = None  # [rows] int64, index of the output token being sampled
    suppress_rows: torch.Tensor | None = (
        None  # with suppress_tokens: (row, token) pairs that cannot be sampled
    )
    suppress_tokens: torch.Tensor | None = None
    # --repetition_penalty: (row, token, penalty) triples, one per distinct token already in a row's
    # prompt or output, for the rows whose penalty is not 1 (None when no row has one).
    penalty_rows: torch.Tensor | None = None
    penalty_tokens: torch.Tensor | None = None
    penalties: torch.Tensor | None = None  # float32
    # The most top log-prob alternatives any row asks for (SamplingParams.logprobs); 0: none computed.
    num_top_logprobs: int = 0


def penalty_tensors(
    seqs: list[Sequence], tensor: Callable[[list, torch.dtype], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``SamplingTensors``' repetition-penalty triples: each distinct token of the prompt and output of every
    row whose ``repetition_penalty`` is not 1 (none: the sampler's default path). ``tensor(data, dtype)``
    puts a list on the device (the model runner's from pinned memory, without waiting)."""
    rows, tokens, penalties = [], [], []
    for row, seq in enumerate(seqs):
        if seq.params.penalizes_repetition:
            seen = sorted(set(seq.token_ids))
            rows += [row] * len(seen)
            tokens += seen
            penalties += [seq.params.repetition_penalty] * len(seen)
    if not rows:
        return {}
    return {
        "penalty_rows": tensor(rows, torch.int64),
        "penalty_tokens": tensor(tokens, torch.int64),
        "penalties": tensor(penalties, torch.float32),
    }


def apply_repetition_penalty(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, penalties: torch.Tensor
) -> torch.Tensor:
    """Hugging Face's and vLLM's repetition penalty on float logits: at each (row, token) a positive
    logit is divided by the penalty, a negative one multiplied (both move it down for a penalty > 1).
    Each (row, token) pair must appear once."""
    picked = logits[rows, tokens]
    penalized = torch.where(picked > 0, picked / penalties, picked * penalties)
    return logits.index_put((rows, tokens), penalized)


def truncate_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    """Set to -inf every token outside top-k, then outside the top-p nucleus, then below min-p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass before it is below p; the top token always survives.
    drop = (probs.cumsum(dim=-1) - probs) > top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    """Stateless: all randomness comes from the per-row seeds in ``SamplingTensors``.

    ``fused``: on CUDA, rows without truncation, suppression or repetition penalty go through one
    Triton kernel (``triton_sampling.fused_sample``) that computes the same tokens without the float32
    copies; a batch with any of those takes the torch path (``reference``)."""

    def __init__(self, fused: bool = False, exact: bool = False):
        self.fused = fused and triton_available()
        self.exact = exact

    def __call__(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        if self.exact:  # the same tokens (the sampling pass computes no log-probs of its own); their
            # log-probs from the batch-invariant log-softmax
            tokens, _ = self._sample(logits, st, logprobs=False)
            return tokens, exact_logprobs(logits, tokens, st)
        return self._sample(logits, st)

    def _sample(self, logits: torch.Tensor, st: SamplingTensors, logprobs: bool = True):
        plain = not st.any_truncation and st.suppress_rows is None and st.penalty_rows is None
        if self.fused and logits.is_cuda and plain:
            from tidal.rollout.kernels.triton_sampling import fused_sample

            if st.all_greedy:
                return fused_sample(logits, None, None, None, logprobs=logprobs)
            return fused_sample(logits, st.temperatures, st.seeds, st.positions, logprobs=logprobs)
        return self.reference(logits, st, logprobs)

    @staticmethod
    def reference(
        logits: torch.Tensor, st: SamplingTensors, logprobs: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampling step in plain torch ops (any device, every option); ``logprobs=False``: the same
        tokens, and None for their log-probs (no log-softmax computed)."""
        scaled = logits.float()
        if not st.all_greedy:
            greedy = st.temperatures == 0
            scaled = scaled / torch.where(greedy, 1.0, st.temperatures)[:, None]
        log_softmax = scaled.log_softmax(dim=-1) if logprobs else None
        if st.penalty_rows is not None:  # after the log-probs: they are of the unpenalized logits
            # Dividing by T > 0 and penalizing commute (the sign is kept), so this equals HF's
            # penalty-then-temperature order.
            scaled = apply_repetition_penalty(scaled, st.penalty_rows, st.penalty_tokens, st.penalties)
        if st.suppress_rows is not None:
            scaled = scaled.index_put((st.suppress_rows, st.suppress_tokens), torch.tensor(float("-inf")))
        tokens = scaled.argmax(dim=-1)
        if not st.all_greedy:
            if st.any_truncation:
                scaled = truncate_logits(scaled, st.top_k, st.top_p, st.min_p)
            gumbel = -torch.log(-torch.log(uniform_noise(st.seeds, st.positions, logits.shape[-1])))
            tokens = torch.where(greedy, tokens, (scaled + gumbel).argmax(dim=-1))
        if log_softmax is None:
            return tokens, None
        return tokens, log_softmax.gather(-1, tokens[:, None]).squeeze(-1)


def exact_logprobs(logits: torch.Tensor, tokens: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """``log_softmax(logits / T)`` at ``tokens`` through ``batch_invariant.token_logprobs`` (the trainer's
    exact-mode log-softmax): each row's value is a function of that row alone."""
    from tidal.rollout.batch_invariant import token_logprobs

    if st.all_greedy:
        return token_logprobs(logits, tokens)
    return token_logprobs(logits, tokens, torch.where(st.temperatures == 0, 1.0, st.temperatures))


def top_logprobs(
    logits: torch.Tensor, st: SamplingTensors, k: int, exact: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of every row and their log-probs, most likely first: ``(ids [rows, k],
    logprobs [rows, k])`` of the distribution the sampled log-prob comes from, ``log_softmax(logits / T)``
    (raw logits for greedy rows), before truncation, suppression and the repetition penalty. The ops are
    those of ``Sampler.reference`` (``exact``: of ``exact_logprobs``), so a sampled token among the top k
    has the same log-prob in both."""
    scaled = logits.float()
    if not st.all_greedy:
        scaled = scaled / torch.where(st.temperatures == 0, 1.0, st.temperatures)[:, None]
    if not exact:
        values, ids = scaled.log_softmax(dim=-1).topk(k, dim=-1)
        return ids, values
    # log-softmax is increasing within a row: its top k are the scaled logits' top k.
    ids = scaled.topk(k, dim=-1).indices
    values = torch.stack([exact_logprobs(logits, ids[:, j], st) for j in range(k)], dim=-1)
    return ids, values


def sequence_seed(request_seed: int, sample_index: int) -> int:
    """A 32-bit noise seed per sample of a request (splitmix64 of the request seed and sample index)."""
    mask64 = (1 << 64) - 1

    def splitmix64(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & mask64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask64
        return x ^ (x >> 31)

    return splitmix64(splitmix64(request_seed & mask64) ^ sample_index) & _MASK32
