"""``tidal serve`` on the tiny offline Qwen2.5-VL (CPU, float32): OpenAI ``image_url`` parts over loopback.

A greedy answer on an image through the ``openai`` client equals ``transformers.generate`` on the same
image; hostile image payloads (a decompression bomb, corrupt base64, a non-image, too many images, an
http URL, an unknown ``detail``) each get a 400 naming the problem, raw or through the client, and a good
request afterwards still gets its exact answer; a text-only model given an image gets a 400 naming it.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import zlib

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from tidal.config.serve import ServeLimits  # noqa: E402
from tidal.rollout import EngineConfig, LLMEngine  # noqa: E402
from tidal.serve import OpenAIServer  # noqa: E402

MODEL = "tiny-vlm"
LIMITS = ServeLimits(max_request_bytes=1 << 20, max_images=2, max_image_pixels=256 * 256)
QUESTION = "What is it?"


def _image(seed: int, size=(56, 56)):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(size[1], size[0], 3, generator=g) * 255).byte().numpy())


def _data_uri(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def _messages(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


def _bomb_png(width: int, height: int, rows: bytes | None = None) -> bytes:
    """A valid PNG header announcing ``width × height`` grey pixels: a few bytes that a decoder would
    expand to width × height bytes (only the header matters: the server must refuse before decoding)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    rows = rows or zlib.compress(b"\0" * (width + 1) * 64)  # a few rows: the rest would be zeros too
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(HF model with peaked logits, processor, tokenizer)."""
    from transformers import AutoModelForImageTextToText

    from tidal.data.vision import load_vision_processor
    from tidal.models import load_tokenizer
    from tidal.testing import build_tiny_vlm

    path = str(build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m"))
    tokenizer = load_tokenizer(path)
    hf = AutoModelForImageTextToText.from_pretrained(path).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)  # peaked distributions, as a trained model's
    return hf, load_vision_processor(path, tokenizer), tokenizer


@pytest.fixture(scope="module")
def served(vlm):
    hf, processor, tokenizer = vlm
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=256, block_size=4, max_num_seqs=4)
    engine = LLMEngine(
        model=hf, tokenizer=tokenizer, config=config, image_processor=processor.image_processor
    )
    with OpenAIServer(engine, MODEL, limits=LIMITS) as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)


@torch.inference_mode()
def _hf_greedy(vlm, image, max_new_tokens: int) -> list[int]:
    from tidal.data.vision import expand_image_tokens

    hf, processor, tokenizer = vlm
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    counts = processor.token_counts([image])
    ids = expand_image_tokens(ids, [0] * len(ids), counts, processor.image_token_id)[0]
    input_ids = torch.tensor([ids])
    out = hf.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=(input_ids == processor.image_token_id).int(),
        suppress_tokens=[processor.image_token_id, hf.config.video_token_id],  # as the engine never samples
        do_sample=False,
        max_new_tokens=max_new_tokens,
        **processor.pixel_inputs([image]),
    )
    return out[0, len(ids) :].tolist()


def _post(server, payload=None, raw: bytes | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = raw if raw is not None else json.dumps(payload).encode()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def _greedy_ids(client, messages, max_tokens: int = 8) -> list[int]:
    out = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, logprobs=True
    )
    return out.choices[0].logprobs.content, out


def test_greedy_answer_on_an_image_equals_transformers_generate(vlm, client):
    image = _image(0)
    tokens, out = _greedy_ids(client, _messages(_data_uri(image)))
    expected = _hf_greedy(vlm, image, 8)
    tokenizer = vlm[2]
    assert out.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert [t.token for t in tokens] == [tokenizer.decode([t]) for t in expected]
    # the prompt counts the image's expanded tokens: 4 for a 56x56 image
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert out.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 3


def test_jpeg_and_a_second_image_change_the_prompt(client):
    one = client.chat.completions.create(
        model=MODEL, messages=_messages(_data_uri(_image(1), "JPEG")), temperature=0, max_tokens=2
    )
    two = client.chat.completions.create(
        model=MODEL,
        messages=_messages(_data_uri(_image(1), "JPEG"), _data_uri(_image(2, (28, 28)))),
        temperature=0,
        max_tokens=2,
    )
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + 3  # a 28x28 image: 1 token + its 2 markers


HOSTILE = {
    "bomb": (lambda: "data:image/png;base64," + base64.b64encode(_bomb_png(10000, 10000)).decode(),
             "10000x10000 = 100000000 pixels, over the server's --max_image_pixels 65536"),
    "bomb over PIL's limit": (
        lambda: "data:image/png;base64," + base64.b64encode(_bomb_png(60000, 60000)).decode(),
        "over the server's --max_image_pixels 65536"),
    "corrupt base64": (lambda: "data:image/png;base64,iVBORw0KGgo%%%not-base64", "not valid base64"),
    "not an image": (lambda: "data:image/png;base64," + base64.b64encode(b"hello " * 40).decode(),
                     "not a readable PNG/JPEG/WEBP/GIF image"),
    "truncated png": (lambda: _data_uri(_image(3))[: len("data:image/png;base64,") + 200], "not a readable"),
    "http url": (lambda: "https://example.com/cat.png", "are not fetched"),
    "file path": (lambda: "/etc/passwd", "must be a base64 data URI"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_images_are_400_and_the_server_keeps_answering(name, vlm, served, client):
    make, message = HOSTILE[name]
    status, body = _post(served, {"model": MODEL, "messages": _messages(make()), "max_tokens": 2})
    assert status == 400 and message in body["error"]["message"], body
    assert "messages[0].content[0]" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="messages\\[0\\].content\\[0\\]"):
        client.chat.completions.create(model=MODEL, messages=_messages(make()), max_tokens=2)
    image = _image(4, (28, 28))
    tokens = _greedy_ids(client, _messages(_data_uri(image)), 3)[0]
    tokenizer = vlm[2]
    assert [t.token for t in tokens] == [tokenizer.decode([t]) for t in _hf_greedy(vlm, image, 3)]


def test_hostile_images_beside_good_requests(vlm, served, client):
    """Bad image requests sent at the same time as good ones: each bad one a 400, each good one exact."""
    from concurrent.futures import ThreadPoolExecutor

    images = [_image(10 + k, (28, 28)) for k in range(3)]
    hostile = [make() for make, _ in HOSTILE.values()]
    with ThreadPoolExecutor(8) as pool:
        good = [pool.submit(_greedy_ids, client, _messages(_data_uri(im)), 3) for im in images]
        bad = [pool.submit(_post, served, {"model": MODEL, "messages": _messages(u)}) for u in hostile]
        assert all(f.result()[0] == 400 for f in bad)
        tokenizer = vlm[2]
        for future, image in zip(good, images, strict=True):
            expected = [tokenizer.decode([t]) for t in _hf_greedy(vlm, image, 3)]
            assert [t.token for t in future.result()[0]] == expected


def test_request_limits(served):
    uri = _data_uri(_image(5, (28, 28)))
    status, body = _post(served, {"model": MODEL, "messages": _messages(uri, uri, uri), "max_tokens": 2})
    assert (
        status == 400 and "3 images, over the server's --max_images_per_request 2" in body["error"]["message"]
    )
    detail = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri, "detail": "high"}}]}
    ]
    status, body = _post(served, {"model": MODEL, "messages": detail, "max_tokens": 2})
    assert status == 400 and "only 'auto' is supported" in body["error"]["message"]
    status, body = _post(
        served, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "video"}]}]}
    )
    assert status == 400 and "got 'video'" in body["error"]["message"]
    big = {"model": MODEL, "messages": _messages("data:image/png;base64," + "A" * (1 << 20))}
    status, body = _post(served, big)
    assert status == 413  # the body limit that bounds every request


def test_image_tokens_count_against_the_context_before_decoding(served):
    # the image's 4 tokens count (19 prompt tokens, not the 16 of its text and one placeholder), from
    # its header: the request is refused before its corrupt pixel data is read
    corrupt = _bomb_png(56, 56, rows=b"not zlib data")
    uri = "data:image/png;base64," + base64.b64encode(corrupt).decode()
    status, body = _post(served, {"model": MODEL, "messages": _messages(uri), "max_tokens": 238})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "(19 in the prompt, 238 in the completion)" in body["error"]["message"]
    status, body = _post(served, {"model": MODEL, "messages": _messages(uri), "max_tokens": 237})
    assert status == 400 and "not a readable" in body["error"]["message"]


def test_a_text_model_given_an_image_names_the_model(tiny_llama):
    engine = LLMEngine(tiny_llama, EngineConfig(max_num_seqs=2, num_kv_blocks=32, max_model_len=256))
    with OpenAIServer(engine, "text-only") as server:
        status, body = _post(
            server, {"model": "text-only", "messages": _messages("data:image/png;base64,AAAA")}
        )
        assert status == 400
        assert body["error"]["message"].startswith("the model 'text-only' takes no images"), body
