#!/usr/bin/env bash
# Conditional SFT (quality-conditioned training, as in SteerLM, arXiv 2310.05344).
# Sample N responses per prompt, score every one with the reward model, and let
# --post_processor csft write each sample's reward into its prompt ("input"), so SFT teaches the
# policy what a response of a given score looks like. At inference, condition on a high score
# (--reward_template, default "{input} <rm_score>: {reward} "; see `tidal generate --help`).
# Runs on a CPU with the tiny assets; set SFT_MODEL/RM_MODEL/PROMPTS for real models and data.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$SCRIPT_DIR/tiny_assets.sh"

PROMPTS=${PROMPTS:-$WORK/prompts.jsonl}
N=${N:-4}
OUT_DIR=$WORK/conditional_sft

# 1. Sample and score: JSONL rows {"input" (prompt with its reward), "output", "reward"}.
$TIDAL generate --pretrain "$SFT_MODEL" --dataset "$PROMPTS" --input_key prompt \
  --output_path "$OUT_DIR/scored.jsonl" --max_new_tokens 8 --temperature 1.0 --top_p 1.0 \
  --best_of_n "$N" --reward_pretrain "$RM_MODEL" --post_processor csft --max_samples 64
# 2. SFT on the reward-conditioned prompts.
$TIDAL sft --pretrain "$SFT_MODEL" --dataset "$OUT_DIR/scored.jsonl" --input_key input --output_key output \
  --max_len 96 --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 1 \
  --learning_rate 5e-4 --save_path "$OUT_DIR/model" --ckpt_path "$OUT_DIR/ckpt"
# 3. Condition on a high reward at inference (here the best reward in the training data): every
#    prompt gets the same tag, so the policy should answer like its best-scored samples.
HIGH=$($PYTHON -c "import json, sys; print(max(json.loads(l)['reward'] for l in open(sys.argv[1])))" "$OUT_DIR/scored.jsonl")
$TIDAL generate --pretrain "$OUT_DIR/model" --dataset "$PROMPTS" --input_key prompt \
  --output_path "$OUT_DIR/conditioned.jsonl" --max_new_tokens 8 --temperature 0 --csft_reward "$HIGH" \
  --reward_pretrain "$RM_MODEL" --max_samples 64
echo "conditional-SFT policy: $OUT_DIR/model (samples conditioned on reward $HIGH: $OUT_DIR/conditioned.jsonl)"
