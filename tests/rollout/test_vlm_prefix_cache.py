"""Prefix caching and chunked prefill with images (vision families: ``scheduling/prefix_cache.py``'s image
keys, ``BlockManager.private_first_block``, ``multimodal.context_prefill_images``) on the tiny offline VLM.

With prefix caching on, a request with images gives the plain engine's greedy tokens, and its log-probs
within 1e-5 (bit-equal on a miss; a hit's prefill attends to cached K/V in another summation order: at
most 5e-7 measured, as for text families); and ``transformers.generate``'s tokens. The number of cached
tokens is computed by hand from the block layout (block size 2): a repeated image shares every block of
the prompt but the last token's, another image with the same text only the blocks before its first
placeholder, two images up to the first one that differs. The vision tower runs only for images not
entirely cached; a cached prefix that would cut an image is cut back to the image's start. Two prompts
sharing a cached first block but with images of different sizes (different decode rotary deltas) run
in one batch; n samples share a prefill; a next turn reuses the image and the answer's blocks;
preempted image sequences recompute; chunked prefill never cuts an image.

Those tests size Qwen-VL's images by their token grids and count M-RoPE deltas, so they run for the Qwen
families; Gemma 3 and Gemma 4 (fixed-size or budget-sized images, one rotary position per token) take
their own hand counts, written in their image token count n (4 and 64 here): a repeated image, another
image, two images, a prompt ending with its image, and ``transformers.generate`` on a hit.
"""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import assert_same_outputs
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.models.registry import VISION_FAMILIES, feature_refusal
from tidal.rollout.runner.multimodal import MultiModalInput, PromptImages

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
# The vision families whose engine runs prefix caching: the Qwen-VL ones (variable image grids, M-RoPE)
# and Gemma's (each image n tokens, ``GEMMA_IMAGE_TOKENS``), which take their own hand counts below.
CACHING = [f for f in VISION_FAMILIES if feature_refusal(f, "prefix_caching") is None]
GEMMA = [f for f in CACHING if f.startswith("gemma")]
QWEN = [f for f in CACHING if f not in GEMMA]
# Image tokens of a square image, by hand: Gemma 3 pools its 32×32 input (8-pixel patches) 2×2 into 4;
# Gemma 4's processor scales an image up to its 70-token budget: 8×8 pooled 16-pixel cells, 64 ≤ 70 < 81.
GEMMA_IMAGE_TOKENS = {"gemma3": 4, "gemma4": 64}
# Families with linear-attention layers: a hit resumes only where a recurrent state was saved (at the
# block boundaries where a prefill chunk ended: ``state_cache.py``, test_hybrid_prefix_cache.py), so some
# hand counts below differ for them.
HYBRID = ("qwen3_5", "qwen3_5_moe")
BS = 2  # KV block size: blocks of two tokens make every boundary case reachable with tiny prompts


def _image(seed: int, tokens_per_side: int, family: str):
    """A random image of ``tokens_per_side``² image tokens."""
    from PIL import Image

    from tidal.testing.tiny_vlm import MERGE, TINY_VLM_FAMILIES

    side = TINY_VLM_FAMILIES[family].patch * MERGE * tokens_per_side
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(side, side, 3, generator=g) * 255).byte().numpy())


def _load(family: str, tmp_path_factory, marks: list[str]):
    """(family, HF model, processor, ids of ``marks``: the image start/placeholder/end tokens)."""
    from transformers import AutoModelForImageTextToText

    from tidal.data.vision import load_vision_processor
    from tidal.models import load_tokenizer
    from tidal.testing import build_tiny_vlm

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m", family)
    tokenizer = load_tokenizer(str(path))
    processor = load_vision_processor(str(path), tokenizer)
    hf = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
    return family, hf, processor, tokenizer.convert_tokens_to_ids(marks)


