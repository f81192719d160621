"""OpenRLHF v0.9.2 flags that tidal's commands do not define: each is either an alias (rewritten to
the tidal flag that does the same) or refused with its reason, one line, before argparse runs.

An OpenRLHF script therefore never meets argparse's bare "unrecognized arguments": a flag tidal can
honour under another name is honoured, one it cannot is refused by name with why (a DeepSpeed-only
knob with no FSDP2 meaning, a feature tidal does not have). The tables are per OpenRLHF module name
(``train_sft``...); ``tests/cli/openrlhf_flags.json`` holds OpenRLHF's flags (v0.9.2, v0.10.1.post2,
v0.11.0 and HEAD) and ``tests/cli/test_openrlhf_flags.py`` checks that every one is accepted, aliased
or refused here; later versions' names (dotted ``--actor.adam.lr``, v0.10's flat ones) are rewritten
to v0.9.2's or tidal's (``DOTTED*``) first.
A flag a command defines itself always wins over these tables (an entry left behind is harmless,
and the test reports it). Deliberate differences are listed in ``docs/openrlhf.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

# tidal command → OpenRLHF module name(s), for ``tidal <openrlhf name>`` and the tables below.
OPENRLHF_MODULES = {
    "train_sft": "sft",
    "train_rm": "rm",
    "train_prm": "prm",
    "train_dpo": "dpo",
    "train_kto": "kto",
    "train_kd": "kd",
    "train_ppo_ray": "ppo",
    "serve_rm": "serve_rm",
    "lora_combiner": "lora_combiner",
    "batch_inference": "generate",
    "interactive_chat": "chat",
}

_DEEPSPEED_CKPT = (
    "a DeepSpeed checkpoint option; tidal saves torch.distributed.checkpoint (FSDP2) checkpoints"
)

# Refused by every trainer command.
_NO_WORKERS = "tidal prepares batches in the training process (no DataLoader workers)"
_TRAINER_REFUSED = {
    "dataloader_num_workers": _NO_WORKERS,  # OpenRLHF v0.10's flat name (HEAD: --data.dataloader_num_workers)
    "max_ckpt_mem": f"{_DEEPSPEED_CKPT} and keeps the newest --max_ckpt_num of them, with no memory cap",
    "use_ds_universal_ckpt": _DEEPSPEED_CKPT,
    "use_ms": "ModelScope downloads are not supported: pass a local folder or a Hugging Face hub name",
}

_NOT_YET = "not implemented in tidal yet"

# --use_liger_kernel switches tidal's fused LM-head loss on where it is off by default (train_kd,
# train_prm: tidal.models.logprob_head); these trainers' log-probs always take it.
_ALWAYS_FUSED = {
    "use_liger_kernel": (
        "this trainer always computes its log-probs with tidal's fused LM head (chunked, one chunk's "
        "logits at a time; Triton kernels on CUDA), so there is nothing to switch on (Liger's own "
        "kernels are not part of tidal): drop the flag"
    )
}

_RL_REFUSED = {
    "actor_init_on_gpu": "a DeepSpeed ZeRO-3 initialisation option; tidal's FSDP2 loads each shard on its GPU",
    "perf": "OpenRLHF's throughput report has no tidal counterpart (tidal logs timings with its metrics)",
}

_LOADER_NOT_YET = {
    "use_ms": _TRAINER_REFUSED["use_ms"],
}


_INFERENCE_REFUSED = {
    **_LOADER_NOT_YET,
    "attn_implementation": "tidal's rollout engine has its own attention kernels (no Hugging Face attention)",
}

# OpenRLHF flag → reason, per OpenRLHF module.
REFUSED: dict[str, dict[str, str]] = {
    "train_sft": {**_TRAINER_REFUSED, **_ALWAYS_FUSED},
    "train_rm": dict(_TRAINER_REFUSED),
    "train_prm": dict(_TRAINER_REFUSED),
    "train_dpo": {**_TRAINER_REFUSED, **_ALWAYS_FUSED},
    "train_kto": {**_TRAINER_REFUSED, **_ALWAYS_FUSED},
    "train_kd": dict(_TRAINER_REFUSED),
    "train_ppo_ray": {**_TRAINER_REFUSED, **_RL_REFUSED, **_ALWAYS_FUSED},
    "serve_rm": {
        **_LOADER_NOT_YET,
    },
    "lora_combiner": {},
    "batch_inference": {
        **_INFERENCE_REFUSED,
        "zero_stage": (
            "only 0 (OpenRLHF's default: a whole model in each process) is accepted: tidal samples and "
            "scores with whole models, never ZeRO-sharded ones"
        ),
        "full_determinism": f"{_NOT_YET} for sampling (--seed makes the same flags give the same samples)",
    },
    "interactive_chat": {
        **_INFERENCE_REFUSED,
    },
}

# OpenRLHF flag → the tidal argv that does the same, per OpenRLHF module.
ALIASES: dict[str, dict[str, tuple[str, ...] | dict[str, tuple[str, ...] | str]]] = {
    "train_sft": {"train_split": ("--dataset_split",)},
    "train_ppo_ray": {
        "max_new_tokens": ("--generate_max_len",),  # v0.10's flat name (HEAD: --rollout.*)
        # v0.10's (HEAD: --algo.advantage.is_correction_type); applies with --enable_vllm_is_correction
        "vllm_is_correction_type": {
            "tis": (),  # what --enable_vllm_is_correction does
            "icepop": ("--use_icepop",),
            "seq-mask-tis": "a sequence-level (geometric-mean) importance-sampling mask is not implemented "
            "in tidal yet (tis and icepop are)",
        },
    },
    "batch_inference": {"greedy_sampling": ("--temperature", "0"), "max_len": ("--max_model_len",)},
    "interactive_chat": {"greedy_sampling": ("--temperature", "0"), "max_len": ("--max_model_len",)},
}


# OpenRLHF's current flag style (after v0.10: ``--actor.model_name_or_path``, ``--ds.zero_stage``):
# each dotted flag is rewritten to its v0.9.2 name, which the tables above then honour, alias or
# refuse. Every flag of OpenRLHF HEAD's CLIs is covered (train_sft, train_rm, train_dpo,
# train_ppo_ray, serve_rm, lora_combiner: the modules HEAD has).
DOTTED_PREFIXES = ("ckpt", "logger", "train", "ds", "data", "model")  # --<prefix>.<v0.9.2 name>
DOTTED: dict[str, str] = {
    "ckpt.output_dir": "save_path",
    "ckpt.save_hf": "save_hf_ckpt",
    "ckpt.disable_ds": "disable_ds_ckpt",
    "ckpt.path": "ckpt_path",
    "ckpt.max_num": "max_ckpt_num",
    "ckpt.max_mem": "max_ckpt_mem",
    "ckpt.load_enable": "load_checkpoint",
    "eval.steps": "eval_steps",
    "eval.dataset": "eval_dataset",
    "eval.split": "eval_split",
    "ds.use_universal_ckpt": "use_ds_universal_ckpt",
    "ds.tensor_parallel_size": "ds_tensor_parallel_size",
    "ds.ring_attn_head_stride": "ring_head_stride",
    "ds.lora.rank": "lora_rank",
    "ds.lora.alpha": "lora_alpha",
    "ds.lora.dropout": "lora_dropout",
    "ds.lora.target_modules": "target_modules",
    "train.micro_batch_size": "micro_train_batch_size",
    "train.batch_size": "train_batch_size",
    "train.full_determinism_enable": "full_determinism",
    "model.gradient_checkpointing_enable": "gradient_checkpointing",
    "model.gradient_checkpointing_reentrant": "gradient_checkpointing_use_reentrant",
    "model.model_name_or_path": "pretrain",
    "model.pretrain_mode_enable": "pretrain_mode",
    "adam.lr": "learning_rate",
    "adam.betas": "adam_betas",
    "adam.weight_decay": "l2",
    "adam.eps": "adam_eps",
    **{f"muon.{name}": f"muon_{name}" for name in ("lr", "momentum", "ns_steps", "nesterov")},
    "muon.no_nesterov": "no-muon_nesterov",
    "logger.wandb.key": "use_wandb",
    "logger.wandb.org": "wandb_org",
    "logger.wandb.group": "wandb_group",
    "logger.wandb.project": "wandb_project",
    "logger.wandb.run_name": "wandb_run_name",
    "logger.tensorboard_dir": "use_tensorboard",
}

# OpenRLHF HEAD's per-role optimizer flags (--actor.adam.lr...) → tidal's per-role flag suffix
# (``--actor_learning_rate``, ``--actor_adam_betas``: tidal.cli.common.TrainerCommand.roles).
_ROLE_OPTIM = {
    "optim": "optim",
    "adam.lr": "learning_rate",
    "adam.betas": "adam_betas",
    "adam.eps": "adam_eps",
    "adam.weight_decay": "l2",
    **{f"muon.{name}": f"muon_{name}" for name in ("lr", "momentum", "ns_steps", "nesterov")},
    **{name: name for name in ("lr_scheduler", "lr_warmup_ratio", "min_lr_ratio", "max_norm")},
}

# Per-module dotted flags (where a name means different v0.9.2 flags in different modules).
_ACTOR_VISION = {
    "actor.freeze_visual_encoder": "freeze_visual_encoder"
}  # train_ppo_ray's name, for SFT/DPO/RM
DOTTED_BY_MODULE: dict[str, dict[str, str]] = {
    "train_sft": dict(_ACTOR_VISION),
    "train_dpo": {
        **_ACTOR_VISION,
        "ref.offload": "ref_offload",
        "ref.model_name_or_path": "ref_pretrain",
        "model.ipo_enable": "ipo",
    },
    "train_rm": {
        **_ACTOR_VISION,
        "model.compute_fp32_loss_enable": "compute_fp32_loss",
        "model.margin_loss_enable": "margin_loss",
        "model.loss_type": "loss",
    },
    "serve_rm": {
        "reward.model_name_or_path": "reward_pretrain",
        "reward.normalize_enable": "normalize_reward",
    },
    "train_ppo_ray": {
        **_ACTOR_VISION,
        **{
            f"{role}.{what}": f"{role}_{what}"
            for role in ("ref", "reward", "actor", "critic")
            for what in ("num_nodes", "num_gpus_per_node")
        },  # fmt: skip
        "train.colocate_all": "colocate_all_models",
        **{
            f"vllm.{name}": f"vllm_{name}"
            for name in (
                "num_engines",
                "tensor_parallel_size",
                "sync_backend",
                "sync_with_ray",
                "enable_sleep",
                "gpu_memory_utilization",
            )
        },  # fmt: skip
        "vllm.enable_prefix_caching": "enable_prefix_caching",
        "vllm.enforce_eager": "enforce_eager",
        "algo.advantage.is_correction_enable": "enable_vllm_is_correction",
        "algo.advantage.is_correction_threshold": "vllm_is_truncated_threshold",
        "algo.advantage.is_correction_type": "vllm_is_correction_type",
        "train.async_enable": "async_train",
        "train.partial_rollout_enable": "partial_rollout_enable",
        "actor.gradient_checkpointing_enable": "gradient_checkpointing",
        "actor.gradient_checkpointing_reentrant": "gradient_checkpointing_use_reentrant",
        "ds.enable_sleep": "deepspeed_enable_sleep",
        "train.dynamic_batch_enable": "use_dynamic_batch",
        "rollout.max_tokens_per_gpu": "rollout_max_tokens_per_gpu",
        "train.max_tokens_per_gpu": "train_max_tokens_per_gpu",
        "rollout.batch_size": "rollout_batch_size",
        "rollout.vllm_generate_batch_size": "vllm_generate_batch_size",
        "rollout.micro_batch_size": "micro_rollout_batch_size",
        "rollout.max_new_tokens": "generate_max_len",
        "rollout.top_p": "top_p",
        "rollout.temperature": "temperature",
        "rollout.n_samples_per_prompt": "n_samples_per_prompt",
        "actor.eps_clip": "eps_clip",
        "actor.eps_clip_low_high": "eps_clip_low_high",
        "actor.dual_clip": "dual_clip",
        "actor.policy_loss_type": "policy_loss_type",
        "actor.aux_loss_coef": "aux_loss_coef",
        "actor.entropy_coef": "entropy_loss_coef",
        "actor.model_name_or_path": "pretrain",
        "critic.value_clip": "value_clip",
        "critic.freezing_steps": "freezing_actor_steps",
        "critic.save_value_network": "save_value_network",
        "critic.model_name_or_path": "critic_pretrain",
        "algo.advantage.lambd": "lambd",
        "algo.advantage.gamma": "gamma",
        "algo.advantage.estimator": "advantage_estimator",
        "algo.advantage.no_std_norm": "no_advantage_std_norm",
        "algo.kl.target": "kl_target",
        "algo.kl.horizon": "kl_horizon",
        "algo.kl.init_coef": "init_kl_coef",
        "algo.kl.estimator": "kl_estimator",
        "algo.kl.use_loss": "use_kl_loss",
        "algo.dynamic_filtering_enable": "dynamic_filtering",
        "algo.dynamic_filtering_range": "dynamic_filtering_reward_range",
        "reward.normalize_enable": "normalize_reward",
        "reward.clip_range": "reward_clip_range",
        "reward.overlong_buffer_len": "overlong_buffer_len",
        "reward.overlong_penalty_factor": "overlong_penalty_factor",
        "reward.stop_properly_penalty_coef": "stop_properly_penalty_coef",
        "reward.model_name_or_path": "reward_pretrain",
        "reward.remote_url": "remote_rm_url",
        "data.prompt_dataset": "prompt_data",
        "data.prompt_probs": "prompt_data_probs",
        "eval.temperature": "eval_temperature",
        "eval.n_samples_per_prompt": "eval_n_samples_per_prompt",
        **{
            f"{role}.{dotted}": f"{role}_{name}"
            for role in ("actor", "critic")
            for dotted, name in _ROLE_OPTIM.items()
        },
        **{f"{role}.muon.no_nesterov": f"no-{role}_muon_nesterov" for role in ("actor", "critic")},
    },
}
_OFFLOAD_TOGETHER = "tidal offloads the reference and reward models together: use --ref_reward_offload"
# Per-module dotted flags with no v0.9.2 counterpart that tidal cannot honour.
DOTTED_REFUSED_BY_MODULE: dict[str, dict[str, str]] = {
    "train_ppo_ray": {
        "ref.offload": _OFFLOAD_TOGETHER,
        "reward.offload": _OFFLOAD_TOGETHER,
    },
}

# Dotted flags with no v0.9.2 counterpart that tidal cannot honour (every trainer).
DOTTED_REFUSED = {
    "ds.experts_implementation": "choosing the MoE experts' kernel is not supported (transformers' default is used)",
}


def dotted_aliases(module: str, flags: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """OpenRLHF's dotted flags for a module, as aliases to v0.9.2 names: the ``DOTTED*`` tables,
    plus ``--<prefix>.<name>`` for each v0.9.2 ``name`` in ``flags`` (the command's own flags and
    its aliased and refused OpenRLHF flags) under the ``DOTTED_PREFIXES``."""
    names = set(flags) | set(aliases(module)) | set(refusals(module))
    found = {f"{prefix}.{name}": (f"--{name}",) for prefix in DOTTED_PREFIXES for name in names}
    table = {**DOTTED, **DOTTED_BY_MODULE.get(module, {})}
    return {**found, **{dotted: (f"--{name}",) for dotted, name in table.items()}}


def openrlhf_module(command: str) -> str | None:
    """The OpenRLHF module name of a tidal command (``sft`` → ``train_sft``), if it has one."""
    return next((module for module, ours in OPENRLHF_MODULES.items() if ours == command), None)


def refusals(module: str) -> dict[str, str]:
    """The refused OpenRLHF flags of one OpenRLHF module (none for an unknown name); a trainer's
    include the dotted-style flags that have no v0.9.2 counterpart (``DOTTED_REFUSED*``)."""
    return {**REFUSED.get(module, {}), **DOTTED_REFUSED, **DOTTED_REFUSED_BY_MODULE.get(module, {})}


def aliases(module: str) -> dict[str, tuple[str, ...]]:
    """The aliased OpenRLHF flags of one OpenRLHF module (none for an unknown name)."""
    return ALIASES.get(module, {})


EVERY = "every command"  # a DEFAULT_DIFFERENCES key that holds for each OpenRLHF CLI with the flag


class DefaultDifference(NamedTuple):
    """A flag whose tidal default differs from OpenRLHF v0.9.2's on purpose."""

    openrlhf: str  # OpenRLHF's default, as a user would read it ("unset" for None)
    reason: str  # tidal's default, and why


