#!/usr/bin/env bash
# Rejection sampling (RS-SFT, best-of-N fine-tuning as in Llama 2, arXiv 2307.09288).
# Each iteration: sample N responses per prompt from the current policy, keep the one the reward
# model scores highest (--post_processor rs), then SFT the policy on the kept (input, output) pairs.
# Runs on a CPU with the tiny assets; set SFT_MODEL/RM_MODEL/PROMPTS for real models and data.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$SCRIPT_DIR/tiny_assets.sh"

PROMPTS=${PROMPTS:-$WORK/prompts.jsonl}
ITERS=${ITERS:-2}
N=${N:-4}
OUT_DIR=$WORK/rejection_sampling
POLICY=$SFT_MODEL

for iter in $(seq 1 "$ITERS"); do
  ITER_DIR=$OUT_DIR/iter_$iter
  # 1. Best of N: generate N samples per prompt, score them with the RM, keep the best one.
  $TIDAL generate --pretrain "$POLICY" --dataset "$PROMPTS" --input_key prompt \
    --output_path "$ITER_DIR/best_of_n.jsonl" --max_new_tokens 8 --temperature 1.0 --top_p 1.0 \
    --best_of_n "$N" --reward_pretrain "$RM_MODEL" --post_processor rs --max_samples 64
  # 2. SFT on the kept samples: JSONL rows {"input", "output", "reward"}.
  $TIDAL sft --pretrain "$POLICY" --dataset "$ITER_DIR/best_of_n.jsonl" --input_key input --output_key output \
    --max_len 64 --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 1 \
    --learning_rate 5e-4 --save_path "$ITER_DIR/model" --ckpt_path "$ITER_DIR/ckpt"
  POLICY=$ITER_DIR/model
done
echo "rejection-sampling policy: $POLICY"
