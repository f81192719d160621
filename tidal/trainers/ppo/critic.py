"""The critic of a GAE run: trained on the policy workers (``LocalCritic``) or on devices of its own
(``RemoteCritic``), behind ``tidal.placement.protocols.CriticRole``.

``LocalCritic`` is the critic as it always was: its FSDP2 shard on this rank's device, its values in
the make-experience phase and its PPO epochs just before the policy's. ``RemoteCritic`` drives one
``CriticWorker`` per policy worker (``--critic_num_nodes x --critic_num_gpus_per_node`` equal to the
actor's count, without ``--colocate_critic_reward`` / ``--colocate_all_models``): a child process on
the devices after the trainers' other workers (``tidal.placement.workers.ExtraDevices.after``) that
holds the value model, its optimizer and schedule, and trains together with the other critic workers
(an FSDP2 group of their own, each on its trainer's share of the batch, as the colocated critic is).
Its update runs while the trainer updates the policy: ``start_train`` sends the experience,
``finish_train`` collects the statistics. Both give the colocated run's numbers:

- the update's shuffles: the worker draws from a copy of the trainer's generator, which the trainer
  then advances past the critic's draws (``skip_shuffles``), so the policy shuffles as after a local
  critic;
- the value head's random init: the worker starts from the trainer's RNG state where the colocated
  critic would have been built, and the trainer continues from the worker's state after it.

Checkpoints: the worker gathers its full state (weights, optimizer, schedule, non-finite guard) on the
CPU and the trainer writes it with its own loop state (``checkpoint_state``); a resume sends it back.
A checkpoint resumes with the critic placed as when it was written.

``build_critic`` makes the one this rank's placement asks for. The critic is trained, so it is the trainer's
(``tidal.placement`` only starts its worker process).

Vision-language policies (``--max_images_per_prompt``): the critic is the VLM with a value head
(``tidal.models.vision_value.load_critic_model``), its vision tower frozen with ``--freeze_visual_encoder``
as the policy's; the experience carries each row's pixels, so its values read the same images.

Ring attention (``--ring_attn_size``): the local critic's forwards and updates run inside the trainer's
``use_ring`` scope, so its packed rows are split like the policy's (``ValueHeadMixin.values``); the
critic workers make the same ring groups among themselves and enter them for each call.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tidal.checkpoint.hf_export import save_hf_model
from tidal.checkpoint.resumable import CheckpointError
from tidal.config import ModelConfig
from tidal.config.distributed import DistributedConfig
from tidal.config.placement import separate_critic
from tidal.config.training import OptimConfig
from tidal.distributed.mesh import ring_group
from tidal.distributed.offload import offload_to_cpu, reload_to_device
from tidal.distributed.world import World, init_world
from tidal.experience.experience import Experience
from tidal.experience.maker import forward_values
from tidal.logging.phases import phase
from tidal.models.ring_attention import use_ring
from tidal.models.vision_value import load_critic_model
from tidal.placement.protocols import CriticRole, PlacedRun
from tidal.placement.roles import worker_counts
from tidal.placement.workers import ExtraDevices, start_process_workers
from tidal.trainers.optimization import Optimization, build_optimization

# The critic's PPO epochs: ``update(opt, exp, shape, world, generator) -> stats``, given by the trainer
# (``tidal.trainers.ppo.entry.ValueUpdate``; picklable, so a critic worker runs the same code).
CriticUpdate = Callable[..., dict[str, float]]

CPU = torch.device("cpu")


def skip_shuffles(generator: torch.Generator, rows: int, epochs: int) -> None:
    """Advance ``generator`` past the draws the critic's update (``train_on_experience`` of
    ``tidal.trainers.ppo.update``) makes for ``rows`` rows over ``epochs`` epochs (one permutation
    each), as if the critic had trained with it here."""
    for _ in range(epochs):
        torch.randperm(rows, generator=generator)


class LocalCritic:
    """The critic on this rank's device (see the module docstring)."""

    def __init__(self, opt: Optimization, update: CriticUpdate, world: World):
        self.opt, self.update, self.world = opt, update, world
        self._stats: dict[str, float] | None = None

    def values(self, exp: Experience, micro: int, packing: bool, max_tokens: int | None) -> Tensor:
        return forward_values(self.opt.model, exp, micro, packing, self.opt.precision, max_tokens)

    def start_train(self, exp: Experience, shape, generator: torch.Generator) -> None:
        self._stats = self.update(self.opt, exp, shape, self.world, generator)

    def finish_train(self) -> dict[str, float]:
        stats, self._stats = self._stats or {}, None
        return stats

    @property
    def skipped_steps(self) -> int:
        return self.opt.guard.skipped

    def checkpoint_parts(self) -> dict[str, Optimization]:
        return {"critic": self.opt}

    def checkpoint_state(self) -> dict:
        return {}

    def set_awake(self, awake: bool) -> None:
        (reload_to_device if awake else offload_to_cpu)(self.opt)

    def export(self, tokenizer, path) -> None:
        save_hf_model(self.opt.model, tokenizer, path, self.world)

    def close(self) -> None:
        """Nothing to stop: the critic lives in this process."""


