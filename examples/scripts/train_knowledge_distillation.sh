#!/usr/bin/env bash
# Knowledge distillation (the seed's train_knowledge_distillation.sh, tiny and on a CPU): the
# untrained base learns from the SFT model's next-token distributions on SFT data.
# --kd_coef is α in (1 − α)·LM + α·KD; --teacher_offload keeps the teacher in CPU memory.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$SCRIPT_DIR/tiny_assets.sh"

$TIDAL kd --pretrain "$BASE" --teacher_model "$SFT_MODEL" --dataset "$WORK/sft.jsonl" \
  --input_key prompt --output_key answer --kd_coef 0.4 \
  --max_len 64 --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 1 \
  --learning_rate 3e-3 --lr_warmup_ratio 0.1 --logging_steps 1 \
  --save_path "$WORK/kd" --ckpt_path "$WORK/ckpt/kd" "$@"
