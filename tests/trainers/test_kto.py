"""KTO: the first step against a hand computation, the step-level KL (micro-batching leaves it
unchanged), learning on addition data, LoRA, and flag errors."""

from __future__ import annotations

import json

import pytest

from tidal.cli.train_kto import main as kto_main
from tidal.cli.train_kto import parse_run
from tidal.testing import AdditionTask
from tidal.trainers.kto import mismatched, run_kto


@pytest.fixture(scope="module")
def kto_file(tmp_path_factory):
    """Addition prompts answered correctly (desirable) or off by a few (undesirable), alternating."""
    path = tmp_path_factory.mktemp("kto") / "kto.jsonl"
    with path.open("w") as f:
        for i, s in enumerate(AdditionTask(digits=2, seed=2).samples(64)):
            good = i % 2 == 0
            answer = s["answer"] if good else str(int(s["answer"]) + 1 + i % 5)
            f.write(json.dumps({"input": s["prompt"], "output": answer, "label": good}) + "\n")
    return path


def flags(model, data, out, *extra):
    return [
        "--pretrain", str(model), "--dataset", str(data), "--max_len", "64", "--train_batch_size", "8",
        "--micro_train_batch_size", "4", "--learning_rate", "2e-3", "--lr_warmup_ratio", "0",
        "--lr_scheduler", "constant", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        "--seed", "5", *extra,
    ]  # fmt: skip


def test_mismatched_swaps_neighbours_responses():
    from tidal.data.unpaired import UnpairedSample

    samples = [UnpairedSample([i], [10 + i], i % 2 == 0, row=i) for i in range(5)]
    pairs = [(p.prompt_ids[0], p.response_ids[0]) for p in mismatched(samples)]
    assert pairs == [(0, 11), (1, 10), (2, 13), (3, 12), (4, 13)]


def test_first_step_loss_with_reference_equal_to_policy(tiny_llama, kto_file, tmp_path):
    """At step 1 policy = reference: logratio = KL = 0, so each sample's loss is w·(1 − σ(0)) = w/2."""
    history = run_kto(parse_run(flags(tiny_llama, kto_file, tmp_path, "--max_samples", "8",
                                      "--desirable_loss_weight", "2.0", "--undesirable_loss_weight", "0.5")))  # fmt: skip
    step = history[0]
    assert step["kl"] == 0.0 and step["desirable_reward"] == 0.0 and step["undesirable_reward"] == 0.0
    # The step holds 4 desirable and 4 undesirable samples (alternating labels).
    assert step["loss"] == pytest.approx((4 * 2.0 * 0.5 + 4 * 0.5 * 0.5) / 8, abs=1e-6)


def test_kl_is_a_step_quantity_unchanged_by_micro_batching(tiny_llama, perturbed_llama, kto_file, tmp_path):
    common = ("--max_samples", "8", "--ref_pretrain", str(perturbed_llama), "--beta", "0.1")
    whole = run_kto(
        parse_run(flags(tiny_llama, kto_file, tmp_path / "a", *common, "--micro_train_batch_size", "8"))
    )
    split = run_kto(parse_run(flags(tiny_llama, kto_file, tmp_path / "b", *common, "--micro_train_batch_size", "2",
                                    "--packing_samples", "--ref_offload")))  # fmt: skip
    assert whole[0]["kl"] > 1e-3  # the perturbed reference gives a positive reference point
    for key in ("kl", "loss", "desirable_reward", "undesirable_reward"):
        assert split[0][key] == pytest.approx(whole[0][key], abs=1e-5), key


def test_kto_moves_desirable_rewards_above_undesirable(tiny_llama, kto_file, tmp_path):
    history = run_kto(
        parse_run(
            flags(tiny_llama, kto_file, tmp_path, "--max_samples", "32", "--max_epochs", "3", "--beta", "0.5")
        )
    )
    assert len(history) == 12
    gap = [
        sum(h["desirable_reward"] - h["undesirable_reward"] for h in e) / 4
        for e in (history[:4], history[-4:])
    ]
    assert gap[1] > gap[0] + 0.5, gap
    assert sum(h["loss"] for h in history[-4:]) < sum(h["loss"] for h in history[:4])


def test_lora_kto_evaluates_and_saves_adapters(tiny_llama, kto_file, tmp_path):
    run_kto(parse_run(flags(tiny_llama, kto_file, tmp_path, "--max_samples", "8", "--lora_rank", "4",
                            "--eval_dataset", str(kto_file))))  # fmt: skip
    saved = {p.name for p in (tmp_path / "final").iterdir()}
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved
    records = [json.loads(x) for x in (tmp_path / "final" / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/kl" in r]
    assert len(evals) == 1 and evals[0]["eval/kl"] >= 0.0
    assert {"eval/desirable_reward", "eval/undesirable_reward", "eval/loss"} <= set(evals[0])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--train_batch_size", "1", "--micro_train_batch_size", "1"], "at least 2"),
        (["--label_key", "good"], "'good'"),
        (["--beta", "-1"], "--beta"),
        (["--undesirable_loss_weight", "-1"], "--undesirable_loss_weight"),
    ],
)
def test_bad_flags_fail_clearly(tiny_llama, kto_file, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        kto_main(flags(tiny_llama, kto_file, tmp_path, "--max_samples", "8", *extra))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
