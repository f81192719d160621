"""Vision-language training (issue #32, part A) on tidal.testing's tiny Qwen2.5-VL: the trainer's forward
equals transformers' loss, SFT learns a task whose answer is only in the image (and the same model
without the images stays at chance), --freeze_visual_encoder keeps the vision tower bit-identical,
DPO and RM take steps on image pairs, LoRA adapts the language model only, FSDP2 finds both kinds of
blocks, and the image flags parse in OpenRLHF's spellings."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tidal.cli.train_dpo import parse_run as parse_dpo
from tidal.cli.train_rm import parse_run as parse_rm
from tidal.cli.train_sft import parse_run as parse_sft
from tidal.config.args import ConfigError
from tidal.config.data import VisionConfig
from tidal.config.model import ModelConfig
from tidal.data import DataError, collate_packed, collate_padded
from tidal.data.images import open_image
from tidal.data.vision import ImageSamples, load_vision_processor
from tidal.distributed.fsdp import transformer_blocks
from tidal.models import load_causal_lm, load_tokenizer, token_logprobs
from tidal.models.vision_value import load_vision_value_model
from tidal.rollout.models.registry import feature_refusal
from tidal.testing import TINY_VLM_FAMILIES, ColourTask, build_tiny_vlm
from tidal.testing.vision_tasks import COLOURS, greedy_answers
from tidal.trainers.dpo import run_dpo
from tidal.trainers.rm import run_rm
from tidal.trainers.sft import load_sft_samples, run_sft


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(
    scope="module", params=sorted(f for f in TINY_VLM_FAMILIES if not feature_refusal(f, "packing_samples"))
)
def any_vlm(request, vlm, tmp_path_factory):
    """Each tiny VLM family that packs samples (Qwen2.5-VL is ``vlm``'s; Qwen3.5's hybrid refuses packing,
    and its trainer side runs in test_vlm_grpo)."""
    if request.param == "qwen2_5_vl":
        return vlm
    return build_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def colours(tmp_path_factory):
    """Colour-task files: train (192 rows) and held-out eval rows (60), with and without images."""
    folder = tmp_path_factory.mktemp("colours")
    task = ColourTask(seed=0)
    return {
        "train": task.write_jsonl(folder / "train.jsonl", 192),
        "train_text": task.write_jsonl(folder / "train_text.jsonl", 192, with_images=False),
        "eval": task.rows(folder, 60, offset=10_000),
        "eval_text": task.rows(folder, 60, with_images=False, offset=10_000),
        "folder": folder,
    }


def sft_flags(model, data, out, *extra):
    return [
        "--pretrain", str(model), "--dataset", str(data), "--input_key", "prompt", "--output_key", "answer",
        "--apply_chat_template", "--max_len", "64", "--train_batch_size", "16", "--micro_train_batch_size", "16",
        "--learning_rate", "3e-3", "--lr_warmup_ratio", "0.05", "--max_epochs", "3", "--seed", "1",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


def test_trainer_forward_equals_the_hf_loss_padded_and_packed(any_vlm, colours, tmp_path):
    vlm = any_vlm
    tokenizer = load_tokenizer(str(vlm))
    processor = load_vision_processor(str(vlm), tokenizer)
    images = ImageSamples(VisionConfig(max_images_per_prompt=1), processor)
    run = parse_sft(sft_flags(vlm, colours["train"], tmp_path, "--max_images_per_prompt", "1"))
    samples = load_sft_samples(str(colours["train"]), None, "train", 4, tokenizer, run.data, 0, images)
    model = load_causal_lm(run.model, torch.device("cpu")).eval()
    padded, packed = collate_padded(samples, tokenizer.pad_token_id), collate_packed(samples)
    with torch.no_grad():
        lp_pad, outputs = token_logprobs(model, padded)
        assert type(outputs).__name__ == "LogprobOutputs"  # the chunked LM head, not full logits
        lp_pack, _ = token_logprobs(model, packed)
        for row, sample in enumerate(samples):  # transformers' own loss, one sample at a time
            ids = torch.tensor([sample.input_ids])
            labels = torch.where(torch.tensor([sample.loss_mask]).bool(), ids, -100)
            pixels = processor.pixel_inputs([open_image(r) for r in sample.images.refs])
            hf = model(
                input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                mm_token_type_ids=(ids == processor.image_token_id).int(), **pixels,
            ).loss  # fmt: skip
            mask = padded["loss_mask"][row].bool()
            torch.testing.assert_close(-lp_pad[row][mask].mean(), hf, atol=1e-5, rtol=1e-5)
    want = lp_pad[padded["loss_mask"].bool()]
    got = lp_pack[packed["loss_mask"].bool()]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _accuracy(model_dir, rows, folder) -> float:
    answers = greedy_answers(model_dir, rows, folder)
    return sum(a == r["answer"] for a, r in zip(answers, rows, strict=True)) / len(rows)


def test_sft_learns_the_colour_from_the_image_and_not_without_it(any_vlm, colours, tmp_path):
    vlm = any_vlm
    run_sft(parse_sft(sft_flags(vlm, colours["train"], tmp_path / "img", "--max_images_per_prompt", "1")))
    run_sft(parse_sft(sft_flags(vlm, colours["train_text"], tmp_path / "text")))
    with_images = _accuracy(tmp_path / "img" / "final", colours["eval"], colours["folder"])
    without = _accuracy(tmp_path / "text" / "final", colours["eval_text"], colours["folder"])
    chance = 1 / len(COLOURS)
    assert with_images >= 0.9, with_images
    assert without <= chance + 0.1, without  # the prompt text says nothing about the colour


def test_sft_packed_on_images_steps_as_padded(any_vlm, colours, tmp_path):
    """``--packing_samples`` with images (each sample's own M-RoPE positions, DeepStack for Qwen3-VL):
    the same losses as padded rows, step after step."""
    extra = ("--max_images_per_prompt", "1", "--max_samples", "32", "--max_epochs", "1")
    padded = run_sft(parse_sft(sft_flags(any_vlm, colours["train"], tmp_path / "pad", *extra)))
    packed = run_sft(
        parse_sft(sft_flags(any_vlm, colours["train"], tmp_path / "pack", *extra, "--packing_samples"))
    )
    assert len(packed) == len(padded) == 2
    for a, b in zip(padded, packed, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (padded, packed)


def test_freeze_visual_encoder_keeps_the_vision_tower_bit_identical(vlm, colours, tmp_path):
    extra = ("--data.max_images_per_prompt", "1", "--actor.freeze_visual_encoder", "--max_samples", "32")
    run = parse_sft(sft_flags(vlm, colours["train"], tmp_path, *extra, "--max_epochs", "1"))
    assert run.vision == VisionConfig(max_images_per_prompt=1, freeze_visual_encoder=True)
    run_sft(run)
    before, after = load_file(vlm / "model.safetensors"), load_file(tmp_path / "final" / "model.safetensors")
    vision = [k for k in before if k.startswith("visual.")]  # transformers saves Qwen-VL's legacy names
    language = [k for k in before if not k.startswith("visual.")]
    assert vision and language
    assert all(torch.equal(before[k], after[k]) for k in vision)
    assert any(not torch.equal(before[k], after[k]) for k in language)


def _pairs(folder, n: int = 8):
    """Preference rows: the image's colour is chosen over another colour."""
    rows = ColourTask(seed=3).rows(folder, n)
    names = list(COLOURS)
    for row in rows:
        wrong = names[(names.index(row["answer"]) + 1) % len(names)]
        row.update(chosen=row["answer"], rejected=wrong)
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pair_flags(model, data, out, *extra):
    return [
        "--pretrain", str(model), "--dataset", str(data), "--prompt_key", "prompt", "--apply_chat_template",
        "--train_batch_size", "4", "--micro_train_batch_size", "2", "--max_samples", "8", "--max_epochs", "1",
        "--max_images_per_prompt", "1", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        *extra,
    ]  # fmt: skip


def test_dpo_steps_on_image_pairs_padded_and_packed(vlm, tmp_path):
    data = _pairs(tmp_path)
    for packing in ((), ("--packing_samples",)):
        metrics = run_dpo(parse_dpo(pair_flags(vlm, data, tmp_path / str(len(packing)), *packing)))
        assert len(metrics) == 2 and all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    # the first step's loss is log 2 (policy == reference) in both layouts
    assert metrics[0]["preference_loss"] == pytest.approx(0.6931, abs=1e-3)


def test_rm_steps_on_image_pairs_and_its_head_is_saved(vlm, tmp_path):
    metrics = run_rm(parse_rm(pair_flags(vlm, _pairs(tmp_path), tmp_path, "--learning_rate", "1e-3")))
    assert len(metrics) == 2 and all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    saved = load_file(tmp_path / "final" / "model.safetensors")
    assert saved["score.weight"].shape[0] == 1 and not any(k.startswith("lm_head") for k in saved)
    reloaded = load_vision_value_model(ModelConfig(pretrain=str(tmp_path / "final")), torch.device("cpu"))
    assert torch.equal(reloaded.score.weight, saved["score.weight"])  # the trained head, not a fresh one


def test_lora_adapts_the_language_model_only_and_trains_on_images(vlm, colours, tmp_path):
    extra = ("--lora_rank", "4", "--max_images_per_prompt", "1", "--max_samples", "32", "--max_epochs", "1")
    run = parse_sft(sft_flags(vlm, colours["train"], tmp_path, *extra))
    model = load_causal_lm(run.model, torch.device("cpu"))
    adapted = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapted and all("lora_" in n and "language_model" in n for n in adapted)
    assert len(run_sft(run)) == 2
    adapter = load_file(tmp_path / "final" / "adapter_model.safetensors")
    lora_b = [w for k, w in adapter.items() if "lora_B" in k]  # zero at the start: trained if not
    assert lora_b and any(w.abs().sum() > 0 for w in lora_b)
    assert not any("visual" in k for k in adapter)


def test_fsdp_wraps_decoder_layers_and_vision_blocks(vlm):
    model = load_causal_lm(parse_sft(sft_flags(vlm, "unused.jsonl", vlm)).model, torch.device("cpu"))
    kinds = [type(block).__name__ for block in transformer_blocks(model)]
    assert kinds.count("Qwen2_5_VLDecoderLayer") == 2 and kinds.count("Qwen2_5_VLVisionBlock") == 2


def test_image_flags_with_a_text_model_or_text_only_runs_are_refused(tiny_llama, vlm, colours, tmp_path):
    with pytest.raises(ConfigError, match="--max_images_per_prompt 1 needs a vision-language model"):
        run_sft(parse_sft(sft_flags(tiny_llama, colours["train"], tmp_path, "--max_images_per_prompt", "1")))
    with pytest.raises(DataError, match=r"row \d+ of .*train.jsonl: has 1 image\(s\) under 'images', but"):
        run_sft(parse_sft(sft_flags(vlm, colours["train"], tmp_path)))  # --max_images_per_prompt 0


def test_flat_and_dotted_image_flags_parse_alike(vlm):
    flat = ["--image_key", "pics", "--max_images_per_prompt", "2", "--freeze_visual_encoder"]
    dotted = [
        "--data.image_key",
        "pics",
        "--data.max_images_per_prompt",
        "2",
        "--actor.freeze_visual_encoder",
    ]
    for parse in (parse_sft, parse_dpo, parse_rm):
        base = ["--pretrain", str(vlm), "--dataset", "d.jsonl"]
        assert parse(base + flat).vision == parse(base + dotted).vision == VisionConfig("pics", 2, True)


def test_qwen3_5_token_logprobs_take_the_chunked_head(tmp_path):
    """Qwen3.5's VLM applies its LM head as is: token log-probs run through the chunked head (no full
    [B, T, vocab] logits) and equal transformers' log-softmax (its packing is refused, so padded rows)."""
    path = build_tiny_vlm(tmp_path / "q35", "qwen3_5")
    model = load_causal_lm(ModelConfig(pretrain=str(path)), torch.device("cpu")).eval()
    ids = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(12).expand(2, 12),
    }
    with torch.no_grad():
        logprobs, outputs = token_logprobs(model, batch)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1]
    assert type(outputs).__name__ == "LogprobOutputs"
    want = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(logprobs[:, 1:], want, atol=1e-5, rtol=0)
