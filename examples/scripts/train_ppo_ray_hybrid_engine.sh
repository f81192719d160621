#!/usr/bin/env bash
# The seed README's PPO command (hybrid engine: every model and the rollout engine share the devices),
# tiny and on a CPU: only model paths, sizes and the module name differ. On a GPU cluster, set the
# *_num_gpus_per_node / --vllm_num_engines sizes back (they launch Ray workers; docs/distributed.md).
# Variants: --advantage_estimator reinforce | rloo | reinforce_baseline | group_norm | dr_grpo.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$SCRIPT_DIR/tiny_assets.sh"

$PYTHON -m tidal.cli.train_ppo_ray \
  --ref_num_nodes 1 --ref_num_gpus_per_node 1 --reward_num_nodes 1 --reward_num_gpus_per_node 1 \
  --critic_num_nodes 1 --critic_num_gpus_per_node 1 --actor_num_nodes 1 --actor_num_gpus_per_node 1 \
  --vllm_num_engines 1 --vllm_tensor_parallel_size 1 --colocate_all_models --vllm_gpu_memory_utilization 0.5 \
  --pretrain "$SFT_MODEL" --reward_pretrain "$RM_MODEL" \
  --save_path "$WORK/ppo" --ckpt_path "$WORK/ckpt/ppo" --save_hf_ckpt \
  --train_batch_size 16 --rollout_batch_size 16 --use_dynamic_batch --n_samples_per_prompt 1 \
  --max_epochs 1 --prompt_max_len 32 --max_samples 64 --generate_max_len 8 \
  --zero_stage 3 --param_dtype fp32 --actor_learning_rate 5e-6 --critic_learning_rate 9e-6 \
  --init_kl_coef 0.01 --prompt_data "$WORK/prompts.jsonl" --input_key prompt \
  --normalize_reward --gradient_checkpointing --packing_samples \
  --vllm_sync_backend nccl --enforce_eager --vllm_enable_sleep --deepspeed_enable_sleep "$@"
