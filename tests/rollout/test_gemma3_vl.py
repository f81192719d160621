"""Gemma 3 and Gemma 4 with images (``tidal/rollout/models/gemma3_vl.py``, ``gemma4_vl.py``) in the rollout
engine against transformers' ``Gemma3ForConditionalGeneration`` / ``Gemma4ForConditionalGeneration`` on
the tiny offline VLMs (CPU, float32); every test runs for both families.

Greedy completions equal ``transformers.generate`` (one image, two images, batched with a text-only
prompt, n greedy samples); the bidirectional attention among an image's tokens changes the tokens when
left out (the engine with causal image tokens follows transformers without ``token_type_ids``); n sampled
completions' log-probs equal an HF forward; weight updates under HF names (language model, then the
tower); prefix caching and chunked prefill with images equal the plain engine (whole images per chunk,
so the bidirectional block is whole); the patch-row round trip and image spans by hand; refusals;
``tidal generate --image_key``.
"""

from __future__ import annotations

import pytest
import torch

from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.runner.multimodal import MultiModalInput

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
ONE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
TWO = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]


def _image(seed: int, size: tuple[int, int] = (40, 30)):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    colour = torch.rand(3, generator=g)  # the images differ in more than their noise
    pixels = 0.5 * colour + 0.5 * torch.rand(size[1], size[0], 3, generator=g)
    return Image.fromarray((pixels * 255).byte().numpy())


def _config(**overrides) -> EngineConfig:
    return EngineConfig(
        **{"device": "cpu", "dtype": "float32", "max_model_len": 256, "block_size": 4, **overrides}
    )


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def vlm_dir(request, tmp_path_factory):
    from tidal.testing import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp(request.param) / "m", request.param)


def _family(hf) -> str:
    return hf.config.model_type


# the checkpoint prefixes of the vision tower and its projector / embedder
TOWERS = {
    "gemma3": ("model.vision_tower.", "model.multi_modal_projector."),
    "gemma4": ("model.vision_tower.", "model.embed_vision."),
}


@pytest.fixture(scope="module")
def setup(vlm_dir):
    """(HF model, processor, prompt ids of ONE, of TWO, engine)."""
    from transformers import AutoModelForImageTextToText

    from tidal.data.vision import load_vision_processor
    from tidal.models import load_tokenizer

    tokenizer = load_tokenizer(str(vlm_dir))
    processor = load_vision_processor(str(vlm_dir), tokenizer)
    hf = AutoModelForImageTextToText.from_pretrained(str(vlm_dir)).eval()

    def ids(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return hf, processor, ids(ONE), ids(TWO), _engine(hf, processor)


def _engine(hf, processor, **overrides) -> LLMEngine:
    return LLMEngine(
        model=hf, tokenizer=processor.tokenizer, config=_config(**overrides),
        image_processor=processor.image_processor,
    )  # fmt: skip


def _inputs(hf, processor, ids, images, output=(), bidirectional=True):
    """transformers' inputs for prompt ``ids`` (one placeholder per image) + ``output``."""
    from tidal.data.vision import expand_image_tokens
    from tidal.models.vision import fixed_size_kwargs

    counts = processor.token_counts(images)
    expanded = expand_image_tokens(ids, [0] * len(ids), counts, processor.image_token_id)[0]
    input_ids = torch.tensor([expanded + list(output)])
    pixels = processor.pixel_inputs(images)
    kwargs = fixed_size_kwargs(hf.config, input_ids, pixels["pixel_values"], pixels["image_grid_thw"])
    if not bidirectional:  # transformers' Gemma then attends causally among image tokens too
        kwargs.pop("token_type_ids", None), kwargs.pop("mm_token_type_ids", None)
    return len(expanded), input_ids, kwargs


@torch.inference_mode()
def _hf_greedy(hf, processor, ids, images, bidirectional=True) -> list[int]:
    n, input_ids, kwargs = _inputs(hf, processor, ids, images, bidirectional=bidirectional)
    out = hf.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=8,
        suppress_tokens=[processor.image_token_id], **kwargs,
    )  # fmt: skip
    return out[0, n:].tolist()