@pytest.fixture(scope="module", params=QWEN)
def vlm(request, tmp_path_factory):
    """A Qwen-VL family's (family, HF model with peaked logits, processor, vision start/pad/end ids)."""
    vlm = _load(request.param, tmp_path_factory, ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    with torch.no_grad():
        vlm[1].lm_head.weight.mul_(4.0)  # peaked distributions, as a trained model's
    return vlm


@pytest.fixture(scope="module", params=GEMMA)
def gemma(request, tmp_path_factory):
    """The same for a Gemma family (its tiny model's logits are peaked already)."""
    return _load(
        request.param, tmp_path_factory, ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
    )


def _engine(vlm, device: str = "cpu", **features) -> LLMEngine:
    _, hf, processor, _ = vlm
    features = {"num_kv_blocks": 256, "max_model_len": 128, **features}
    config = EngineConfig(device=device, dtype="float32", block_size=BS, **features)
    return LLMEngine(
        model=hf,
        tokenizer=processor.tokenizer,
        config=config,
        image_processor=processor.image_processor,
    )


def _prompts(vlm) -> dict[str, list[int]]:
    """Prompts with one placeholder per image (the engine expands it; A: 4 image tokens, B: 1)."""
    start, pad, end = vlm[3]
    image = [start, pad, end]
    return {
        # 4 text, start, image tokens at 5..8 (so block [4, 6) holds text and image), end, 3 text: 13
        "one": [40, 41, 42, 43, *image, 50, 51, 52],
        # 3 text, start, image at 4..7, end, 2 text, start, image at 12..15, end, 3 text: 20 tokens
        "two": [40, 41, 42, *image, 45, 46, *image, 50, 51, 52],
        # the prompt ends with its image: 4 text, start, image at 5..8: 9 tokens
        "last": [40, 41, 42, 43, start, pad],
    }


def _mm(*images) -> MultiModalInput:
    return MultiModalInput(images=list(images))


def _count_vision_calls(engine: LLMEngine, monkeypatch) -> list[int]:
    """The number of images each vision tower call computes."""
    visual = engine.runner.model.visual
    calls, forward = [], visual.forward

    def spy(*args, **kw):  # Qwen: (pixels, grid_thw=...); Gemma 3: (pixels [N, ...]); Gemma 4: (rows, grid)
        calls.append(len(kw["grid_thw"] if "grid_thw" in kw else args[-1]))
        return forward(*args, **kw)

    monkeypatch.setattr(visual, "forward", spy)
    return calls


def _run_and_count(engine: LLMEngine, prompts, params, images):
    """Outputs and (cached tokens, computed prompt tokens) of one ``generate``."""
    sched = engine.scheduler
    cached, computed = sched.num_cached_tokens, sched.num_prefill_tokens
    out = engine.generate(prompts, params, multi_modal=images)
    return out, (sched.num_cached_tokens - cached, sched.num_prefill_tokens - computed)


def test_block_keys_and_image_boundaries_by_hand():
    """Image k's placeholders key a block by (content hash, offsets within the image); a cached prefix or
    a chunk that would cut an image ends at its start (or, starting at it, after it)."""
    images = PromptImages(
        torch.zeros(0), torch.zeros(0), None, 0, hashes=("0a", "ff"), spans=((5, 4), (12, 4))
    )
    assert images.block_key(0, 4) == ()
    assert images.block_key(4, 6) == ((10, 0, 1),)
    assert images.block_key(8, 13) == ((10, 3, 4), (255, 0, 1))
    assert [images.image_start(n) for n in (5, 6, 9, 10, 13)] == [5, 5, 9, 10, 12]
    assert images.chunk_end(0, 7) == 5  # before image 0
    assert images.chunk_end(5, 7) == 9  # image 0 starts the chunk: all of it
    assert images.chunk_end(9, 14) == 12 and images.chunk_end(9, 12) == 12
    assert images.images_within(4, 12) == [0] and images.images_within(6, 20) == [1]


def test_hits_and_outputs_for_repeated_other_and_two_images(vlm, monkeypatch):
    family = vlm[0]
    plain, cached = _engine(vlm), _engine(vlm, enable_prefix_caching=True)
    calls = _count_vision_calls(cached, monkeypatch)
    prompts = _prompts(vlm)
    a, b, c = (_image(seed, 2, family) for seed in (1, 2, 3))  # 4 image tokens each
    cases = [  # (prompt, images, cached tokens, images through the vision tower)
        ("one", [a], 0, 1),  # first sight
        ("one", [a], 12, 0),  # every full block but the last token's: 12 // 2 blocks
        ("one", [b], 4, 1),  # the blocks before the first image token (5): 2 blocks
        ("two", [a, b], 2, 2),  # its first block (40, 41) is "one"'s
        ("two", [a, b], 18, 0),  # 19 // 2 blocks
        ("two", [a, c], 12, 1),  # up to image c's first token (12): 6 blocks
        ("two", [c, b], 4, 2),  # up to image c's first token (4): 2 blocks
    ]
    if family in HYBRID:  # hits only at saved states: where a prefill chunk ended on a block boundary,
        # its last one before its last token ("one" at 12, "two" at 18) or the end of a cached KV prefix
        # without a state ("one" with b at 4, "two" at 2 then 12)
        cases = [
            ("one", [a], 0, 1),
            ("one", [a], 12, 0),
            ("one", [b], 0, 1),  # 4 cached in KV, no state saved there yet
            ("two", [a, b], 0, 2),  # (40, 41) cached in KV, no state saved at 2
            ("two", [a, b], 18, 0),
            ("two", [a, c], 2, 2),  # 12 cached in KV, a state saved at 2 only
            ("two", [c, b], 2, 2),
        ]
    for name, images, hits, vision in cases:
        calls.clear()
        expected = plain.generate([prompts[name]], GREEDY, multi_modal=[_mm(*images)])
        got, (cached_tokens, computed) = _run_and_count(cached, [prompts[name]], GREEDY, [_mm(*images)])
        assert_same_outputs(expected, got)
        length = len(got[0].prompt_token_ids)
        assert (cached_tokens, computed) == (hits, length - hits), (name, hits)
        assert sum(calls) == vision, name
        if hits == 0 and family not in HYBRID:  # nothing cached: the plain prefill's values exactly
            assert expected[0].outputs[0].logprobs == got[0].outputs[0].logprobs
    assert cached.block_manager.num_free_blocks == cached.num_kv_blocks


def test_next_turn_reuses_the_image_and_the_answer(vlm):
    """Turn 2 = turn 1's prompt (image tokens expanded) + its answer + new text, with the same image: the
    blocks turn 1 filled while decoding are cached when it ends, so all but the new text is reused."""
    family = vlm[0]
    plain, cached = _engine(vlm), _engine(vlm, enable_prefix_caching=True)
    image = [_mm(_image(15, 2, family))]
    first = cached.generate([_prompts(vlm)["one"]], GREEDY, multi_modal=image)[0]
    history = first.prompt_token_ids + first.outputs[0].token_ids + [60, 61, 62]  # 13 + 6 + 3 tokens
    got, (hits, computed) = _run_and_count(cached, [history], GREEDY, image)
    assert_same_outputs(plain.generate([history], GREEDY, multi_modal=image), got)
    # Turn 1's 19 tokens but the last (never computed): 9 blocks; a hybrid resumes at the state turn 1's
    # prefill saved at 12 (decode steps save none).
    assert (hits, computed) == ((12, 10) if family in HYBRID else (18, 4))


def test_preempted_image_sequences_with_the_cache_on(vlm):
    """A KV cache too small for the batch preempts image sequences; recomputed (their prompt and outputs,
    through the cache where it holds their blocks), they give the plain engine's outputs."""
    family = vlm[0]
    prompts = _prompts(vlm)
    batch = [prompts["one"], prompts["two"], prompts["one"], prompts["last"]]
    images = [
        _mm(_image(16, 2, family)),
        _mm(_image(16, 2, family), _image(17, 1, family)),
        _mm(_image(18, 1, family)),
        _mm(_image(19, 2, family)),
    ]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    expected = _engine(vlm).generate(batch, params, multi_modal=images)
    small = _engine(vlm, enable_prefix_caching=True, num_kv_blocks=24)  # 48 token slots
    preempted = []
    preempt = small.scheduler._preempt
    small.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
    assert_same_outputs(expected, small.generate(batch, params, multi_modal=images))
    assert preempted and small.block_manager.num_free_blocks == 24


@torch.inference_mode()
def test_cache_hits_equal_transformers_generate(vlm):
    """Two images, the second run served from the cache: ``transformers.generate``'s greedy tokens."""
    family, hf, processor, _ = vlm
    cached = _engine(vlm, enable_prefix_caching=True)
    prompt, images = _prompts(vlm)["two"], [_image(13, 2, family), _image(14, 1, family)]
    for _ in range(2):
        got, (hits, _) = _run_and_count(cached, [prompt], GREEDY, [_mm(*images)])
    assert hits == 16  # 17 tokens (4 + 1 image tokens): 16 // 2 blocks
    ids = torch.tensor([got[0].prompt_token_ids])
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == processor.image_token_id).int(),  # M-RoPE positions, as the engine's
        suppress_tokens=list(cached.runner.never_sample),  # the engine never samples placeholders
        do_sample=False,
        max_new_tokens=GREEDY.max_new_tokens,
        **processor.pixel_inputs(images),
    )
    assert got[0].outputs[0].token_ids == out[0, ids.shape[1] :].tolist()


