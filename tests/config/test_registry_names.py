"""The flag choices kept as name tuples in ``tidal.config.registries`` (so that ``--help`` imports no
torch) are exactly the keys of ``tidal.algorithms``' registries, in registration order: an estimator or
loss registered without its name there fails here instead of being refused by its flag. The model
families are read from the engine's registry itself (plain data), and the tiny builders must match it."""

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


def test_tiny_families_and_the_demo_choices_are_the_engine_registry():
    import dataclasses

    from tidal.cli.demo import DemoConfig
    from tidal.rollout.models.registry import FAMILIES
    from tidal.testing import TINY_FAMILIES

    demo_choices = next(f.metadata["choices"] for f in dataclasses.fields(DemoConfig) if f.name == "family")
    assert tuple(FAMILIES) == tuple(TINY_FAMILIES) == demo_choices
