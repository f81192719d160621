#!/usr/bin/env bash
# OpenRLHF v0.9.2's examples/scripts/train_conditional.sh on tidal: the same flags, with `openrlhf` ->
# `tidal` in the module paths and `deepspeed --module` -> `torchrun ... -m` (tidal trains under
# torchrun; the batch_inference step runs in one process). Set the paths below (environment variables)
# for your models and data; tests/cli/test_openrlhf_scripts.py runs these command lines on a CPU with
# tiny models and small sizes. Score each preference row's chosen conversation (its last turn is the
# response), write the reward into the prompt (--post_processor csft), SFT on that.
set -x

checkSuccess() {
    if [[ $? != 0 ]]; then
        echo "FAILED $1"
        exit 1
    fi
}

OUT=${OUT:-./checkpoint/llama-2-8b-csft}
mkdir -p $OUT
RM_OUTPUT=$OUT/rm.jsonl
REWARD_MODEL_PATH=${REWARD_MODEL_PATH:-OpenRLHF/Llama-3-8b-rm-mixture}
POLICY_MODEL_PATH=${POLICY_MODEL_PATH:-OpenRLHF/Llama-3-8b-sft-mixture}
PREFERENCE_DATASET=${PREFERENCE_DATASET:-OpenRLHF/preference_dataset_mixture2_and_safe_pku}
MODEL_OUTPUT_PATH=${MODEL_OUTPUT_PATH:-./checkpoint/llama-3-8b-csft}

read -r -d '' get_rewards_commands <<EOC
tidal.cli.batch_inference \
    --eval_task rm \
    --pretrain $REWARD_MODEL_PATH \
    --param_dtype bf16 \
    --max_len 4096 \
    --dataset $PREFERENCE_DATASET \
    --input_key chosen \
    --apply_chat_template \
    --max_samples 128000 \
    --zero_stage 0 \
    --post_processor csft \
    --normalize_reward
    --micro_batch_size 4 \
    --output_path $RM_OUTPUT
EOC

read -r -d '' sft_commands <<EOC
tidal.cli.train_sft \
    --max_len 4096 \
    --dataset $RM_OUTPUT \
    --dataset_probs 1.0 \
    --train_batch_size 128 \
    --micro_train_batch_size 2 \
    --pretrain $POLICY_MODEL_PATH \
    --save_path $MODEL_OUTPUT_PATH \
    --zero_stage 2 \
    --max_epochs 1 \
    --param_dtype bf16 \
    --learning_rate 5e-6 \
    --gradient_checkpointing
EOC

if [ ! -e $RM_OUTPUT ]; then
    python -m $get_rewards_commands
    checkSuccess "RM"
fi
torchrun --standalone --nproc-per-node ${NPROC_PER_NODE:-8} -m $sft_commands
