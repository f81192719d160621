"""A GAE critic for a vision-language policy (``tidal ppo --advantage_estimator gae --max_images_per_prompt``).

The critic is the VLM with a value head (``tidal.models.vision_value.load_critic_model``): its forward takes
the actor's image inputs (pixels, grids, M-RoPE positions), padded or packed, so the same text with another
image gets other values, and it learns a return that only the image tells. Through the CLI a run trains
policy and critic for two steps, freezes the critic's vision tower with ``--freeze_visual_encoder`` and
resumes from a checkpoint exactly (``test_vlm_engines``: with an engine process of its own). What RL with
images still refuses is one line each.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoImageProcessor, AutoTokenizer

from tests.trainers.test_vlm_grpo import _flags
from tidal.cli.train_ppo import parse_run
from tidal.config import ConfigError
from tidal.config.model import ModelConfig
from tidal.experience.experience import Experience
from tidal.experience.images import ExperienceImages
from tidal.experience.maker import forward_values
from tidal.models.precision import Precision
from tidal.models.vision import vision_modules
from tidal.models.vision_value import load_critic_model
from tidal.testing import ColourTask, build_tiny_model, build_tiny_vlm
from tidal.testing.tiny_vlm import IMAGE_PAD, VISION_END, VISION_START
from tidal.trainers.ppo import run_ppo
from tidal.trainers.ppo.update import Normaliser, ValueLoss

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CPU = torch.device("cpu")
FP32 = Precision(torch.float32, CPU)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "policy")


def coloured_rows(vlm, colours: list[str], extra: list[int]) -> Experience:
    """One row per colour: the same text around a 56x56 image of that colour (4 image tokens), then a
    response of ``3 + extra`` tokens (rows right-padded to one width); returns 0 everywhere."""
    tokenizer, processor = AutoTokenizer.from_pretrained(vlm), AutoImageProcessor.from_pretrained(vlm)
    start, end, pad = tokenizer.convert_tokens_to_ids([VISION_START, VISION_END, IMAGE_PAD])
    text = tokenizer("Colour?")["input_ids"]
    rows, images = [], []
    for colour, more in zip(colours, extra, strict=True):
        pixels = processor(images=[ColourTask(size=56).draw(colour, random.Random(0))], return_tensors="pt")
        tokens = int(pixels["image_grid_thw"].prod()) // processor.merge_size**2
        prompt = text + [start] + [pad] * tokens + [end] + text
        rows.append((prompt, tokenizer(" it is" + " so" * more)["input_ids"]))
        images.append((pixels["pixel_values"], pixels["image_grid_thw"]))
    width = max(len(p) + len(r) for p, r in rows)
    seq = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention, action = torch.zeros_like(seq), torch.zeros_like(seq)
    for i, (prompt, response) in enumerate(rows):
        n = len(prompt) + len(response)
        seq[i, :n] = torch.tensor(prompt + response)
        attention[i, :n], action[i, len(prompt) : n] = 1, 1
    zeros = torch.zeros(len(rows))
    exp = Experience(
        seq, attention, action, torch.zeros(seq.shape), zeros, zeros, images=ExperienceImages(images)
    )
    exp.values, exp.returns = torch.zeros(seq.shape), torch.zeros(seq.shape)
    return exp


def critic(vlm, freeze: bool = False, lora_rank: int = 0):
    cfg = ModelConfig(pretrain=str(vlm), lora_rank=lora_rank, lora_alpha=16, target_modules=["all-linear"])
    return load_critic_model(cfg, CPU, "value_head", images=True, freeze_visual_encoder=freeze)


def test_critic_values_read_the_image_padded_and_packed(vlm):
    model = critic(vlm, freeze=True)
    assert all(not p.requires_grad for _, m in vision_modules(model) for p in m.parameters())
    assert model.value_head.weight.requires_grad
    exp = coloured_rows(vlm, ["red", "blue", "red"], [0, 0, 2])  # the last row is longer: padding
    padded = forward_values(model, exp, micro=3, packing=False, precision=FP32)
    packed = forward_values(model, exp, micro=3, packing=True, precision=FP32)
    mask = exp.attention_mask.bool()
    mask[:, 0] = False  # V(before the first token) is never read: packed rows shift it from the row before
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=1e-5)
    image_at = (
        exp.sequences[0].tolist().index(AutoTokenizer.from_pretrained(vlm).convert_tokens_to_ids(IMAGE_PAD))
    )
    red, blue, n = padded[0], padded[1], int(exp.attention_mask[0].sum())
    # values[t] is V(before token t): causal, so equal up to the first image token and different after it
    torch.testing.assert_close(red[: image_at + 1], blue[: image_at + 1])
    assert (red[image_at + 1 : n] - blue[image_at + 1 : n]).abs().min() > 1e-4
    torch.testing.assert_close(padded[2, :n], red[:n])  # the same image and text, a longer response


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])
def test_critic_learns_a_return_only_the_image_tells(vlm, lora_rank):
    """Same text, red → return 1, blue → return −1: the value loss falls and the values part. With
    ``--lora_rank`` the adapters sit on the language model only and the value head trains whole."""
    torch.manual_seed(0)
    model = critic(vlm, lora_rank=lora_rank)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("value_head" in n for n in trained)
    if lora_rank:  # nothing of the vision tower: it has no adapters and stays frozen
        assert all("lora_" in n or "value_head" in n for n in trained) and not any(
            ".visual." in n for n in trained
        )
    exp = coloured_rows(vlm, ["red", "blue", "red", "blue"], [0, 0, 1, 1])
    exp.returns = exp.action_mask * torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    tokens = float(exp.action_mask.sum())
    loss_fn, norm = ValueLoss(None, FP32, packing=True), Normaliser(tokens=tokens, sequences=4.0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(12):
        model.train()
        loss, _ = loss_fn(model, exp, norm)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"VLM critic loss per step: {[round(x, 4) for x in losses]}")
    assert losses[-1] < 0.2 * losses[0], losses
    values = forward_values(model, exp, micro=4, packing=True, precision=FP32)
    mean = (values * exp.action_mask).sum(-1) / exp.action_mask.sum(-1)
    assert mean[[0, 2]].min() > mean[[1, 3]].max() + 0.5, mean


def test_gae_on_images_trains_two_steps_and_resumes_exactly(vlm, tmp_path):
    keys = ("reward", "critic/loss", "policy/loss", "values/mean", "returns/mean", "grad_norm")
    flags = ["--advantage_estimator", "gae", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
             "--critic_learning_rate", "1e-3", "--freeze_visual_encoder", "--packing_samples",
             "--save_steps", "1", "--save_value_network"]  # fmt: skip
    history = run_ppo(parse_run(_flags(vlm, tmp_path / "run", *flags)))
    assert [h["step"] for h in history] == [1, 2]
    assert history[0]["critic/loss"] != history[1]["critic/loss"]
    print(f"VLM GAE critic loss per step: {[h['critic/loss'] for h in history]}")

    # the exported critic: the value head trained, its vision tower frozen as the policy's
    before = load_file(vlm / "model.safetensors")
    after = load_file(tmp_path / "run" / "rl" / "final_critic" / "model.safetensors")
    towers = [n for n in after if ".visual." in f".{n}" and n.endswith("weight")]
    assert towers and "score.weight" in after  # --value_head_prefix's default
    for name in towers:  # the export may name the tower with or without the inner model's prefix
        original = next(
            before[k] for k in (name, f"model.{name}", name.removeprefix("model.")) if k in before
        )
        torch.testing.assert_close(after[name], original)

    # resume from the step-1 checkpoint as if the run had stopped there: step 2 is the same
    shutil.copytree(tmp_path / "run" / "rl" / "ckpt", tmp_path / "resumed" / "rl" / "ckpt")
    (tmp_path / "resumed" / "rl" / "ckpt" / "latest").write_text("global_step_1")
    resumed = run_ppo(parse_run(_flags(vlm, tmp_path / "resumed", *flags, "--load_checkpoint")))
    assert [h["step"] for h in resumed] == [2]
    for key in keys:
        assert resumed[0][key] == history[1][key], key


def test_what_rl_with_images_still_refuses_is_one_line(vlm, tmp_path):
    agent = _flags(vlm, tmp_path, "--agent_endpoint", str(EXAMPLES / "agent_func.py"))
    scored = _flags(vlm, tmp_path, "--reward_pretrain", str(vlm))
    del scored[scored.index("--remote_rm_url") : scored.index("--remote_rm_url") + 2]  # one reward source
    for flags, message in [
        (agent, "--agent_endpoint episodes take text only"),  # --agent_func_path: test_vlm_agent_rl
        (scored, "reward models score text"),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            parse_run(flags)
        assert "\n" not in str(err.value)
    text = build_tiny_model(tmp_path / "text", "qwen2")
    with pytest.raises(ConfigError, match="is not a vision-language model, but the critic reads") as err:
        run_ppo(
            parse_run(_flags(vlm, tmp_path, "--advantage_estimator", "gae", "--critic_pretrain", str(text)))
        )
    assert "\n" not in str(err.value)


@pytest.mark.gpu
def test_gae_on_images_on_cuda(vlm, tmp_path):
    """On CUDA (bf16 autocast; packed rows through the varlen attention where torch has it): the critic's
    values still read the image and agree padded vs packed, and a GAE run trains both models two steps."""
    cuda = torch.device("cuda", 0)
    model = critic(vlm, freeze=True).to(cuda)
    exp = coloured_rows(vlm, ["red", "blue", "red"], [0, 0, 2]).to(cuda)
    bf16 = Precision(torch.bfloat16, cuda)
    padded = forward_values(model, exp, micro=3, packing=False, precision=bf16)
    packed = forward_values(model, exp, micro=3, packing=True, precision=bf16)
    mask = exp.attention_mask.bool()
    mask[:, 0] = False
    torch.testing.assert_close(packed[mask], padded[mask], atol=3e-2, rtol=3e-2)
    n = int(exp.attention_mask[0].sum())
    assert (padded[0, n - 3 : n] - padded[1, n - 3 : n]).abs().max() > 1e-3  # red vs blue, same text

    flags = ["--advantage_estimator", "gae", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
             "--freeze_visual_encoder", "--packing_samples", "--critic_learning_rate", "1e-3"]  # fmt: skip
    history = run_ppo(parse_run(_flags(vlm, tmp_path, *flags)))
    print(
        f"VLM GAE on CUDA: {[{k: h[k] for k in ('critic/loss', 'rollout/logprob_mismatch')} for h in history]}"
    )
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["critic/loss"])) for h in history)
    assert history[0]["critic/loss"] != history[1]["critic/loss"]