def test_a_cached_prefix_never_cuts_an_image(vlm, monkeypatch):
    """The prompt ends with its image (tokens 5..8 of 9): its 4 usable cached blocks end inside the
    image, so the hit is cut back to the image's first token (2 blocks) and the image recomputed whole."""
    family = vlm[0]
    plain, cached = _engine(vlm), _engine(vlm, enable_prefix_caching=True)
    calls = _count_vision_calls(cached, monkeypatch)
    prompt, image = _prompts(vlm)["last"], _image(4, 2, family)
    expected = plain.generate([prompt], GREEDY, multi_modal=[_mm(image)])
    for hits in (0, 4):
        calls.clear()
        got, (cached_tokens, computed) = _run_and_count(cached, [prompt], GREEDY, [_mm(image)])
        assert_same_outputs(expected, got)
        assert (cached_tokens, computed, calls) == (hits, 9 - hits, [1])


def test_shared_first_block_with_different_rotary_deltas(vlm):
    """Prompts sharing their cached first blocks, with images of 4 and 1 tokens (decode deltas -2 and 0),
    decode in one batch: each got a private copy of the cached first block, where its delta lives."""
    family = vlm[0]
    plain, cached = _engine(vlm), _engine(vlm, enable_prefix_caching=True)
    prompt = _prompts(vlm)["one"]
    images = [_mm(_image(5, 2, family)), _mm(_image(6, 1, family))]
    assert [len(p.prompt_token_ids) for p in plain.generate([prompt] * 2, GREEDY, multi_modal=images)] == [
        13,
        10,
    ]
    copies = []
    take = cached.block_manager.take_copies_before
    cached.block_manager.take_copies_before = lambda: (copies.append(take()), copies[-1])[1]
    cached.generate([prompt], GREEDY, multi_modal=images[:1])  # caches the first prompt's blocks
    expected = plain.generate([prompt] * 2, GREEDY, multi_modal=images)
    got, (hits, _) = _run_and_count(cached, [prompt] * 2, GREEDY, images)
    assert_same_outputs(expected, got)
    # All of the first prompt's usable blocks; the text before the other's image (for a hybrid none: no
    # state was saved at 4).
    assert hits == (12 if family in HYBRID else 12 + 4)
    assert sum(len(c) for c in copies) == (1 if family in HYBRID else 2)  # one first block copied per hit


