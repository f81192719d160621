"""Reinforcement-learning configs, one per component that reads them (``tidal.trainers.ppo.PPORun``
holds them): the rollout (engine and sampling; in ``tidal.config.rollout``, re-exported here), the algorithm (advantages, losses, KL, reward
shaping), rewards, the critic, agents, the frozen models' offload and the RL training schedule.

The seed's ``--vllm_*`` flags configure tidal's own rollout engine; the algorithm flags map onto
the pure functions in ``tidal.algorithms`` (the math: docs/algorithms.md). Fields named by their
component keep OpenRLHF's flag (``RewardConfig.pretrain`` is ``--reward_pretrain``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.config.args import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, UNIT, Checked, arg
from tidal.config.registries import (
    ADVANTAGE_ESTIMATOR_NAMES,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    KL_ESTIMATOR_NAMES,
    LOSS_AGGREGATION_NAMES,
    POLICY_LOSS_NAMES,
)
from tidal.config.rollout import (  # noqa: F401 (re-exported: the RL configs in one place)
    DEFAULT_GENERATE_MAX_LEN,
    DEFAULT_PROMPT_MAX_LEN,
    ROLLOUT_QUANTIZATIONS,
    RolloutConfig,
)
from tidal.config.training import TrainConfig

if TYPE_CHECKING:
    from tidal.algorithms.policy_loss import PolicyLossParams


def ratio_against_rollout() -> frozenset[str]:
    """``tidal.algorithms.correction.RATIO_AGAINST_ROLLOUT``, imported when a check needs it (it imports
    torch; building the default configs for ``--help`` does not)."""
    from tidal.algorithms.correction import RATIO_AGAINST_ROLLOUT

    return RATIO_AGAINST_ROLLOUT


@dataclass
class AlgorithmConfig(Checked):
    """RL algorithm: advantages, KL, policy/value losses and reward shaping (read by the experience
    path, ``tidal.experience.maker``, and the update, ``tidal.trainers.ppo.update``)."""

    advantage_estimator: str = arg("gae", help="advantage estimator", choices=ADVANTAGE_ESTIMATOR_NAMES)
    gamma: float = arg(1.0, help="discount factor", check=UNIT)
    lambd: float = arg(1.0, help="GAE lambda", check=UNIT)
    eps_clip: float = arg(0.2, help="PPO clip range (cispo: of its importance weight)", check=POSITIVE)
    eps_clip_low_high: tuple[float, float] | None = arg(
        None, help="separate PPO clip bounds (low high)", nargs=2, check=POSITIVE
    )
    dual_clip: float | None = arg(None, help="dual-clip constant c > 1 for negative advantages")
    policy_loss_type: str = arg(
        "ppo",
        help="ppo: token ratio; gspo: sequence ratio; cispo: clipped, detached importance weight times log π "
        "(MiniMax-M1); sapo: soft sigmoid gate instead of the clip (Qwen SAPO). docs/algorithms.md",
        choices=POLICY_LOSS_NAMES,
    )
    tau_pos: float | None = arg(
        None, help="SAPO gate temperature for positive advantages (unset: 1.0)", check=POSITIVE
    )
    tau_neg: float | None = arg(
        None, help="SAPO gate temperature for negative advantages (unset: 1.05)", check=POSITIVE
    )
    loss_agg_mode: str | None = arg(
        None,
        help="policy-loss mean over tokens or over sequences; unset: the loss's own, as in OpenRLHF (ppo "
        "token, gspo sequence). The KL-loss and entropy terms are token means in every mode",
        choices=LOSS_AGGREGATION_NAMES,
    )
    value_clip: float | None = arg(0.5, help="PPO value clip range", check=POSITIVE)
    entropy_loss_coef: float | None = arg(
        None, help="entropy bonus coefficient (0 only logs entropy)", check=NON_NEGATIVE
    )
    init_kl_coef: float = arg(
        0.01, help="KL coefficient β (0 disables the reference model)", check=NON_NEGATIVE
    )
    kl_estimator: str = arg("k1", help="KL estimator", choices=KL_ESTIMATOR_NAMES)
    use_kl_loss: bool = arg(False, help="put β·KL in the loss instead of the reward (GRPO)")
    kl_target: float | None = arg(None, help="target KL for the adaptive KL controller", check=POSITIVE)
    kl_horizon: int = arg(10000, help="horizon of the adaptive KL controller", check=AT_LEAST_ONE)
    reward_clip_range: tuple[float, float] = arg(
        (-10.0, 10.0), help="clip scalar rewards to [low, high]", nargs=2
    )
    enable_vllm_is_correction: bool = arg(
        False, help="correct rollout/trainer mismatch with importance weights (TIS)"
    )
    vllm_is_truncated_threshold: list[float] = arg(
        [0.5, 5.0], help="importance-weight bounds: LOW HIGH (or HIGH)", nargs="+", check=NON_NEGATIVE
    )
    use_icepop: bool = arg(False, help="ICEPOP: zero the loss of tokens whose weight is outside the bounds")
    dynamic_filtering: bool = arg(
        False,
        help="DAPO dynamic sampling: drop prompt groups whose mean score is not strictly inside "
        "--dynamic_filtering_reward_range and draw a new prompt for each until the batch is full",
    )
    dynamic_filtering_reward_range: tuple[float, float] = arg(
        (0.0, 1.0), help="keep groups with LOW < mean score < HIGH", nargs=2
    )
    dynamic_filtering_no_refill: bool = arg(
        False, help="--dynamic_filtering without refilling: train on the groups the filter left in the batch"
    )
    overlong_buffer_len: int | None = arg(
        None, help="DAPO overlong penalty buffer (tokens)", check=AT_LEAST_ONE
    )
    overlong_penalty_factor: float = arg(1.0, help="DAPO overlong penalty factor", check=NON_NEGATIVE)
    stop_properly_penalty_coef: float | None = arg(
        None,
        help="ProRL stop-properly penalty: the reward of a sample cut at --generate_max_len (finish reason "
        "'length') is multiplied by this coefficient in [0, 1] (unset: off)",
        check=UNIT,
    )
    no_advantage_std_norm: bool = arg(
        False,
        help="estimators that whiten advantages (gae, reinforce, reinforce_baseline) only subtract the "
        "batch mean, without dividing by the std",
    )
    freezing_actor_steps: int = arg(-1, help="train only the critic for this many steps")

    def problems(self, flags=None) -> list[str]:
        own = []
        if self.dual_clip is not None and self.dual_clip <= 1:
            own.append(f"--dual_clip must be > 1, got {self.dual_clip}")
        if not 1 <= len(self.vllm_is_truncated_threshold) <= 2:
            own.append("--vllm_is_truncated_threshold takes HIGH or LOW HIGH")
        if self.use_icepop and not self.enable_vllm_is_correction:
            own.append("--use_icepop needs --enable_vllm_is_correction")
        if self.use_icepop and self.policy_loss_type in ratio_against_rollout():  # docs/algorithms.md
            own.append("--use_icepop with --policy_loss_type gspo: GSPO corrects in its sequence ratio")
        own += self._loss_flag_problems()
        if self.no_advantage_std_norm and not self.estimator.whiten:
            own.append(
                f"--no_advantage_std_norm: --advantage_estimator {self.advantage_estimator} does not normalise "
                "advantages over the batch (only gae, reinforce and reinforce_baseline do)"
            )
        if self.gamma != 1.0 and not self.estimator.discounted:
            own.append(
                f"--gamma {self.gamma}: --advantage_estimator {self.advantage_estimator} is undiscounted"
            )
        for flag in ("reward_clip_range", "dynamic_filtering_reward_range", "vllm_is_truncated_threshold"):
            low_high = getattr(self, flag)
            if len(low_high) == 2 and not low_high[0] < low_high[1]:
                own.append(f"--{flag} needs LOW < HIGH, got {low_high[0]} {low_high[1]}")
        return super().problems(flags) + own

    def _loss_flag_problems(self) -> list[str]:
        """Flags that mean nothing to the chosen policy loss (docs/algorithms.md, "CISPO and SAPO")."""
        loss, own = self.policy_loss_type, []
        if self.dual_clip is not None and loss in ("cispo", "sapo"):
            own.append(
                f"--dual_clip with --policy_loss_type {loss}: it bounds the ppo/gspo clipped surrogate"
            )
        if loss != "sapo" and (self.tau_pos is not None or self.tau_neg is not None):
            own.append(
                f"--tau_pos/--tau_neg are SAPO's gate temperatures, not used by --policy_loss_type {loss}"
            )
        default_eps = type(self).__dataclass_fields__["eps_clip"].default
        if loss == "sapo" and (self.eps_clip_low_high is not None or self.eps_clip != default_eps):
            own.append(
                "--eps_clip/--eps_clip_low_high with --policy_loss_type sapo: SAPO has no clip (its gate "
                "is set by --tau_pos/--tau_neg)"
            )
        return own

    @property
    def estimator(self):
        """The registry entry of ``--advantage_estimator`` (``tidal.algorithms.advantages``): its facts."""
        from tidal.algorithms import ADVANTAGE_ESTIMATORS  # imports torch: not at --help

        return ADVANTAGE_ESTIMATORS[self.advantage_estimator]

    @property
    def loss_aggregation(self) -> str:
        """The policy loss's aggregation: ``--loss_agg_mode`` if given, else the loss's own default
        (``tidal.algorithms.policy_loss.DEFAULT_AGGREGATION``: ppo token, gspo sequence)."""
        from tidal.algorithms import loss_aggregation  # imports torch: not at --help

        return loss_aggregation(self.policy_loss_type, self.loss_agg_mode)

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """The clip ε (low, high) of the clipped losses (ppo, gspo, cispo); sapo has none."""
        return tuple(self.eps_clip_low_high) if self.eps_clip_low_high else (self.eps_clip, self.eps_clip)

    def policy_loss_params(self) -> PolicyLossParams:
        """The chosen policy loss's own parameters (``tidal.algorithms.policy_loss``): ``SapoParams``
        (the gate temperatures, the paper's where unset) for sapo, else ``ClipParams`` (the clip
        bounds and the dual clip)."""
        from tidal.algorithms.policy_loss import ClipParams, SapoParams  # imports torch: not at --help

        if self.policy_loss_type == "sapo":
            unset = SapoParams()
            return SapoParams(self.tau_pos or unset.tau_pos, self.tau_neg or unset.tau_neg)
        return ClipParams(*self.clip_bounds, dual_clip=self.dual_clip)

    @property
    def is_bounds(self) -> tuple[float, float]:
        t = self.vllm_is_truncated_threshold
        return (t[0], t[1]) if len(t) == 2 else (0.0, t[0])

    @property
    def needs_reference(self) -> bool:
        return self.init_kl_coef > 0

    @property
    def needs_critic(self) -> bool:
        return self.estimator.needs_critic

    @property
    def needs_groups(self) -> bool:
        """The estimator's baseline compares samples of one prompt (n >= 2)."""
        return self.estimator.grouped


