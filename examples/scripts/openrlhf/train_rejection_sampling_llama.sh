#!/usr/bin/env bash
# OpenRLHF v0.9.2's examples/scripts/train_rejection_sampling_llama.sh on tidal: the same flags, with
# `openrlhf` -> `tidal` in the module paths and `deepspeed --module` -> `torchrun ... -m` (tidal trains
# under torchrun; the two batch_inference steps run in one process). Set the paths below (environment
# variables) for your models and data; tests/cli/test_openrlhf_scripts.py runs these command lines on a
# CPU with tiny models and small sizes. Each iteration: sample --best_of_n responses per prompt, keep the
# reward model's best (--post_processor rs), SFT the policy on them.
set -x

checkSuccess() {
   if [[ $? != 0 ]]; then
      echo "FAILED $1"
      exit 1
   fi
}

OUT=${OUT:-./checkpoint/llama-3-8b-rejection}
mkdir -p $OUT
GENERATE_OUTPUT=$OUT/generate.jsonl
RM_OUTPUT=$OUT/rm.jsonl
ITER_LOG_PATH=$OUT/iter.log
MODEL_OUTPUT_PATH=$OUT

TRAINING_ITERS=${TRAINING_ITERS:-10}
ROLLOUT_BATCH_SIZE=${ROLLOUT_BATCH_SIZE:-10240}

POLICY_MODEL_PATH=${POLICY_MODEL_PATH:-OpenRLHF/Llama-3-8b-sft-mixture}
REWARD_MODEL_PATH=${REWARD_MODEL_PATH:-OpenRLHF/Llama-3-8b-rm-mixture}
PROMPT_DATASET=${PROMPT_DATASET:-OpenRLHF/prompt-collection-v0.1}

iter=0
if [ -f $ITER_LOG_PATH ]; then
   iter=$(cat $ITER_LOG_PATH)
fi

while (($iter < $TRAINING_ITERS)); do
   echo "Iter: $iter"
   # Use latest model if past first iteration
   if ((iter > 0)); then
      POLICY_MODEL_PATH=$MODEL_OUTPUT_PATH
   fi

   read -r -d '' generate_commands <<EOC
tidal.cli.batch_inference
   --eval_task generate_vllm \
   --pretrain $POLICY_MODEL_PATH \
   --param_dtype bf16 \
   --max_new_tokens 2048 \
   --prompt_max_len 2048 \
   --dataset $PROMPT_DATASET \
   --input_key context_messages \
   --apply_chat_template \
   --temperature 0.9
   --zero_stage 0 \
   --best_of_n 4 \
   --enable_prefix_caching \
   --tp_size 4 \
   --max_num_seqs 64 \
   --iter $iter \
   --rollout_batch_size $ROLLOUT_BATCH_SIZE \
   --output_path $GENERATE_OUTPUT
EOC
   echo $generate_commands
   python -m $generate_commands
   checkSuccess "GENERATE"

   read -r -d '' get_rewards_commands <<EOC
tidal.cli.batch_inference
   --eval_task rm \
   --pretrain $REWARD_MODEL_PATH \
   --param_dtype bf16 \
   --max_len 4096 \
   --dataset $GENERATE_OUTPUT  \
   --dataset_probs 1.0 \
   --zero_stage 0 \
   --post_processor rs \
   --micro_batch_size 4 \
   --output_path $RM_OUTPUT
EOC
   echo $get_rewards_commands
   python -m $get_rewards_commands
   checkSuccess "RM"

   read -r -d '' sft_commands <<EOC
tidal.cli.train_sft \
   --max_len 4096 \
   --dataset $RM_OUTPUT \
   --dataset_probs 1.0 \
   --train_batch_size 128 \
   --micro_train_batch_size 2 \
   --pretrain $POLICY_MODEL_PATH \
   --save_path $MODEL_OUTPUT_PATH \
   --input_template "" \
   --zero_stage 2 \
   --max_epochs 1 \
   --param_dtype bf16 \
   --learning_rate 2e-6 \
   --gradient_checkpointing
EOC
   echo $sft_commands
   torchrun --standalone --nproc-per-node ${NPROC_PER_NODE:-8} -m $sft_commands
   checkSuccess "SFT"

   iter=$((iter + 1))
   if [[ "$ITER_LOG_PATH" != "null" ]]; then
      echo $iter >$ITER_LOG_PATH
   fi
done
