"""``PPORun``: every component config of an RL run, grouped by the component that reads it, its
defaults (``tidal ppo``'s), and the checks that span several configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidal.config import (
    CheckpointConfig,
    DistributedConfig,
    ModelConfig,
    OptimConfig,
    PromptDataConfig,
)
from tidal.config.checkpoint import BestCheckpointConfig, best_key_problems
from tidal.config.data import VisionConfig
from tidal.config.logging import LoggingConfig
from tidal.config.placement import (
    PlacementConfig,
    placement_problems,
    separate_engines,
    separate_reference,
    separate_reward,
)
from tidal.config.rl import (
    AgentConfig,
    AlgorithmConfig,
    CriticConfig,
    EMAConfig,
    FrozenModelsConfig,
    PtxConfig,
    RewardConfig,
    RLTrainConfig,
    RolloutConfig,
)
from tidal.config.run import RunConfig, config_field


def ppo_train() -> RLTrainConfig:
    """OpenRLHF's train_ppo_ray defaults: micro-batches of 4 samples (128 per optimizer step)."""
    return RLTrainConfig(train_batch_size=128, micro_train_batch_size=4)


@dataclass(kw_only=True)
class PPORun(RunConfig):
    """An RL run. Only the policy (``actor``) and the prompts (``data``) have required flags; every
    other config has the defaults of ``tidal ppo``. The actor's and critic's optimizers share every
    optimizer flag except their learning rates (``--actor_learning_rate``, ``--critic_learning_rate``)."""

    actor: ModelConfig = config_field()  # the policy; reference, critic and reward models copy its precision
    data: PromptDataConfig = config_field()
    rollout: RolloutConfig = config_field(RolloutConfig)
    algorithm: AlgorithmConfig = config_field(AlgorithmConfig)
    reward: RewardConfig = config_field(RewardConfig)
    critic: CriticConfig = config_field(CriticConfig)
    agent: AgentConfig = config_field(AgentConfig)
    frozen: FrozenModelsConfig = config_field(FrozenModelsConfig)
    train: RLTrainConfig = config_field(ppo_train)
    ema: EMAConfig = config_field(EMAConfig)
    ptx: PtxConfig = config_field(PtxConfig)
    actor_optim: OptimConfig = config_field(
        lambda: OptimConfig(learning_rate=1e-6), flags={"learning_rate": "actor_learning_rate"}
    )
    critic_optim: OptimConfig = config_field(
        lambda: OptimConfig(learning_rate=9e-6), flags={"learning_rate": "critic_learning_rate"}
    )
    ckpt: CheckpointConfig = config_field(lambda: CheckpointConfig(ckpt_path="./ckpt/checkpoints_ppo"))
    best: BestCheckpointConfig = config_field(BestCheckpointConfig)
    logging: LoggingConfig = config_field(LoggingConfig)
    dist: DistributedConfig = config_field(DistributedConfig)
    placement: PlacementConfig = config_field(PlacementConfig)
    vision: VisionConfig = config_field(VisionConfig)

    def cross_problems(self, world: Any = None) -> list[str]:
        a, r, p, n = self.algorithm, self.rollout, self.placement, self.rollout.n_samples_per_prompt
        problems = []
        if a.needs_groups and n < 2:
            problems.append(
                f"--advantage_estimator {a.advantage_estimator} compares samples of a prompt: "
                "set --n_samples_per_prompt >= 2"
            )
        if a.dynamic_filtering and n < 2:
            problems.append("--dynamic_filtering needs --n_samples_per_prompt >= 2")
        problems += staleness_problems(r.rollout_batch_size, r.vllm_generate_batch_size, p)
        evaluates = bool(self.data.eval_dataset) and self.train.eval_steps > 0
        problems += best_key_problems(self.best.best_metric_key, evaluates, self.ckpt.disable_ds_ckpt,
                                      self.ckpt.save_hf_ckpt)  # fmt: skip
        problems += partial_rollout_problems(self)
        if (r.vllm_generate_batch_size or 0) > r.rollout_batch_size and not p.async_train:  # as OpenRLHF
            problems.append(
                f"--vllm_generate_batch_size {r.vllm_generate_batch_size} > --rollout_batch_size "
                f"{r.rollout_batch_size} over-samples (the extra groups train at later steps): add --async_train"
            )
        # --use_kl_loss with --init_kl_coef 0 is a KL loss of 0 and no reference model, as OpenRLHF
        # (v0.11.0's VLM example passes --algo.kl.use_loss --algo.kl.init_coef 0)
        if self.reward.teacher_model and a.init_kl_coef <= 0:
            problems.append("--teacher_model distils through the KL penalty: set --init_kl_coef > 0 (e.g. 1)")
        problems += teacher_placement_problems(self.reward.teacher_model, p)
        if p.async_train and r.vllm_enable_sleep:  # OpenRLHF asserts the same (not supported)
            problems.append(
                "--async_train generates while training, so the engine never sleeps: drop --vllm_enable_sleep "
                "(--deepspeed_enable_sleep still offloads the trained models between their updates)"
            )
        problems += placement_problems(
            p, r.vllm_num_engines, r.vllm_tensor_parallel_size,
            a.needs_reference, a.needs_critic, bool(self.reward.pretrain),
        )  # fmt: skip
        if separate_engines(p, r.vllm_num_engines) and r.vllm_enable_sleep and not p.async_train:
            problems.append(
                "--vllm_enable_sleep frees a colocated engine's memory for the trainer, but --vllm_num_engines "
                "without --colocate_all_models puts the engines on devices of their own: drop it, or pass "
                "--colocate_all_models"
            )
        colocated = (a.needs_reference and not separate_reference(p)) or (
            bool(self.reward.pretrain) and not separate_reward(p)
        )
        if self.frozen.offload and not colocated:
            problems.append(
                "--ref_reward_offload keeps a reference or reward model that shares the policy's device in host "
                "memory between uses, but this run has none (no --init_kl_coef > 0 / --reward_pretrain, or "
                "they run on devices of their own)"
            )
        if self.ptx.data and self.ptx.coef <= 0:
            problems.append("--pretrain_data is only read for the ptx loss: set --ptx_coef > 0, or drop it")
        problems += self.image_problems()
        samples = r.rollout_batch_size * n
        if self.train.train_batch_size > samples:
            problems.append(
                f"--train_batch_size {self.train.train_batch_size} exceeds the samples of one rollout "
                f"(--rollout_batch_size x --n_samples_per_prompt = {samples})"
            )
        return problems

    def image_problems(self) -> list[str]:
        """What RL with images (``--max_images_per_prompt`` > 0) does not support yet, one line each. A GAE
        critic (a vision-language value model on the same image inputs, tidal.models.vision_value), engines
        on devices of their own (images sent with the prompts, tidal.experience.images) and --agent_func_path
        agents (episodes start from their prompt's images, tidal.agents.images) are supported."""
        n = self.vision.max_images_per_prompt
        if n == 0:
            return []
        flag, problems = f"--max_images_per_prompt {n}", []
        if self.agent.endpoint:  # --agent_func_path episodes start from their prompts' images (tidal.agents)
            problems.append(f"{flag}: --agent_endpoint episodes take text only (their requests are rebuilt "
                            "from recorded ids, without pixels); use --agent_func_path")  # fmt: skip
        if self.reward.pretrain:
            problems.append(f"{flag}: reward models score text; score image prompts with --remote_rm_url "
                            "or a reward function")  # fmt: skip
        return problems

    @property
    def critic_source(self) -> str:
        """OpenRLHF's default: the critic starts from the first reward model, else the policy."""
        if self.critic.pretrain:
            return self.critic.pretrain
        if self.reward.pretrain:
            return self.reward.pretrain.split(",")[0]
        return self.actor.pretrain