def test_n_samples_share_a_cached_prefill(vlm):
    family = vlm[0]
    plain, cached = _engine(vlm), _engine(vlm, enable_prefix_caching=True)
    prompt, images = _prompts(vlm)["two"], [_mm(_image(7, 2, family), _image(8, 1, family))]
    params = SamplingParams(temperature=1.0, n=3, seed=11, max_new_tokens=6, ignore_eos=True)
    expected = plain.generate([prompt], params, multi_modal=images)
    assert len({tuple(s.token_ids) for s in expected[0].outputs}) > 1  # the samples differ
    for _ in range(2):  # the second run hits the cache
        assert_same_outputs(expected, cached.generate([prompt], params, multi_modal=images))
    assert cached.block_manager.num_free_blocks == cached.num_kv_blocks


def test_chunked_prefill_keeps_images_whole(vlm, monkeypatch):
    """A 3-token budget would cut every 4-token image: a chunk ends before an image, or holds all of it
    when the image starts it (4 tokens, over the budget)."""
    family = vlm[0]
    plain = _engine(vlm)
    chunked = _engine(vlm, enable_chunked_prefill=True, enable_prefix_caching=True, max_num_batched_tokens=3)
    cuts, sizes = [], []
    run = chunked.runner._run_context_prefill

    def spy(batch):
        for group, (start, end) in zip(batch.groups, batch.chunks, strict=True):
            mm = group[0].mm
            cuts.append(mm is not None and mm.image_start(end) != end)
            sizes.append(end - start)
        return run(batch)

    monkeypatch.setattr(chunked.runner, "_run_context_prefill", spy)
    prompts = _prompts(vlm)
    batch = [prompts["one"], prompts["two"], prompts["last"]]
    images = [
        _mm(_image(9, 2, family)),
        _mm(_image(10, 2, family), _image(11, 1, family)),
        _mm(_image(12, 2, family)),
    ]
    expected = plain.generate(batch, GREEDY, multi_modal=images)
    for _ in range(2):  # the second run also hits the cache
        assert_same_outputs(expected, chunked.generate(batch, GREEDY, multi_modal=images))
    assert not any(cuts) and max(sizes) == 4 and len(cuts) > 2 * len(batch)
    assert chunked.scheduler.num_cached_tokens > 0


