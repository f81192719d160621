"""The rollout role: the engine generates, agents act, rewards score, weights sync back.

A ``Rollout`` turns a batch of prompts into an ``Experience`` with scalar rewards: an engine and
the agent executor make trajectories, and rewards score them here, with the trainer. ``LocalRollout``
owns tidal's ``LLMEngine`` on the trainer's device; ``RemoteRollout`` (``remote_rollout.py``) drives
engines on devices of their own; ``DataParallelRollout`` (``data_parallel.py``) gives a data-parallel
rank its share of either. All three are a ``tidal.placement.protocols.RolloutRole``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import nn

from tidal.agents import AgentExecutorBase, SingleTurnAgentExecutor, Trajectory, load_agent_executor
from tidal.agents.base import rollout_logs
from tidal.agents.endpoint import EndpointAgentExecutor
from tidal.config.args import ConfigError
from tidal.config.engine import rollout_engine_config
from tidal.config.rl import AgentConfig, RewardConfig, RolloutConfig
from tidal.data.prompts import PromptSample
from tidal.distributed.weight_sync import engine_weights
from tidal.experience.experience import Experience
from tidal.experience.maker import from_trajectories
from tidal.placement.protocols import RewardRole
from tidal.rewards import RewardResult, load_reward_source
from tidal.rollout import SamplingParams, make_engine


def build_executor(agent: AgentConfig, apply_chat_template: bool) -> AgentExecutorBase:
    if agent.endpoint:  # the agent function renders its own requests from the dataset's prompt text
        executor = EndpointAgentExecutor.from_file(agent.endpoint)
    elif agent.func_path:
        executor = load_agent_executor(agent.func_path)
    else:
        executor = SingleTurnAgentExecutor()
    # Chat-rendered prompts already carry the template's special tokens (see tidal.data.templates).
    executor.add_special_tokens = not apply_chat_template
    return executor


def check_sync_flags(cfg: RolloutConfig, device: torch.device) -> None:
    """Weights travel over torch process groups (NCCL on CUDA, gloo on the CPU), never through Ray."""
    if cfg.vllm_sync_with_ray:
        raise ConfigError(
            "--vllm_sync_with_ray: weights travel over torch process groups (the training group, or a "
            "trainer's group with its separate engines), not through Ray's object store"
        )
    if device.type == "cuda" and cfg.vllm_sync_backend == "gloo":
        raise ConfigError("--vllm_sync_backend gloo: on CUDA weights travel over NCCL; use nccl")


class Rollout:
    """Prompts in, an ``Experience`` with rewards out. Subclasses say where trajectories come from
    (``trajectories``) and how weights reach their engines (``sync_weights``)."""

    def __init__(
        self,
        tokenizer,
        cfg: RolloutConfig,
        reward: RewardConfig,
        agent: AgentConfig,
        pad_id: int,
        reward_models: RewardRole | None = None,
    ):
        self.lock = threading.Lock()  # generation (maybe on a background thread) and weight sync take turns
        self.cfg, self.tokenizer, self.pad_id = cfg, tokenizer, pad_id
        self.reward_source = (
            load_reward_source(reward.remote_url, timeout=reward.timeout, max_retries=reward.retries)
            if reward.remote_url
            else None
        )
        self.reward_models = reward_models
        # on-policy distillation may run on the teacher's signal alone (scalar rewards 0)
        self.distilling = bool(reward.teacher_model)
        if not (agent.func_path or agent.endpoint or self.reward_source or reward_models or self.distilling):
            raise ConfigError(
                "RL needs rewards: pass --remote_rm_url, --reward_pretrain, --agent_func_path, --agent_endpoint "
                "or --teacher_model"
            )

    def sampling_params(self, n: int, temperature: float, seed: int) -> SamplingParams:
        c = self.cfg
        return SamplingParams(n=n, temperature=temperature, top_p=c.top_p, top_k=c.top_k,
                              max_new_tokens=c.generate_max_len, seed=seed)  # fmt: skip

    def generate(
        self, prompts: Sequence[PromptSample], n: int, temperature: float, seed: int, first_index: int = 0
    ) -> tuple[list[Trajectory], Experience, dict[str, float]]:
        """Trajectories (prompt-major) and their Experience with rewards, scores and reward logs.

        ``first_index``: where ``prompts`` start in the whole rollout (a data-parallel share); sample
        seeds follow the global index."""
        params = self.sampling_params(n, temperature, seed)
        with self.lock:
            trajectories = self.trajectories(prompts, params, first_index)
        exp = from_trajectories(trajectories, self.pad_id)
        result = self.score(trajectories, exp, n, prompts)
        exp.rewards, exp.scores = result.rewards.float(), result.scores.float()
        # agents' own logs and failed-episode counts (agent/errors) join the reward's logs
        return trajectories, exp, result.extra_logs | rollout_logs(trajectories)

    def trajectories(self, prompts: Sequence[PromptSample], params: SamplingParams, first_index: int):
        raise NotImplementedError

    def score(self, trajectories: list[Trajectory], exp: Experience, n: int, prompts) -> RewardResult:
        if all(t.reward is not None for t in trajectories):  # agents already rewarded every sample
            return RewardResult(rewards=exp.rewards, scores=exp.scores)
        if self.reward_models is not None:
            return self.reward_models(exp)
        if self.distilling and self.reward_source is None:  # the KL to the teacher is the only signal
            return RewardResult(rewards=torch.zeros(len(trajectories)))
        queries = [t.prompt + t.response_text for t in trajectories]
        labels = [p.label for p in prompts for _ in range(n)]
        return self.reward_source(queries, [t.prompt for t in trajectories], labels)

    def close(self) -> None:
        """Release workers outside this process: reward models on devices of their own (and, in
        ``RemoteRollout``, the engines)."""
        if self.reward_models is not None:
            self.reward_models.close()


def colocated_tp_group(cfg: RolloutConfig, device: torch.device):
    """With several training processes and --vllm_tensor_parallel_size N, the engine spans N consecutive
    processes (their devices): this process's group (``tp_worker.colocated_group``); else None."""
    import torch.distributed as dist

    if cfg.vllm_tensor_parallel_size == 1 or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from tidal.rollout.tp_worker import colocated_group

    return colocated_group(cfg.vllm_tensor_parallel_size, device)


