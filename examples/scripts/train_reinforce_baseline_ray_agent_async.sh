#!/usr/bin/env bash
# Multi-turn agent RL with asynchronous generation (the seed README's agent command), tiny and on a
# CPU. examples/agent_func.py gives the model a second try when its first answer is wrong.
# On GPUs, pass --vllm_num_engines N (without --colocate_all_models) to give the engines GPUs of their
# own: they then generate the next rollout while the policy trains (docs/distributed.md).
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$SCRIPT_DIR/tiny_assets.sh"

$PYTHON -m tidal.cli.train_ppo_ray \
  --pretrain "$SFT_MODEL" --use_dynamic_batch \
  --agent_func_path "$SCRIPT_DIR/../agent_func.py" --label_key label \
  --prompt_data "$WORK/prompts.jsonl" --input_key prompt \
  --advantage_estimator reinforce_baseline --n_samples_per_prompt 4 --rollout_batch_size 16 \
  --train_batch_size 64 --micro_train_batch_size 16 --prompt_max_len 32 --generate_max_len 8 \
  --init_kl_coef 1e-3 --use_kl_loss --kl_estimator k2 --actor_learning_rate 1e-4 --normalize_reward \
  --async_train --async_queue_size 1 \
  --save_path "$WORK/agent_async" --ckpt_path "$WORK/ckpt/agent_async" "$@"