@dataclass
class RewardConfig(Checked):
    """Rewards: reward models, or reward functions/servers, and reward normalisation."""

    pretrain: str | None = arg(
        None, flag="reward_pretrain", help="reward model(s), comma-separated; their scores are summed"
    )
    remote_url: str | None = arg(
        None, flag="remote_rm_url", help="reward_func.py file, or comma-separated HTTP reward-server URLs"
    )
    # OpenRLHF waits 180 s per request and tries 6 times (~18 min on a server that accepts and never
    # answers); tidal's shorter defaults (tidal.rewards.remote) fail such a run in ~3 min.
    timeout: float = arg(
        DEFAULT_TIMEOUT,
        flag="remote_rm_timeout",
        help="seconds a reward-server request may wait for each read before it is retried",
        check=POSITIVE,
    )
    retries: int = arg(
        DEFAULT_RETRIES,
        flag="remote_rm_retries",
        help="retries of a failed reward-server request (timeouts, resets, 429/5xx)",
        check=NON_NEGATIVE,
    )
    teacher_model: str | None = arg(
        None,
        help="on-policy distillation: this model (the policy's tokenizer) takes the reference's place, so "
        "the per-token KL penalty beta*(log p_policy - log p_teacher) on the policy's own samples is the "
        "distillation signal; needs --init_kl_coef > 0 (docs/recipes.md)",
        metavar="PATH",
    )
    normalize: bool = arg(
        False,
        flag="normalize_reward",
        help="normalise rewards: reward models with their stored mean/std, reward functions with running "
        "mean/std",
    )

    def problems(self, flags=None) -> list[str]:
        own = (
            ["use either --remote_rm_url or --reward_pretrain, not both"]
            if self.remote_url and self.pretrain
            else []
        )
        return super().problems(flags) + own