class LocalRollout(Rollout):
    """Generation on the trainer's own device (the hybrid engine: it sleeps while the trainer trains
    when ``--vllm_enable_sleep`` is set)."""

    def __init__(
        self,
        model_path: str,
        tokenizer,
        cfg: RolloutConfig,
        reward: RewardConfig,
        agent: AgentConfig,
        device: torch.device,
        pad_id: int,
        apply_chat_template: bool,
        seed: int,
        reward_models: RewardRole | None = None,
    ):
        check_sync_flags(cfg, device)
        super().__init__(tokenizer, cfg, reward, agent, pad_id, reward_models)
        config = rollout_engine_config(cfg, str(device), seed)
        self.engine = make_engine(model_path, config, tp_group=colocated_tp_group(cfg, device))
        self.executor = build_executor(agent, apply_chat_template)

    def trajectories(self, prompts: Sequence[PromptSample], params: SamplingParams, first_index: int):
        # first_index is passed on only when set, for executors overriding ``run`` without it
        offset = {"first_index": first_index} if first_index else {}
        if self.engine.is_sleeping:
            self.engine.wake_up()
        # an engine spanning several training processes generates each one's share in turn
        return self.engine.take_turns(lambda: self.executor.run(
            self.engine, self.tokenizer, [p.prompt for p in prompts], [p.label for p in prompts], params,
            self.cfg.total_len, **offset,
        ))  # fmt: skip

    def sync_weights(self, policy: nn.Module) -> int:
        """Copy the policy's weights into the engine (in place, same device)."""
        with self.lock, engine_weights(policy) as named:
            return self.engine.update_weights(named)

    def sleep(self) -> None:
        with self.lock:
            self.engine.sleep()
