"""Reward-model trainer: learns a held-out preference, exports an HF-loadable RM with normalisation
stats, accumulation/packing leave the update unchanged, the seed's command runs, bad flags fail."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tidal.cli.train_rm import main as rm_main
from tidal.cli.train_rm import parse_run
from tidal.data.pairs import PairSample, collate_pairs
from tidal.models import Precision, load_tokenizer
from tidal.trainers import common as common_module
from tidal.trainers import rm as rm_module
from tidal.trainers.rm import RMObjective, load_pair_samples, run_rm

WORDS = ["the", "a", "of", "to", "and", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are"]
GOOD = ["good", "great", "right", "correct", "help", "light", "well", "high", "new", "kind"]
BAD = ["wrong", "low", "old", "small", "end", "off", "cause", "differ", "act", "turn"]


def keyword_pairs(n: int, seed: int, chat: bool = False) -> list[dict]:
    """chosen and rejected are the same words with a GOOD vs a BAD word inserted at one random place.

    Many word pairs, so an untrained model ranks them about as often wrong as right."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        pos = rng.randint(0, len(words))
        good, bad = (" ".join(words[:pos] + [w] + words[pos:]) for w in (rng.choice(GOOD), rng.choice(BAD)))
        if chat:
            user = [{"role": "user", "content": "say something"}]
            rows.append({"chosen": user + [{"role": "assistant", "content": good}],
                         "rejected": user + [{"role": "assistant", "content": bad}]})  # fmt: skip
        else:
            rows.append({"prompt": "Answer: ", "chosen": good, "rejected": bad})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return write_jsonl(root / "train.jsonl", keyword_pairs(96, 0)), write_jsonl(
        root / "test.jsonl", keyword_pairs(32, 1)
    )


def flags(model, data, out, *extra):
    return [
        "--pretrain", str(model), "--dataset", str(data), "--prompt_key", "prompt", "--max_len", "64",
        "--train_batch_size", "16", "--micro_train_batch_size", "8", "--learning_rate", "1e-3",
        "--lr_warmup_ratio", "0.1", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        "--seed", "3", *extra,
    ]  # fmt: skip


