"""Does the rollout engine sample from the distribution it claims? An end-to-end statistical check.

The engine samples two tokens for many seeded requests of one prompt (n samples each); a ``transformers``
forward of the same weights gives the exact probabilities. Checked, with ``tidal.testing.stats``:

- the first token (sampled after prefill) against ``p(. | prompt)``;
- the second token (sampled in a decode step, the path CUDA graphs and cached sampling tensors take)
  against ``p(. | prompt, first)`` for the most frequent first tokens (chi-squares summed);
- the diversity of each request's n samples against that of n independent draws.

Temperature, top-k, top-p and min-p apply as ``SamplingParams`` says (``truncated_probs``). Used by
``tests/rollout/test_sampling_stats.py`` (CPU and CUDA) and ``bench/sampling_check.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.rollout import LLMEngine, SamplingParams
from tidal.testing.stats import (
    GoodnessOfFit,
    expected_distinct,
    goodness_of_fit,
    mean_z,
    truncated_probs,
    wilson_hilferty,
)


@dataclass(frozen=True)
class SamplingReport:
    first: GoodnessOfFit  # first token vs p(. | prompt)
    second: GoodnessOfFit  # second token vs p(. | prompt, first), summed over frequent first tokens
    distinct: float  # mean distinct first tokens among a request's n samples
    distinct_expected: float  # ... for n independent draws
    distinct_z: float

    def worst_z(self) -> float:
        return max(self.first.z, self.second.z, abs(self.distinct_z))

    def as_dict(self) -> dict:
        return {
            "first_chi2_per_dof": round(self.first.ratio, 3),
            "first_z": round(self.first.z, 2),
            "second_chi2_per_dof": round(self.second.ratio, 3),
            "second_z": round(self.second.z, 2),
            "outside_support": self.first.outside_support + self.second.outside_support,
            "distinct": round(self.distinct, 3),
            "distinct_expected": round(self.distinct_expected, 3),
            "distinct_z": round(self.distinct_z, 2),
        }


def _params_kwargs(params: SamplingParams) -> dict:
    return dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)


@torch.inference_mode()
def exact_next_token_probs(hf_model, prefixes: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """``[len(prefixes), vocab]`` float64: the distribution the engine must sample the next token from."""
    device = next(hf_model.parameters()).device
    rows = []
    for prefix in prefixes:  # one unpadded forward each: no padding can change the reference
        logits = hf_model(torch.tensor([prefix], device=device)).logits[0, -1].float()
        rows.append(truncated_probs(logits, **_params_kwargs(params)))
    return torch.stack(rows)


def sample_two_tokens(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, requests: int, seed: int = 0
) -> torch.Tensor:
    """``[requests, n, 2]``: two sampled tokens per sample, each request seeded ``seed + i``."""
    per_request = [
        SamplingParams(
            **{**_params_kwargs(params), "n": params.n}, seed=seed + i, max_new_tokens=2, ignore_eos=True
        )
        for i in range(requests)
    ]
    outputs = engine.generate([prompt] * requests, per_request)
    return torch.tensor([[s.token_ids for s in out.outputs] for out in outputs])


def check_engine_sampling(
    engine: LLMEngine,
    hf_model,
    prompt: list[int],
    params: SamplingParams,
    requests: int,
    seed: int = 0,
    second_min_count: int = 200,
    second_max_prefixes: int = 6,
) -> SamplingReport:
    """Sample and compare with the exact probabilities (see the module docstring)."""
    tokens = sample_two_tokens(engine, prompt, params, requests, seed)
    first, second = tokens[..., 0].reshape(-1), tokens[..., 1].reshape(-1)
    p_first = exact_next_token_probs(hf_model, [prompt], params)[0]
    vocab = p_first.numel()
    first_fit = goodness_of_fit(torch.bincount(first, minlength=vocab), p_first)

    counts = torch.bincount(first, minlength=vocab)
    frequent = [
        int(t) for t in counts.argsort(descending=True)[:second_max_prefixes] if counts[t] >= second_min_count
    ]
    if not frequent:
        raise ValueError(
            f"no first token was drawn {second_min_count} times in {first.numel()} samples: the distribution "
            "is too flat to check the second token (a peaked model, e.g. build_tiny_model(logit_scale=8))"
        )
    conditional = exact_next_token_probs(hf_model, [prompt + [t] for t in frequent], params)
    fits = [
        goodness_of_fit(torch.bincount(second[first == t], minlength=vocab), conditional[i])
        for i, t in enumerate(frequent)
    ]
    chi2, dof = sum(f.chi2 for f in fits), sum(f.dof for f in fits)
    second_fit = GoodnessOfFit(
        chi2, dof, wilson_hilferty(chi2, max(dof, 1)), sum(f.outside_support for f in fits)
    )

    distinct = torch.tensor([len(set(group.tolist())) for group in tokens[..., 0]], dtype=torch.float64)
    want = expected_distinct(p_first, params.n)
    return SamplingReport(first_fit, second_fit, distinct.mean().item(), want, mean_z(distinct, want))