def _square(seed: int):
    """A random 32×32 image: ``GEMMA_IMAGE_TOKENS[family]`` image tokens for a Gemma family."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).byte().numpy())


def test_gemma_hits_and_outputs_by_image_token_count(gemma, monkeypatch):
    """``_prompts``' layouts with n tokens per image: "one" is 9 + n tokens, its image at 5 .. 4 + n; "two"
    is 12 + 2n, its images at 4 .. 3 + n and 8 + n .. 7 + 2n; "last" is 5 + n, ending with its image. The
    same counts as the Qwen families' at n = 4; n is even, so the boundaries below fall on blocks of 2."""
    family, _, processor, _ = gemma
    n = GEMMA_IMAGE_TOKENS[family]
    plain, cached = (
        _engine(gemma, max_model_len=256),
        _engine(gemma, max_model_len=256, enable_prefix_caching=True),
    )
    calls = _count_vision_calls(cached, monkeypatch)
    prompts = _prompts(gemma)
    a, b, c = (_square(seed) for seed in (1, 2, 3))
    assert processor.token_counts([a, b, c]) == [n] * 3
    cases = [  # (prompt, images, cached tokens, images through the vision tower)
        ("one", [a], 0, 1),  # first sight
        ("one", [a], 8 + n, 0),  # every block but the last token's
        ("one", [b], 4, 1),  # the blocks before the image's first token (5)
        ("two", [a, b], 2, 2),  # its first block (40, 41) is "one"'s
        ("two", [a, b], 10 + 2 * n, 0),  # every block but the last token's
        ("two", [a, c], 8 + n, 1),  # up to image c's first token
        ("two", [c, b], 4, 2),  # up to image c's first token
        # "one"'s blocks hold its text and image a, but the usable ones (the 4 + n tokens before the last)
        # end inside the image (5 .. 4 + n): cut back to the image's start, the image recomputed whole
        ("last", [a], 4, 1),
        ("last", [a], 4, 1),  # the same from its own blocks
    ]
    for name, images, hits, vision in cases:
        calls.clear()
        expected = plain.generate([prompts[name]], GREEDY, multi_modal=[_mm(*images)])
        got, counts = _run_and_count(cached, [prompts[name]], GREEDY, [_mm(*images)])
        assert_same_outputs(expected, got)
        assert counts == (hits, len(got[0].prompt_token_ids) - hits), (name, hits)
        assert sum(calls) == vision, name
        if hits == 0:  # nothing cached: the plain prefill's values exactly
            assert expected[0].outputs[0].logprobs == got[0].outputs[0].logprobs
    assert cached.block_manager.num_free_blocks == cached.num_kv_blocks


