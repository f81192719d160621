#!/usr/bin/env bash
# OpenRLHF v0.9.2's examples/scripts/train_iterative_dpo.sh on tidal: the same flags, with `openrlhf` ->
# `tidal` in the module paths and `deepspeed --module` -> `torchrun ... -m` (tidal trains under
# torchrun; the two batch_inference steps run in one process). Set the paths below (environment
# variables) for your models and data; tests/cli/test_openrlhf_scripts.py runs these command lines on a
# CPU with tiny models and small sizes. Each iteration: sample --best_of_n responses per prompt, let the
# reward model pick the best and worst (--post_processor iter_dpo), DPO against the sampling policy.
set -x

checkSuccess() {
   if [[ $? != 0 ]]; then
      echo "FAILED $1"
      exit 1
   fi
}

OUT=${OUT:-./checkpoint/llama-3-8b-iter-dpo}
mkdir -p $OUT
GENERATE_OUTPUT=$OUT/generate.jsonl
RM_OUTPUT=$OUT/rm.jsonl
MODEL_OUTPUT_PATH=$OUT/checkpoint
ITER_LOG_PATH=null

TRAINING_ITERS=${TRAINING_ITERS:-5}
ROLLOUT_BATCH_SIZE=${ROLLOUT_BATCH_SIZE:-10240}

POLICY_MODEL_PATH=${POLICY_MODEL_PATH:-OpenRLHF/Llama-3-8b-sft-mixture}
REF_MODEL_PATH=$POLICY_MODEL_PATH
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
   --max_new_tokens 2048 \
   --prompt_max_len 2048 \
   --dataset $PROMPT_DATASET \
   --input_key context_messages \
   --apply_chat_template \
   --temperature 1.0 \
   --tp_size 4 \
   --best_of_n 8 \
   --enable_prefix_caching \
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
   --post_processor iter_dpo \
   --micro_batch_size 4 \
   --output_path $RM_OUTPUT
EOC
   echo $get_rewards_commands
   python -m $get_rewards_commands
   checkSuccess "RM"

   read -r -d '' dpo_commands <<EOC
tidal.cli.train_dpo \
   --max_len 4096 \
   --dataset $RM_OUTPUT \
   --dataset_probs 1.0 \
   --prompt_key prompt \
   --train_batch_size 128 \
   --micro_train_batch_size 2 \
   --pretrain $POLICY_MODEL_PATH \
   --ref_pretrain $REF_MODEL_PATH \
   --save_path $MODEL_OUTPUT_PATH \
   --zero_stage 3 \
   --max_epochs 1 \
   --param_dtype bf16 \
   --learning_rate 5e-7 \
   --gradient_checkpointing
EOC
   echo $dpo_commands
   torchrun --standalone --nproc-per-node ${NPROC_PER_NODE:-8} -m $dpo_commands
   checkSuccess "DPO"

   iter=$((iter + 1))
   if [[ "$ITER_LOG_PATH" != "null" ]]; then
      echo $iter >$ITER_LOG_PATH
   fi
done
