"""The math of post-training: pure tensor functions, chosen by name from plain dict registries.

Shapes: per-token tensors are batch-first ``[B, T]`` over action (response) tokens with an
``action_mask``; scalar rewards are ``[N]`` in consecutive prompt groups of ``n_samples_per_prompt``.
Losses are minimised; per-token losses are reduced with ``aggregate_loss``. Outputs are float32
(inputs in bf16/fp16 are upcast first).

Registries (a trainer looks a name up, it never branches on it):

- ``ADVANTAGE_ESTIMATORS``: gae, reinforce, reinforce_baseline, rloo, group_norm, dr_grpo
- ``POLICY_LOSSES``: ppo, gspo, cispo, sapo · ``MISMATCH_CORRECTIONS``: tis, icepop
- ``KL_ESTIMATORS``: k1, k2, k3 · ``LOSS_AGGREGATIONS``: token, sequence, sequence_sum
- ``RM_LOSSES``: sigmoid, logexp · ``DPO_LOSSES``: sigmoid, ipo
"""

from tidal.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    discounted_returns,
    estimate_advantages,
    gae_advantages_and_returns,
    group_normalized,
    leave_one_out_baseline,
    mean_baseline,
    no_baseline,
)
from tidal.algorithms.correction import (
    MISMATCH_CORRECTIONS,
    corrected_policy_loss,
    icepop_weights,
    tis_weights,
)
from tidal.algorithms.distill import distillation_cross_entropy, kd_loss
from tidal.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    compute_kl,
    make_kl_controller,
)
from tidal.algorithms.logprobs import entropy_from_logits, gather_logprobs
from tidal.algorithms.masked import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    aggregate_policy_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from tidal.algorithms.policy_loss import (
    POLICY_LOSSES,
    ClipParams,
    PolicyLossParams,
    SapoParams,
    cispo_policy_loss,
    gspo_policy_loss,
    loss_aggregation,
    ppo_policy_loss,
    sapo_policy_loss,
)
from tidal.algorithms.preference import (
    DPO_LOSSES,
    RM_LOSSES,
    dpo_loss,
    ipo_loss,
    kto_kl_estimate,
    kto_loss,
    logexp_pairwise_loss,
    sigmoid_pairwise_loss,
)
from tidal.algorithms.prm import prm_loss
from tidal.algorithms.rewards import (
    RunningMoments,
    dynamic_filter_mask,
    group_by_prompt,
    kl_penalized_rewards,
    last_action_index,
    normalize_rewards,
    overlong_penalty,
)
from tidal.algorithms.sft import IGNORE_INDEX, loss_mask_from_labels, token_cross_entropy
from tidal.algorithms.value_loss import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DPO_LOSSES",
    "IGNORE_INDEX",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "MISMATCH_CORRECTIONS",
    "POLICY_LOSSES",
    "RM_LOSSES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "ClipParams",
    "FixedKLController",
    "PolicyLossParams",
    "RunningMoments",
    "SapoParams",
    "aggregate_loss",
    "aggregate_policy_loss",
    "compute_kl",
    "corrected_policy_loss",
    "discounted_returns",
    "distillation_cross_entropy",
    "dpo_loss",
    "dynamic_filter_mask",
    "entropy_from_logits",
    "estimate_advantages",
    "gae_advantages_and_returns",
    "gather_logprobs",
    "group_by_prompt",
    "group_normalized",
    "gspo_policy_loss",
    "cispo_policy_loss",
    "sapo_policy_loss",
    "icepop_weights",
    "ipo_loss",
    "kd_loss",
    "kl_penalized_rewards",
    "kto_kl_estimate",
    "kto_loss",
    "last_action_index",
    "leave_one_out_baseline",
    "logexp_pairwise_loss",
    "loss_aggregation",
    "loss_mask_from_labels",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mean_baseline",
    "no_baseline",
    "normalize_rewards",
    "overlong_penalty",
    "ppo_policy_loss",
    "prm_loss",
    "sigmoid_pairwise_loss",
    "tis_weights",
    "token_cross_entropy",
    "value_loss",
]
