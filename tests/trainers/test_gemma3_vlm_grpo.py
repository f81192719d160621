"""``tidal ppo`` (GRPO) with images on the tiny Gemma 3 and Gemma 4 VLMs and the colour task (test_vlm_grpo.py's
flags); every test runs for both families.

The engine generates with Gemma 3's bidirectional image attention; the trainer's transformers forward
gets the same samples' pixels (back from tidal's patch rows) and ``token_type_ids``, so old log-probs
equal the engine's within float32 noise, before and after the weight sync (``--freeze_visual_encoder``:
the tower and projector stay as loaded, only the language model is synced). Packing is refused: before
loading in ``tidal ppo``, and at the forward for any trainer that packs image rows.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.trainers.test_vlm_grpo import _flags
from tidal.cli.train_ppo import parse_run
from tidal.config import ConfigError
from tidal.testing import build_tiny_vlm
from tidal.trainers.ppo import run_ppo

# the vision modules, as ``vision_modules`` names them, and the projection into the text width
PROJECTIONS = {"gemma3": "mm_input_projection", "gemma4": "embedding_projection"}
TOWERS = {
    "gemma3": ["model.vision_tower", "model.multi_modal_projector"],
    "gemma4": ["model.vision_tower", "model.embed_vision"],
}


@pytest.fixture(scope="module", params=sorted(TOWERS))
def vlm(request, tmp_path_factory):
    """The tiny VLM of each Gemma family."""
    return build_tiny_vlm(tmp_path_factory.mktemp(request.param) / "policy", request.param)


def _family(path) -> str:
    import json

    return json.loads((path / "config.json").read_text())["model_type"]


def test_grpo_on_images_engine_logprobs_match_the_trainer(vlm, tmp_path):
    longer = ["--prompt_max_len", "160"]  # Gemma 4's images are ~70 tokens
    history = run_ppo(parse_run(_flags(vlm, tmp_path, "--freeze_visual_encoder", *longer)))
    assert len(history) == 2
    mismatch = [step["rollout/logprob_mismatch"] for step in history]
    print(f"{_family(vlm)} VLM GRPO |Δ log-prob| per step: {mismatch}")
    assert max(mismatch) < 1e-3  # the second rollout ran on the synced weights
    before, after = (
        load_file(vlm / "model.safetensors"),
        load_file(tmp_path / "rl" / "final" / "model.safetensors"),
    )
    name = {
        k: [n for n in after if k in n]
        for k in (
            "model.layers.0.mlp.gate_proj.",
            PROJECTIONS[_family(vlm)],
            "encoder.layers.0.self_attn.q_proj.",
        )
    }
    lm, projector, tower = (names[0] for names in name.values())  # as transformers saves them
    assert not torch.equal(before[lm], after[lm])
    torch.testing.assert_close(before[projector], after[projector])
    torch.testing.assert_close(before[tower], after[tower])


def test_packing_with_images_is_refused(vlm, tmp_path):
    from transformers import AutoConfig

    from tidal.models.vision import vision_kwargs

    with pytest.raises(
        ConfigError, match=f"--packing_samples: packing_samples is not supported for the {_family(vlm)} "
    ):
        run_ppo(parse_run(_flags(vlm, tmp_path, "--packing_samples")))
    model = torch.nn.Module()
    model.config = AutoConfig.from_pretrained(str(vlm))
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "pixel_values": torch.zeros(16, 192),
             "image_grid_thw": torch.tensor([[1, 4, 4]]), "segment_ids": torch.zeros(1, 4)}  # fmt: skip
    with pytest.raises(
        ValueError, match=f"--packing_samples with images is not supported for {_family(vlm)}"
    ):
        vision_kwargs(model, batch)
    del batch["segment_ids"]
    kwargs = vision_kwargs(model, batch)
    if _family(vlm) == "gemma3":  # one 32x32 image of 8-pixel patches
        assert kwargs["pixel_values"].shape == (1, 3, 32, 32) and kwargs["token_type_ids"].sum() == 0
    else:  # its 16 patches with their (x, y) positions, row-major
        assert kwargs["pixel_values"].shape == (1, 16, 192) and kwargs["mm_token_type_ids"].sum() == 0
        assert kwargs["image_position_ids"][0, :5].tolist() == [[0, 0], [1, 0], [2, 0], [3, 0], [0, 1]]


def test_vision_modules_freeze_and_lora_targets(vlm):
    """The tower and the projector (Gemma 4: embedder) are the vision modules (frozen together); LoRA adapts the language
    model's linear layers only."""
    from transformers import AutoModelForImageTextToText

    from tidal.models.vision import freeze_vision, language_lora_targets, vision_modules

    model = AutoModelForImageTextToText.from_pretrained(str(vlm))
    assert [name for name, _ in vision_modules(model)] == TOWERS[_family(vlm)]
    tower = sum(p.numel() for _, m in vision_modules(model) for p in m.parameters())
    assert freeze_vision(model) == tower
    targets = language_lora_targets(model, ["all-linear"])
    assert targets and all(t.startswith("model.language_model.") for t in targets)
    assert len(language_lora_targets(model, ["q_proj"])) == model.config.text_config.num_hidden_layers


def test_sft_forward_equals_the_hf_loss_and_packing_is_refused(vlm, tmp_path):
    """``tidal sft``'s samples and forward on images: each padded row's loss is transformers' own (with
    its token types); packed image rows stop with the one-line refusal."""
    from tidal.cli.train_sft import parse_run as parse_sft
    from tidal.config.data import VisionConfig
    from tidal.data import collate_packed, collate_padded
    from tidal.data.images import open_image
    from tidal.data.vision import ImageSamples, load_vision_processor
    from tidal.models import load_causal_lm, load_tokenizer, token_logprobs
    from tidal.models.vision import fixed_size_kwargs
    from tidal.testing import ColourTask
    from tidal.trainers.sft import load_sft_samples

    data = ColourTask(seed=0).write_jsonl(tmp_path / "train.jsonl", 8)
    tokenizer = load_tokenizer(str(vlm))
    processor = load_vision_processor(str(vlm), tokenizer)
    images = ImageSamples(VisionConfig(max_images_per_prompt=1), processor)
    run = parse_sft(["--pretrain", str(vlm), "--dataset", str(data), "--input_key", "prompt", "--output_key",
                     "answer", "--apply_chat_template", "--max_len", "160", "--max_images_per_prompt", "1",
                     "--save_path", str(tmp_path / "final")])  # fmt: skip
    samples = load_sft_samples(str(data), None, "train", 4, tokenizer, run.data, 0, images)
    model = load_causal_lm(run.model, torch.device("cpu")).eval()
    padded = collate_padded(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, padded)
        for row, sample in enumerate(samples):
            ids = torch.tensor([sample.input_ids])
            labels = torch.where(torch.tensor([sample.loss_mask]).bool(), ids, -100)
            pixels = processor.pixel_inputs([open_image(r) for r in sample.images.refs])
            kwargs = fixed_size_kwargs(model.config, ids, pixels["pixel_values"], pixels["image_grid_thw"])
            hf = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, **kwargs).loss
            mask = padded["loss_mask"][row].bool()
            torch.testing.assert_close(-logprobs[row][mask].mean(), hf, atol=1e-5, rtol=1e-5)
        with pytest.raises(
            ValueError, match=f"--packing_samples with images is not supported for {_family(vlm)}"
        ):
            token_logprobs(model, collate_packed(samples))
