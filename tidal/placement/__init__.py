"""Placement: where the roles of an RL run that are not trained here run, and how the loop reaches them.

The RL loop (``tidal.trainers.ppo``) trains the policy and critic on its own device and sees the
other roles only through the protocols of ``protocols``; this package builds them:

- ``rollout`` / ``remote_rollout`` / ``data_parallel``: the rollout role (an engine on this device,
  engines on devices of their own, a data-parallel rank's share of either); ``engines``: the engine
  worker;
- ``frozen_roles``: the reference and reward-model roles, here or on workers of their own;
- ``workers`` (child processes and Ray actors with one call interface, their devices), ``roles``
  (how many workers of each role a rank drives), ``build`` (a rank's roles from the run's placement)
  and ``ray_launch`` (the Ray driver: actor groups for the ranks and the separate roles).

Nothing here imports the trainer: the entry point (``tidal.trainers.ppo.entry.run_ppo``) makes the
Ray-or-local choice once and hands the rank's function to ``run_on_ray``.
"""

from typing import TYPE_CHECKING

from tidal.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for type checkers, and for tests/test_imports.py's import graph
    from tidal.placement.build import Roles, build_roles
    from tidal.placement.protocols import PlacedRun, ReferenceRole, RewardRole, RolloutRole
    from tidal.placement.ray_launch import run_on_ray, wants_ray

# name → the submodule that defines it, imported when the name is first used (see tidal.lazy)
_EXPORTS = {
    "PlacedRun": "tidal.placement.protocols",
    "ReferenceRole": "tidal.placement.protocols",
    "RewardRole": "tidal.placement.protocols",
    "Roles": "tidal.placement.build",
    "RolloutRole": "tidal.placement.protocols",
    "build_roles": "tidal.placement.build",
    "run_on_ray": "tidal.placement.ray_launch",
    "wants_ray": "tidal.placement.ray_launch",
}

__all__ = [
    "PlacedRun",
    "ReferenceRole",
    "RewardRole",
    "Roles",
    "RolloutRole",
    "build_roles",
    "run_on_ray",
    "wants_ray",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
