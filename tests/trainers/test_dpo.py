"""DPO/IPO/cDPO: the objective against hand computations, learning on addition pairs, the LoRA
reference (adapters disabled), reference offload, and flag errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.cli.train_dpo import main as dpo_main
from tidal.cli.train_dpo import parse_run
from tidal.data.pairs import collate_pairs
from tidal.models import Precision, load_causal_lm, load_tokenizer
from tidal.models.frozen import FrozenModel
from tidal.testing import AdditionTask
from tidal.trainers import reference as reference_module
from tidal.trainers.dpo import DPOConfig, DPOObjective, load_pair_samples, run_dpo
from tidal.trainers.reference import DisabledAdapters, sequence_logps

CPU = torch.device("cpu")
FP32 = Precision.create("fp32", CPU)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    """Addition prompts: chosen is the right sum, rejected a wrong one."""
    path = tmp_path_factory.mktemp("dpo") / "pairs.jsonl"
    with path.open("w") as f:
        for i, s in enumerate(AdditionTask(digits=2, seed=1).samples(64)):
            wrong = str(int(s["answer"]) + 1 + i % 7)
            f.write(json.dumps({"prompt": s["prompt"], "chosen": s["answer"], "rejected": wrong}) + "\n")
    return path


def flags(model, data, out, *extra):
    return [
        "--pretrain", str(model), "--dataset", str(data), "--prompt_key", "prompt", "--chosen_key", "chosen",
        "--rejected_key", "rejected", "--max_len", "64", "--train_batch_size", "8",
        "--micro_train_batch_size", "4", "--learning_rate", "2e-3", "--lr_warmup_ratio", "0",
        "--lr_scheduler", "constant", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        "--seed", "5", *extra,
    ]  # fmt: skip


def objective(**cfg) -> DPOObjective:
    return DPOObjective(reference=None, cfg=DPOConfig(**cfg), pad_id=0)


# Two pairs, chosen first: policy and reference sequence log-probs and response token counts.
LOGPS = torch.tensor([-1.0, -2.0, -3.0, -2.5])
REF = torch.tensor([-1.5, -1.8, -2.0, -2.6])
COUNTS = torch.tensor([2.0, 4.0, 3.0, 3.0])
Z = [(-1.0 + 3.0) - (-1.5 + 2.0), (-2.0 + 2.5) - (-1.8 + 2.6)]  # 1.5 and -0.3


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


@pytest.mark.parametrize(
    ("cfg", "per_pair"),
    [
        ({"beta": 0.5}, [-log_sigmoid(0.5 * z) for z in Z]),
        (
            {"beta": 0.5, "label_smoothing": 0.2},
            [-0.8 * log_sigmoid(0.5 * z) - 0.2 * log_sigmoid(-0.5 * z) for z in Z],
        ),
        ({"beta": 0.5, "ipo": True}, [(z - 1 / (2 * 0.5)) ** 2 for z in Z]),
    ],
)
def test_loss_from_fixed_logps_matches_hand_computation(cfg, per_pair):
    # The micro-batch holds 2 of the step's 4 pairs, so every contribution is divided by 4.
    loss, metrics = objective(**cfg).loss_from_logps(LOGPS, COUNTS, REF, normaliser=4.0)
    assert loss.item() == pytest.approx(sum(per_pair) / 4, abs=1e-6)
    # Implicit rewards β(π − ref): chosen 0.25, −0.1; rejected −0.5, 0.05.
    assert metrics["chosen_reward"].item() == pytest.approx((0.25 - 0.1) / 4, abs=1e-6)
    assert metrics["rejected_reward"].item() == pytest.approx((-0.5 + 0.05) / 4, abs=1e-6)
    assert metrics["reward_accuracy"].item() == pytest.approx(1 / 4)
    assert metrics["reward_margin"].item() == pytest.approx((0.75 - 0.15) / 4, abs=1e-6)


def test_nll_term_is_mean_token_nll_of_chosen():
    base, _ = objective(beta=0.5).loss_from_logps(LOGPS, COUNTS, REF, normaliser=4.0)
    loss, metrics = objective(beta=0.5, nll_loss_coef=0.5).loss_from_logps(LOGPS, COUNTS, REF, 4.0)
    nll = (1.0 / 2 + 2.0 / 4) / 4
    assert metrics["nll_loss"].item() == pytest.approx(nll)
    assert loss.item() == pytest.approx(base.item() + 0.5 * nll, abs=1e-6)


def response_logp(model, ids: list[int], prompt_len: int) -> float:
    """Σ log p over response tokens, one unpadded sequence at a time (the slow, obvious way)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return sum(logits[t - 1, ids[t]].item() for t in range(max(prompt_len, 1), len(ids)))