def teacher_placement_problems(teacher_model: str | None, p: PlacementConfig) -> list[str]:
    """The teacher takes the reference's place, so ``--teacher_num_*`` size it instead of ``--ref_num_*``:
    they need a teacher, and one pair of sizes (``PlacementConfig.flag_prefix``)."""
    teacher_sized = p.teacher_num_nodes is not None or p.teacher_num_gpus_per_node is not None
    ref_sized = p.ref_num_nodes is not None or p.ref_num_gpus_per_node is not None
    if teacher_sized and not teacher_model:
        return ["--teacher_num_nodes/--teacher_num_gpus_per_node place the --teacher_model teacher: pass "
                "--teacher_model, or size the reference with --ref_num_nodes/--ref_num_gpus_per_node"]  # fmt: skip
    if teacher_sized and ref_sized:
        return ["--teacher_num_nodes/--teacher_num_gpus_per_node with --ref_num_nodes/--ref_num_gpus_per_node: "
                "the teacher takes the reference's place (there is no other reference), so size it with one "
                "pair of flags"]  # fmt: skip
    return []


def staleness_problems(batch: int, generate: int | None, p: PlacementConfig) -> list[str]:
    """``--max_staleness`` needs ``--async_train``, and room for one generation call's groups: a call of G
    prompts fills batches up to ``spread`` steps after its first (trainers/ppo/sampling.py)."""
    if p.max_staleness is None:
        return []
    if not p.async_train:
        return ["--max_staleness bounds how far --async_train generates ahead: add --async_train"]
    g = generate or batch
    spread = (g - 1) // batch if g % batch == 0 else (g + batch - 2) // batch
    if p.max_staleness < spread:
        return [
            f"--max_staleness {p.max_staleness}: one generation call of --vllm_generate_batch_size {g} prompts "
            f"fills batches up to {spread} step(s) after its first; set --max_staleness >= {spread}"
        ]
    return []


def partial_rollout_problems(run: PPORun) -> list[str]:
    """What ``--partial_rollout_enable`` needs: ``--async_train`` and the local engine's single-turn text
    rollout (tidal.placement.partial)."""
    if not run.rollout.partial_rollout_enable:
        return []
    p, why = run.placement, []
    if not p.async_train:
        why.append("--async_train (updates interrupt the rollout generated on the background thread)")
    if separate_engines(p, run.rollout.vllm_num_engines):
        why.append("the engine on the trainer's device (not --vllm_num_engines engines of their own)")
    if run.agent.func_path or run.agent.endpoint:
        why.append("single-turn rollouts (not --agent_func_path / --agent_endpoint)")
    if run.vision.max_images_per_prompt > 0:
        why.append("text prompts (not --max_images_per_prompt)")
    return [f"--partial_rollout_enable needs {w}" for w in why]