# (OpenRLHF module or EVERY, flag) → the deliberate difference; ``--help`` appends each to its flag
# (``default_notes``), docs/openrlhf.md ("Defaults") lists them, and ``tests/cli/test_defaults.py``
# checks that every other shared flag's default equals OpenRLHF's and that each of these still differs.
DEFAULT_DIFFERENCES: dict[tuple[str, str], DefaultDifference] = {
    (EVERY, "param_dtype"): DefaultDifference(
        "bf16",
        "auto: bf16 on a GPU (OpenRLHF's default) and float32 on the CPU, where bf16 is slow and imprecise",
    ),
    (EVERY, "attn_implementation"): DefaultDifference(
        "flash_attention_2",
        "sdpa ships with torch; flash-attn is optional in tidal (passing flash_attention_2 without it "
        "falls back to sdpa and tidal's varlen path)",
    ),
    (EVERY, "max_samples"): DefaultDifference(
        "1000000 (train_ppo_ray, batch_inference: 1e8)",
        "unset means every sample; OpenRLHF's cap (1e6, PPO 1e8) is a large number meaning the same",
    ),
    (EVERY, "wandb_project"): DefaultDifference(
        "openrlhf_train_<sft, rm, prm, dpo or ppo> (per script)",
        "runs are logged to the W&B project 'tidal' rather than OpenRLHF's per-script names",
    ),
    (EVERY, "wandb_run_name"): DefaultDifference(
        "<kind>_<month><day>T<hour>:<minute>",
        "unset: tidal names the run itself; OpenRLHF's default is a Python expression, not a value",
    ),
    ("train_sft", "output_key"): DefaultDifference(
        "unset",
        "'output': OpenRLHF's unset key fails on single-turn data; with --multiturn/--pretrain_mode "
        "tidal accepts it unset",
    ),
    ("train_kto", "output_key"): DefaultDifference(
        "unset", "'output': OpenRLHF's unset key fails when a response is read"
    ),
    ("train_kto", "pretrain"): DefaultDifference(
        "bigscience/bloomz-1b7", "--pretrain is required (OpenRLHF's default downloads bigscience/bloomz-1b7)"
    ),
    ("train_prm", "placeholder_token"): DefaultDifference(
        "unset",
        "'ки' (Math-Shepherd's step marker, which OpenRLHF's PRM example passes); OpenRLHF's unset "
        "marker cannot train",
    ),
    ("train_ppo_ray", "actor_num_gpus_per_node"): DefaultDifference(
        "8", "1: tidal's default PPO run uses one device; OpenRLHF's 8 assumes a full node"
    ),
    **{
        ("train_ppo_ray", f"{role}_num_{what}"): DefaultDifference(
            "1" if what == "nodes" else "8", f"unset: the {name} follows the actor's placement"
        )
        for role, name in (("ref", "reference"), ("reward", "reward model"), ("critic", "critic"))
        for what in ("nodes", "gpus_per_node")
    },
    ("train_ppo_ray", "vllm_gpu_memory_utilization"): DefaultDifference(
        "0.95",
        "0.5 of the free memory: tidal's engine sizes its KV cache from what is free and by default "
        "shares the device with training (vLLM's 0.95 is of the total, on a dedicated GPU)",
    ),
    **{
        ("train_ppo_ray", flag): DefaultDifference(
            "1024",
            f"unset: 1024 as OpenRLHF v0.9.2, but with --max_len set (OpenRLHF >= v0.10, which has no "
            f"{what}, bounds prompt + response by --max_len alone) {resolved}",
        )
        for flag, what, resolved in (
            ("prompt_max_len", "prompt limit", "a prompt may take up to --max_len - 1 tokens"),
            ("generate_max_len", "response limit", "a response gets what its prompt leaves of --max_len"),
        )
    },
    ("train_ppo_ray", "ckpt_path"): DefaultDifference(
        "./ckpt/checkpoints_ppo_ray",
        "./ckpt/checkpoints_ppo, named after tidal's command, so existing tidal PPO checkpoints still resume",
    ),
    ("batch_inference", "max_len"): DefaultDifference(
        "2048",
        "unset: the model's context length bounds prompt + response (tidal's engine sizes its cache to it)",
    ),
    ("batch_inference", "micro_batch_size"): DefaultDifference(
        "16",
        "unset means 16 as OpenRLHF; unset lets tidal refuse the flag outside --eval_task rm, where it does "
        "nothing",
    ),
    ("batch_inference", "rollout_batch_size"): DefaultDifference(
        "2048",
        "unset means 2048 prompts per --iter as OpenRLHF; set, it also caps the prompts per engine call",
    ),
    ("batch_inference", "tp_size"): DefaultDifference(
        "torch.cuda.device_count()",
        "1: one process on one device; OpenRLHF's default spans every visible GPU (tidal's engine runs on the CPU too)",
    ),
    ("batch_inference", "value_head_prefix"): DefaultDifference(
        "value_head",
        "'score': the head name train_rm saves by default (OpenRLHF's batch_inference default does not "
        "match its own train_rm)",
    ),
    ("interactive_chat", "max_len"): DefaultDifference(
        "4096", "unset: the model's context length bounds the conversation"
    ),
    ("interactive_chat", "apply_chat_template"): DefaultDifference(
        "off",
        "auto: the tokenizer's chat template when it has one, else plain text (OpenRLHF: off unless passed)",
    ),
    ("serve_rm", "host"): DefaultDifference(
        "0.0.0.0", "127.0.0.1: an unauthenticated server listens on loopback unless --host says otherwise"
    ),
    ("serve_rm", "batch_size"): DefaultDifference(
        "unset",
        "16: bounded memory per forward (tidal coalesces concurrent requests); OpenRLHF's unset is one "
        "forward per request, however large",
    ),
}