def test_rm_learns_and_exports_hf_loadable_model(tiny_llama, pair_files, tmp_path):
    train, test = pair_files
    history = run_rm(
        parse_run(flags(tiny_llama, train, tmp_path, "--eval_dataset", str(test), "--normalize_reward"))
    )
    assert len(history) == 6
    final = tmp_path / "final"
    records = [json.loads(x) for x in (final / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/acc" in r]
    assert evals[-1]["eval/acc"] > 0.9 and evals[-1]["eval/loss"] < 0.6 * history[0]["loss"]

    # Plain HF loading scores the held-out pairs like tidal's wrapper, and ranks them correctly,
    # where the untrained model did not.
    run = parse_run(
        flags(tiny_llama, test, tmp_path, "--pretrain", str(final), "--save_path", str(tmp_path / "unused"))
    )
    tokenizer = load_tokenizer(str(final))
    samples = load_pair_samples(str(test), None, "train", None, tokenizer, run.data, 0)
    batch = collate_pairs(samples, tokenizer.pad_token_id)
    hf = AutoModelForSequenceClassification.from_pretrained(str(final)).eval()
    ours = rm_module.load_value_model(run.model, torch.device("cpu"), path=str(final)).eval()
    untrained = rm_module.load_value_model(run.model, torch.device("cpu"), path=str(tiny_llama)).eval()
    with torch.no_grad():
        hf_scores = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        our_scores = ours.scores(batch)
        before = untrained.scores(batch)
    torch.testing.assert_close(hf_scores, our_scores, atol=1e-5, rtol=0)
    assert accuracy(before) < 0.8 and accuracy(hf_scores) > 0.9, (accuracy(before), accuracy(hf_scores))

    # --normalize_reward stored the eval set's reward mean/std in the config.
    assert hf.config.mean == pytest.approx(our_scores.mean().item(), abs=1e-4)
    assert hf.config.std == pytest.approx(our_scores.std().item(), rel=1e-4)
    assert hf.config.value_head_prefix == "score" and hf.config.pad_token_id == tokenizer.pad_token_id


def accuracy(scores: torch.Tensor) -> float:
    """Fraction of pairs (chosen rows first, then rejected) where chosen scores higher."""
    chosen, rejected = scores.chunk(2)
    return (chosen > rejected).float().mean().item()


def _first_step_grads(tiny, data, out, monkeypatch, *extra):
    """Gradients the first optimizer step applies (an optimizer pre-step hook copies them)."""
    grads = {}
    build = common_module.build_optimization

    def capture(optimizer, args, kwargs):
        if not grads:
            grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    def build_and_hook(*args, **kwargs):
        nonlocal model
        opt = build(*args, **kwargs)
        model = opt.model
        opt.optimizer.register_step_pre_hook(capture)
        return opt

    model = None
    monkeypatch.setattr(common_module, "build_optimization", build_and_hook)
    run_rm(parse_run(flags(tiny, data, out, "--max_samples", "16", *extra)))
    return grads


def test_accumulation_and_packing_match_one_batch(tiny_qwen2, pair_files, tmp_path, monkeypatch):
    train, _ = pair_files
    big = _first_step_grads(tiny_qwen2, train, tmp_path / "a", monkeypatch, "--micro_train_batch_size", "16")
    small = _first_step_grads(
        tiny_qwen2, train, tmp_path / "b", monkeypatch, "--micro_train_batch_size", "4", "--packing_samples"
    )
    assert "score.weight" in big and big["score.weight"].abs().max() > 1e-4
    for name in big:
        torch.testing.assert_close(small[name], big[name], atol=1e-6, rtol=1e-4)


def test_objective_applies_margin_and_normaliser():
    rewards = torch.tensor([2.0, 0.5, 1.0, 1.0])  # chosen (2.0, 0.5), rejected (1.0, 1.0)
    model = SimpleNamespace(scores=lambda batch: rewards)
    pairs = [PairSample([1, 2], [1, 3], 1, 0.5), PairSample([1, 4], [1, 5], 1, 0.0)]
    objective = RMObjective(0, rm_module.RM_LOSSES["sigmoid"], margin_loss=True)
    batch = objective.collate(pairs)
    loss, metrics = objective.loss(model, batch, normaliser=4.0, precision=Precision(torch.float32, "cpu"))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    want = (-math.log(sig(2.0 - 1.0 - 0.5)) - math.log(sig(0.5 - 1.0))) / 4
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert metrics["acc"].item() == pytest.approx(1 / 4)
    assert metrics["reward_gap"].item() == pytest.approx((1.0 - 0.5) / 4)


def test_objective_without_margin_loss_ignores_the_margin_column():
    """As OpenRLHF: the dataset's margins enter the loss only with --margin_loss."""
    rewards = torch.tensor([2.0, 0.5, 1.0, 1.0])
    model = SimpleNamespace(scores=lambda batch: rewards)
    objective = RMObjective(0, rm_module.RM_LOSSES["sigmoid"])
    batch = objective.collate([PairSample([1, 2], [1, 3], 1, 0.5), PairSample([1, 4], [1, 5], 1, 0.0)])
    loss, _ = objective.loss(model, batch, normaliser=2.0, precision=Precision(torch.float32, "cpu"))
    want = (math.log1p(math.exp(-(2.0 - 1.0))) + math.log1p(math.exp(-(0.5 - 1.0)))) / 2
    assert loss.item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("fp32", [False, True])
def test_compute_fp32_loss_picks_the_loss_dtype(fp32):
    """Without --compute_fp32_loss the loss is computed on the rewards rounded to the compute dtype
    (bf16 here), with it on the float32 rewards."""
    rewards = torch.tensor([1.2345678, 0.1234567, 0.3333333, 0.7777777])
    model = SimpleNamespace(scores=lambda batch: rewards)
    objective = RMObjective(0, rm_module.RM_LOSSES["sigmoid"], fp32_loss=fp32)
    batch = objective.collate([PairSample([1, 2], [1, 3], 1), PairSample([1, 4], [1, 5], 1)])
    loss, metrics = objective.loss(
        model, batch, normaliser=2.0, precision=Precision(torch.bfloat16, torch.device("cpu"))
    )
    dtype = torch.float32 if fp32 else torch.bfloat16
    chosen, rejected = rewards.to(dtype).chunk(2)
    assert loss.dtype == dtype
    assert torch.equal(loss, -torch.nn.functional.logsigmoid(chosen - rejected).sum() / 2.0)
    assert metrics["reward_gap"].dtype == torch.float32  # metrics stay float32


def margin_rows(n: int, seed: int) -> list[dict]:
    return [{**row, "margin": 2.0} for row in keyword_pairs(n, seed)]


def test_margin_loss_changes_the_update(tiny_qwen2, tmp_path, monkeypatch):
    """--margin_loss reaches the loss through the command: the first step's gradients change."""
    data = write_jsonl(tmp_path / "margins.jsonl", margin_rows(16, 5))
    plain = _first_step_grads(tiny_qwen2, data, tmp_path / "a", monkeypatch)
    margin = _first_step_grads(tiny_qwen2, data, tmp_path / "b", monkeypatch, "--margin_loss")
    assert plain["score.weight"].abs().max() > 1e-4
    assert not torch.allclose(plain["score.weight"], margin["score.weight"], atol=1e-6, rtol=1e-4)


def test_margin_loss_needs_a_margin_in_every_row(tiny_llama, tmp_path, capsys):
    rows = margin_rows(16, 6)
    del rows[3]["margin"]
    data = write_jsonl(tmp_path / "margins.jsonl", rows)
    with pytest.raises(SystemExit) as exc:
        rm_main(flags(tiny_llama, data, tmp_path, "--margin_loss"))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # (datasets' progress bars may come first)
    assert last.endswith(f"row 4 of {data} has no 'margin' value; --margin_loss needs a number in every row")
    assert "Traceback" not in err


def test_seed_rm_command_runs_with_paths_changed(tiny_llama, tmp_path):
    """The seed README's RM command (chat-format pairs), with only model/data paths and sizes changed."""
    data = write_jsonl(tmp_path / "chat.jsonl", keyword_pairs(4, 2, chat=True))
    rm_main([
        "--save_path", str(tmp_path / "rm"), "--save_steps", "-1", "--logging_steps", "1", "--eval_steps", "-1",
        "--train_batch_size", "4", "--micro_train_batch_size", "1", "--pretrain", str(tiny_llama),
        "--param_dtype", "bf16", "--max_epochs", "1", "--max_len", "128", "--zero_stage", "3",
        "--learning_rate", "9e-6", "--dataset", str(data), "--apply_chat_template", "--chosen_key", "chosen",
        "--rejected_key", "rejected", "--packing_samples", "--gradient_checkpointing", "--use_wandb", "offline",
    ])  # fmt: skip
    model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm"))
    assert model.score.weight.shape[0] == 1
    assert any((tmp_path / "rm" / "run").rglob("*.wandb"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--chosen_key", "better"], "'better' not found"),
        (["--normalize_reward", "--lora_rank", "4"], "--normalize_reward with --lora_rank"),
        (["--loss", "hinge"], "invalid choice"),
        (["--train_batch_size", "512"], "fewer than one --train_batch_size"),
        (["--margin_loss", "--loss", "logexp"], "--margin_loss with --loss logexp"),
    ],
)
def test_bad_flags_fail_clearly(tiny_llama, pair_files, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        rm_main(flags(tiny_llama, pair_files[0], tmp_path, *extra))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_seed_readme_flag_spelling_is_accepted(tiny_llama, pair_files, tmp_path):
    """The seed README spells the head flag --value_prefix_head; both names set value_head_prefix."""
    run = parse_run(flags(tiny_llama, pair_files[0], tmp_path, "--value_prefix_head", "value_head"))
    assert run.rm.value_head_prefix == "value_head"
