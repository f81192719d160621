# Tiny CPU assets shared by the recipe scripts (source it, don't run it):
#   - $WORK/base     a random-init tiny Llama-style model with its tokenizer (built offline)
#   - $WORK/sft      the base after a short SFT on "a+b=" -> sum, so it answers with digits
#   - $WORK/rm       a reward model trained on correct-vs-wrong sums (tidal rm, with reward mean/std)
#   - data files:    prompts.jsonl (prompt, answer, label = the true sum), sft.jsonl (prompt, answer),
#                    pairs.jsonl (prompt, chosen, rejected), unpaired.jsonl (input, output, label)
# Everything is skipped when it already exists, so recipes can share one $WORK.
# Swap in real models and datasets by setting BASE, SFT_MODEL and RM_MODEL before sourcing.

WORK=${WORK:-./runs/tiny}
TIDAL=${TIDAL:-tidal}        # e.g. TIDAL="python -m tidal.cli.main"
PYTHON=${PYTHON:-python}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
mkdir -p "$WORK"

BASE=${BASE:-$WORK/base}
SFT_MODEL=${SFT_MODEL:-$WORK/sft}
RM_MODEL=${RM_MODEL:-$WORK/rm}

if [ ! -f "$BASE/config.json" ]; then
  $PYTHON -c "from tidal.testing import build_tiny_model; build_tiny_model('$BASE', 'llama', seed=0)"
fi

if [ ! -f "$WORK/unpaired.jsonl" ]; then
  $PYTHON - "$WORK" <<'PY'
import json
import sys
from pathlib import Path

from tidal.testing import AdditionTask

work = Path(sys.argv[1])
task = AdditionTask(digits=2, seed=0)
task.write_jsonl(work / "sft.jsonl", 512)
task.write_jsonl(work / "prompts.jsonl", 64, split="test")
with open(work / "pairs.jsonl", "w") as pairs, open(work / "unpaired.jsonl", "w") as unpaired:
    for i, s in enumerate(task.samples(256, split="pairs")):
        wrong = str(int(s["answer"]) + 1 + i % 9)
        pairs.write(json.dumps({"prompt": s["prompt"], "chosen": s["answer"], "rejected": wrong}) + "\n")
        good = i % 2 == 0
        row = {"input": s["prompt"], "output": s["answer"] if good else wrong, "label": good}
        unpaired.write(json.dumps(row) + "\n")
PY
fi

# Batch sizes and learning rates below are for the tiny model on a CPU; see docs/recipes.md.
if [ ! -f "$SFT_MODEL/config.json" ]; then
  $TIDAL sft --pretrain "$BASE" --dataset "$WORK/sft.jsonl" --input_key prompt --output_key answer \
    --max_len 64 --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 2 \
    --learning_rate 3e-3 --lr_warmup_ratio 0.1 --save_path "$SFT_MODEL" --ckpt_path "$WORK/ckpt/sft"
fi

if [ ! -f "$RM_MODEL/config.json" ]; then
  $TIDAL rm --pretrain "$SFT_MODEL" --dataset "$WORK/pairs.jsonl" \
    --prompt_key prompt --chosen_key chosen --rejected_key rejected \
    --max_len 64 --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 2 \
    --learning_rate 1e-3 --normalize_reward --save_path "$RM_MODEL" --ckpt_path "$WORK/ckpt/rm"
fi
