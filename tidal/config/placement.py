"""Where RL roles run: the seed's Ray placement flags.

Local mode (all counts 1, the default): one process; every role and one rollout engine share its
device (the hybrid engine). With ``--actor_num_nodes x --actor_num_gpus_per_node`` = T > 1, ``tidal
ppo`` starts T data-parallel policy workers as Ray actors, one per placement-group bundle (a GPU,
or on a machine without GPUs a CPU, so ``*_num_gpus_per_node`` then counts CPU worker processes);
torchrun starts them itself. Each worker holds its shard of the policy (and critic).

The other roles sit with the policy workers — one engine and full copies of the reference and
reward models each — unless they are given devices of their own, as in OpenRLHF:

- ``--vllm_num_engines E`` without ``--colocate_all_models``: E engines (T divides E);
- ``--ref_num_nodes/--ref_num_gpus_per_node`` set without ``--colocate_actor_ref`` or
  ``--colocate_all_models``: that many reference workers (T divides it);
- ``--teacher_num_nodes/--teacher_num_gpus_per_node`` (a tidal addition; on-policy distillation): the
  teacher takes the reference's place, so these size the "ref" role in its stead, with the same rules
  (``--colocate_actor_ref`` / ``--colocate_all_models`` keep it with the policy);
- ``--reward_num_nodes/--reward_num_gpus_per_node`` set without ``--colocate_critic_reward`` or
  ``--colocate_all_models``: that many reward-model workers (T divides it);
- ``--critic_num_nodes/--critic_num_gpus_per_node`` set without ``--colocate_critic_reward`` or
  ``--colocate_all_models``: a critic on devices of its own, one worker per policy worker (the count
  must equal T), trained while the policy updates (``tidal.trainers.ppo.critic``); local mode and
  torchrun only. Otherwise the critic trains on the policy workers.

Separate workers are child processes of their trainer (GPUs after the trainers', or CPU processes)
or Ray actors in bundles of their own (``tidal.placement.workers``). ``placement_problems`` lists
what this design cannot honour.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.args import AT_LEAST_ONE, NON_NEGATIVE, Checked, arg


@dataclass
class PlacementConfig(Checked):
    """Placement (Ray): devices per role, colocation, sleep modes and asynchronous training."""

    actor_num_nodes: int = arg(1, help="nodes for the policy")
    actor_num_gpus_per_node: int = arg(1, help="devices per node for the policy")
    ref_num_nodes: int | None = arg(
        None, help="nodes for the reference model (unset: with the policy workers)"
    )
    ref_num_gpus_per_node: int | None = arg(
        None, help="devices per node for the reference model (unset: with the policy workers)"
    )
    # tidal addition (OpenRLHF has no on-policy distillation): the teacher in the reference's place
    teacher_num_nodes: int | None = arg(
        None,
        help="nodes for the --teacher_model teacher (unset: with the policy workers, or --ref_num_nodes)",
    )
    teacher_num_gpus_per_node: int | None = arg(
        None,
        help="devices per node for the --teacher_model teacher (unset: with the policy workers, or "
        "--ref_num_gpus_per_node)",
    )
    critic_num_nodes: int | None = arg(
        None, help="nodes for the critic (unset: it trains on the policy workers)"
    )
    critic_num_gpus_per_node: int | None = arg(
        None, help="devices per node for the critic (unset: it trains on the policy workers)"
    )
    reward_num_nodes: int | None = arg(
        None, help="nodes for the reward model (unset: with the policy workers)"
    )
    reward_num_gpus_per_node: int | None = arg(
        None, help="devices per node for the reward model (unset: with the policy workers)"
    )
    colocate_actor_ref: bool = arg(False, help="policy and reference share devices")
    colocate_critic_reward: bool = arg(False, help="critic and reward model share devices")
    colocate_all_models: bool = arg(False, help="all models and engines share devices (hybrid engine)")
    deepspeed_enable_sleep: bool = arg(
        False, help="offload trainer weights and optimizer state while generating"
    )
    async_train: bool = arg(False, help="generate the next rollout while training on the current one")
    async_queue_size: int = arg(
        1, help="max rollouts generated ahead of training (staleness bound)", check=AT_LEAST_ONE
    )
    max_staleness: int | None = arg(
        None,
        help="--async_train: a generation round starts only when each of its groups will be trained at most "
        "this many policy updates (steps) after the weights it is generated with; bounds the extra age of "
        "over-sampled groups (unset: only --async_queue_size bounds it)",
        check=NON_NEGATIVE,
    )

    def problems(self, flags=None) -> list[str]:
        counts = [self.actor_num_nodes, self.actor_num_gpus_per_node, self.ref_num_nodes, self.ref_num_gpus_per_node,
                  self.critic_num_nodes, self.critic_num_gpus_per_node, self.reward_num_nodes,
                  self.reward_num_gpus_per_node, self.teacher_num_nodes, self.teacher_num_gpus_per_node]  # fmt: skip
        own = []
        if min(c for c in counts if c is not None) < 1:
            own.append("--*_num_nodes and --*_num_gpus_per_node must be >= 1")
        return super().problems(flags) + own

    @property
    def actor_world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    def flag_prefix(self, role: str) -> str:
        """The flags that size ``role``: the teacher's size the "ref" role when given (it takes the
        reference's place; ``tidal.config.ppo`` refuses them without --teacher_model)."""
        return "teacher" if role == "ref" and self._given("teacher") else role

    def _given(self, prefix: str) -> bool:
        return (
            getattr(self, f"{prefix}_num_nodes") is not None
            or getattr(self, f"{prefix}_num_gpus_per_node") is not None
        )

    def role_size(self, role: str) -> tuple[int, int]:
        """(nodes, devices per node) of ``role`` (actor, ref, critic, reward); an unset count is 1."""
        prefix = self.flag_prefix(role)
        return getattr(self, f"{prefix}_num_nodes") or 1, getattr(self, f"{prefix}_num_gpus_per_node") or 1

    def sized(self, role: str) -> bool:
        return self._given(self.flag_prefix(role))

    def role_count(self, role: str) -> int:
        nodes, per_node = self.role_size(role)
        return nodes * per_node


