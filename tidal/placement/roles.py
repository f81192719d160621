"""This trainer's separate workers, per role: child processes it starts, or Ray actors from the driver.

``worker_counts`` says how many workers of each role (engine, reference, reward model) every trainer
drives on devices of their own (``tidal.config.placement``: 0 when the role sits with the policy
worker). ``role_spec`` is what builds one (a spec with ``on_device``); ``start_workers`` starts this trainer's share as child
processes (``tidal.placement.workers``), or wraps the Ray actors the driver placed for it.
"""

from __future__ import annotations

import torch

from tidal.config import ConfigError
from tidal.config.placement import separate_engines, separate_reference, separate_reward
from tidal.models.frozen import frozen_copy_config
from tidal.placement.engines import EngineWorker, engine_spec
from tidal.placement.frozen_roles import FrozenSpec, ReferenceWorker, RewardWorker, reference_source
from tidal.placement.protocols import PlacedRun
from tidal.placement.workers import ROLES, ExtraDevices, RayWorker, start_process_workers

FLAGS = {"engine": "--vllm_num_engines", "reference": "--ref_num_nodes x --ref_num_gpus_per_node",
         "reward model": "--reward_num_nodes x --reward_num_gpus_per_node"}  # fmt: skip


def role_totals(run: PlacedRun) -> dict[str, int]:
    """Separate workers of each role in the whole run (0: the role sits with the policy workers)."""
    p, r = run.placement, run.rollout
    return {
        "engine": r.vllm_num_engines if separate_engines(p, r.vllm_num_engines) else 0,
        "reference": p.role_count("ref") if run.algorithm.needs_reference and separate_reference(p) else 0,
        "reward model": p.role_count("reward") if run.reward.pretrain and separate_reward(p) else 0,
    }


def worker_counts(run: PlacedRun, world_size: int) -> dict[str, int]:
    """Separate workers of each role per trainer; every trainer drives the same number."""
    counts = {}
    for role, total in role_totals(run).items():
        if total % world_size:
            prefix = run.placement.flag_prefix("ref")  # the teacher's flags size it in the reference's place
            flag = (
                f"--{prefix}_num_nodes x --{prefix}_num_gpus_per_node" if role == "reference" else FLAGS[role]
            )
            raise ConfigError(
                f"{flag} = {total}: each of the {world_size} policy workers drives the same number of "
                f"{role} workers, so it must be a multiple of {world_size}"
            )
        counts[role] = total // world_size
    return counts


def role_spec(run: PlacedRun, role: str):
    """``(factory, spec)`` building one worker of ``role`` (device "auto" until placed)."""
    if role == "engine":
        return EngineWorker, engine_spec(run)
    threads, dtype = torch.get_num_threads(), run.actor.param_dtype
    if role == "reference":
        return ReferenceWorker, FrozenSpec((frozen_copy_config(run.actor, reference_source(run)),), dtype,
                                           num_threads=threads)  # fmt: skip
    paths = run.reward.pretrain.split(",")
    spec = FrozenSpec(tuple(frozen_copy_config(run.actor, p) for p in paths), dtype, num_threads=threads,
                      value_head_prefix=run.critic.value_head_prefix, normalize_reward=run.reward.normalize,
                      micro_size=run.rollout.micro_rollout_batch_size)  # fmt: skip
    return RewardWorker, spec


def start_workers(run: PlacedRun, world_size: int, ray_actors: dict | None = None) -> dict[str, list]:
    """This trainer's separate workers per role (handles with ``submit`` / ``result`` / ``close``)."""
    counts = worker_counts(run, world_size)
    if ray_actors is not None:
        return {role: [RayWorker(a, role) for a in ray_actors.get(role, [])] for role in ROLES}
    tp = run.rollout.vllm_tensor_parallel_size  # a tensor-parallel engine spans tp devices
    extra, started = ExtraDevices({**counts, "engine": counts["engine"] * tp}), {role: [] for role in ROLES}
    try:
        for role in ROLES:
            if counts[role]:
                factory, spec = role_spec(run, role)
                devices = extra.devices(role)[:: tp if role == "engine" else 1]  # each engine's first
                specs = [spec.on_device(d) for d in devices]
                started[role] = start_process_workers(factory, specs, role, devices)
    except BaseException:
        for workers in started.values():
            for w in workers:
                w.close()
        raise
    return started
