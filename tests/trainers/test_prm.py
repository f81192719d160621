"""PRM trainer: learns held-out step labels (hard), runs with soft labels and packing via the CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.cli.train_prm import main as prm_main
from tidal.cli.train_prm import parse_run
from tidal.testing import build_tiny_model
from tidal.trainers.prm import run_prm

MARK = "ки"
WORDS = ["the", "a", "of", "to", "and", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are"]


@pytest.fixture(scope="module")
def prm_model(tmp_path_factory):
    """A tiny Qwen2 model whose tokenizer has the step marker as one token."""
    path = build_tiny_model(tmp_path_factory.mktemp("prm_model"), "qwen2", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens([MARK])
    tokenizer.save_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(str(path))
    return path


def step_rows(n: int, seed: int, soft: bool = False) -> list[dict]:
    """2-4 steps per row; a step is good ("+") when it says "correct", bad ("-") when it says "wrong"."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        steps, labels = [], []
        for _ in range(rng.randint(2, 4)):
            good = rng.random() < 0.5
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 5))]
            words.insert(rng.randint(0, len(words)), "correct" if good else "wrong")
            steps.append(" ".join(words) + f" {MARK}")
            labels.append((0.9 if good else 0.1) if soft else ("+" if good else "-"))
        rows.append({"input": "Solve: " + " ".join(steps), "label": labels})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def flags(model, data, out, *extra):
    return [
        "--pretrain", str(model), "--dataset", str(data), "--placeholder_token", MARK, "--reward_tokens", "+", "-",
        "--max_len", "96", "--train_batch_size", "16", "--micro_train_batch_size", "8", "--learning_rate", "2e-3",
        "--lr_warmup_ratio", "0.1", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        "--seed", "1", *extra,
    ]  # fmt: skip


def test_prm_learns_step_labels(prm_model, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", step_rows(160, 0))
    test = write_jsonl(tmp_path / "test.jsonl", step_rows(32, 1))
    history = run_prm(
        parse_run(flags(prm_model, train, tmp_path, "--eval_dataset", str(test), "--eval_steps", "5"))
    )
    assert len(history) == 10
    assert history[0]["acc"] < 0.8 and history[-1]["loss"] < 0.5 * history[0]["loss"]
    records = [json.loads(x) for x in (tmp_path / "final" / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/acc"] for r in records if "eval/acc" in r]
    assert len(evals) == 2 and evals[-1] > 0.9, evals

    # The exported causal LM puts more mass on "+" than "-" at the markers of good steps.
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "final"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final")).eval()
    ids = tokenizer(f"Solve: the correct of {MARK} a wrong it {MARK}", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0]
    at = (ids[0] == tokenizer.convert_tokens_to_ids(MARK)).nonzero().flatten()
    plus, minus = tokenizer.convert_tokens_to_ids(["+", "-"])
    assert (logits[at, plus] - logits[at, minus] > 0).tolist() == [True, False]


def test_soft_labels_with_packing_via_cli(prm_model, tmp_path):
    data = write_jsonl(tmp_path / "soft.jsonl", step_rows(16, 2, soft=True))
    prm_main(flags(prm_model, data, tmp_path, "--packing_samples", "--micro_train_batch_size", "4"))
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_bad_marker_fails_clearly(prm_model, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", step_rows(16, 3))
    with pytest.raises(SystemExit) as exc:
        prm_main(flags(prm_model, data, tmp_path, "--placeholder_token", "<step>"))
    assert exc.value.code == 2 and "--placeholder_token '<step>'" in capsys.readouterr().err
