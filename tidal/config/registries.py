"""Names the flag configs need from heavy modules, kept here so that building a parser (``--help``)
imports no torch.

The ``*_NAMES`` tuples are the keys of ``tidal.algorithms``' registries, in registration order (the
order ``--help`` lists a flag's choices in); tests/config/test_registry_names.py checks that each
equals its registry's keys, so a new estimator or loss registered without its name here fails a test
instead of being refused by the flag. The remote reward defaults are ``tidal.rewards.remote``'s.
"""

from __future__ import annotations

# tidal.algorithms.ADVANTAGE_ESTIMATORS
ADVANTAGE_ESTIMATOR_NAMES = ("gae", "reinforce", "reinforce_baseline", "dr_grpo", "rloo", "group_norm")
# tidal.algorithms.POLICY_LOSSES
POLICY_LOSS_NAMES = ("ppo", "gspo", "cispo", "sapo")
# tidal.algorithms.KL_ESTIMATORS
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")
# tidal.algorithms.LOSS_AGGREGATIONS
LOSS_AGGREGATION_NAMES = ("token", "sequence", "sequence_sum")
# tidal.algorithms.RM_LOSSES
RM_LOSS_NAMES = ("sigmoid", "logexp")

# --remote_rm_timeout / --remote_rm_retries defaults (tidal.rewards.remote.RemoteReward's).
DEFAULT_TIMEOUT = 60.0
DEFAULT_RETRIES = 2
