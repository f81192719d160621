"""Statistical checks of a sampler against exact probabilities (used by tests and ``bench/sampling_check.py``).

Comparing one sampler with another only shows that they agree; these functions compare samples with
the distribution they must follow:

- ``goodness_of_fit``: Pearson's chi-square of token counts against exact probabilities, with bins
  whose expected count is small pooled together (the chi-square approximation needs about 5 per bin),
  reported as a z-score by the Wilson-Hilferty transform (no scipy needed). An honest sampler gives
  ``chi2 / dof`` near 1 and |z| of a few at most; a biased one gives z in the tens or hundreds.
- ``expected_distinct``: how many distinct tokens n independent draws give on average, to check that
  the n samples of one request are as diverse as independent draws.
- ``truncated_probs``: the exact distribution that temperature, top-k, top-p and min-p leave, written
  independently of ``tidal.rollout.runner.sampler.truncate_logits`` (sorted float64 arithmetic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GoodnessOfFit:
    chi2: float
    dof: int
    z: float  # Wilson-Hilferty: approximately standard normal under the null hypothesis
    outside_support: int  # samples of tokens whose exact probability is 0

    @property
    def ratio(self) -> float:
        return self.chi2 / max(self.dof, 1)


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> GoodnessOfFit:
    """Chi-square of ``counts`` (a histogram over the vocabulary) against ``probs`` (summing to 1)."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    n = counts.sum().item()
    support = probs > 0
    outside = int(counts[~support].sum().item())
    expected, observed = probs[support] * n, counts[support]
    order = expected.argsort(descending=True)
    expected, observed = expected[order], observed[order]
    # Bins below the threshold go into one pooled bin; if that is still too small, take the smallest
    # remaining regular bins into it too.
    small = expected < min_expected
    keep_e, keep_o = expected[~small], observed[~small]
    pool_e, pool_o = expected[small].sum(), observed[small].sum()
    while pool_e > 0 and pool_e < min_expected and len(keep_e) > 1:
        pool_e, pool_o = pool_e + keep_e[-1], pool_o + keep_o[-1]
        keep_e, keep_o = keep_e[:-1], keep_o[:-1]
    if pool_e > 0:
        keep_e = torch.cat([keep_e, pool_e.reshape(1)])
        keep_o = torch.cat([keep_o, pool_o.reshape(1)])
    chi2 = float(((keep_o - keep_e) ** 2 / keep_e).sum())
    dof = max(len(keep_e) - 1, 1)
    return GoodnessOfFit(chi2, dof, wilson_hilferty(chi2, dof), outside)


def wilson_hilferty(chi2: float, dof: int) -> float:
    """The z-score of a chi-square statistic with ``dof`` degrees of freedom."""
    scale = 2.0 / (9.0 * dof)
    return ((chi2 / dof) ** (1.0 / 3.0) - (1.0 - scale)) / math.sqrt(scale)


def expected_distinct(probs: torch.Tensor, n: int) -> float:
    """Mean number of distinct values among ``n`` independent draws from ``probs``."""
    p = probs.double()
    return float((1.0 - (1.0 - p) ** n).sum())


def mean_z(values: torch.Tensor, expected: float) -> float:
    """z-score of the mean of ``values`` against ``expected`` (standard error from the sample variance)."""
    values = values.double()
    se = values.std().item() / math.sqrt(len(values))
    return (values.mean().item() - expected) / max(se, 1e-12)


def truncated_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Exact probabilities of one row after temperature, then top-k, top-p and min-p (renormalised).

    Semantics (as vLLM's and tidal's): top-p keeps the most likely tokens while the mass before a token
    is at most p (the first token always stays), min-p drops tokens below ``min_p`` times the largest
    probability; each step sees the distribution the previous one left, renormalised.
    """
    z = logits.double().cpu() / temperature
    sorted_z, order = z.sort(descending=True)
    keep = torch.ones_like(sorted_z, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    p = torch.where(keep, (sorted_z - sorted_z[keep].logsumexp(0)).exp(), 0.0)
    before = p.cumsum(0) - p
    keep &= ~(before > top_p)
    keep &= ~(p < min_p * p[0])
    keep[0] = True
    out_sorted = torch.where(keep, (sorted_z - sorted_z[keep].logsumexp(0)).exp(), 0.0)
    return torch.zeros_like(out_sorted).scatter_(0, order, out_sorted)