def separate_engines(p: PlacementConfig, vllm_num_engines: int | None) -> bool:
    """Engines on devices of their own (``--vllm_num_engines`` without ``--colocate_all_models``, or with
    it and ``--async_train``: as in OpenRLHF, async training colocates only the trained models, since the
    engines generate while they train)."""
    return vllm_num_engines is not None and (not p.colocate_all_models or p.async_train)


def separate_reference(p: PlacementConfig) -> bool:
    """Reference workers on devices of their own (sized, and not colocated with the policy)."""
    return p.sized("ref") and not (p.colocate_actor_ref or p.colocate_all_models)


def separate_critic(p: PlacementConfig) -> bool:
    """The critic on devices of its own (sized, and not colocated with the reward model or everything)."""
    return p.sized("critic") and not (p.colocate_critic_reward or p.colocate_all_models)


def separate_reward(p: PlacementConfig) -> bool:
    """Reward-model workers on devices of their own (sized, and not colocated)."""
    return p.sized("reward") and not (p.colocate_critic_reward or p.colocate_all_models)


def placement_problems(
    p: PlacementConfig,
    vllm_num_engines: int | None,
    vllm_tensor_parallel_size: int,
    needs_reference: bool,
    needs_critic: bool,
    has_reward_model: bool,
) -> list[str]:
    """Placements the data-parallel design cannot honour (see the module docstring), one line each."""
    problems = []
    w = p.actor_world_size
    problems += engine_tp_problems(p, vllm_num_engines, vllm_tensor_parallel_size, w)
    if separate_engines(p, vllm_num_engines):
        problems += separate_engine_problems(p, vllm_num_engines, w)
    elif vllm_num_engines not in (None, colocated_engines(w, vllm_tensor_parallel_size)):
        engines = colocated_engines(w, vllm_tensor_parallel_size)
        problems.append(
            f"--vllm_num_engines {vllm_num_engines} with --colocate_all_models: the {w} policy workers run "
            f"{engines} engine(s) on their own devices (one per worker, or one per --vllm_tensor_parallel_size "
            f"workers); set --vllm_num_engines {engines} (or leave it unset)"
        )
    actor = p.role_size("actor")
    separate = {"ref": separate_reference(p) and needs_reference, "critic": separate_critic(p) and needs_critic,
                "reward": separate_reward(p) and has_reward_model}  # fmt: skip
    for role, needed in (("ref", needs_reference), ("critic", needs_critic), ("reward", has_reward_model)):
        if not needed or not p.sized(role):
            continue
        count = p.role_count(role)
        if role == "critic" and separate[role] and count != w:
            problems.append(
                f"--critic_num_nodes x --critic_num_gpus_per_node = {count}: a critic on devices of its own runs "
                f"one worker per policy worker (each trains on its worker's share of the batch), so it must be "
                f"{w} (or leave them unset to train it on the policy workers)"
            )
        flag = p.flag_prefix(role)
        if separate[role] and role != "critic" and count % w:
            problems.append(
                f"--{flag}_num_nodes x --{flag}_num_gpus_per_node = {count}: each of the {w} policy workers "
                f"drives the same number of {role} workers on devices of their own, so it must be a "
                f"multiple of {w}"
            )
        if not separate[role] and p.role_size(role) not in ((1, 1), actor):
            where = "trains on" if role == "critic" else "is colocated with"
            problems.append(
                f"--{flag}_num_nodes/--{flag}_num_gpus_per_node {p.role_size(role)}: the {flag} model {where} "
                f"the policy workers, so its size must be 1x1 or the actor's {actor[0]}x{actor[1]}"
            )
    return problems


