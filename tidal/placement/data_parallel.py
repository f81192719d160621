"""Data-parallel RL: each process generates, scores and trains on its share of every rollout (the
scoring and training are the trainer's; this module gives a rank its share of the generation).

Rank r of W takes a contiguous slice of a rollout's prompts and runs its own rollout (an engine on
its device, or its separate engines) on them. Per-sample seeds follow the *global* prompt index
(``first_index``), so the samples are those a single process would draw. A prompt's n samples stay
on one rank, so group baselines (GRPO, RLOO, REINFORCE++-baseline) need no communication; the
batch-wide steps do, and the experience path takes them as a ``BatchReduction`` over the world
(``tidal.experience.maker``). The policy (and critic) are FSDP2-sharded across the ranks; weight
sync gathers full parameters (``DTensor.full_tensor``) into every rank's engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from tidal.agents import Trajectory
from tidal.config.args import ConfigError
from tidal.config.placement import colocated_engines, separate_engines
from tidal.data.batching import contiguous_splits
from tidal.data.prompts import PromptSample
from tidal.distributed.world import World
from tidal.placement.protocols import PlacedRun
from tidal.placement.rollout import Rollout


def shard_bounds(count: int, world: World) -> tuple[int, int]:
    """This rank's contiguous ``[start, stop)`` of ``count`` items (earlier ranks take the remainder);
    the tensor-parallel ranks of one data-parallel group share one slice."""
    return contiguous_splits(count, world.dp_size)[world.dp_rank]


class DataParallelRollout:
    """This rank's share of every rollout, on its own ``LocalRollout`` or ``RemoteRollout``."""

    def __init__(self, local: Rollout, world: World):
        self.local, self.world = local, world
        self.lock = local.lock

    def generate(
        self, prompts: Sequence[PromptSample], n: int, temperature: float, seed: int
    ) -> list[Trajectory]:
        start, stop = shard_bounds(len(prompts), self.world)
        return self.local.generate(prompts[start:stop], n, temperature, seed, first_index=start)

    def sync_weights(self, policy: nn.Module) -> int:
        return self.local.sync_weights(policy)  # every rank gathers the full weights (a collective)

    def sleep(self) -> None:
        self.local.sleep()

    def close(self) -> None:
        self.local.close()


def check_data_parallel(run: PlacedRun, world: World, num_eval_prompts: int | None) -> None:
    """Fail clearly on what the data-parallel loop cannot do with ``world.world_size`` processes."""
    w, r = world.world_size, run.rollout
    # separate workers (engines, reference, reward) are checked against w by roles.worker_counts
    engines = colocated_engines(w, r.vllm_tensor_parallel_size)  # w, or one per TP group of processes
    if not separate_engines(run.placement, r.vllm_num_engines) and (r.vllm_num_engines or engines) != engines:
        where = f"the {w} processes run {engines} engine(s)" if w > 1 else "local mode runs one engine"
        raise ConfigError(
            f"--vllm_num_engines {r.vllm_num_engines} with --colocate_all_models: {where}; set it to {engines} "
            "(or leave it unset)"
        )
    if not world.distributed:
        return
    generate = r.vllm_generate_batch_size or r.rollout_batch_size
    if generate != r.rollout_batch_size:  # the ranks' shares of a batch must stay equal
        raise ConfigError(f"--vllm_generate_batch_size {generate} differs from --rollout_batch_size "
                          f"{r.rollout_batch_size}: over-sampling runs in one process")  # fmt: skip
    if r.partial_rollout_enable:  # the update is applied from the generation thread (tidal.placement.partial)
        raise ConfigError("--partial_rollout_enable runs in one process (not under torchrun or Ray workers)")
    if run.placement.actor_world_size not in (1, w):
        raise ConfigError(
            f"--actor_num_nodes x --actor_num_gpus_per_node = {run.placement.actor_world_size}, but the "
            f"launcher started {w} processes"
        )
    dp = world.dp_size  # the processes that hold distinct data (all of them without tensor parallelism)
    groups = f"{dp} data-parallel groups" if world.tp_size > 1 else f"{dp} processes"
    for flag, value in (
        ("rollout_batch_size", r.rollout_batch_size),
        ("train_batch_size", run.train.train_batch_size),
    ):
        if value % dp:
            raise ConfigError(f"--{flag} {value} must be divisible by the {groups}")
    if num_eval_prompts is not None and num_eval_prompts < dp:
        raise ConfigError(f"--eval_dataset has {num_eval_prompts} prompts, fewer than the {groups}")