_LATER = "from v0.10.1.post2"
# (OpenRLHF module, tidal flag) → a default OpenRLHF changed after v0.9.2 that tidal keeps at v0.9.2's
# (the reference), with why; docs/openrlhf.md ("Defaults of later versions") lists them, and
# ``tests/cli/test_defaults.py`` checks every later version's other defaults equal tidal's.
LATER_DEFAULT_DIFFERENCES: dict[tuple[str, str], DefaultDifference] = {
    ("train_ppo_ray", "micro_rollout_batch_size"): DefaultDifference(
        f"1 ({_LATER}; v0.9.2: 8)",
        "8, v0.9.2's: samples per scoring forward (log-probs, values); larger is faster and changes no result",
    ),
    ("train_ppo_ray", "micro_train_batch_size"): DefaultDifference(
        f"1 ({_LATER}; v0.9.2: 4)",
        "4, v0.9.2's: the micro-batch only splits --train_batch_size, which sets the update",
    ),
    ("train_ppo_ray", "max_len"): DefaultDifference(
        f"2048 ({_LATER}, which has no --prompt_max_len / --generate_max_len; v0.9.2: unset)",
        "unset: v0.9.2's 1024-token prompt and 1024-token response limits, 2048 in total; set it "
        "(--data.max_len) for the later versions' budget (a response gets what its prompt leaves)",
    ),
}


def default_difference(module: str, flag: str) -> DefaultDifference | None:
    """The deliberate default difference of ``flag`` in OpenRLHF's ``module``, if there is one."""
    return DEFAULT_DIFFERENCES.get((module, flag)) or DEFAULT_DIFFERENCES.get((EVERY, flag))


def default_notes(module: str) -> dict[str, str]:
    """Flag → the note its ``--help`` ends with: "OpenRLHF's default: X; <why tidal's differs>"."""
    flags = {flag for _, flag in DEFAULT_DIFFERENCES}
    notes = {flag: default_difference(module, flag) for flag in flags}
    return {
        flag: f"OpenRLHF's default: {diff.openrlhf}; {diff.reason}" for flag, diff in notes.items() if diff
    }