def colocated_engines(w: int, tp: int) -> int:
    """Engines colocated with ``w`` policy workers: one per worker, or with tensor parallelism one per
    ``tp`` consecutive workers, spanning their devices (OpenRLHF's hybrid engine: engines x tp = workers)."""
    return w // tp if w > 1 and tp > 1 else w


def engine_tp_problems(p: PlacementConfig, engines: int | None, tp: int, w: int) -> list[str]:
    """A tensor-parallel engine spans ``tp`` devices (processes): its own, in local mode (one policy
    worker) the worker's device and the next ``tp - 1``, or colocated with several workers, ``tp``
    consecutive workers' devices (so ``tp`` must divide their number)."""
    if tp < 1:
        return [f"--vllm_tensor_parallel_size must be >= 1, got {tp}"]
    if tp > 1 and w > 1 and not separate_engines(p, engines) and w % tp:
        return [
            f"--vllm_tensor_parallel_size {tp} with engines colocated with the {w} policy workers: each engine "
            f"spans {tp} consecutive workers' devices, so {tp} must divide {w}"
        ]
    if tp > 1 and w > 1 and not separate_engines(p, engines) and p.async_train:
        return [
            f"--vllm_tensor_parallel_size {tp} with --async_train: an engine colocated with {tp} policy workers "
            "generates in turns with them, not on a background thread; drop --async_train or put the engines "
            "on devices of their own (--vllm_num_engines without --colocate_all_models)"
        ]
    return []


def local_engine_gpu_problem(tp: int, gpus: int) -> str | None:
    """Local mode on CUDA: the engine spans the trainer's GPU (the first) and the next ``tp - 1``."""
    if tp > gpus:
        return f"the local engine spans {tp} GPUs from the trainer's (cuda:0..cuda:{tp - 1}) but {gpus} are visible"
    return None


def local_engine_overlap_problem(p: PlacementConfig, tp: int) -> str | None:
    """Local mode on CUDA: a ``tp``-GPU engine takes cuda:1..cuda:tp-1 too, which is where workers on
    devices of their own (reference, reward model, critic) would start."""
    roles = [role for role, separate in (("ref", separate_reference(p)), ("reward", separate_reward(p)),
                                         ("critic", separate_critic(p))) if separate]  # fmt: skip
    if tp == 1 or not roles:
        return None
    return (
        f"the local engine spans cuda:0..cuda:{tp - 1}, the GPUs where the {', '.join(roles)} worker(s) on "
        f"devices of their own would start: run the engines on their own devices too (--vllm_num_engines "
        f"without --colocate_all_models) or colocate the {', '.join(roles)} model(s) with the policy"
    )


def separate_engine_problems(p: PlacementConfig, engines: int, w: int) -> list[str]:
    """``engines`` separate engines for ``w`` policy workers (processes)."""
    problems = []
    if engines < 1 or engines % w:
        problems.append(
            f"--vllm_num_engines {engines}: without --colocate_all_models each of the {w} policy workers "
            f"drives the same number of engines on devices of their own, so it must be a multiple of {w}"
        )
    if p.deepspeed_enable_sleep and not (p.async_train and p.colocate_all_models):  # async: models take turns
        problems.append(
            "--deepspeed_enable_sleep frees the policy's device for a colocated engine, but "
            f"--vllm_num_engines {engines} without --colocate_all_models puts the engines on devices of "
            "their own: drop it, or pass --colocate_all_models"
        )
    return problems