@torch.inference_mode()
def _hf_logprobs(hf, processor, ids, images, output: list[int]) -> torch.Tensor:
    """log_softmax of each output token from one transformers forward over prompt + output."""
    n, input_ids, kwargs = _inputs(hf, processor, ids, images, output)
    logits = hf(input_ids=input_ids, **kwargs).logits[0, n - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def _greedy(engine, ids, images) -> list[int]:
    return (
        engine.generate([ids], GREEDY, multi_modal=[MultiModalInput(images=images)])[0].outputs[0].token_ids
    )


def test_greedy_equals_transformers_generate_batched_with_text(setup):
    hf, processor, one, two, engine = setup
    singles = [[_image(i)] for i in range(3)]
    pair = [_image(5), _image(6, (20, 60))]
    text = one[:2] + [300, 301, 302]  # no placeholder: a text-only request in the same batch
    prompts, images = [one] * 3 + [two, text], [*singles, pair, None]
    outs = engine.generate(prompts, GREEDY, multi_modal=[im and MultiModalInput(images=im) for im in images])
    for ids, ims, out in zip(prompts[:4], images[:4], outs, strict=False):
        assert out.outputs[0].token_ids == _hf_greedy(hf, processor, ids, ims)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([text]), do_sample=False, max_new_tokens=8)[0, len(text) :].tolist()
    assert outs[4].outputs[0].token_ids == ref
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:3]}) > 1  # the image decides the answer
    n2 = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, n=2)
    out = engine.generate([two], n2, multi_modal=[MultiModalInput(images=pair)])[0]
    assert [s.token_ids for s in out.outputs] == [outs[3].outputs[0].token_ids] * 2


def test_bidirectional_image_attention_matters(setup, monkeypatch):
    """Image tokens attending causally (the prefill masks' image spans off) give transformers' tokens
    without ``token_type_ids``, which differ from the model's."""
    from tidal.rollout.runner.attention import AttentionMetadata

    hf, processor, one, two, engine = setup
    images = [[_image(16)], [_image(16), _image(66)]]  # images for which the two differ (many do)
    prompts = [one, two]
    want = [_hf_greedy(hf, processor, p, im) for p, im in zip(prompts, images, strict=True)]
    causal = [
        _hf_greedy(hf, processor, p, im, bidirectional=False) for p, im in zip(prompts, images, strict=True)
    ]
    assert want[0] != causal[0] and want[1] != causal[1]
    assert [_greedy(engine, p, im) for p, im in zip(prompts, images, strict=True)] == want
    monkeypatch.setattr(AttentionMetadata, "_or_image_spans", lambda self, mask, k, window: mask)
    assert [_greedy(engine, p, im) for p, im in zip(prompts, images, strict=True)] == causal


@torch.inference_mode()
def test_n_samples_share_the_prefill_and_logprobs_match_hf_forward(setup):
    hf, processor, _, two, engine = setup
    images = [_image(3), _image(4)]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=5, ignore_eos=True)
    out = engine.generate([two], params, multi_modal=[MultiModalInput(images=images)])[0]
    for sample in out.outputs:
        ref = _hf_logprobs(hf, processor, two, images, sample.token_ids)
        assert torch.allclose(torch.tensor(sample.logprobs), ref, atol=1e-4)
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1  # the samples differ


def test_update_weights_language_model_then_vision_tower(setup):
    """A trainer's names: the language model alone (what ``--freeze_visual_encoder`` syncs) leaves the
    tower and projector as they were; their names then update them too."""
    from transformers import AutoModelForImageTextToText

    hf, processor, one, _, _ = setup
    engine = _engine(hf, processor)
    changed = AutoModelForImageTextToText.from_config(hf.config).eval()
    changed.load_state_dict(hf.state_dict())
    torch.manual_seed(0)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    named = list(changed.named_parameters())
    towers = TOWERS[_family(hf)]
    vision = [(n, p) for n, p in named if n.startswith(towers)]
    language = [(n, p) for n, p in named if not n.startswith(towers)]
    assert engine.update_weights(language) == len(language)
    half = AutoModelForImageTextToText.from_config(hf.config).eval()
    state = {**hf.state_dict(), **dict(language)}
    state.pop("lm_head.weight")  # tied to the embeddings: the updated ones must win
    half.load_state_dict(state, strict=False)
    images = [_image(6)]
    assert _greedy(engine, one, images) == _hf_greedy(half, processor, one, images)
    assert engine.update_weights(vision) == len(vision)
    assert _greedy(engine, one, images) == _hf_greedy(changed, processor, one, images)
    with pytest.raises(
        ValueError, match=f"unexpected weight 'model.vision_tower.nope' for a {_family(hf)} vision"
    ):
        engine.update_weights([("model.vision_tower.nope", torch.zeros(1))])


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefix_caching_and_chunked_prefill_keep_images_whole(setup, block_size):
    """With the cache on, a repeated image hits the blocks before its last token and a chunk budget of 3
    tokens never cuts an image (each prefill attends bidirectionally over whole images): the plain
    engine's tokens and log-probs. Blocks of 16 (the GPU test's): Gemma 4's two images of 63 tokens sit
    3 tokens apart, so the block before the second image ends inside the first; the cached prefix must
    stop before the first image too (``PromptImages.block_start``)."""
    hf, processor, one, two, engine = setup
    prompts = [one, two, one]
    mm = [MultiModalInput(images=im) for im in ([_image(40)], [_image(41), _image(42)], [_image(40)])]
    want = engine.generate(prompts, GREEDY, multi_modal=mm)
    for flags in (
        {"enable_prefix_caching": True},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 3},
    ):
        other = _engine(hf, processor, block_size=block_size, **flags)
        for _ in range(2):  # the second round hits the cache
            got = other.generate(prompts, GREEDY, multi_modal=mm)
            for a, b in zip(got, want, strict=True):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
                assert torch.allclose(
                    torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs), atol=1e-5
                )
        # round 2 found every prompt's blocks but its last token's; at 16, Gemma 4's first image (tokens
        # 4 to 66) covers every boundary before a prompt's end that is not inside the second: none cached
        if "enable_prefix_caching" in flags and (block_size == 4 or _family(hf) == "gemma3"):
            assert other.scheduler.num_cached_tokens > 0


