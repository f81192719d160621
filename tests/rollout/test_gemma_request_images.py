"""The engine's image requests for Gemma 3 and Gemma 4 (``prepare_images`` through
``tidal.data.vision.expand_request_images``) take a prompt rendered by the real chat templates' shapes
(Gemma 3: a lone ``<start_of_image>``; Gemma 4: its image token) and give exactly the ids of transformers'
``Gemma3Processor`` / ``Gemma4Processor``: as token ids or as text, one and two images; a prompt already
laid out (the processor's own ids) is kept as it is; markers and images that do not pair up are refused.
Greedy completions from such a prompt equal
``transformers.generate`` on the processor's inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.runner.multimodal import MultiModalInput

ONE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
TWO = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "look\n"},
            {"type": "image"},
            {"type": "text", "text": "and "},
            {"type": "image"},
        ],
    }
]


def _images(seed: int, n: int) -> list:
    rng = np.random.default_rng(seed)
    sizes = [(30, 40), (64, 40)][:n]  # Gemma 4 keeps the aspect ratio: different token counts
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def setup(request, tmp_path_factory):
    """(family, HF model, transformers' processor with the real template, engine)."""
    from transformers import AutoModelForImageTextToText

    from tidal.data.vision import load_vision_processor
    from tidal.models import load_tokenizer
    from tidal.testing import build_tiny_vlm
    from tidal.testing.tiny_vlm import (
        GEMMA3_REAL_CHAT_TEMPLATE,
        GEMMA4_REAL_CHAT_TEMPLATE,
        gemma_hf_processor,
    )

    family = request.param
    path = str(build_tiny_vlm(tmp_path_factory.mktemp(family) / "m", family))
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = GEMMA3_REAL_CHAT_TEMPLATE if family == "gemma3" else GEMMA4_REAL_CHAT_TEMPLATE
    hf = AutoModelForImageTextToText.from_pretrained(path).eval()
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=256, block_size=4)
    engine = LLMEngine(
        model=hf, tokenizer=tokenizer, config=config,
        image_processor=load_vision_processor(path, tokenizer).image_processor,
    )  # fmt: skip
    return family, hf, gemma_hf_processor(family, tokenizer), engine


def _text(processor, messages) -> str:
    return processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_request_ids_equal_the_transformers_processor(setup):
    family, hf, processor, engine = setup
    tokenizer = processor.tokenizer
    prompts, images, wants = [], [], []
    for messages, seed in ((ONE, 0), (TWO, 1)):
        text, ims = _text(processor, messages), _images(seed, 1 if messages is ONE else 2)
        want = processor(text=text, images=ims, return_tensors=None)["input_ids"][0]
        assert want.count(hf.config.image_token_id) > len(ims)  # each image is a run of its tokens
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        # the rendered ids, the rendered text, and the processor's own (already laid out) ids
        prompts += [ids, text, want]
        images += [MultiModalInput(images=ims)] * 3
        wants += [want] * 3
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    outs = engine.generate(prompts, params, multi_modal=images)
    assert [o.prompt_token_ids for o in outs] == wants
    # two markers for one image (the markers counted, whichever the family's) are refused in one line
    with pytest.raises(ValueError, match="request 0: the prompt has 2 image placeholder token.*1 image"):
        engine.generate([prompts[3]], params, multi_modal=[MultiModalInput(images=_images(0, 1))])


@torch.inference_mode()
def test_greedy_from_a_real_template_prompt_equals_transformers_generate(setup):
    family, hf, processor, engine = setup
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    answers = []
    for messages, seed in ((ONE, 2), (TWO, 3)):
        text, ims = _text(processor, messages), _images(seed, 1 if messages is ONE else 2)
        ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        got = engine.generate([ids], params, multi_modal=[MultiModalInput(images=ims)])[0]
        inputs = processor(text=text, images=ims, return_tensors="pt")
        out = hf.generate(
            **inputs, do_sample=False, max_new_tokens=8,
            suppress_tokens=[hf.config.image_token_id],  # the engine never samples image tokens
        )  # fmt: skip
        assert got.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()
        answers.append(got.outputs[0].token_ids)
    assert answers[0] != answers[1]
