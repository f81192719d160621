"""Images of dataset rows (tidal.data.images, tidal.data.vision): every accepted form decodes to the same
pixels, bad input is one line naming the file, row and image before any sample is built, and the
image-token expansion matches the processor."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from tidal.config.args import ConfigError
from tidal.config.data import VisionConfig
from tidal.config.sample_data import SFTDataConfig
from tidal.data import DataError, collate_padded, load_dataset_spec
from tidal.data.images import ImageError, RowImages, check_image_rows, image_ref, open_image
from tidal.data.vision import ImageSamples, expand_image_tokens, load_vision_processor
from tidal.models import load_tokenizer
from tidal.testing import build_tiny_vlm
from tidal.trainers.sft import load_sft_samples

RED = (200, 30, 30)


def png(colour=RED, size=28) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def prompt(n_images: int = 1) -> list[dict]:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": "What colour?"}]
    return [{"role": "user", "content": parts}]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


def test_every_accepted_form_decodes_to_the_same_pixels(tmp_path):
    data = png()
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    forms = [
        "img/a.png",  # relative to the data file's folder
        str(tmp_path / "img" / "a.png"),
        b64,
        f"data:image/png;base64,{b64}",
        data,
        {"bytes": data, "path": None},  # datasets' Image feature
        Image.open(io.BytesIO(data)),
    ]
    for form in forms:
        image = open_image(image_ref(form, tmp_path))
        assert image.mode == "RGB" and image.size == (28, 28) and image.getpixel((3, 3)) == RED, form


def test_urls_and_undecodable_values_are_image_errors(tmp_path):
    with pytest.raises(ImageError, match="is a URL"):
        image_ref("https://example.com/a.png")
    with pytest.raises(ImageError, match="not a readable image"):
        open_image(image_ref(b"\x89PNG not really"))
    with pytest.raises(ImageError, match="no such file"):
        open_image(image_ref("missing.png", tmp_path))


def _check(path, **cfg):
    dataset = load_dataset_spec(str(path), None)
    return check_image_rows(dataset, VisionConfig(**{"max_images_per_prompt": 2, **cfg}), str(path))


def test_a_missing_file_names_the_row_the_image_and_the_file(tmp_path):
    (tmp_path / "ok.png").write_bytes(png())
    path = write_rows(
        tmp_path / "train.jsonl",
        [{"prompt": prompt(), "images": ["ok.png"]}, {"prompt": prompt(2), "images": ["ok.png", "gone.png"]}],
    )
    with pytest.raises(DataError) as err:
        _check(path)
    message = str(err.value)
    assert "\n" not in message
    assert f"row 2 of {path}: image 2: {tmp_path / 'gone.png'}: no such file" in message


def test_corrupt_bytes_name_the_row_and_image(tmp_path):
    path = write_rows(
        tmp_path / "train.jsonl",
        [{"prompt": prompt(), "images": [base64.b64encode(png()[:40]).decode()]}],
    )
    with pytest.raises(DataError, match=rf"row 1 of {path}: image 1: .*not a readable image"):
        _check(path)


def test_too_many_images_and_text_only_runs_name_the_flag(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    path = write_rows(tmp_path / "train.jsonl", [{"prompt": prompt(3), "images": ["a.png"] * 3}])
    with pytest.raises(DataError, match=r"row 1 of .*: has 3 images, more than --max_images_per_prompt 2"):
        _check(path)
    with pytest.raises(DataError, match=r"has 3 image\(s\) under 'images', but --max_images_per_prompt is 0"):
        _check(path, max_images_per_prompt=0)


def test_a_dataset_without_the_image_column_is_text_only(tmp_path):
    path = write_rows(tmp_path / "train.jsonl", [{"prompt": "hi"}])
    assert _check(path, max_images_per_prompt=0) == [RowImages()]


def test_expand_image_tokens_repeats_each_placeholder_by_its_count():
    ids, mask = expand_image_tokens([5, 9, 6, 9, 7], [0, 0, 0, 0, 1], [2, 3], image_token_id=9)
    assert ids == [5, 9, 9, 6, 9, 9, 9, 7] and mask == [0, 0, 0, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="1 image placeholder"):
        expand_image_tokens([5, 9], [0, 0], [1, 1], image_token_id=9)


def sft_samples(tiny_vlm, path, max_images: int):
    """``path``'s SFT samples (prompt -> answer, chat template) with the tiny VLM's tokenizer and image
    processor, at most ``max_images`` images a row."""
    tokenizer = load_tokenizer(str(tiny_vlm))
    processor = load_vision_processor(str(tiny_vlm), tokenizer)
    images = ImageSamples(VisionConfig(max_images_per_prompt=max_images), processor)
    cfg = SFTDataConfig(input_key="prompt", output_key="answer", apply_chat_template=True)
    return load_sft_samples(str(path), None, "train", None, tokenizer, cfg, 0, images)


def test_sft_samples_carry_expanded_image_tokens_matching_the_processor(tiny_vlm, tmp_path):
    (tmp_path / "big.png").write_bytes(png(size=56))  # 4 image tokens
    (tmp_path / "small.png").write_bytes(png(size=28))  # 1 image token
    rows = [
        {"prompt": prompt(2), "answer": "red", "images": ["big.png", "small.png"]},
        {"prompt": prompt(0), "answer": "red"},  # text only rows mix with image rows
    ]
    path = write_rows(tmp_path / "train.jsonl", rows)
    tokenizer = load_tokenizer(str(tiny_vlm))
    processor = load_vision_processor(str(tiny_vlm), tokenizer)
    assert processor.image_token == "<|image_pad|>"
    images = ImageSamples(VisionConfig(max_images_per_prompt=2), processor)
    cfg = SFTDataConfig(input_key="prompt", output_key="answer", apply_chat_template=True)
    samples = sorted(
        load_sft_samples(str(path), None, "train", None, tokenizer, cfg, 0, images), key=lambda s: s.row
    )
    with_images, text = samples
    pad = processor.image_token_id
    assert with_images.input_ids.count(pad) == 5 and len(with_images.images) == 2
    assert all(m == 0 for t, m in zip(with_images.input_ids, with_images.loss_mask, strict=True) if t == pad)
    assert text.images is None and pad not in text.input_ids
    # the processor's own expansion of the same text gives the same token count
    grid = processor.pixel_inputs([open_image(r) for r in with_images.images.refs])["image_grid_thw"]
    assert (grid.prod(-1) // 4).tolist() == [4, 1]


def test_placeholders_that_do_not_match_the_images_name_the_row(tiny_vlm, tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    path = write_rows(tmp_path / "train.jsonl", [{"prompt": prompt(2), "answer": "red", "images": ["a.png"]}])
    with pytest.raises(
        DataError, match=rf"row 1 of {path}: the rendered text has 2 image placeholder\(s\) but"
    ):
        sft_samples(tiny_vlm, path, max_images=2)


def test_the_tiny_vlm_folder_loads_with_auto_processor(tiny_vlm):
    """Where torchvision is installed (transformers' Qwen-VL video processor needs it)."""
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(tiny_vlm))
    out = processor(
        text=["<|image_pad|>"], images=[Image.open(io.BytesIO(png(size=56)))], return_tensors="pt"
    )
    assert out["input_ids"][0].tolist().count(processor.image_token_id) == 4