def test_patch_rows_and_image_spans_by_hand():
    import numpy as np

    from tidal.rollout.runner.attention import image_spans
    from tidal.rollout.runner.multimodal import PromptImages, images_to_patch_rows, patch_rows_to_images

    pixels = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).view(2, 3, 4, 4)
    rows, grid = images_to_patch_rows(pixels, 2)
    assert rows.shape == (8, 12) and grid.tolist() == [[1, 2, 2]] * 2
    assert rows[1].tolist() == [
        2,
        3,
        6,
        7,
        18,
        19,
        22,
        23,
        34,
        35,
        38,
        39,
    ]  # image 0, patch (0, 1), 3 channels
    assert torch.equal(patch_rows_to_images(rows, grid, 2), pixels)
    is_image = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    start, end = image_spans(is_image, None)
    assert start.tolist() == [[0, 1, 1, 0, 4, 4, 4, 0], [0, 0, 0, 0, 0, 0, 0, 0]]
    assert end.tolist() == [[0, 3, 3, 0, 7, 7, 7, 0], [2, 2, 0, 0, 0, 0, 0, 0]]
    start, end = image_spans(is_image, torch.tensor([0, 10]))  # a chunk from position 10
    assert start[1].tolist()[:3] == [10, 10, 10] and end[1].tolist()[:3] == [12, 12, 10]
    # where a cached prefix may end: images at [4, 67) and [70, 133) (Gemma 4's two images), blocks of 16
    images = PromptImages(torch.zeros(0), torch.zeros(0, 3), np.zeros((3, 0)), 0, spans=((4, 63), (70, 63)))
    assert [images.block_start(n, 16) for n in (128, 64, 144, 3)] == [0, 0, 144, 0]
    assert [images.block_start(n, 2) for n in (72, 68, 66, 4)] == [70, 68, 4, 4]