@torch.inference_mode()
def test_gemma_cache_hits_equal_transformers_generate(gemma):
    """Two images, the second run served from the cache: ``transformers.generate``'s greedy tokens (with
    the token types that make each image attend to itself both ways)."""
    from tidal.models.vision import fixed_size_kwargs

    family, hf, processor, _ = gemma
    cached = _engine(gemma, max_model_len=256, enable_prefix_caching=True)
    prompt, images = _prompts(gemma)["two"], [_square(13), _square(14)]
    for _ in range(2):
        got, (hits, _) = _run_and_count(cached, [prompt], GREEDY, [_mm(*images)])
    assert hits == 10 + 2 * GEMMA_IMAGE_TOKENS[family]  # every block but the last token's
    ids = torch.tensor([got[0].prompt_token_ids])
    pixels = processor.pixel_inputs(images)
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        suppress_tokens=list(cached.runner.never_sample),  # the engine never samples placeholders
        do_sample=False,
        max_new_tokens=GREEDY.max_new_tokens,
        **fixed_size_kwargs(hf.config, ids, pixels["pixel_values"], pixels["image_grid_thw"]),
    )
    assert got[0].outputs[0].token_ids == out[0, ids.shape[1] :].tolist()


@pytest.mark.gpu
def test_cuda_graphs_with_prefix_caching_and_chunked_prefill(vlm):
    """On CUDA (float32, Triton context attention, decode under CUDA graphs reading the delta table):
    prefix caching + chunked prefill with images give the plain CUDA engine's tokens, log-probs within
    1e-4, twice (the second run hits the cache); the batch holds two prompts sharing their first blocks
    with images of 4 and 1 tokens (different decode deltas) and a prompt ending with its image."""
    family = vlm[0]
    plain = _engine(vlm, "cuda")
    both = _engine(
        vlm, "cuda", enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=3
    )
    assert both.runner.graphs is not None
    prompts = _prompts(vlm)
    batch = [prompts["one"], prompts["one"], prompts["two"], prompts["last"]]
    images = [
        _mm(_image(30, 2, family)),
        _mm(_image(31, 1, family)),
        _mm(_image(30, 2, family), _image(32, 2, family)),
        _mm(_image(33, 2, family)),
    ]
    expected = plain.generate(batch, GREEDY, multi_modal=images)
    for _ in range(2):
        got = both.generate(batch, GREEDY, multi_modal=images)
        assert_same_outputs(expected, got, tol=1e-4)
    assert both.scheduler.num_cached_tokens > 0