@dataclass
class CriticConfig(Checked):
    """Critic (value model) of PPO with GAE: where it starts and whether it is saved."""

    pretrain: str | None = arg(
        None,
        flag="critic_pretrain",
        help="critic initialisation (default: first reward model, else --pretrain)",
    )
    value_head_prefix: str = arg(
        "score", help="attribute name of the value head in the critic and the reward models"
    )
    save: bool = arg(False, flag="save_value_network", help="also save the critic as a HF folder")


@dataclass
class AgentConfig(Checked):
    """Agents: multi-turn rollouts driven by a user's AgentExecutor."""

    func_path: str | None = arg(
        None, flag="agent_func_path", help="agent_func.py with an AgentExecutor class (multi-turn)"
    )
    endpoint: str | None = arg(
        None,
        flag="agent_endpoint",
        help="file defining agent(base_url, prompt, label) -> reward: any OpenAI-API client code against "
        "the live policy; each episode's requests are trained token-in-token-out (docs/recipes.md)",
        metavar="PATH",
    )

    def problems(self, flags=None) -> list[str]:
        own = (
            [
                "use either --agent_func_path (an AgentExecutor) or --agent_endpoint (an agent function), not both"
            ]
            if self.func_path and self.endpoint
            else []
        )
        return super().problems(flags) + own


