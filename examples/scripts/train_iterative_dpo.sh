#!/usr/bin/env bash
# Iterative (online) DPO (RLHF workflow, arXiv 2405.07863).
# Each iteration: sample N responses per prompt from the current policy, let the reward model pick
# the best as "chosen" and the worst as "rejected" (--post_processor iter_dpo), then run DPO with
# the current policy as both the starting point and the reference.
# Runs on a CPU with the tiny assets; set SFT_MODEL/RM_MODEL/PROMPTS for real models and data.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$SCRIPT_DIR/tiny_assets.sh"

PROMPTS=${PROMPTS:-$WORK/prompts.jsonl}
ITERS=${ITERS:-2}
N=${N:-4}
OUT_DIR=$WORK/iterative_dpo
POLICY=$SFT_MODEL

for iter in $(seq 1 "$ITERS"); do
  ITER_DIR=$OUT_DIR/iter_$iter
  # 1. On-policy pairs: JSONL rows {"prompt", "chosen", "rejected"}.
  $TIDAL generate --pretrain "$POLICY" --dataset "$PROMPTS" --input_key prompt \
    --output_path "$ITER_DIR/pairs.jsonl" --max_new_tokens 8 --temperature 1.0 --top_p 1.0 \
    --best_of_n "$N" --reward_pretrain "$RM_MODEL" --post_processor iter_dpo --max_samples 64
  # 2. DPO against the policy that generated the pairs.
  $TIDAL dpo --pretrain "$POLICY" --ref_pretrain "$POLICY" --dataset "$ITER_DIR/pairs.jsonl" \
    --prompt_key prompt --chosen_key chosen --rejected_key rejected --beta 0.1 \
    --max_len 64 --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 1 \
    --learning_rate 5e-4 --save_path "$ITER_DIR/model" --ckpt_path "$ITER_DIR/ckpt"
  POLICY=$ITER_DIR/model
done
echo "iterative-DPO policy: $POLICY"