def test_token_counts_from_the_image_size_agree_with_the_pixels(setup):
    """The size rule (``tidal serve`` and the data checks count tokens without decoding) gives the token
    count of the processor's output, for images of several shapes."""
    _, processor, _, _, _ = setup
    wrapped = processor.image_processor
    for size in ((40, 30), (20, 60), (64, 64), (9, 50)):
        grid = wrapped(images=[_image(0, size)])["image_grid_thw"]
        patches = int(grid.prod())
        assert wrapped.get_number_of_image_patches(size[1], size[0]) == patches
        assert processor.token_counts([_image(0, size)]) == [patches // wrapped.merge_size**2]


def test_refusals(setup):
    from tidal.rollout.models.registry import feature_refusal

    hf, processor, _, _, _ = setup
    with pytest.raises(ValueError, match=f"tensor_parallel is not supported for the {_family(hf)} family"):
        LLMEngine(model=hf, tokenizer=processor.tokenizer, config=_config(tp_size=2))
    assert feature_refusal(_family(hf), "prefix_caching") is None  # tests/rollout/test_vlm_prefix_cache.py
    assert "bidirectional image attention" in feature_refusal(_family(hf), "packing_samples")


def test_generate_with_images(vlm_dir, setup, tmp_path):
    """``tidal generate --image_key``: rows in OpenRLHF's format, greedy answers equal transformers'."""
    import json

    from tidal.cli.generate import main as generate_main
    from tidal.data.images import image_ref, open_image
    from tidal.testing import ColourTask

    hf, processor, _, _, _ = setup
    data = ColourTask(seed=1).write_jsonl(tmp_path / "rows.jsonl", 4)
    generate_main(["--pretrain", str(vlm_dir), "--dataset", str(data), "--input_key", "prompt",
                   "--apply_chat_template", "--max_new_tokens", "4", "--temperature", "0", "--max_num_seqs", "8",
                   "--output_path", str(tmp_path / "out.jsonl"), "--image_key", "images",
                   "--max_images_per_prompt", "1"])  # fmt: skip
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    tokenizer = processor.tokenizer
    for row, got in zip(rows, out, strict=True):
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        images = [open_image(image_ref(v, tmp_path)) for v in row["images"]]
        with torch.inference_mode():
            n, input_ids, kwargs = _inputs(hf, processor, ids, images)
            ref = hf.generate(input_ids=input_ids, do_sample=False, max_new_tokens=4, **kwargs)[0, n:]
        assert got["output"].strip() == tokenizer.decode(ref, skip_special_tokens=True).strip()


def test_async_scheduling_samples_as_the_synchronous_loop(setup):
    """Decode steps launched ahead give the synchronous loop's seeded samples."""
    hf, processor, one, _, _ = setup
    images = [MultiModalInput(images=[_image(30 + i)]) for i in range(3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=1)
    outs = []
    for ahead in (False, True):
        engine = _engine(hf, processor, async_scheduling=ahead)
        assert engine.async_scheduling == ahead
        result = engine.generate([one] * 3, params, multi_modal=images)
        outs.append([[(c.token_ids, c.logprobs) for c in out.outputs] for out in result])
    assert outs[0] == outs[1]


def test_gemma4_with_an_audio_tower_or_without_a_vision_tower(setup):
    """A Gemma 4 checkpoint with an audio tower (E2B/E4B): the engine skips the audio weights and answers
    image prompts as transformers does; one without a vision tower serves text."""
    from transformers import AutoModelForImageTextToText, Gemma4Config

    hf, processor, one, _, _ = setup
    if _family(hf) != "gemma4":
        pytest.skip("Gemma 4 only")
    fields = {k: v for k, v in hf.config.to_dict().items() if k not in ("model_type", "architectures")}
    fields["audio_config"] = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  subsampling_conv_channels=[8, 4], output_proj_dims=32)  # fmt: skip
    audio = AutoModelForImageTextToText.from_config(Gemma4Config(**fields)).eval()
    missing = audio.load_state_dict(hf.state_dict(), strict=False).missing_keys
    assert missing and all(".audio_tower." in k or ".embed_audio." in k for k in missing)
    images = [_image(7)]
    assert _greedy(_engine(audio, processor), one, images) == _hf_greedy(audio, processor, one, images)
    # no vision tower at all: text prompts as transformers, images refused in one line
    fields.update(audio_config=None, vision_config=None)
    text = AutoModelForImageTextToText.from_config(Gemma4Config(**fields)).eval()
    text.load_state_dict(hf.state_dict(), strict=False)
    engine, ids = _engine(text, processor), one[:2] + [300, 301, 302]
    with torch.inference_mode():
        ref = text.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8)[0, len(ids) :].tolist()
    assert engine.generate([ids], GREEDY)[0].outputs[0].token_ids == ref
    with pytest.raises(ValueError, match="has images but the model has no vision tower"):
        _greedy(engine, one, images)


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_float32_matches_transformers_with_and_without_graphs(vlm_dir, eager):
    """On CUDA (float32; Triton decode attention, torch prefill masks with the image spans): greedy on
    images equals transformers', eager and with CUDA graphs / async scheduling; prefix caching and chunked
    prefill (whose context kernel is causal, so image chunks take the masked path) too."""
    from transformers import AutoModelForImageTextToText

    from tidal.data.vision import load_vision_processor
    from tidal.models import load_tokenizer

    tokenizer = load_tokenizer(str(vlm_dir))
    processor = load_vision_processor(str(vlm_dir), tokenizer)
    hf = AutoModelForImageTextToText.from_pretrained(str(vlm_dir)).eval()
    ids = tokenizer(tokenizer.apply_chat_template(TWO, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"]  # fmt: skip
    images = [[_image(20 + i), _image(30 + i)] for i in range(4)]
    # GREEDY ignores eos, transformers stops at it: compare up to transformers' stop
    want = [_hf_greedy(hf, processor, ids, im) for im in images]
    mm = [MultiModalInput(images=im) for im in images]
    for flags in (
        {},
        {"enable_prefix_caching": True},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 8},
    ):
        config = EngineConfig(device="cuda", dtype="float32", max_model_len=256, block_size=16,
                              enforce_eager=eager, **flags)  # fmt: skip
        engine = LLMEngine(
            model=hf, tokenizer=tokenizer, config=config, image_processor=processor.image_processor
        )
        for _ in range(2):
            got = engine.generate([ids] * 4, GREEDY, multi_modal=mm)
            assert [o.outputs[0].token_ids[: len(w)] for o, w in zip(got, want, strict=True)] == want
