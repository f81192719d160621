"""SFT trainer behaviour: packing, gradient accumulation, exact resume, learning, export and CLI."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.cli.train_sft import main as sft_main
from tidal.cli.train_sft import parse_run
from tidal.data import collate_packed, collate_padded
from tidal.models import load_causal_lm, token_logprobs
from tidal.testing import AdditionTask
from tidal.trainers import loop as loop_module
from tidal.trainers import sft as sft_module
from tidal.trainers.sft import run_sft


@pytest.fixture(scope="module")
def addition_file(tmp_path_factory):
    return AdditionTask(digits=2).write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", 256)


def flags(model, data, out, *extra):
    return [
        "--pretrain", str(model), "--dataset", str(data), "--input_key", "prompt", "--output_key", "answer",
        "--max_len", "64", "--train_batch_size", "16", "--micro_train_batch_size", "4", "--learning_rate", "3e-3",
        "--lr_warmup_ratio", "0.1", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        "--max_samples", "128", "--seed", "7", *extra,
    ]  # fmt: skip


def test_packed_token_losses_equal_padded(tiny_llama, addition_file, tmp_path):
    run = parse_run(flags(tiny_llama, addition_file, tmp_path))
    samples = sft_module.load_sft_samples(str(addition_file), None, "train", 8, _tok(tiny_llama), run.data, 0)
    model = load_causal_lm(run.model, torch.device("cpu")).eval()
    padded = collate_padded(samples, 0)
    packed = collate_packed(samples)
    with torch.no_grad():
        lp_pad, _ = token_logprobs(model, padded)
        lp_pack, _ = token_logprobs(model, packed)
    want = lp_pad[padded["loss_mask"].bool()]
    got = lp_pack[packed["loss_mask"].bool()]
    assert got.shape == want.shape and got.numel() > 8
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _tok(path):
    from tidal.models import load_tokenizer

    return load_tokenizer(str(path))


def _first_step_grads(tiny, data, tmp_path, monkeypatch, *extra):
    """Gradients the first optimizer step applies (captured just before the update)."""
    grads = {}
    original = loop_module.optimizer_step

    def capture(opt):
        if not grads:
            grads.update({n: p.grad.clone() for n, p in opt.model.named_parameters() if p.grad is not None})
        return original(opt)

    monkeypatch.setattr(loop_module, "optimizer_step", capture)
    run_sft(parse_run(flags(tiny, data, tmp_path, "--max_samples", "16", *extra)))
    return grads


def test_gradient_accumulation_and_packing_match_one_big_batch(
    tiny_llama, addition_file, tmp_path, monkeypatch
):
    big = _first_step_grads(
        tiny_llama, addition_file, tmp_path / "a", monkeypatch, "--micro_train_batch_size", "16"
    )
    small = _first_step_grads(
        tiny_llama, addition_file, tmp_path / "b", monkeypatch, "--micro_train_batch_size", "2"
    )
    packed = _first_step_grads(
        tiny_llama,
        addition_file,
        tmp_path / "c",
        monkeypatch,
        "--micro_train_batch_size",
        "4",
        "--packing_samples",
    )
    assert len(big) > 10 and max(g.abs().max().item() for g in big.values()) > 1e-3
    for k in big:
        torch.testing.assert_close(small[k], big[k], atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(packed[k], big[k], atol=1e-6, rtol=1e-4)


def test_resume_continues_exactly(tiny_qwen2, addition_file, tmp_path, crash_after):
    common = ["--save_steps", "2", "--max_epochs", "2", "--logging_steps", "1"]
    full = run_sft(parse_run(flags(tiny_qwen2, addition_file, tmp_path / "full", *common)))
    assert len(full) == 16

    # Stop the second run right after step 5 (checkpoint at step 4), as a crash would.
    restore = crash_after(loop_module.SupervisedTrainer, "train_step", 5)
    with pytest.raises(KeyboardInterrupt):
        run_sft(parse_run(flags(tiny_qwen2, addition_file, tmp_path / "cut", *common)))
    restore()
    assert (tmp_path / "cut" / "ckpt" / "latest").read_text() == "global_step_4"

    resumed = run_sft(
        parse_run(flags(tiny_qwen2, addition_file, tmp_path / "cut", *common, "--load_checkpoint"))
    )
    assert [h["step"] for h in resumed] == list(range(5, 17))
    for a, b in zip(full[4:], resumed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), (a["step"], a["loss"], b["loss"])
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9)
    # The resumed metrics file has one entry per step, no duplicates from the interrupted run.
    lines = [
        json.loads(x) for x in (tmp_path / "cut" / "final" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [x["step"] for x in lines if "train/loss" in x]
    assert steps == list(range(1, 17))


def test_sft_learns_and_exports_hf_folder(tiny_llama, addition_file, tmp_path):
    eval_file = AdditionTask(digits=2).write_jsonl(tmp_path / "eval.jsonl", 32, split="test")
    out = tmp_path / "out"
    history = run_sft(
        parse_run(flags(tiny_llama, addition_file, out, "--max_epochs", "3", "--eval_dataset", str(eval_file),
                        "--use_tensorboard", str(tmp_path / "tb")))
    )  # fmt: skip
    first, last = history[0]["loss"], sum(h["loss"] for h in history[-4:]) / 4
    assert last < 0.5 * first, (first, last)
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert isinstance(model, torch.nn.Module)
    records = [json.loads(x) for x in (out / "final" / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0]
    assert any((tmp_path / "tb").rglob("events.out.tfevents.*"))


def test_lora_trains_adapters_only(tiny_llama, addition_file, tmp_path):
    run_sft(parse_run(flags(tiny_llama, addition_file, tmp_path, "--lora_rank", "4", "--lora_alpha", "8")))
    saved = sorted(p.name for p in (tmp_path / "final").iterdir())
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved


def test_seed_sft_command_runs_with_paths_changed(tiny_llama, addition_file, tmp_path):
    """The seed README's SFT command, with only model/data paths and sizes changed."""
    sft_main([
        "--max_len", "64", "--dataset", str(addition_file), "--input_key", "prompt", "--output_key", "answer",
        "--input_template", "Q: {}\nA: ", "--train_batch_size", "8", "--micro_train_batch_size", "2",
        "--max_samples", "16", "--pretrain", str(tiny_llama), "--save_path", str(tmp_path / "sft"),
        "--save_steps", "-1", "--logging_steps", "1", "--eval_steps", "-1", "--zero_stage", "2",
        "--max_epochs", "1", "--packing_samples", "--param_dtype", "bf16", "--learning_rate", "5e-6",
        "--gradient_checkpointing", "--use_wandb", "offline",
    ])  # fmt: skip
    assert (tmp_path / "sft" / "model.safetensors").exists()
    assert any((tmp_path / "sft" / "run").rglob("*.wandb"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ring_attn_size", "2"], "--ring_attn_size"),
        (["--input_template", "no placeholder"], "{}"),
        (["--train_batch_size", "10", "--micro_train_batch_size", "4"], "divisible"),
        (["--dataset_probs", "0.5,0.5"], "probs"),
    ],
)
def test_bad_flags_fail_clearly(tiny_llama, addition_file, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        sft_main(flags(tiny_llama, addition_file, tmp_path, *extra))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_qlora_trains_adapters_on_a_4bit_base(tiny_llama, addition_file, tmp_path):
    pytest.importorskip("bitsandbytes")
    history = run_sft(
        parse_run(
            flags(
                tiny_llama, addition_file, tmp_path, "--lora_rank", "8", "--load_in_4bit", "--max_epochs", "2"
            )
        )
    )
    assert history[-1]["loss"] < history[0]["loss"]
    saved = sorted(p.name for p in (tmp_path / "final").iterdir())
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved


def test_full_determinism_turns_on_deterministic_kernels(tiny_llama, addition_file, tmp_path):
    import torch

    try:
        run_sft(
            parse_run(flags(tiny_llama, addition_file, tmp_path, "--max_samples", "16", "--full_determinism"))
        )
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("family", ["qwen3_5_text", "bamba"])
def test_packing_refused_for_recurrent_layers(family, addition_file, tmp_path, capsys):
    """Packed rows would carry a Gated DeltaNet's (registry: Qwen3.5) or a Mamba layer's (a family outside the
    registry, read from its layer_types) state from one sample into the next: one line, before any data
    or weights load; an attention-only family outside the registry still packs."""
    from tidal.testing.tiny import build_tiny_fallback_model, build_tiny_model
    from tidal.trainers.common import packing_problem

    build = build_tiny_fallback_model if family == "bamba" else build_tiny_model
    model = build(tmp_path / family, family)
    with pytest.raises(SystemExit) as exc:
        sft_main(flags(model, addition_file, tmp_path, "--packing_samples"))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"error: --packing_samples: packing_samples is not supported for the {family} family" in err[-1]
    assert "Traceback" not in "\n".join(err)
    assert packing_problem(str(build_tiny_model(tmp_path / "qwen2", "qwen2"))) is None
