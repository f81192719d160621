"""OpenRLHF's example training scripts as facts about its interface: for each script of
``examples/scripts/`` at v0.9.2 and v0.11.0, the module it starts, its flags in the script's order, and
its launcher. Only the values of model/data/output paths are placeholders (``{policy}``, ``{prompts}``...,
filled by ``tests/cli/test_openrlhf_example_scripts.py``); sizes are the script's own and are made small
there (``SIZES``). ``deepspeed --module X`` appends ``--local_rank=0``; ``python3 -m X`` (through ``ray job
submit`` or not) passes the flags as they are.

Not listed: v0.9.2's ``train_rejection_sampling_llama.sh``, ``train_conditional.sh`` and
``train_iterative_dpo.sh`` (three commands each; run end to end by ``test_openrlhf_scripts.py``), and the
scripts that train nothing themselves: ``train_nonrl_slurm.sh`` (runs ``train_dpo_llama.sh``'s flags under
``torchrun`` in Slurm), ``ckpt_ds_zero_to_universal.sh`` (DeepSpeed's checkpoint converter),
``docker_run.sh`` and ``nvidia_docker_install.sh``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Script:
    version: str
    path: str  # under OpenRLHF's examples/scripts/
    module: str  # the OpenRLHF module the script starts
    launcher: (
        str  # "deepspeed" (deepspeed --module), "python" (python3 -m), "ray" (ray job submit -- python3 -m)
    )
    flags: str  # the flags, whitespace-separated, in the script's order

    @property
    def name(self) -> str:
        return f"{self.version}/{self.path}"

    def argv(self, paths: dict[str, str]) -> list[str]:
        argv = [token.format(**paths) for token in self.flags.split()]
        return argv + (["--local_rank=0"] if self.launcher == "deepspeed" else [])


V092, V011 = "v0.9.2", "v0.11.0"

SCRIPTS = [
    # ---------------------------------------------------------------- v0.9.2
    Script(V092, "serve_remote_rm.sh", "openrlhf.cli.serve_rm", "python", """
        --reward_pretrain {reward} --port 5000 --param_dtype bf16 --attn_implementation flash_attention_2
        --normalize_reward --max_len 8192 --batch_size 16"""),
    Script(V092, "train_dapo_ray_hybrid_engine.sh", "openrlhf.cli.train_ppo_ray", "python", """
        --ref_num_nodes 1 --ref_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
        --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models
        --vllm_gpu_memory_utilization 0.6 --init_kl_coef 1e-3 --gamma 1.0 --use_kl_loss --kl_estimator k3
        --advantage_estimator group_norm --dynamic_filtering --dynamic_filtering_reward_range 0 1
        --eps_clip_low_high 0.2 0.27 --pretrain {policy} --remote_rm_url {reward_fn} --save_path {out}/final
        --ckpt_path {out}/ckpt --save_steps 20 --save_hf_ckpt --micro_train_batch_size 8
        --train_batch_size 128 --micro_rollout_batch_size 16 --rollout_batch_size 128
        --n_samples_per_prompt 8 --max_epochs 1 --prompt_max_len 1024 --max_samples 20000
        --generate_max_len 1024 --zero_stage 3 --param_dtype bf16 --actor_learning_rate 5e-7
        --prompt_data {prompts} --input_key context_messages --apply_chat_template --gradient_checkpointing
        --packing_samples --vllm_sync_backend nccl --enforce_eager --vllm_enable_sleep
        --deepspeed_enable_sleep --vllm_enable_is_correction"""),
    Script(V092, "train_dpo_llama.sh", "openrlhf.cli.train_dpo", "deepspeed", """
        --save_path {out}/final --save_steps -1 --logging_steps 1 --eval_steps -1 --train_batch_size 256
        --micro_train_batch_size 1 --pretrain {policy} --param_dtype bf16 --max_epochs 1 --max_len 8192
        --zero_stage 3 --learning_rate 5e-7 --beta 0.1 --dataset {prefs} --apply_chat_template
        --chosen_key chosen --rejected_key rejected --attn_implementation flash_attention_2
        --load_checkpoint --packing_samples --gradient_checkpointing"""),
    Script(V092, "train_knowledge_distillation.sh", "openrlhf.cli.train_kd", "deepspeed", """
        --max_len 2048 --dataset {sft} --input_key question --output_key response --train_batch_size 256
        --micro_train_batch_size 2 --max_samples 500000 --pretrain {policy} --teacher_model {teacher}
        --save_path {out}/final --save_steps -1 --logging_steps 1 --eval_steps -1 --zero_stage 3
        --max_epochs 1 --param_dtype bf16 --attn_implementation flash_attention_2 --kd_coef 0.4
        --learning_rate 5e-6 --teacher_offload --gradient_checkpointing"""),
    Script(V092, "train_kto_llama.sh", "openrlhf.cli.train_kto", "deepspeed", """
        --save_path {out}/final --save_steps -1 --logging_steps 1 --eval_steps -1 --train_batch_size 64
        --micro_train_batch_size 1 --pretrain {policy} --param_dtype bf16 --max_epochs 1 --max_len 8192
        --zero_stage 3 --learning_rate 5e-7 --dataset {kto} --input_key instruction --output_key response
        --label_key score --attn_implementation flash_attention_2 --beta 0.1 --max_samples 1024
        --gradient_checkpointing"""),
    Script(V092, "train_ppo_ray_hybrid_engine.sh", "openrlhf.cli.train_ppo_ray", "python", """
        --ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8
        --critic_num_nodes 1 --critic_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
        --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models
        --vllm_gpu_memory_utilization 0.5 --pretrain {policy} --reward_pretrain {reward}
        --save_path {out}/final --ckpt_path {out}/ckpt --save_hf_ckpt --train_batch_size 128
        --rollout_batch_size 1024 --n_samples_per_prompt 1 --max_epochs 1 --prompt_max_len 1024
        --max_samples 100000 --generate_max_len 1024 --zero_stage 3 --param_dtype bf16
        --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01 --prompt_data {prompts}
        --input_key context_messages --apply_chat_template --normalize_reward --gradient_checkpointing
        --packing_samples --vllm_sync_backend nccl --enforce_eager --vllm_enable_sleep
        --deepspeed_enable_sleep --use_dynamic_batch --train_max_tokens_per_gpu 16384
        --enable_vllm_is_correction"""),
    Script(V092, "train_ppo_ray_slurm.sh", "openrlhf.cli.train_ppo_ray", "ray", """
        --ref_num_nodes 1 --ref_num_gpus_per_node 4 --reward_num_nodes 1 --reward_num_gpus_per_node 4
        --critic_num_nodes 1 --critic_num_gpus_per_node 4 --actor_num_nodes 1 --actor_num_gpus_per_node 4
        --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_critic_reward --colocate_actor_ref
        --pretrain {policy} --reward_pretrain {reward} --save_path {out}/final --micro_train_batch_size 8
        --train_batch_size 128 --micro_rollout_batch_size 16 --rollout_batch_size 1024 --max_samples 100000
        --max_epochs 1 --prompt_max_len 1024 --generate_max_len 1024 --zero_stage 3 --param_dtype bf16
        --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01 --prompt_data {prompts}
        --input_key context_messages --apply_chat_template --normalize_reward --adam_offload
        --packing_samples --vllm_sync_backend nccl --gradient_checkpointing --use_wandb {wandb}"""),
    Script(V092, "train_ppo_with_reward_fn.sh", "openrlhf.cli.train_ppo_ray", "ray", """
        --ref_num_nodes 1 --ref_num_gpus_per_node 2 --critic_num_nodes 1 --critic_num_gpus_per_node 2
        --actor_num_nodes 1 --actor_num_gpus_per_node 2 --vllm_num_engines 2 --vllm_tensor_parallel_size 2
        --colocate_actor_ref --pretrain {policy} --remote_rm_url {reward_fn} --save_path {out}/final
        --micro_train_batch_size 8 --train_batch_size 128 --micro_rollout_batch_size 16
        --rollout_batch_size 1024 --max_samples 100000 --max_epochs 1 --prompt_max_len 1024
        --generate_max_len 1024 --zero_stage 3 --param_dtype bf16 --actor_learning_rate 5e-7
        --critic_learning_rate 9e-6 --init_kl_coef 0.01 --prompt_data {prompts} --input_key context_messages
        --apply_chat_template --normalize_reward --packing_samples --adam_offload
        --attn_implementation flash_attention_2 --gradient_checkpointing --use_wandb {wandb}"""),
    Script(V092, "train_prm_mistral.sh", "openrlhf.cli.train_prm", "deepspeed", """
        --save_path {out}/final --save_steps 500 --logging_steps 1 --eval_steps 100 --train_batch_size 256
        --micro_train_batch_size 8 --pretrain {prm_model} --param_dtype bf16 --max_epochs 1 --max_len 8192
        --zero_stage 3 --learning_rate 1e-6 --dataset {prm} --input_key input --label_key value
        --attn_implementation flash_attention_2 --load_checkpoint --gradient_checkpointing --packing_samples
        --wandb_group prm --placeholder_token ки --reward_tokens + -"""),
    Script(V092, "train_prorlv2_math_hybrid_engine.sh", "openrlhf.cli.train_ppo_ray", "python", """
        --ref_num_nodes 1 --ref_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
        --vllm_num_engines 8 --vllm_tensor_parallel_size 1 --colocate_all_models
        --vllm_gpu_memory_utilization 0.6 --init_kl_coef 1e-4 --gamma 1.0 --use_kl_loss --kl_estimator k2
        --advantage_estimator reinforce_baseline --dynamic_filtering --dynamic_filtering_reward_range 0 1
        --eps_clip_low_high 0.2 0.27 --pretrain {policy} --remote_rm_url {math_fn} --save_path {out}/final
        --ckpt_path {out}/ckpt --save_steps 10 --save_hf_ckpt --train_batch_size 8192
        --rollout_batch_size 512 --n_samples_per_prompt 16 --use_dynamic_batch --max_epochs 100
        --prompt_max_len 1024 --generate_max_len 8192 --zero_stage 3 --param_dtype bf16
        --actor_learning_rate 2e-6 --prompt_data {math} --input_key prompt --label_key label
        --apply_chat_template --gradient_checkpointing --packing_samples --vllm_sync_backend nccl
        --enforce_eager --vllm_enable_sleep --deepspeed_enable_sleep --enable_vllm_is_correction
        --vllm_is_truncated_threshold 0.5 5.0 --use_icepop --train_max_tokens_per_gpu 16192
        --stop_properly_penalty_coef 0.0"""),
    Script(V092, "train_reinforce_baseline_hybrid_engine.sh", "openrlhf.cli.train_ppo_ray", "ray", """
        --pretrain {policy} --load_checkpoint --save_path {out}/final --ckpt_path {out}/ckpt --save_hf_ckpt
        --max_ckpt_num 3 --save_steps 10
        --agent_func_path {agent_fn} --prompt_data {math} --input_key prompt --label_key label
        --prompt_max_len 10240 --generate_max_len 64000 --apply_chat_template --packing_samples
        --rollout_batch_size 128 --n_samples_per_prompt 8 --train_batch_size 1024 --dynamic_filtering
        --dynamic_filtering_reward_range 0.0 1.0 --use_dynamic_batch --train_max_tokens_per_gpu 16192
        --rollout_max_tokens_per_gpu 32768 --micro_train_batch_size 1 --micro_rollout_batch_size 8
        --max_samples 128000 --max_epochs 1 --num_episodes 1
        --ref_num_nodes 1 --ref_num_gpus_per_node 4 --actor_num_nodes 1 --actor_num_gpus_per_node 4
        --vllm_num_engines 2 --vllm_tensor_parallel_size 2 --vllm_gpu_memory_utilization 0.7
        --colocate_all_models --deepspeed_enable_sleep --vllm_sync_backend nccl --enforce_eager
        --zero_stage 3 --gradient_checkpointing --ring_attn_size 2 --ring_head_stride 2 --param_dtype bf16
        --advantage_estimator reinforce_baseline --actor_learning_rate 5e-7 --entropy_loss_coef 0.0
        --init_kl_coef 1e-5 --use_kl_loss --kl_estimator k2 --enable_vllm_is_correction --use_icepop
        --use_tensorboard {out}/runs --logging_steps 1 --eval_steps -1"""),
    Script(V092, "train_reinforce_baseline_ray_agent_async.sh", "openrlhf.cli.train_ppo_ray", "ray", """
        --pretrain {policy} --load_checkpoint --save_path {out}/final --ckpt_path {out}/ckpt --save_hf_ckpt
        --max_ckpt_num 3 --save_steps 10
        --agent_func_path {agent_fn} --prompt_data {math} --input_key prompt --label_key label
        --prompt_max_len 10240 --generate_max_len 64000 --apply_chat_template --packing_samples
        --rollout_batch_size 128 --n_samples_per_prompt 8 --train_batch_size 1024 --dynamic_filtering
        --dynamic_filtering_reward_range 0.0 1.0 --use_dynamic_batch --train_max_tokens_per_gpu 16192
        --rollout_max_tokens_per_gpu 32768 --micro_train_batch_size 1 --micro_rollout_batch_size 8
        --max_samples 128000 --max_epochs 1 --num_episodes 1
        --async_train --ref_num_nodes 1 --ref_num_gpus_per_node 4 --actor_num_nodes 1
        --actor_num_gpus_per_node 4 --vllm_num_engines 2 --vllm_tensor_parallel_size 2
        --vllm_gpu_memory_utilization 0.7 --colocate_all_models --deepspeed_enable_sleep
        --vllm_sync_backend nccl --enforce_eager --zero_stage 3 --gradient_checkpointing --ring_attn_size 2
        --ring_head_stride 2 --param_dtype bf16
        --advantage_estimator reinforce_baseline --actor_learning_rate 5e-7 --entropy_loss_coef 0.0
        --init_kl_coef 1e-5 --use_kl_loss --kl_estimator k2 --enable_vllm_is_correction --use_icepop
        --use_tensorboard {out}/runs --logging_steps 1 --eval_steps -1"""),
    Script(V092, "train_rm.sh", "openrlhf.cli.train_rm", "deepspeed", """
        --save_path {out}/final --save_steps -1 --logging_steps 1 --eval_steps -1 --train_batch_size 256
        --micro_train_batch_size 1 --pretrain {policy} --param_dtype bf16 --max_epochs 1 --max_len 8192
        --zero_stage 3 --learning_rate 9e-6 --dataset {prefs} --apply_chat_template --chosen_key chosen
        --rejected_key rejected --attn_implementation flash_attention_2 --load_checkpoint --packing_samples
        --gradient_checkpointing"""),
    Script(V092, "train_sft.sh", "openrlhf.cli.train_sft", "deepspeed", """
        --max_len 2048 --dataset {sft} --input_key question --output_key response --train_batch_size 256
        --micro_train_batch_size 2 --max_samples 500000 --pretrain {policy} --save_path {out}/final
        --save_steps -1 --logging_steps 1 --eval_steps -1 --zero_stage 2 --max_epochs 1 --param_dtype bf16
        --attn_implementation flash_attention_2 --learning_rate 5e-6 --load_checkpoint --packing_samples
        --gradient_checkpointing"""),
    Script(V092, "train_sft_mixtral_lora.sh", "openrlhf.cli.train_sft", "deepspeed", """
        --max_len 2048 --dataset {sft} --input_key question --output_key response --train_batch_size 128
        --micro_train_batch_size 4 --max_samples 500000 --pretrain {moe} --save_path {out}/final
        --save_steps -1 --logging_steps 1 --eval_steps -1 --zero_stage 3 --max_epochs 1 --param_dtype bf16
        --gradient_checkpointing --attn_implementation flash_attention_2 --learning_rate 5e-6 --lora_rank 64
        --lora_alpha 64 --packing_samples --aux_loss_coef 0.001"""),
    # ---------------------------------------------------------------- v0.11.0 (dotted flags)
    Script(V011, "serve_remote_rm.sh", "openrlhf.cli.serve_rm", "python", """
        --reward.model_name_or_path {reward} --port 5000 --ds.param_dtype bf16
        --ds.attn_implementation flash_attention_2 --reward.normalize_enable --data.max_len 8192
        --batch_size 16"""),
    Script(V011, "train_dapo_ray_hybrid_engine.sh", "openrlhf.cli.train_ppo_ray", "python", """
        --ref.num_nodes 1 --ref.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
        --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all
        --vllm.gpu_memory_utilization 0.6 --algo.kl.init_coef 1e-3 --algo.advantage.gamma 1.0
        --algo.kl.use_loss --algo.kl.estimator k3 --algo.advantage.estimator group_norm
        --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1 --actor.eps_clip_low_high 0.2 0.27
        --actor.model_name_or_path {policy} --reward.remote_url {reward_fn} --ckpt.output_dir {out}/final
        --ckpt.path {out}/ckpt --ckpt.save_steps 20 --ckpt.save_hf --train.micro_batch_size 8
        --train.batch_size 128 --rollout.micro_batch_size 16 --rollout.batch_size 128
        --rollout.n_samples_per_prompt 8 --train.max_epochs 1 --data.max_len 2048 --data.max_samples 20000
        --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --data.prompt_dataset {prompts}
        --data.input_key context_messages --data.apply_chat_template --actor.gradient_checkpointing_enable
        --ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep
        --ds.enable_sleep --algo.advantage.is_correction_enable"""),
    Script(V011, "train_dpo_llama.sh", "openrlhf.cli.train_dpo", "deepspeed", """
        --ckpt.output_dir {out}/final --ckpt.save_steps -1 --logger.logging_steps 1 --eval.steps -1
        --train.batch_size 256 --train.micro_batch_size 1 --model.model_name_or_path {policy}
        --ds.param_dtype bf16 --train.max_epochs 1 --data.max_len 8192 --ds.zero_stage 3 --adam.lr 5e-7
        --model.beta 0.1 --data.dataset {prefs} --data.apply_chat_template --data.chosen_key chosen
        --data.rejected_key rejected --ds.attn_implementation flash_attention_2 --ckpt.load_enable
        --ds.packing_samples --model.gradient_checkpointing_enable"""),
    Script(V011, "train_ppo_ray_hybrid_engine.sh", "openrlhf.cli.train_ppo_ray", "python", """
        --ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1 --reward.num_gpus_per_node 8
        --critic.num_nodes 1 --critic.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
        --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all
        --vllm.gpu_memory_utilization 0.5 --actor.model_name_or_path {policy}
        --reward.model_name_or_path {reward} --ckpt.output_dir {out}/final --ckpt.path {out}/ckpt
        --ckpt.save_hf --train.batch_size 128 --rollout.batch_size 1024 --rollout.n_samples_per_prompt 1
        --train.max_epochs 1 --data.max_len 2048 --data.max_samples 100000 --ds.zero_stage 3
        --ds.param_dtype bf16 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01
        --data.prompt_dataset {prompts} --data.input_key context_messages --data.apply_chat_template
        --reward.normalize_enable --actor.gradient_checkpointing_enable --ds.packing_samples
        --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep
        --train.dynamic_batch_enable --train.max_tokens_per_gpu 16384 --algo.advantage.is_correction_enable"""),
    Script(V011, "train_ppo_ray_slurm.sh", "openrlhf.cli.train_ppo_ray", "ray", """
        --ref.num_nodes 1 --ref.num_gpus_per_node 4 --reward.num_nodes 1 --reward.num_gpus_per_node 4
        --critic.num_nodes 1 --critic.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4
        --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_critic_reward
        --train.colocate_actor_ref --actor.model_name_or_path {policy} --reward.model_name_or_path {reward}
        --ckpt.output_dir {out}/final --train.micro_batch_size 8 --train.batch_size 128
        --rollout.micro_batch_size 16 --rollout.batch_size 1024 --data.max_samples 100000
        --train.max_epochs 1 --data.max_len 2048 --ds.zero_stage 3 --ds.param_dtype bf16
        --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 --data.prompt_dataset {prompts}
        --data.input_key context_messages --data.apply_chat_template --reward.normalize_enable
        --ds.adam_offload --ds.packing_samples --vllm.sync_backend nccl --actor.gradient_checkpointing_enable
        --logger.wandb.key {wandb}"""),
    Script(V011, "train_ppo_with_reward_fn.sh", "openrlhf.cli.train_ppo_ray", "ray", """
        --ref.num_nodes 1 --ref.num_gpus_per_node 2 --critic.num_nodes 1 --critic.num_gpus_per_node 2
        --actor.num_nodes 1 --actor.num_gpus_per_node 2 --vllm.num_engines 2 --vllm.tensor_parallel_size 2
        --train.colocate_actor_ref --actor.model_name_or_path {policy} --reward.remote_url {reward_fn}
        --ckpt.output_dir {out}/final --train.micro_batch_size 8 --train.batch_size 128
        --rollout.micro_batch_size 16 --rollout.batch_size 1024 --data.max_samples 100000
        --train.max_epochs 1 --data.max_len 2048 --ds.zero_stage 3 --ds.param_dtype bf16
        --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 --data.prompt_dataset {prompts}
        --data.input_key context_messages --data.apply_chat_template --reward.normalize_enable
        --ds.packing_samples --ds.adam_offload --ds.attn_implementation flash_attention_2
        --actor.gradient_checkpointing_enable --logger.wandb.key {wandb}"""),
    Script(V011, "train_prorlv2_math_hybrid_engine.sh", "openrlhf.cli.train_ppo_ray", "python", """
        --ref.num_nodes 1 --ref.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
        --vllm.num_engines 8 --vllm.tensor_parallel_size 1 --train.colocate_all
        --vllm.gpu_memory_utilization 0.75 --algo.kl.init_coef 1e-4 --algo.advantage.gamma 1.0
        --algo.kl.use_loss --algo.kl.estimator k2 --algo.advantage.estimator reinforce_baseline
        --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1 --actor.eps_clip_low_high 0.2 0.27
        --actor.model_name_or_path {policy} --reward.remote_url {math_fn} --ckpt.output_dir {out}/final
        --ckpt.path {out}/ckpt --ckpt.save_steps 5 --ckpt.save_hf --train.batch_size 1024
        --rollout.batch_size 512 --rollout.n_samples_per_prompt 16 --train.dynamic_batch_enable
        --train.num_episodes 100 --data.max_len 9216 --rollout.max_new_tokens 8192 --ds.zero_stage 3
        --ds.param_dtype bf16 --actor.adam.lr 1e-6 --data.prompt_dataset {math} --data.input_key prompt
        --data.label_key label --eval.dataset {math} --eval.steps 5 --eval.temperature 1.0
        --eval.n_samples_per_prompt 4 --data.apply_chat_template --actor.gradient_checkpointing_enable
        --ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep
        --ds.enable_sleep --algo.advantage.is_correction_enable --algo.advantage.is_correction_threshold 0.5 5.0
        --algo.advantage.is_correction_type icepop --train.max_tokens_per_gpu 32768
        --reward.stop_properly_penalty_coef 0.0"""),
    Script(V011, "train_reinforce_baseline_hybrid_engine.sh", "openrlhf.cli.train_ppo_ray", "ray", """
        --actor.model_name_or_path {policy} --ckpt.load_enable --ckpt.output_dir {out}/final
        --ckpt.path {out}/ckpt --ckpt.save_hf --ckpt.max_num 3 --ckpt.save_steps 10
        --train.agent_func_path {agent_fn} --data.prompt_dataset {math} --data.input_key prompt
        --data.label_key label --data.max_len 74240 --rollout.max_new_tokens 64000 --data.apply_chat_template
        --ds.packing_samples --rollout.batch_size 128 --rollout.n_samples_per_prompt 8 --train.batch_size 1024
        --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0.0 1.0 --train.dynamic_batch_enable
        --train.max_tokens_per_gpu 16192 --rollout.max_tokens_per_gpu 32768 --train.micro_batch_size 1
        --rollout.micro_batch_size 8 --data.max_samples 128000 --train.max_epochs 1 --train.num_episodes 1
        --ref.num_nodes 1 --ref.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4
        --vllm.num_engines 2 --vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.7
        --train.colocate_all --ds.enable_sleep --vllm.sync_backend nccl --vllm.enforce_eager --ds.zero_stage 3
        --actor.gradient_checkpointing_enable --ds.ring_attn_size 2 --ds.ring_attn_head_stride 2
        --ds.param_dtype bf16
        --algo.advantage.estimator reinforce_baseline --actor.adam.lr 5e-7 --actor.entropy_coef 0.0
        --algo.kl.init_coef 1e-5 --algo.kl.use_loss --algo.kl.estimator k2 --algo.advantage.is_correction_enable
        --algo.advantage.is_correction_type icepop
        --logger.tensorboard_dir {out}/runs --logger.logging_steps 1 --eval.steps -1"""),
    Script(V011, "train_reinforce_baseline_ray_agent_async.sh", "openrlhf.cli.train_ppo_ray", "ray", """
        --actor.model_name_or_path {policy} --ckpt.load_enable --ckpt.output_dir {out}/final
        --ckpt.path {out}/ckpt --ckpt.save_hf --ckpt.max_num 3 --ckpt.save_steps 10
        --train.agent_func_path {agent_fn} --data.prompt_dataset {math} --data.input_key prompt
        --data.label_key label --data.max_len 74240 --rollout.max_new_tokens 64000 --data.apply_chat_template
        --ds.packing_samples --rollout.batch_size 128 --rollout.n_samples_per_prompt 8 --train.batch_size 1024
        --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0.0 1.0 --train.dynamic_batch_enable
        --train.max_tokens_per_gpu 16192 --rollout.max_tokens_per_gpu 32768 --train.micro_batch_size 1
        --rollout.micro_batch_size 8 --data.max_samples 128000 --train.max_epochs 1 --train.num_episodes 1
        --train.async_enable --train.partial_rollout_enable --ref.num_nodes 1 --ref.num_gpus_per_node 4
        --actor.num_nodes 1 --actor.num_gpus_per_node 4 --vllm.num_engines 2 --vllm.tensor_parallel_size 2
        --vllm.gpu_memory_utilization 0.95 --train.colocate_all --ds.enable_sleep --vllm.sync_backend nccl
        --vllm.enforce_eager --ds.zero_stage 3 --actor.gradient_checkpointing_enable --ds.ring_attn_size 2
        --ds.ring_attn_head_stride 2 --ds.param_dtype bf16
        --algo.advantage.estimator reinforce_baseline --actor.adam.lr 5e-7 --actor.entropy_coef 0.0
        --algo.kl.init_coef 1e-5 --algo.kl.use_loss --algo.kl.estimator k2 --algo.advantage.is_correction_enable
        --algo.advantage.is_correction_type icepop
        --logger.tensorboard_dir {out}/runs --logger.logging_steps 1 --eval.steps -1"""),
    Script(V011, "train_rm.sh", "openrlhf.cli.train_rm", "deepspeed", """
        --ckpt.output_dir {out}/final --ckpt.save_steps -1 --logger.logging_steps 1 --eval.steps -1
        --train.batch_size 256 --train.micro_batch_size 1 --model.model_name_or_path {policy}
        --ds.param_dtype bf16 --train.max_epochs 1 --data.max_len 8192 --ds.zero_stage 3 --adam.lr 9e-6
        --data.dataset {prefs} --data.apply_chat_template --data.chosen_key chosen --data.rejected_key rejected
        --ds.attn_implementation flash_attention_2 --ckpt.load_enable --ds.packing_samples
        --model.gradient_checkpointing_enable"""),
    Script(V011, "train_sft.sh", "openrlhf.cli.train_sft", "deepspeed", """
        --data.max_len 2048 --data.dataset {sft} --data.input_key question --data.output_key response
        --train.batch_size 256 --train.micro_batch_size 2 --data.max_samples 500000
        --model.model_name_or_path {policy} --ckpt.output_dir {out}/final --ckpt.save_steps -1
        --logger.logging_steps 1 --eval.steps -1 --ds.zero_stage 2 --train.max_epochs 1 --ds.param_dtype bf16
        --ds.attn_implementation flash_attention_2 --adam.lr 5e-6 --ckpt.load_enable --ds.packing_samples
        --model.gradient_checkpointing_enable"""),
    Script(V011, "train_sft_mixtral_lora.sh", "openrlhf.cli.train_sft", "deepspeed", """
        --data.max_len 2048 --data.dataset {sft} --data.input_key question --data.output_key response
        --train.batch_size 128 --train.micro_batch_size 4 --data.max_samples 500000
        --model.model_name_or_path {moe} --ckpt.output_dir {out}/final --ckpt.save_steps -1
        --logger.logging_steps 1 --eval.steps -1 --ds.zero_stage 3 --train.max_epochs 1 --ds.param_dtype bf16
        --model.gradient_checkpointing_enable --ds.attn_implementation flash_attention_2 --adam.lr 5e-6
        --ds.lora.rank 64 --ds.lora.alpha 64 --ds.packing_samples --model.aux_loss_coef 0.001"""),
    Script(V011, "train_vlm_math_hybrid_engine.sh", "openrlhf.cli.train_ppo_ray", "python", """
        --ref.num_nodes 1 --ref.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4
        --vllm.num_engines 4 --vllm.tensor_parallel_size 1 --train.colocate_all
        --vllm.gpu_memory_utilization 0.7 --algo.kl.init_coef 0 --algo.advantage.gamma 1.0 --algo.kl.use_loss
        --algo.kl.estimator k2 --algo.advantage.estimator reinforce_baseline --actor.model_name_or_path {vlm}
        --reward.remote_url {math_fn} --ckpt.output_dir {out}/final --ckpt.path {out}/ckpt --ckpt.save_hf
        --ckpt.save_steps 5 --eval.steps -1 --train.micro_batch_size 1 --rollout.micro_batch_size 1
        --train.batch_size 1024 --rollout.batch_size 128 --rollout.n_samples_per_prompt 8
        --train.num_episodes 100 --data.max_len 4096 --rollout.max_new_tokens 2048 --ds.zero_stage 3
        --ds.param_dtype bf16 --actor.adam.lr 2e-6 --data.prompt_dataset {images} --data.input_key prompt
        --data.label_key label --data.image_key images --data.max_images_per_prompt 1
        --actor.freeze_visual_encoder --data.apply_chat_template --actor.gradient_checkpointing_enable
        --ds.attn_implementation eager --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep
        --ds.enable_sleep"""),
]  # fmt: skip