@dataclass
class FrozenModelsConfig(Checked):
    """The frozen models of an RL run (reference and reward models) that share the policy's device."""

    offload: bool = arg(
        False, flag="ref_reward_offload", help="keep reference and reward models on the CPU between uses"
    )


@dataclass
class EMAConfig(Checked):
    """An EMA of the policy's weights, updated after each optimizer step and saved as the run's model.

    ``--enable_ema`` / ``--ema_beta`` as in OpenRLHF v0.9.2 (``tidal.trainers.ppo.ema``)."""

    enable: bool = arg(
        False,
        flag="enable_ema",
        help="keep an EMA of the policy's weights; --save_path (and --save_hf_ckpt copies) get the EMA model",
    )
    beta: float = arg(
        0.992, flag="ema_beta", help="EMA decay: ema = beta * ema + (1 - beta) * weights", check=UNIT
    )


@dataclass
class PtxConfig(Checked):
    """A next-token loss on --pretrain_data texts, weighted by --ptx_coef, added to the policy update.

    InstructGPT's PPO-ptx, as OpenRLHF <= v0.7 computed it (``tidal.trainers.ppo.ptx``)."""

    coef: float = arg(
        0.05,
        flag="ptx_coef",
        help="weight of the pretraining loss in the policy update (needs --pretrain_data; without it "
        "there is no ptx loss, as in OpenRLHF v0.9.2)",
        check=NON_NEGATIVE,
    )
    data: str | None = arg(
        None,
        flag="pretrain_data",
        help="pretraining text dataset(s) for the ptx loss: its --input_key column, every token trained",
        metavar="DATASET",
    )
    data_probs: str | None = arg(
        None, flag="pretrain_data_probs", help="blend weights for the pretraining datasets"
    )
    split: str = arg("train", flag="pretrain_split", help="split of the pretraining dataset")

    @property
    def enabled(self) -> bool:
        return bool(self.data) and self.coef > 0


@dataclass
class RLTrainConfig(TrainConfig):
    """Training loop: episodes over the prompts, batch sizes, epochs per rollout, dynamic batching."""

    num_episodes: int = arg(1, help="passes over the prompt dataset", check=AT_LEAST_ONE)
    use_dynamic_batch: bool = arg(False, help="micro-batches by token budget instead of sample count")
    train_max_tokens_per_gpu: int = arg(
        16192, help="token budget of a training micro-batch with --use_dynamic_batch", check=AT_LEAST_ONE
    )
    rollout_max_tokens_per_gpu: int | None = arg(
        None, help="token budget of a scoring micro-batch (default: train's)", check=AT_LEAST_ONE
    )