def test_image_runs_refuse_layouts_and_models_they_cannot_use():
    vision = ImageSamples(VisionConfig(max_images_per_prompt=1), processor=object())
    with pytest.raises(ConfigError, match="--ring_attn_size 2 with images"):
        vision.check("m", ring_attn_size=2)
    with pytest.raises(ConfigError, match="--ds_tensor_parallel_size 2 with images"):
        vision.check("m", tensor_parallel_size=2)
    with pytest.raises(
        ConfigError, match="--freeze_visual_encoder needs a vision-language model; --pretrain m"
    ):
        ImageSamples(VisionConfig(freeze_visual_encoder=True)).check("m", vision_model=False)
    ImageSamples(VisionConfig()).check("m", ring_attn_size=2)  # text only: nothing to refuse


def test_parquet_binary_images_are_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {"prompt": ["a", "b"], "images": pa.array([[png()], [png((0, 0, 255))]], pa.list_(pa.binary()))}
    )
    pq.write_table(table, tmp_path / "train.parquet")
    rows = _check(tmp_path / "train.parquet")
    assert [open_image(r.refs[0]).getpixel((0, 0)) for r in rows] == [RED, (0, 0, 255)]


def test_an_image_changed_after_the_check_is_named_when_collated(tiny_vlm, tmp_path):
    (tmp_path / "a.png").write_bytes(png(size=28))
    path = write_rows(tmp_path / "train.jsonl", [{"prompt": prompt(), "answer": "red", "images": ["a.png"]}])
    samples = sft_samples(tiny_vlm, path, max_images=1)
    assert collate_padded(samples, 0)["image_counts"].tolist() == [1]
    (tmp_path / "a.png").write_bytes(png(size=56))  # now 4 image tokens
    with pytest.raises(
        DataError, match=r"dataset row 1: its 1 image\(s\) now make 4 image tokens, not the 1"
    ):
        collate_padded(samples, 0)


def test_a_placeholder_without_an_image_is_refused(tiny_vlm, tmp_path):
    path = write_rows(tmp_path / "train.jsonl", [{"prompt": prompt(1), "answer": "red"}])  # no images key
    with pytest.raises(
        DataError, match=r"row 1 of .*: the rendered text has 1 image placeholder\(s\) but the row has 0"
    ):
        sft_samples(tiny_vlm, path, max_images=1)
