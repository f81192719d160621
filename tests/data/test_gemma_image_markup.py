"""Gemma 3/4 image prompts (``tidal.data.vision.ImageMarkup``): the token ids tidal builds from a prompt
rendered by the real templates' shape equal what transformers' ``Gemma3Processor`` / ``Gemma4Processor``
build, on the text path (RL prompts) and the id path (training samples); the tiny models' whole-group
shape is expanded in place; agents' feedback images take the processor's ids too."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from tidal.agents.images import _image_pieces
from tidal.data.image_processors import fixed_size_processor
from tidal.data.vision import VisionProcessor, expand_image_tokens, image_markup
from tidal.testing.tiny_vlm import (
    _GEMMA4_OTHER_TOKENS,
    BOI,
    EOI,
    GEMMA3_CHAT_TEMPLATE,
    GEMMA3_REAL_CHAT_TEMPLATE,
    GEMMA4_REAL_CHAT_TEMPLATE,
    SOFT,
    build_gemma3_tokenizer,
    gemma3_config,
    gemma4_config,
    gemma_hf_processor,
)

MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "look\n"},
            {"type": "image"},
            {"type": "text", "text": "what colour? "},
            {"type": "image"},
        ],
    }
]


def _images() -> list:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((20, 30), (64, 40))]


def _tokenizer(family: str, template: str):
    tokenizer = build_gemma3_tokenizer(seed=0)
    if family == "gemma4":
        tokenizer.add_special_tokens({"additional_special_tokens": list(_GEMMA4_OTHER_TOKENS)})
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize(
    ("family", "template"),
    [("gemma3", GEMMA3_REAL_CHAT_TEMPLATE), ("gemma4", GEMMA4_REAL_CHAT_TEMPLATE)],
    ids=["gemma3", "gemma4"],
)
def test_prompt_ids_equal_the_transformers_processor(family, template):
    tokenizer = _tokenizer(family, template)
    config = (gemma3_config if family == "gemma3" else gemma4_config)(tokenizer)
    hf = gemma_hf_processor(family, tokenizer)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    want = hf(text=text, images=_images(), return_tensors=None)["input_ids"][0]

    ours = VisionProcessor(
        tokenizer, fixed_size_processor(hf.image_processor, config), config.image_token_id,
        markup=image_markup(config, tokenizer),
    )  # fmt: skip
    counts = ours.token_counts(_images())
    assert sum(counts) == want.count(config.image_token_id)
    # RL prompts (tidal.experience.images): the rendered text expanded, then tokenized
    expanded = ours.image_markup.expand_text(text, counts)
    assert tokenizer(expanded, add_special_tokens=False)["input_ids"] == want
    # training samples: the rendered ids expanded
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    got, mask = expand_image_tokens(ids, [1] * len(ids), counts, ours.image_token_id, ours.image_pieces(ids))
    assert got == want
    assert sum(mask) == len(ids) - len(counts)  # every added id (and the marker) untrained
    # agents' feedback images: the same ids around an image's tokens as the processor's
    markup, before, after = _image_pieces(SimpleNamespace(hf_config=config), tokenizer, "episode 1")
    first = want.index(config.image_token_id)
    assert want[first - len(before) : first] == before
    assert markup.image_text(counts[0]) in tokenizer.decode(want)


def test_whole_group_templates_expand_in_place_and_miscounts_are_refused():
    """The tiny models' ``<start_of_image><image_soft_token><end_of_image>`` repeats its soft token (as the
    engine's requests do); a prompt whose markers and images differ is refused, naming both counts."""
    tokenizer = _tokenizer("gemma3", GEMMA3_CHAT_TEMPLATE)
    markup = image_markup(gemma3_config(tokenizer), tokenizer)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    group = BOI + SOFT + EOI
    assert text.count(group) == 2
    first, second = BOI + SOFT * 2 + EOI, BOI + SOFT * 3 + EOI
    assert markup.expand_text(text, [2, 3]) == text.replace(group, first, 1).replace(group, second, 1)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    image_token_id = tokenizer.convert_tokens_to_ids(SOFT)
    processor = VisionProcessor(tokenizer, None, image_token_id, markup=markup)
    pieces = processor.image_pieces(ids)
    expanded = expand_image_tokens(ids, [0] * len(ids), [2, 3], image_token_id, pieces)[0]
    assert expanded == tokenizer(markup.expand_text(text, [2, 3]), add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="has 2 image placeholder.*has 1 image"):
        markup.expand_text(text, [4])