@pytest.mark.parametrize("packing", [False, True])
def test_objective_loss_on_models_matches_hand_computation(tiny_llama, pairs_file, packing):
    run = parse_run(flags(tiny_llama, pairs_file, Path("unused")))
    tokenizer = load_tokenizer(str(tiny_llama))
    samples = load_pair_samples(str(pairs_file), None, "train", 3, tokenizer, run.data, 0)
    policy = load_causal_lm(run.model, CPU).eval()
    ref_model = load_causal_lm(run.model, CPU)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    obj = DPOObjective(FrozenModel(ref_model, CPU), DPOConfig(beta=0.3), tokenizer.pad_token_id, packing)
    loss, metrics = obj.loss(policy, obj.collate(samples), normaliser=3.0, precision=FP32)
    want = 0.0
    for s in samples:
        pc, pr = (response_logp(policy, ids, s.prompt_len) for ids in (s.chosen_ids, s.rejected_ids))
        rc, rr = (response_logp(ref_model, ids, s.prompt_len) for ids in (s.chosen_ids, s.rejected_ids))
        want += -log_sigmoid(0.3 * ((pc - pr) - (rc - rr))) / 3
    assert loss.item() == pytest.approx(want, abs=1e-5)
    assert abs(metrics["reward_margin"].item()) > 1e-4  # the reference really differs


def test_dpo_margin_grows_on_addition_pairs(tiny_llama, pairs_file, tmp_path):
    history = run_dpo(
        parse_run(
            flags(
                tiny_llama, pairs_file, tmp_path, "--max_samples", "32", "--max_epochs", "3", "--beta", "0.5"
            )
        )
    )
    assert len(history) == 12
    # Steps of 8 pairs are noisy: compare epochs (4 steps each).
    margin = [sum(h["reward_margin"] for h in history[i : i + 4]) / 4 for i in (0, 4, 8)]
    assert margin[0] < margin[1] < margin[2] and margin[2] > margin[0] + 0.5, margin
    assert sum(h["reward_accuracy"] for h in history[-4:]) / 4 >= 0.6
    assert sum(h["loss"] for h in history[-4:]) < sum(h["loss"] for h in history[:4])


def test_lora_reference_is_base_with_adapters_disabled(tiny_llama, pairs_file):
    run = parse_run(flags(tiny_llama, pairs_file, Path("unused"), "--lora_rank", "4"))
    tokenizer = load_tokenizer(str(tiny_llama))
    samples = load_pair_samples(str(pairs_file), None, "train", 4, tokenizer, run.data, 0)
    batch = collate_pairs(samples, tokenizer.pad_token_id)
    policy = load_causal_lm(run.model, CPU)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    with DisabledAdapters(policy).use() as reference:
        ref_logps, _, _ = sequence_logps(reference, batch, FP32)
    assert policy.training  # the reference pass restored the mode
    base_logps, _, _ = sequence_logps(base, batch, FP32)
    policy_logps, _, _ = sequence_logps(policy.eval(), batch, FP32)
    torch.testing.assert_close(ref_logps, base_logps, atol=1e-5, rtol=0)
    assert (policy_logps - base_logps).abs().max() > 1e-3


def test_lora_dpo_loads_no_second_model_and_saves_adapters(tiny_llama, pairs_file, tmp_path, monkeypatch):
    def no_copy(*args, **kwargs):
        raise AssertionError("LoRA DPO must not load a reference copy")

    monkeypatch.setattr(reference_module, "load_frozen", no_copy)
    history = run_dpo(
        parse_run(flags(tiny_llama, pairs_file, tmp_path, "--max_samples", "8", "--lora_rank", "4"))
    )
    # LoRA B starts at zero, so at the first step the policy equals its adapter-disabled base.
    assert history[0]["chosen_reward"] == 0.0 and history[0]["rejected_reward"] == 0.0
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    saved = {p.name for p in (tmp_path / "final").iterdir()}
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved


def test_ref_offload_gives_the_same_run(tiny_llama, pairs_file, tmp_path):
    common = ("--max_samples", "16", "--nll_loss_coef", "0.1")
    a = run_dpo(parse_run(flags(tiny_llama, pairs_file, tmp_path / "a", *common)))
    b = run_dpo(parse_run(flags(tiny_llama, pairs_file, tmp_path / "b", *common, "--ref_offload")))
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-6)
        assert x["nll_loss"] == pytest.approx(y["nll_loss"], abs=1e-6)
    assert a[0]["loss"] == pytest.approx(math.log(2) + 0.1 * a[0]["nll_loss"], abs=1e-5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ipo", "--label_smoothing", "0.1"], "--label_smoothing"),
        (["--beta", "0"], "--beta"),
        (["--lora_rank", "4", "--ref_offload"], "--ref_offload"),
        (["--ref_pretrain", "/nonexistent/ref"], "--ref_pretrain"),
        (["--chosen_key", "best"], "'best'"),
    ],
)
def test_bad_flags_fail_clearly(tiny_llama, pairs_file, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        dpo_main(flags(tiny_llama, pairs_file, tmp_path, "--max_samples", "8", *extra))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_seed_style_dpo_command(tiny_llama, pairs_file, tmp_path):
    """The seed's DPO flags (paths and sizes changed): IPO, eval set, packing, checkpointing."""
    dpo_main(flags(tiny_llama, pairs_file, tmp_path, "--max_samples", "8", "--ipo", "--beta", "0.2",
                   "--eval_dataset", str(pairs_file), "--packing_samples", "--gradient_checkpointing",
                   "--zero_stage", "3", "--param_dtype", "bf16", "--logging_steps", "1"))  # fmt: skip
    records = [json.loads(x) for x in (tmp_path / "final" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/reward_accuracy" in r for r in records)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "final") is not None
