"""``tidal serve`` on the tiny offline Gemma 3 VLM with the real chat template's shape (a lone
``<start_of_image>`` per image): an OpenAI ``image_url`` data URI gives the prompt ids of transformers'
``Gemma3Processor`` (counted in ``usage``) and its greedy answer equals ``transformers.generate`` on the
processor's inputs."""

from __future__ import annotations

import base64
import http.client
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from tidal.config.serve import ServeLimits  # noqa: E402
from tidal.rollout import EngineConfig, LLMEngine  # noqa: E402
from tidal.serve import OpenAIServer  # noqa: E402

MODEL = "tiny-gemma3"
QUESTION = "What is it?"


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(HF model, transformers' processor with the real template, running server)."""
    from transformers import AutoModelForImageTextToText

    from tidal.data.vision import load_vision_processor
    from tidal.models import load_tokenizer
    from tidal.testing import build_tiny_vlm
    from tidal.testing.tiny_vlm import GEMMA3_REAL_CHAT_TEMPLATE, gemma_hf_processor

    path = str(build_tiny_vlm(tmp_path_factory.mktemp("gemma3") / "m", "gemma3"))
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = GEMMA3_REAL_CHAT_TEMPLATE
    hf = AutoModelForImageTextToText.from_pretrained(path).eval()
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=256, block_size=4, max_num_seqs=2)
    image_processor = load_vision_processor(path, tokenizer).image_processor
    engine = LLMEngine(model=hf, tokenizer=tokenizer, config=config, image_processor=image_processor)
    limits = ServeLimits(max_request_bytes=1 << 20, max_images=2, max_image_pixels=256 * 256)
    with OpenAIServer(engine, MODEL, limits=limits) as server:
        yield hf, gemma_hf_processor("gemma3", tokenizer), server


def _data_uri(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"


def _post(server, payload: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(
        "POST", "/v1/chat/completions", body=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    resp = conn.getresponse()
    status, body = resp.status, json.loads(resp.read())
    conn.close()
    assert status == 200, body
    return body


@torch.inference_mode()
def test_image_url_gives_the_processor_ids_and_transformers_greedy_answer(gemma):
    hf, processor, server = gemma
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 30, 3), dtype=np.uint8))
    content = [
        {"type": "image_url", "image_url": {"url": _data_uri(image)}},
        {"type": "text", "text": QUESTION},
    ]
    body = _post(server, {"model": MODEL, "messages": [{"role": "user", "content": content}],
                          "temperature": 0, "max_tokens": 8})  # fmt: skip
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=text, images=[image], return_tensors="pt")
    out = hf.generate(
        **inputs, do_sample=False, max_new_tokens=8,
        suppress_tokens=[hf.config.image_token_id],  # the engine never samples image tokens
    )  # fmt: skip
    answer = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert body["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert body["choices"][0]["message"]["content"] == processor.tokenizer.decode(
        answer, skip_special_tokens=True
    )