@dataclass
class CriticSpec:
    """One critic worker: its model and optimizer configs, its rank among the critic workers, where
    they meet, its device, and the trainer's RNG state to build from (picklable)."""

    model: ModelConfig
    optim: OptimConfig
    dist: DistributedConfig
    value_head_prefix: str
    update: CriticUpdate
    total_steps: int
    rng_state: Tensor
    rank: int = 0
    world_size: int = 1
    master: tuple[str, int] = ("127.0.0.1", 0)  # the critic workers' rendezvous when world_size > 1
    device: str = "cpu"
    num_threads: int = 1
    images: bool = False  # the prompts carry images: a vision-language critic (tidal.models.vision_value)
    freeze_visual_encoder: bool = False

    def on_device(self, device: str) -> CriticSpec:
        return dataclasses.replace(self, device=device)


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class CriticWorker:
    """The critic's value model, optimizer and schedule in a process of its own."""

    def __init__(self, spec: CriticSpec):
        torch.set_num_threads(spec.num_threads)
        # this process's place among the critic workers (a child inherits its trainer's torchrun env)
        os.environ.update(RANK=str(spec.rank), WORLD_SIZE=str(spec.world_size), MASTER_ADDR=spec.master[0],
                          MASTER_PORT=str(spec.master[1]))  # fmt: skip
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 serves the critic group's own store
        self.world = init_world(spec.device)
        self.spec = spec
        # the trainers' ring groups (--ring_attn_size), made among the critic workers: worker i serves
        # trainer i, so the ranks of a ring group take the same turns as their trainers
        self.ring = ring_group(self.world, spec.dist.ring_attn_size, spec.dist.ring_head_stride)
        torch.set_rng_state(spec.rng_state)
        model = load_critic_model(spec.model, self.world.device, spec.value_head_prefix, spec.images,
                                  spec.freeze_visual_encoder)  # fmt: skip
        self.opt = build_optimization(model, spec.model, spec.optim, spec.dist, self.world, spec.total_steps)

    def rng_state(self) -> Tensor:
        """The RNG state after building (the trainer continues from it, as after a colocated critic)."""
        return torch.get_rng_state()

    def values(self, exp: Experience, micro: int, packing: bool, max_tokens: int | None) -> Tensor:
        exp = exp.to(self.world.device)
        with use_ring(self.ring):
            return forward_values(self.opt.model, exp, micro, packing, self.opt.precision, max_tokens).cpu()

    def train(self, exp: Experience, shape, generator_state: Tensor) -> tuple[dict, int]:
        generator = torch.Generator()
        generator.set_state(generator_state)
        with use_ring(self.ring):
            stats = self.spec.update(self.opt, exp.to(self.world.device), shape, self.world, generator)
        return stats, self.opt.guard.skipped

    def state_dict(self) -> dict:
        """The full state on the CPU (on the first critic worker; the others return their schedule and guard)."""
        model, optim = get_state_dict(self.opt.model, self.opt.optimizer, options=FULL)
        return {"model": model, "optim": optim, "scheduler": self.opt.scheduler.state_dict(),
                "guard": self.opt.guard.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        options = dataclasses.replace(FULL, broadcast_from_rank0=self.world.distributed)
        set_state_dict(self.opt.model, self.opt.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)  # fmt: skip
        self.opt.scheduler.load_state_dict(state["scheduler"])
        self.opt.guard.load_state_dict(state["guard"])

    def export(self, tokenizer, path: str) -> None:
        save_hf_model(self.opt.model, tokenizer, path, self.world)


class RemoteCritic:
    """The critic on this trainer's critic worker (a ``CriticWorker`` handle); see the module docstring."""

    def __init__(self, worker):
        self.worker = worker
        self._skipped = 0

    def values(self, exp: Experience, micro: int, packing: bool, max_tokens: int | None) -> Tensor:
        values = self.worker.call("values", exp.to(CPU), micro, packing, max_tokens)
        return values.to(exp.sequences.device)

    def start_train(self, exp: Experience, shape, generator: torch.Generator) -> None:
        self.worker.submit("train", exp.to(CPU), shape, generator.get_state())
        skip_shuffles(generator, len(exp), shape.epochs)

    def finish_train(self) -> dict[str, float]:
        stats, self._skipped = self.worker.result()
        return stats

    @property
    def skipped_steps(self) -> int:
        return self._skipped

    def checkpoint_parts(self) -> dict[str, Optimization]:
        return {}

    def checkpoint_state(self) -> dict:
        return {"critic_worker": self}

    def state_dict(self) -> dict:
        return self.worker.call("state_dict")

    def load_state_dict(self, state: dict) -> None:
        if not state:
            raise CheckpointError(
                "the checkpoint holds no state of a critic on devices of its own (it was written with the critic "
                "on the policy workers): resume it with --critic_num_nodes/--critic_num_gpus_per_node unset"
            )
        self.worker.call("load_state_dict", state)
        self._skipped = int(state["guard"].get("skipped", 0))

    def set_awake(self, awake: bool) -> None:
        """Nothing to offload: the critic has devices of its own."""

    def export(self, tokenizer, path) -> None:
        self.worker.call("export", tokenizer, str(path))

    def close(self) -> None:
        self.worker.close()


def build_critic(run: PlacedRun, world: World, steps: int, update: CriticUpdate) -> CriticRole:
    """The critic from ``--critic_pretrain`` (else the first reward model, else the policy): on this
    rank's device (FSDP2-sharded over the policy workers), or on a worker process of its own when
    ``--critic_num_*`` give it devices (``tidal.config.placement.separate_critic``). ``steps``: optimizer
    steps of the run (the LR schedule); ``update``: its PPO epochs (the trainer's, run where it is)."""
    cfg = dataclasses.replace(run.actor, pretrain=run.critic_source)
    # a vision-language critic reads the prompts' images; --freeze_visual_encoder freezes its tower too
    images, freeze = run.vision.max_images_per_prompt > 0, run.vision.freeze_visual_encoder
    if not separate_critic(run.placement):
        with phase(f"critic: {cfg.pretrain}"):
            model = load_critic_model(cfg, world.device, run.critic.value_head_prefix, images, freeze)
            opt = build_optimization(model, cfg, run.critic_optim, run.dist, world, steps)
        return LocalCritic(opt, update, world)
    counts = worker_counts(run, world.world_size)  # the other roles' devices come first
    extra = ExtraDevices({**counts, "engine": counts["engine"] * run.rollout.vllm_tensor_parallel_size})
    devices = extra.after("critic", 1)
    # the value head's random init starts where a colocated critic's would (after the policy's load)
    spec = CriticSpec(cfg, run.critic_optim, run.dist, run.critic.value_head_prefix, update, steps, torch.get_rng_state(), world.rank, world.world_size, critic_rendezvous(world),
                      devices[0], torch.get_num_threads(), images, freeze)  # fmt: skip
    [worker] = start_process_workers(CriticWorker, [spec], "critic", devices)
    try:
        torch.set_rng_state(worker.call("rng_state"))  # and this rank continues as after building it
    except BaseException:
        worker.close()
        raise
    return RemoteCritic(worker)


def critic_rendezvous(world: World) -> tuple[str, int]:
    """Where the critic workers of a multi-process run meet: a free port on the first trainer's node."""
    if not world.distributed:
        return "127.0.0.1", 0
    port = [0]
    if world.is_main:
        with socket.socket() as s:
            s.bind(("", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(port[0])
