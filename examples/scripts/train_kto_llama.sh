#!/usr/bin/env bash
# KTO on unpaired desirable/undesirable samples (the seed's train_kto_llama.sh, tiny and on a CPU).
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$SCRIPT_DIR/tiny_assets.sh"

$TIDAL kto --pretrain "$SFT_MODEL" --dataset "$WORK/unpaired.jsonl" \
  --input_key input --output_key output --label_key label \
  --beta 0.1 --desirable_loss_weight 1.0 --undesirable_loss_weight 1.0 \
  --max_len 64 --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 1 \
  --learning_rate 5e-4 --logging_steps 1 --save_path "$WORK/kto" --ckpt_path "$WORK/ckpt/kto" "$@"
