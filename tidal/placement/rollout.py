"""The rollout role: the engine generates, agents act, weights sync back.

A ``Rollout`` turns a batch of prompts into trajectories (token ids, the engine's log-probs, agents'
rewards when they give them): an engine and the agent executor make them. Scoring and packing them
into an ``Experience`` is the experience path's (``tidal.experience.scoring``). ``LocalRollout``
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
from tidal.agents.endpoint import EndpointAgentExecutor
from tidal.config.args import ConfigError
from tidal.config.engine import rollout_engine_config
from tidal.config.rl import AgentConfig, RolloutConfig
from tidal.data.prompts import PromptSample
from tidal.distributed.weight_sync import engine_weights
from tidal.experience.images import ImagePromptEngine, attach_trajectory_images, rollout_images
from tidal.models.vision import language_weights
from tidal.placement.partial import PartialUpdates, token_updates
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
    """Prompts in, trajectories out. Subclasses say where trajectories come from (``trajectories``) and
    how weights reach their engines (``sync_weights``)."""

    def __init__(self, tokenizer, cfg: RolloutConfig, pad_id: int):
        self.lock = threading.Lock()  # generation (maybe on a background thread) and weight sync take turns
        self.cfg, self.tokenizer, self.pad_id = cfg, tokenizer, pad_id

    def sampling_params(self, n: int, temperature: float, seed: int) -> SamplingParams:
        c = self.cfg
        return SamplingParams(n=n, temperature=temperature, top_p=c.top_p, top_k=c.top_k,
                              max_new_tokens=c.generate_max_len, seed=seed)  # fmt: skip

    def generate(
        self, prompts: Sequence[PromptSample], n: int, temperature: float, seed: int, first_index: int = 0
    ) -> list[Trajectory]:
        """``n`` trajectories per prompt (prompt-major).

        ``first_index``: where ``prompts`` start in the whole rollout (a data-parallel share); sample
        seeds follow the global index."""
        params = self.sampling_params(n, temperature, seed)
        with self.lock:
            return self.trajectories(prompts, params, first_index)

    def trajectories(self, prompts: Sequence[PromptSample], params: SamplingParams, first_index: int):
        raise NotImplementedError

    def close(self) -> None:
        """Release workers outside this process (in ``RemoteRollout``, the engines)."""


def colocated_tp_group(cfg: RolloutConfig, device: torch.device):
    """With several training processes and --vllm_tensor_parallel_size N, the engine spans N consecutive
    processes (their devices): this process's group (``tp_worker.colocated_group``); else None."""
    import torch.distributed as dist

    if cfg.vllm_tensor_parallel_size == 1 or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from tidal.rollout.runner.tp_worker import colocated_group

    return colocated_group(cfg.vllm_tensor_parallel_size, device)


class LocalRollout(Rollout):
    """Generation on the trainer's own device (the hybrid engine: it sleeps while the trainer trains
    when ``--vllm_enable_sleep`` is set)."""

    def __init__(
        self,
        model_path: str,
        tokenizer,
        cfg: RolloutConfig,
        agent: AgentConfig,
        device: torch.device,
        pad_id: int,
        apply_chat_template: bool,
        seed: int,
    ):
        check_sync_flags(cfg, device)
        super().__init__(tokenizer, cfg, pad_id)
        config = rollout_engine_config(cfg, str(device), seed)
        self.engine = make_engine(model_path, config, tp_group=colocated_tp_group(cfg, device))
        self.engine.progress_label = "generation"  # requests done and tokens/s, logged as they go
        self.executor = build_executor(agent, apply_chat_template)
        # --partial_rollout_enable: weight updates land between the engine's steps (tidal.placement.partial)
        self.partial = PartialUpdates(self.engine, self._load) if cfg.partial_rollout_enable else None
        if self.partial is not None:
            partial_engine_check(self.engine)

    def trajectories(self, prompts: Sequence[PromptSample], params: SamplingParams, first_index: int):
        # first_index is passed on only when set, for executors overriding ``run`` without it
        offset = {"first_index": first_index} if first_index else {}
        if self.engine.is_sleeping:
            self.engine.wake_up()
        # prompts with images: the engine gets each prompt's pixels with it (tidal.experience.images)
        images = rollout_images([p.images for p in prompts], getattr(self.engine, "image_processor", None))
        engine = self.engine if images is None else ImagePromptEngine(self.engine, images)

        # an engine spanning several training processes generates each one's share in turn
        def run() -> list[Trajectory]:
            return self.engine.take_turns(lambda: self.executor.run(
                engine, self.tokenizer, [p.prompt for p in prompts], [p.label for p in prompts], params,
                self.cfg.total_len, **offset,
            ))  # fmt: skip

        if self.partial is None:
            trajectories = run()
        else:  # one engine.generate, prompt-major: trajectory i is request i // n, sample i % n
            trajectories, boundaries = self.partial.generate(run)
            for i, t in enumerate(trajectories):
                updates = token_updates(
                    boundaries.get(divmod(i, params.n), []), len(t.token_ids) - t.prompt_len
                )
                t.weight_updates = [0] * t.prompt_len + updates
        if images is not None:
            attach_trajectory_images(trajectories, images, params.n)
        return trajectories

    def sync_weights(self, policy: nn.Module) -> int:
        """Copy the policy's weights into the engine (in place, same device); with partial rollouts between
        two steps of the rollout being generated, if one is."""
        if self.partial is not None:
            return self.partial.sync(policy)
        with self.lock:
            return self._load(policy)

    def _load(self, policy: nn.Module) -> int:
        with engine_weights(policy) as named:
            return self.engine.update_weights(language_weights(policy, named))

    def sleep(self) -> None:
        with self.lock:
            self.engine.sleep()


def partial_engine_check(engine) -> None:
    """Partial rollouts need tidal's native engine (one process: ``check_data_parallel``)."""
    if not hasattr(engine, "between_steps"):
        raise ConfigError("--partial_rollout_enable: the transformers fallback engine has no step hook; "
                          "use a model family native to tidal's engine")  # fmt: skip
