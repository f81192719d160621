#!/usr/bin/env bash
# DPO / IPO / cDPO on preference pairs (the seed's train_dpo_llama.sh, tiny and on a CPU).
# Variants: add --ipo for IPO, --label_smoothing 0.1 for cDPO, --nll_loss_coef 0.2 for an NLL term
# on the chosen responses; --lora_rank 8 trains adapters (the reference is then the base with the
# adapters disabled); --ref_offload keeps a separate reference in CPU memory.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$SCRIPT_DIR/tiny_assets.sh"

$TIDAL dpo --pretrain "$SFT_MODEL" --dataset "$WORK/pairs.jsonl" \
  --prompt_key prompt --chosen_key chosen --rejected_key rejected \
  --beta 0.1 --max_len 64 --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 1 \
  --learning_rate 5e-4 --packing_samples --logging_steps 1 \
  --save_path "$WORK/dpo" --ckpt_path "$WORK/ckpt/dpo" "$@"
