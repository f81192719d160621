"""The RL loop: generate → make experience → advantages → update → sync weights → log/save.

One trainer serves every estimator (PPO with GAE, REINFORCE++, REINFORCE++-baseline, RLOO, GRPO,
Dr.GRPO): the differences are data in ``tidal.algorithms`` registries. ``fit`` runs the episodes;
``train_step`` is one RL step read top to bottom, each phase a short method below it. Where the
roles run (this device, processes or Ray actors of their own, data-parallel ranks) is not the
loop's business: it sees the protocols of ``tidal.placement.protocols`` and, for batch-wide
statistics, a ``BatchReduction`` over its world.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tidal.algorithms import dynamic_filter_mask, make_kl_controller, masked_mean
from tidal.algorithms.rewards import RunningMoments
from tidal.checkpoint import Checkpointer, LoopState, StateFns, StopSignals, flat_settings
from tidal.config.ppo import PPORun
from tidal.data import epoch_permutation
from tidal.distributed.collectives import all_gather_objects, mean_over_world, world_masked_mean
from tidal.distributed.offload import offload_to_cpu, reload_to_device
from tidal.distributed.world import World, all_reduce_sum
from tidal.experience.experience import Experience
from tidal.experience.maker import (
    BatchReduction,
    add_advantages,
    forward_logprobs,
    shape_rewards,
)
from tidal.experience.scoring import RewardScorer
from tidal.logging import MetricsLogger, ProgressBar, get_logger
from tidal.models.exact_lora import make_lora_exact
from tidal.models.moe_routing import force_routing
from tidal.placement.protocols import CriticRole, ReferenceRole, RolloutRole
from tidal.rollout.batch_invariant import make_exact
from tidal.trainers.data_position import DataPosition, resume_offset
from tidal.trainers.optimization import Optimization
from tidal.trainers.ppo.ema import PolicyEMA
from tidal.trainers.ppo.evaluation import RLEvaluation
from tidal.trainers.ppo.ptx import PtxLoss, PtxStream
from tidal.trainers.ppo.sampling import RolloutBatcher, SamplingState, sampling_config
from tidal.trainers.ppo.stream import RolloutJob, RolloutResult, rollout_stream
from tidal.trainers.ppo.update import (
    MISMATCH,
    PolicyLoss,
    StepShape,
    old_logprobs_from_update,
    train_on_experience,
)
from tidal.trainers.sft import SFTObjective

log = get_logger(__name__)

# Config groups a checkpoint records; resuming with other values warns (see tidal.checkpoint.manager).
SETTINGS = (
    "actor",
    "data",
    "rollout",
    "algorithm",
    "reward",
    "critic",
    "agent",
    "train",
    "actor_optim",
    "critic_optim",
    "ema",
    "ptx",
)


@dataclass
class PPOParts:
    """What the loop drives: the policy on this device, the critic, the frozen reference and the rollout
    wherever ``tidal.placement`` put them, the scorer of their trajectories (with the reward models), and
    this rank's pretraining micro-batches (``--pretrain_data``)."""

    actor: Optimization
    critic: CriticRole | None
    reference: ReferenceRole | None
    rollout: RolloutRole
    scorer: RewardScorer
    tokenizer: object
    ptx: PtxStream | None = None

    def close(self) -> None:
        """Stop what runs outside this process (engines, critic, reference and reward workers)."""
        self.rollout.close()
        self.scorer.close()
        if self.reference is not None:
            self.reference.close()
        if self.critic is not None:
            self.critic.close()


class PhaseTimer:
    """Wall time per phase of one step, logged as ``time/<phase>``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[f"time/{phase}"] = time.perf_counter() - start


def peak_memory(world: World) -> dict[str, float]:
    """``memory/peak_gb_rank<i>``: each rank's peak CUDA memory (GiB) since the previous step's reading,
    which spans this step's generation and update; nothing on the CPU."""
    if world.device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(world.device) / 2**30
    torch.cuda.reset_peak_memory_stats(world.device)
    return {f"memory/peak_gb_rank{i}": round(gb, 2) for i, gb in enumerate(all_gather_objects(peak, world))}


