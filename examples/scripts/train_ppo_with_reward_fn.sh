#!/usr/bin/env bash
# RL with a custom reward function (the seed README's reward_func.py usage), tiny and on a CPU.
# --label_key passes the dataset's "label" column to reward_func as `labels`.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$SCRIPT_DIR/tiny_assets.sh"

$PYTHON -m tidal.cli.train_ppo_ray \
  --pretrain "$SFT_MODEL" --use_dynamic_batch \
  --remote_rm_url "$SCRIPT_DIR/../reward_func.py" --label_key label \
  --prompt_data "$WORK/prompts.jsonl" --input_key prompt \
  --advantage_estimator reinforce_baseline --n_samples_per_prompt 4 --rollout_batch_size 16 \
  --train_batch_size 64 --micro_train_batch_size 16 --prompt_max_len 32 --generate_max_len 8 \
  --init_kl_coef 1e-3 --use_kl_loss --kl_estimator k2 --actor_learning_rate 1e-4 \
  --save_path "$WORK/ppo_reward_fn" --ckpt_path "$WORK/ckpt/ppo_reward_fn" "$@"
