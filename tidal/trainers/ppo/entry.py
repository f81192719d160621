"""``run_ppo``: the entry point of an RL run — where its ranks run, then each rank's setup and loop.

``run_ppo`` makes the one placement decision of the run: more than one policy worker and no launcher
means Ray (``tidal.placement.ray_launch`` starts the ranks as actors and calls ``train_rank`` in
each); otherwise this process is the whole run (local mode) or one of torchrun's ranks. Every rank
then runs ``train``: check the models and prompts before anything loads, build the trained parts
(policy, critic: FSDP2-sharded over the ranks) and ask ``tidal.placement`` for the other roles
(rollout, reference) here or on devices of their own, and run ``PPOTrainer``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from tidal.config import ConfigError
from tidal.config.engine import rollout_engine_config
from tidal.config.placement import (
    local_engine_gpu_problem,
    local_engine_overlap_problem,
    separate_critic,
    separate_engines,
)
from tidal.config.ppo import PPORun
from tidal.config.rl import ratio_against_rollout
from tidal.data import SFTDataConfig, build_prompt_samples, load_dataset_spec
from tidal.distributed import World, init_world
from tidal.distributed.mesh import ring_group, ring_layout_problems
from tidal.distributed.tensor_parallel import model_layout_problems, with_tensor_parallel
from tidal.experience.images import image_prompts
from tidal.experience.scoring import RewardScorer
from tidal.logging import get_logger
from tidal.models import load_causal_lm, load_tokenizer
from tidal.models.loading import check_model_folder, model_load_error
from tidal.models.ring_attention import use_ring
from tidal.models.vision import freeze_vision
from tidal.models.vision_value import critic_image_problem
from tidal.placement.build import build_roles, critic_ray_problem, log_placement
from tidal.placement.data_parallel import check_data_parallel
from tidal.placement.ray_launch import run_on_ray, wants_ray
from tidal.rollout.batch_invariant import exact_problem
from tidal.rollout.engine.hf_engine import fallback_problem
from tidal.rollout.models.loader import context_prefill_problem, tp_layout_problem
from tidal.rollout.models.registry import FAMILIES, VISION_FAMILIES, feature_refusal
from tidal.rollout.quant.linear import registry_family_problem
from tidal.trainers.common import seed_everything
from tidal.trainers.optimization import Optimization, build_optimization
from tidal.trainers.ppo.critic import build_critic
from tidal.trainers.ppo.memory_check import check_memory
from tidal.trainers.ppo.ptx import PtxStream
from tidal.trainers.ppo.trainer import PPOParts, PPOTrainer
from tidal.trainers.ppo.update import StepShape, ValueLoss, train_on_experience
from tidal.trainers.sft import load_sft_samples

log = get_logger(__name__)


def run_ppo(run: PPORun, world: World | None = None) -> list[dict]:
    """Train a policy with RL as configured; returns per-rollout metrics (rank 0's in Ray mode)."""
    check_models_before_loading(run)
    if world is None and wants_ray(run):
        if problem := critic_ray_problem(run):
            raise ConfigError(problem)
        return run_on_ray(run, train_rank)
    return train(run, world or init_world())


def train_rank(run: PPORun, ray_actors: dict) -> list[dict]:
    """One rank of a Ray run, in its actor (torchrun's environment set); ``ray_actors``: this rank's
    separate workers per role, placed by the driver."""
    check_models_before_loading(run)  # on this rank's node
    return train(run, init_world(), ray_actors)


def train(run: PPORun, world: World, ray_actors: dict | None = None) -> list[dict]:
    """This rank's part of the run: prompts, parts, the loop."""
    ring = ring_for(run, world)  # one-line errors before anything loads; this rank's ring group or None
    world = with_tensor_parallel(world, run.dist.ds_tensor_parallel_size)
    check_tensor_parallel(run, world)
    # the device must hold the run (one line naming the flag that makes it fit, not an OOM minutes later)
    check_memory(run, AutoConfig.from_pretrained(run.actor.pretrain), world.device, world.dp_size)
    seed_everything(run.train)
    tokenizer = load_tokenizer(run.actor.pretrain, run.actor)
    d = run.data
    prompts = load_prompts(run, tokenizer, d.prompt_data, d.prompt_data_probs, d.prompt_split, d.max_samples)
    if len(prompts) < run.rollout.rollout_batch_size:
        raise ConfigError(
            f"--prompt_data {d.prompt_data}: {len(prompts)} prompts is fewer than one --rollout_batch_size "
            f"({run.rollout.rollout_batch_size})"
        )
    evals = load_prompts(run, tokenizer, d.eval_dataset, None, d.eval_split, None) if d.eval_dataset else None
    ptx = load_ptx_stream(run, tokenizer, world) if run.ptx.enabled else None
    check_data_parallel(run, world, len(evals) if evals is not None else None)
    log_placement(run, world)
    if warning := uncorrected_staleness(run):
        log.warning(warning)
    parts = build_parts(run, world, tokenizer, total_update_steps(run, len(prompts)), ray_actors)
    parts.ptx = ptx
    log.info("RL (%s): %d prompts, device %s", run.algorithm.advantage_estimator, len(prompts), world.device)
    try:
        with use_ring(ring):  # packed policy/reference forwards split their rows over the ring group
            return PPOTrainer(run, parts, prompts, evals, world).fit()
    finally:
        parts.close()


def uncorrected_staleness(run: PPORun) -> str | None:
    """A one-line warning for ``--async_train`` without an importance-sampling correction: its samples come
    from weights one or more updates older than the trainer's, and the old log-probs are the trainer's, so
    nothing reweights them (docs/algorithms.md, "Staleness": on the addition task plain async learned
    worse than synchronous, async with TIS as well). None when a correction covers it."""
    a = run.algorithm
    if not run.placement.async_train or a.enable_vllm_is_correction:
        return None
    if a.policy_loss_type in ratio_against_rollout():  # its ratio is taken against the engine's log-probs
        return None
    return (
        "--async_train trains on samples generated by older weights and nothing corrects for it: add "
        "--enable_vllm_is_correction (TIS) or --use_icepop (docs/algorithms.md, Staleness)"
    )


def check_tensor_parallel(run: PPORun, world: World) -> None:
    """``--ds_tensor_parallel_size`` layouts the policy (and critic) cannot train in, before anything
    loads; the rollout engines stay one per process, colocated (each tp rank generates its group's share)."""
    tp = run.dist.ds_tensor_parallel_size
    models = {"--pretrain": run.actor}
    if run.algorithm.needs_critic:
        models["--critic_pretrain"] = dataclasses.replace(run.actor, pretrain=run.critic_source)
    problems = model_layout_problems(tp, world.world_size, models)
    if tp > 1 and run.algorithm.needs_critic and separate_critic(run.placement):
        problems.append(
            f"--ds_tensor_parallel_size {tp} with a critic on devices of its own (--critic_num_nodes/"
            "--critic_num_gpus_per_node): its workers train data-parallel only; leave them unset"
        )
    if tp > 1 and separate_engines(run.placement, run.rollout.vllm_num_engines):
        problems.append(
            f"--ds_tensor_parallel_size {tp} with --vllm_num_engines {run.rollout.vllm_num_engines} on "
            "devices of their own: tensor-parallel training needs the engines colocated (--colocate_all_models)"
        )
    if problems:
        raise ConfigError("; ".join(problems))


def ring_for(run: PPORun, world: World):
    """This rank's ring-attention group (``--ring_attn_size``), or None; impossible settings fail in one
    line first. The policy, reference and critic forwards run under the ring (a critic on devices of its
    own makes the same ring groups among its workers, ``tidal.trainers.ppo.critic``); reward models score
    padded rows and are not split."""
    size = run.dist.ring_attn_size
    if size <= 1:
        return None
    problems = ring_layout_problems(size, world.world_size)
    if not run.train.packing_samples:
        problems.append(
            f"--ring_attn_size {size} needs --packing_samples (ring attention splits packed rows)"
        )
    if run.actor.aux_loss_coef > 0:
        problems.append(
            f"--ring_attn_size {size} with --aux_loss_coef: the MoE load-balancing loss is not supported"
        )
    if run.rollout.moe_router_replay:
        problems.append(f"--ring_attn_size {size} with --moe_router_replay: routing replay is not supported")
    if run.ptx.enabled:
        problems.append(
            f"--ring_attn_size {size} with --pretrain_data: the ptx loss does not run under ring attention"
        )
    if problems:
        raise ConfigError("; ".join(problems))
    return ring_group(world, size, run.dist.ring_head_stride)


def check_models_before_loading(run: PPORun) -> None:
    """Fail in one line, before anything loads, on a model folder the run cannot use: one without
    ``config.json``, or rollout-engine settings the policy's family cannot run (a family outside the
    engine's registry generates on the transformers fallback, which refuses the features it lacks)."""
    folders = {"--pretrain": [run.actor.pretrain], "--critic_pretrain": [run.critic.pretrain]}
    folders["--reward_pretrain"] = (run.reward.pretrain or "").split(",")
    for flag, paths in folders.items():
        for path in filter(None, paths):
            check_model_folder(path, flag)
    try:
        config = AutoConfig.from_pretrained(run.actor.pretrain)
        model_type = getattr(config, "model_type", None)
    except (OSError, ValueError, KeyError) as err:
        raise model_load_error(run.actor.pretrain, err) from err
    n_images = run.vision.max_images_per_prompt
    for flag, asked in ((f"--max_images_per_prompt {n_images}", n_images > 0),
                        ("--freeze_visual_encoder", run.vision.freeze_visual_encoder)):  # fmt: skip
        if asked and getattr(config, "vision_config", None) is None:
            raise ConfigError(
                f"{flag} needs a vision-language model; --pretrain {run.actor.pretrain} has none"
            )
    if run.algorithm.needs_critic and (problem := critic_image_problem(run.critic_source, n_images > 0)):
        raise ConfigError(problem)  # the critic reads the images too (tidal.models.vision_value)
    if getattr(config, "vision_config", None) is not None and model_type not in VISION_FAMILIES:
        raise ConfigError(
            f"--pretrain {run.actor.pretrain}: {model_type} is a vision-language model the rollout engine does "
            f"not implement (it generates with images for {', '.join(sorted(VISION_FAMILIES))})"
        )
    # outside the engine's families the transformers fallback generates: refuse what it lacks
    if model_type not in FAMILIES and model_type not in VISION_FAMILIES:
        engine = rollout_engine_config(run.rollout, "auto", run.train.seed)
        if problem := fallback_problem(engine, model_type):
            raise ConfigError(f"--pretrain {run.actor.pretrain}: {problem}")
        if run.train.packing_samples:  # recurrent (Mamba-style) layers would carry state across samples
            raise ConfigError(
                f"--packing_samples: not supported for the {model_type} family outside tidal's engine, whose "
                f"layers may not keep packed samples apart (--pretrain {run.actor.pretrain}); drop the flag"
            )
    if run.train.packing_samples and (problem := feature_refusal(model_type, "packing_samples")):
        raise ConfigError(f"--packing_samples: {problem} (--pretrain {run.actor.pretrain})")
    tp = run.rollout.vllm_tensor_parallel_size
    tp_problem = tp_layout_problem(config, tp)
    local_engine = run.placement.actor_world_size == 1 and not separate_engines(
        run.placement, run.rollout.vllm_num_engines
    )
    if not tp_problem and tp > 1 and local_engine and torch.cuda.is_available():
        tp_problem = local_engine_gpu_problem(tp, torch.cuda.device_count())
        tp_problem = tp_problem or local_engine_overlap_problem(run.placement, tp)
    if tp_problem:
        raise ConfigError(f"--vllm_tensor_parallel_size {tp}: {tp_problem}")
    if run.rollout.enable_prefix_caching and (problem := context_prefill_problem(config)):
        raise ConfigError(
            f"--enable_prefix_caching: not supported with {problem} (--pretrain {run.actor.pretrain})"
        )
    lora_dropout = run.actor.lora_dropout if run.actor.lora_rank else 0.0
    if run.rollout.exact_logprobs and (
        problem := exact_problem(config, lora_dropout, run.actor.load_in_4bit)
    ):
        raise ConfigError(f"{problem} (--pretrain {run.actor.pretrain})")
    fp8 = run.rollout.rollout_quantization != "none"  # tidal.rollout.quant
    fp8 = fp8 and (model_type in FAMILIES or model_type in VISION_FAMILIES)
    engines_on = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the engines' "auto" device
    if fp8 and (problem := registry_family_problem(model_type, engines_on)):
        raise ConfigError(f"{problem} (--pretrain {run.actor.pretrain})")
    if run.rollout.rollout_kv_cache_dtype == "fp8" and (
        problem := feature_refusal(model_type, "fp8_kv_cache")
    ):
        raise ConfigError(f"--rollout_kv_cache_dtype fp8: {problem} (--pretrain {run.actor.pretrain})")
    if run.rollout.moe_router_replay:
        check_router_replay(run, config)


def check_router_replay(run: PPORun, config) -> None:
    """``--moe_router_replay`` replays experts: the policy must have them. Agents (``--agent_func_path``,
    ``--agent_endpoint``) carry each turn's recorded experts into their trajectories (``tidal.agents.base``)."""
    if not any(getattr(config, key, 0) for key in ("num_experts", "num_local_experts")):
        raise ConfigError(
            f"--moe_router_replay: --pretrain {run.actor.pretrain} (model_type {config.model_type!r}) is a dense "
            "model with no MoE routers to replay; drop the flag"
        )


def load_prompts(run: PPORun, tokenizer, spec: str, probs, split: str, max_samples):
    d = run.data
    dataset = load_dataset_spec(spec, probs, split=split, max_samples=max_samples, seed=run.train.seed)
    images = run.vision.max_images_per_prompt > 0  # prompts are measured with their image tokens
    prompts, skipped = build_prompt_samples(dataset, tokenizer, d.input_key, d.label_key, d.input_template,
                                            d.apply_chat_template, None if images else run.rollout.prompt_max_len,
                                            source=spec)  # fmt: skip
    if images:
        prompts, skipped = image_prompts(run, dataset, prompts, tokenizer, spec)
    if skipped.count:
        log.warning("%s: %s", spec, skipped.summary())
    return prompts


def load_ptx_stream(run: PPORun, tokenizer, world: World) -> PtxStream:
    """``--pretrain_data`` as pretrain-mode SFT samples (every token of the ``--input_key`` text, at
    most prompt + generate length, as OpenRLHF), in this rank's micro-batches for the ptx loss (ranks
    of one tensor-parallel group share theirs: the stream is split by data-parallel rank)."""
    p, d = run.ptx, run.data
    cfg = SFTDataConfig(
        input_key=d.input_key, output_key=None, pretrain_mode=True, max_len=run.rollout.total_len
    )
    samples = load_sft_samples(p.data, p.data_probs, p.split, d.max_samples, tokenizer, cfg, run.train.seed)
    return PtxStream(samples, run.train.micro_train_batch_size, run.train.seed, world.dp_rank, world.dp_size)


def total_update_steps(run: PPORun, num_prompts: int) -> int:
    rollouts = (num_prompts // run.rollout.rollout_batch_size) * run.train.num_episodes
    samples = run.rollout.rollout_batch_size * run.rollout.n_samples_per_prompt
    per_rollout = -(-samples // run.train.train_batch_size) * run.train.max_epochs
    return max(rollouts * per_rollout, 1)


def build_parts(run: PPORun, world: World, tokenizer, steps: int, ray_actors: dict | None = None) -> PPOParts:
    """The policy (and critic) on this device, then the other roles from ``tidal.placement``."""
    actor = build_actor(run, world, steps)
    update = ValueUpdate(run.algorithm.value_clip)  # the critic's epochs, here or in its own worker
    critic = build_critic(run, world, steps, update) if run.algorithm.needs_critic else None
    # the reward source loads (or the run is refused for having none) before any engine or worker starts
    scorer = RewardScorer(run.reward, run.agent, tokenizer.pad_token_id)
    roles = build_roles(run, world, tokenizer, actor.precision, ray_actors)
    scorer.reward_models = roles.reward_models  # reward models where placement put them
    return PPOParts(actor, critic, roles.reference, roles.rollout, scorer, tokenizer)


@dataclass(frozen=True)
class ValueUpdate:
    """The critic's PPO epochs on an experience (``tidal.trainers.ppo.critic.CriticUpdate``): picklable, so
    a critic on devices of its own runs this same code in its worker."""

    value_clip: float | None

    def __call__(self, opt: Optimization, exp, shape: StepShape, world: World, generator) -> dict[str, float]:
        loss = ValueLoss(self.value_clip, opt.precision, shape.packing)
        return train_on_experience(opt, exp, loss, shape, world, generator)


def build_actor(run: PPORun, world: World, steps: int) -> Optimization:
    model = load_causal_lm(run.actor, world.device)
    if run.vision.freeze_visual_encoder:  # the language model trains; only its weights reach the engine
        log.info("--freeze_visual_encoder: %d vision parameters frozen", freeze_vision(model))
    return build_optimization(model, run.actor, run.actor_optim, run.dist, world, steps)