class PPOTrainer:
    """See the module docstring; ``train_step`` is the whole algorithm."""

    def __init__(
        self, run: PPORun, parts: PPOParts, prompts: Sequence, eval_prompts: Sequence | None, world: World
    ):
        self.run, self.parts, self.world = run, parts, world
        self.prompts, self.eval_prompts = prompts, eval_prompts
        self.kl_ctl = make_kl_controller(
            run.algorithm.init_kl_coef, run.algorithm.kl_target, run.algorithm.kl_horizon
        )
        self.moments = RunningMoments() if run.reward.normalize and not run.reward.pretrain else None
        self.reduction = BatchReduction.over(world)  # whitening and reward moments over every rank
        self.n = run.rollout.n_samples_per_prompt
        # the prompts trained in the episode, for a resume with another batch size or prompt set
        self.position, self._skip, self._first_episode = DataPosition(), 0, 0
        # batches of filtered-and-refilled (--dynamic_filtering) or over-sampled groups, and their position
        self.sampling = SamplingState()
        self.batcher = RolloutBatcher(
            sampling_config(run, world.distributed), prompts, self._experience_of, self._rollout_seed
        )
        # --enable_ema: the average starts from the initial policy (a resume restores the saved one)
        self.ema = PolicyEMA(parts.actor.model, run.ema.beta) if run.ema.enable else None
        # --exact_logprobs: the policy runs the engine's batch-invariant ops, so (weights being the engine's:
        # not --async_train, whose rollouts may come from older weights) its old log-probs are the rollout's.
        if run.rollout.exact_logprobs:  # LoRA layers multiply by the merged weight the engine receives
            make_lora_exact(make_exact(parts.actor.model))
        self._engine_logprobs_exact = run.rollout.exact_logprobs and not run.placement.async_train
        self.checkpointer = Checkpointer(
            run.ckpt, world, "ppo", self._trained_parts(), flat_settings(asdict(run), SETTINGS),
            state=self._loop_state(), hf_copy=self._hf_copy,
        )  # fmt: skip
        # one rollout's generation and scoring at a time: an evaluation waits for the async thread's round
        self._turn = threading.Lock()
        self.evaluation = RLEvaluation(
            run, world, eval_prompts, self._experience_of, self._sleep_engine, self.checkpointer
        )

    def fit(self) -> list[dict]:
        run, world = self.run, self.world
        self.checkpointer.check_space([self.parts.actor.model], run.ckpt.save_path)  # before training
        loop, history = self._resume(), []
        self._first_episode = loop.epoch
        resume_step = self.checkpointer.resume_step(loop)
        logger = MetricsLogger(self.run_dir, run.logging, asdict(run), world.is_main, resume_step)
        bar = ProgressBar(self.total_rollouts, initial=loop.global_step, desc="rl", is_main=world.is_main)
        with logger, bar, StopSignals() as stop:
            step_start = time.perf_counter()
            for episode in range(loop.epoch, run.train.num_episodes):
                # generate: each rollout when the loop asks for it, or (--async_train) ahead on a thread
                for generated in rollout_stream(self._batches(episode, loop), self._ahead):
                    log.debug("step %d trains prompts %s", loop.global_step + 1, generated.prompt_ids)
                    stats = self.train_step(generated, loop.global_step)
                    loop = LoopState(loop.global_step + 1, episode, loop.step_in_epoch + 1)
                    self.sampling.position = generated.position  # a checkpoint resumes after this batch
                    self.position.samples = len(self.prompts)
                    self.position.offset = generated.position.drawn - len(generated.position.pending)
                    # wall time of the step: with --async_train generation overlaps the previous update
                    stats["time/step"], step_start = time.perf_counter() - step_start, time.perf_counter()
                    history.append({"step": loop.global_step, "kl_coef": self.kl_ctl.value, **stats})
                    self.after_step(loop, history[-1], logger, bar)
                    signum = stop.requested(world)
                    if signum:
                        raise self.checkpointer.stopped(signum, loop)
                loop = LoopState(loop.global_step, episode + 1, 0)
        self.save_final()
        return history

    def train_step(self, generated: RolloutResult, step: int) -> dict[str, float]:
        """One RL step on a generated rollout (sampled and run by agents in the rollout role, then scored)."""
        timer, lag = PhaseTimer(), self.batcher.staleness(generated)  # steps since its weights
        with timer("wake"):  # --deepspeed_enable_sleep: the trainer's state back on the device
            self._trainer_awake(True)
        with timer("make_experience"):
            exp, stats = self.make_experience(generated.exp)
        with timer("advantages"):
            if exp is not None:  # None: dynamic filtering kept no group on any rank
                exp, stats = self.advantages(exp, stats)
        with timer("train"):
            stats |= self.update(exp, step) if exp is not None else {"skipped": 1.0}
        with timer("sync_weights"):
            self.sync_weights(step)
            self.batcher.trained_one()  # the next rounds generate with these weights (--max_staleness)
        with timer("sleep"):
            self._trainer_awake(False)
        stats |= mean_over_world(generated.reward_logs, self.world) | timer.seconds | generated.stats | lag
        stats["time/generate"] = generated.seconds
        return stats | peak_memory(self.world)

    def _experience_of(self, job: RolloutJob) -> tuple[Experience, dict]:
        """Generate a rollout (the rollout role's trajectories), then score and pack it (experience path)."""
        with self._turn:
            trajectories = self.parts.rollout.generate(job.prompts, job.n, job.temperature, seed=job.seed)
            return self.parts.scorer.experience(trajectories)

    @property
    def _size(self) -> int:
        return self.run.rollout.rollout_batch_size

    def _batches(self, episode: int, loop: LoopState):
        """This episode's remaining batches (``trainers/ppo/sampling.py``: deterministic prompts and seeds;
        a resumed run goes on after the prompts its checkpoint trained, ``tidal.trainers.data_position``)."""
        skip = self._skip if episode == self._first_episode else 0
        start = self.sampling.start(episode, skip)
        order = epoch_permutation(len(self.prompts), self.run.train.seed, episode)
        if self.batcher.cfg.reward_range is None:  # as always, the episode's last partial batch is left out
            trained = start.drawn - len(start.pending)
            order = order[: trained + (len(order) - trained) // self._size * self._size]
        return self.batcher.batches(episode, order, start, loop.global_step)

    @property
    def _ahead(self) -> int | None:
        return self.run.placement.async_queue_size if self.run.placement.async_train else None

    # ---- phases ------------------------------------------------------------------------------
    def make_experience(self, exp: Experience) -> tuple[Experience | None, dict[str, float]]:
        """Filter groups, shape rewards, add old and reference log-probs and values (no grad)."""
        run, actor = self.run, self.parts.actor
        exp = exp.to(self.world.device)
        stats = rollout_stats(exp)
        if run.algorithm.dynamic_filtering and self.batcher.cfg.reward_range is None:  # not refilled
            exp = self._dynamic_filter(exp, stats)
            if exp is None:
                return None, stats
        exp.rewards = shape_rewards(
            exp, run.algorithm, run.rollout.generate_max_len, self.moments, self.reduction
        )
        micro, packing, max_tokens = self._scoring_shape()
        temperature = run.rollout.temperature
        if self._old_logprobs_from_update(len(exp)):
            # the update's own forward gives them (``old_logprobs_from_update``) and logs their gap to the
            # engine's (in exact mode its values are the exact forward's: a measured 0, not an assumed one)
            exp.old_logprobs = None
        elif self._engine_logprobs_exact:  # bit-identical to this forward's: skip it
            exp.old_logprobs = exp.rollout_logprobs.clone()
        else:
            exp.old_logprobs = forward_logprobs(
                actor.model, exp, micro, packing, temperature, actor.precision, max_tokens,
                replay=run.rollout.moe_router_replay,
            )  # fmt: skip
        if self.parts.reference is not None:
            exp.ref_logprobs = self.parts.reference.logprobs(exp, micro, packing, temperature, max_tokens)
        if self.parts.critic is not None:
            exp.values = self.parts.critic.values(exp, micro, packing, max_tokens)
        return exp, stats

    def advantages(self, exp: Experience, stats: dict[str, float]) -> tuple[Experience, dict[str, float]]:
        """KL, baseline, reward clipping, returns and whitening (``tidal.experience.maker``); the
        rollout's and the experience's statistics, averaged over the ranks."""
        exp = add_advantages(exp, self.run.algorithm, self.n, self.kl_ctl.value, self.reduction)
        # Ranks hold equal shares, so the mean of their means is the batch mean.
        return exp, mean_over_world(stats | experience_stats(exp), self.world)

    def _old_logprobs_from_update(self, rows: int) -> bool:
        """The update is one on-policy optimizer step that will compute the old log-probs itself (a
        step within ``--freezing_actor_steps`` then logs no ``rollout/logprob_mismatch``)."""
        run = self.run
        step_size = run.train.train_batch_size // self.world.dp_size
        has_reference = self.parts.reference is not None
        return old_logprobs_from_update(run.train.max_epochs, rows, step_size, has_reference)

    def _dynamic_filter(self, exp, stats: dict):
        """Dynamic filtering without refilling (``--dynamic_filtering_no_refill``, or several processes;
        else ``trainers/ppo/sampling.py`` refills): drop groups whose mean score is outside the range; None
        if no rank kept any. With several processes every rank must run the same sharded forwards, so
        dropped samples stay in the batch with no action tokens: they add no loss and are not counted."""
        keep = dynamic_filter_mask(exp.scores, self.n, *self.run.algorithm.dynamic_filtering_reward_range)
        stats["dynamic_filter/kept"] = float(keep.float().mean())
        if all_reduce_sum(int(keep.sum()), self.world) == 0:
            return None
        if self.world.distributed:
            exp.action_mask = exp.action_mask * keep[:, None].to(exp.action_mask)
            return exp
        return exp.select(keep.nonzero().squeeze(-1).cpu())

    def update(self, exp: Experience, step: int) -> dict[str, float]:
        """PPO epochs for the critic and the policy (unless still frozen); adapts the KL coefficient. A
        critic on devices of its own trains during the policy's epochs; a local one trains first."""
        run, stats = self.run, {}
        generator = torch.Generator().manual_seed(run.train.seed * 7919 + step)
        shape = StepShape(
            step_size=run.train.train_batch_size // self.world.dp_size,
            micro_size=run.train.micro_train_batch_size,
            max_tokens=run.train.train_max_tokens_per_gpu if run.train.use_dynamic_batch else None,
            epochs=run.train.max_epochs,
            packing=run.train.packing_samples,
        )
        critic = self.parts.critic
        if critic is not None:
            critic.start_train(exp, shape, generator)
        if step >= run.algorithm.freezing_actor_steps:
            actor = self.parts.actor
            loss = PolicyLoss(
                run.algorithm, actor.precision, run.rollout.temperature, shape.packing, self.kl_ctl.value,
                aux_loss_coef=run.actor.aux_loss_coef, router_replay=run.rollout.moe_router_replay,
                engine_exact=self._engine_logprobs_exact,
            )  # fmt: skip
            ema_update = self.ema.update if self.ema is not None else None
            ptx = self._ptx_loss() if self.parts.ptx is not None else None
            stats |= train_on_experience(actor, exp, loss, shape, self.world, generator, ptx, ema_update)
            if loss.router_replay:
                force_routing(actor.model, None)  # the last backward is done: route normally again
        if critic is not None:
            stats = critic.finish_train() | stats  # the critic's keys first, as when it trained first
        if exp.kl is not None:
            kl = world_masked_mean(exp.kl, exp.action_mask, self.world)
            self.kl_ctl.update(kl, len(exp) * self.world.dp_size)
        skipped = self.parts.actor.guard.skipped + (critic.skipped_steps if critic is not None else 0)
        stats["nonfinite_steps"] = float(skipped)
        return stats

    def _ptx_loss(self) -> PtxLoss:
        """``--ptx_coef`` x the next-token loss of this rank's next pretraining micro-batch."""
        run, actor = self.run, self.parts.actor
        objective = SFTObjective(
            self.parts.tokenizer.pad_token_id, run.train.packing_samples, run.actor.aux_loss_coef
        )
        return PtxLoss(run.ptx.coef, self.parts.ptx, objective, actor.precision, self.world.device)

    def sync_weights(self, step: int) -> None:
        if step >= self.run.algorithm.freezing_actor_steps:
            self.parts.rollout.sync_weights(self.parts.actor.model)

    def after_step(self, loop: LoopState, stats: dict, logger: MetricsLogger, bar: ProgressBar) -> None:
        bar.update(1, reward=stats.get("reward"), loss=stats.get("policy/loss"), kl=stats.get("kl"))
        if self.run.logging.should_log(loop.global_step):
            logger.log(loop.global_step, stats)
        self.evaluation.after_step(loop, logger)  # eval/* at this step, then the best checkpoint
        self.checkpointer.maybe_save(loop)  # after the evaluation: it records the best so far

    # ---- checkpoints -------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.run.ckpt.save_path) / "run"

    @property
    def total_rollouts(self) -> int:
        return (len(self.prompts) // self.run.rollout.rollout_batch_size) * self.run.train.num_episodes

    def _trained_parts(self) -> dict:
        """The trained parts this rank's checkpoints shard: the policy, and the critic when it is here."""
        parts = {"policy": self.parts.actor}
        if self.parts.critic is not None:
            parts |= self.parts.critic.checkpoint_parts()
        return parts

    def _loop_state(self) -> dict[str, StateFns]:
        """What a checkpoint keeps besides the trained parts, under the names it has always had."""
        state = {
            "kl_coef": StateFns(lambda: self.kl_ctl.value, self._load_kl_coef),
            "moments": StateFns(lambda: asdict(self.moments) if self.moments else None, self._load_moments),
            "nonfinite": StateFns(self._guard_states, self._load_guard_states),
            "data": self.position,
            "sampling": self.sampling,
        }
        if self.ema is not None:
            state["ema"] = self.ema
        if self.parts.ptx is not None:
            state["ptx"] = self.parts.ptx
        if self.parts.critic is not None:
            state |= self.parts.critic.checkpoint_state()  # a critic with workers of its own saves there
        return state

    def _load_kl_coef(self, value: float) -> None:
        self.kl_ctl.value = value

    def _load_moments(self, saved: dict | None) -> None:
        if self.moments is not None and saved:
            self.moments = RunningMoments(**saved)

    def _guard_states(self) -> dict:
        return {name: p.guard.state_dict() for name, p in self._trained_parts().items()}

    def _load_guard_states(self, saved: dict) -> None:
        for name, part in self._trained_parts().items():
            part.guard.load_state_dict(saved.get(name, {}))

    def _hf_copy(self, folder: Path) -> None:
        """``--save_hf_ckpt``: the policy (its EMA with ``--enable_ema``) as a Hugging Face folder next
        to each checkpoint."""
        self._export_policy(folder)

    def _export_policy(self, path, final: bool = False) -> None:
        """The policy as a Hugging Face folder; with ``--enable_ema`` the averaged weights, as OpenRLHF.
        ``final``: rescued to a temporary folder, named in the error, when ``path`` has no room."""
        if self.ema is None:
            self.checkpointer.export(self.parts.actor.model, self.parts.tokenizer, path, final=final)
            return
        with self.ema.swapped_in():
            self.checkpointer.export(self.parts.actor.model, self.parts.tokenizer, path, final=final)

    def _resume(self) -> LoopState:
        """Continue from ``--ckpt_path`` (``--load_checkpoint``); the engine gets the restored weights."""
        loop = self.checkpointer.resume()
        if loop is None:
            return LoopState()
        saved = self.checkpointer.resumed_setting("rollout.rollout_batch_size")
        if self.position.samples != len(self.prompts):  # another dataset: the saved prompt ids mean nothing
            self.sampling.resumed = None
        if self.sampling.resumed is None:  # a checkpoint without the batch position (or another dataset)
            self._skip = resume_offset(
                self.position, loop, len(self.prompts), self._size, saved, "--rollout_batch_size"
            )
        self.parts.rollout.sync_weights(self.parts.actor.model)
        return loop

    def save_final(self) -> None:
        self._export_policy(self.run.ckpt.save_path, final=True)
        if self.parts.critic is not None and self.run.critic.save:
            critic_dir = Path(str(self.run.ckpt.save_path).rstrip("/") + "_critic")
            self.parts.critic.export(self.parts.tokenizer, critic_dir)

    # ---- helpers -----------------------------------------------------------------------------
    def _rollout_seed(self, step: int) -> int:
        return self.run.train.seed * 1_000_003 + step  # reproducible samples, also after a resume

    def _scoring_shape(self) -> tuple[int, bool, int | None]:
        """(samples per micro-batch, packing, token budget) for the no-grad scoring passes."""
        m = self.run.train
        max_tokens = (
            (m.rollout_max_tokens_per_gpu or m.train_max_tokens_per_gpu) if m.use_dynamic_batch else None
        )
        if self.world.distributed:  # sharded forwards must come in equal numbers on every rank
            max_tokens = None
        return self.run.rollout.micro_rollout_batch_size, self.run.train.packing_samples, max_tokens

    def _sleep_engine(self) -> None:
        if self.run.rollout.vllm_enable_sleep:
            self.parts.rollout.sleep()

    def _trainer_awake(self, awake: bool) -> None:
        """Hybrid engine: the engine sleeps while the trainer works, the trainer while the engine generates."""
        if awake:
            self._sleep_engine()
        if not self.run.placement.deepspeed_enable_sleep:
            return
        (reload_to_device if awake else offload_to_cpu)(self.parts.actor)
        if self.parts.critic is not None:
            self.parts.critic.set_awake(awake)


def rollout_stats(exp: Experience) -> dict[str, float]:
    lengths = exp.action_mask.sum(-1).float()
    return {
        "reward": float(exp.rewards.mean()),
        "score": float(exp.scores.mean()),
        "response_length": float(lengths.mean()),
        "total_length": float(exp.attention_mask.sum(-1).float().mean()),
    }


def experience_stats(exp: Experience) -> dict[str, float]:
    mask = exp.action_mask
    stats = {
        "advantages/mean": float(masked_mean(exp.advantages, mask)),
        "advantages/abs_mean": float(masked_mean(exp.advantages.abs(), mask)),
        "returns/mean": float(masked_mean(exp.returns, mask)),
    }
    if exp.old_logprobs is not None:  # else the update logs it (``old_logprobs_from_update``)
        stats[MISMATCH] = float(masked_mean((exp.old_logprobs - exp.rollout_logprobs).abs(), mask))
    if exp.kl is not None:
        stats["kl"] = float(masked_mean(exp.kl, mask))
    if exp.values is not None:
        stats["values/mean"] = float(masked_mean(exp.values, mask))
    return stats
