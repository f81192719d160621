"""The flag choices kept as name tuples in ``tidal.config.registries`` (so that ``--help`` imports no
torch) are exactly the keys of ``tidal.algorithms``' registries, in registration order: an estimator or
loss registered without its name there fails here instead of being refused by its flag."""

from __future__ import annotations

import pytest

from tidal import algorithms
from tidal.config import registries


@pytest.mark.parametrize(
    "names, registry",
    [
        ("ADVANTAGE_ESTIMATOR_NAMES", "ADVANTAGE_ESTIMATORS"),
        ("POLICY_LOSS_NAMES", "POLICY_LOSSES"),
        ("KL_ESTIMATOR_NAMES", "KL_ESTIMATORS"),
        ("LOSS_AGGREGATION_NAMES", "LOSS_AGGREGATIONS"),
        ("RM_LOSS_NAMES", "RM_LOSSES"),
    ],
)
def test_names_equal_registry_keys(names, registry):
    assert getattr(registries, names) == tuple(getattr(algorithms, registry))


def test_model_family_names_equal_the_engine_registry():
    from tidal.rollout.models.registry import FAMILIES
    from tidal.testing import TINY_FAMILIES

    assert registries.MODEL_FAMILY_NAMES == tuple(FAMILIES) == tuple(TINY_FAMILIES)
