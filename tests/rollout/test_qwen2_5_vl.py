"""Qwen2.5-VL in the rollout engine (``tidal/rollout/models/qwen2_5_vl.py``, ``tidal/rollout/runner/multimodal.py``)
against transformers' ``Qwen2_5_VLForConditionalGeneration`` on the tiny offline VLM (CPU, float32).

Greedy completions on images equal ``transformers.generate`` (images of 1, 2 and 4 tokens, the 2×2 one
with M-RoPE height/width positions that differ from plain positions: transformers itself completes it
differently with plain positions, and another image changes the completion), batched with a text-only
prompt; n samples share one prefill and their log-probs equal an HF forward; pixel_values and
pre-expanded placeholders are accepted; weight updates under the trainer's names (language model only, as
``--freeze_visual_encoder`` syncs); preemption recomputes image sequences; bad requests are one line.
"""

from __future__ import annotations

import pytest
import torch

from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.runner.multimodal import MultiModalInput, VisionSpec, mrope_positions

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
SIZES = [(56, 56), (28, 56), (28, 28)]  # 4, 2 and 1 image tokens


def _image(seed: int, size: tuple[int, int]):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(size[1], size[0], 3, generator=g) * 255).byte().numpy())


def _config(**overrides) -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", max_model_len=256, block_size=4, **overrides)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from tidal.testing import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m")


@pytest.fixture(scope="module")
def setup(vlm_dir):
    """(HF model with peaked logits, processor, prompt ids with one placeholder, engine)."""
    from transformers import AutoModelForImageTextToText

    from tidal.data.vision import load_vision_processor
    from tidal.models import load_tokenizer

    path = vlm_dir
    tokenizer = load_tokenizer(str(path))
    processor = load_vision_processor(str(path), tokenizer)
    hf = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)  # peaked distributions, as a trained model's
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    engine = LLMEngine(
        model=hf, tokenizer=tokenizer, config=_config(), image_processor=processor.image_processor
    )
    return hf, processor, ids, engine


def _expanded(ids, processor, image):
    from tidal.data.vision import expand_image_tokens

    count = processor.token_counts([image])
    return expand_image_tokens(ids, [0] * len(ids), count, processor.image_token_id)[0]


@torch.inference_mode()
def _hf_greedy(
    hf, processor, ids, image, mrope: bool = True, suppress_placeholders: bool = True
) -> list[int]:
    expanded = _expanded(ids, processor, image)
    input_ids = torch.tensor([expanded])
    kwargs = processor.pixel_inputs([image])
    if mrope:  # without the token types transformers falls back to plain 1-D positions
        kwargs["mm_token_type_ids"] = (input_ids == processor.image_token_id).int()
    if suppress_placeholders:  # the engine never samples image/video placeholders; nor does this
        kwargs["suppress_tokens"] = [processor.image_token_id, hf.config.video_token_id]
    out = hf.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=10,
        **kwargs,
    )
    return out[0, len(expanded) :].tolist()


@torch.inference_mode()
def _hf_logprobs(hf, processor, ids, image, output: list[int], mrope: bool = True) -> torch.Tensor:
    """log_softmax of each output token from one transformers forward over prompt + output."""
    expanded = _expanded(ids, processor, image)
    full = torch.tensor([expanded + output])
    kwargs = processor.pixel_inputs([image])
    if mrope:
        kwargs["mm_token_type_ids"] = (full == processor.image_token_id).int()
    logits = hf(input_ids=full, **kwargs).logits[0, len(expanded) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def test_greedy_equals_transformers_generate_batched_with_text(setup):
    hf, processor, ids, engine = setup
    images = [_image(i, size) for i, size in enumerate(SIZES)]
    text = ids[:2] + [300, 301, 302]  # no placeholder: a text-only request in the same batch
    outs = engine.generate(
        [ids] * 3 + [text], GREEDY, multi_modal=[MultiModalInput(images=[im]) for im in images] + [None]
    )
    for image, out in zip(images, outs, strict=False):
        assert out.outputs[0].token_ids == _hf_greedy(hf, processor, ids, image)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([text]), do_sample=False, max_new_tokens=10)[0, len(text) :].tolist()
    assert outs[3].outputs[0].token_ids == ref
    # the 2x2 image's M-RoPE positions matter: transformers with plain 1-D positions gives other log-probs
    # (the tiny model's greedy tokens happen to survive that), and the engine's are the M-RoPE ones
    first = outs[0].outputs[0]
    engine_logprobs = torch.tensor(first.logprobs)
    mrope = _hf_logprobs(hf, processor, ids, images[0], first.token_ids)
    plain = _hf_logprobs(hf, processor, ids, images[0], first.token_ids, mrope=False)
    assert torch.allclose(engine_logprobs, mrope, atol=1e-4)
    assert (engine_logprobs - plain).abs().max() > 1e-3  # measured 2.4e-3; the engine agrees to < 1e-5
    other = engine.generate([ids], GREEDY, multi_modal=[MultiModalInput(images=[_image(9, SIZES[0])])])
    assert other[0].outputs[0].token_ids != outs[0].outputs[0].token_ids


def test_mrope_positions_by_hand():
    spec = VisionSpec(image_token_id=7, merge_size=2)
    # text, a 2x2 merged image (grid 1x4x4), text: delta = max + 1 - length = 4 + 1 - 7 = -2
    positions, delta = mrope_positions([1, 7, 7, 7, 7, 2, 3], torch.tensor([[1, 4, 4]]), spec)
    assert positions.tolist() == [[0, 1, 1, 1, 1, 3, 4], [0, 1, 1, 2, 2, 3, 4], [0, 1, 2, 1, 2, 3, 4]]
    assert delta == -2


@torch.inference_mode()
def test_n_samples_share_the_prefill_and_logprobs_match_hf_forward(setup):
    hf, processor, ids, engine = setup
    image = _image(3, SIZES[0])
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=5, ignore_eos=True)
    out = engine.generate([ids], params, multi_modal=[MultiModalInput(images=[image])])[0]
    for sample in out.outputs:
        ref = _hf_logprobs(hf, processor, ids, image, sample.token_ids)
        assert torch.allclose(torch.tensor(sample.logprobs), ref, atol=1e-4)
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1  # the samples differ


def test_pixel_values_and_expanded_placeholders(setup):
    hf, processor, ids, engine = setup
    image = _image(4, SIZES[1])
    by_pil = engine.generate([ids], GREEDY, multi_modal=[MultiModalInput(images=[image])])
    pixels = processor.pixel_inputs([image])
    by_pixels = engine.generate(
        [_expanded(ids, processor, image)], GREEDY, multi_modal=[MultiModalInput(**pixels)]
    )
    assert by_pil[0].outputs[0].token_ids == by_pixels[0].outputs[0].token_ids
    assert by_pil[0].prompt_token_ids == by_pixels[0].prompt_token_ids


def test_update_weights_language_model_only(setup):
    """A trainer's names (``model.language_model.*``) update the decoder; the tower keeps its weights."""
    from transformers import AutoModelForImageTextToText

    hf, processor, ids, _ = setup
    engine = LLMEngine(
        model=hf, tokenizer=processor.tokenizer, config=_config(), image_processor=processor.image_processor
    )
    changed = AutoModelForImageTextToText.from_config(hf.config).eval()
    changed.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for name, p in changed.named_parameters():
            if "language_model" in name:
                p.add_(0.05 * torch.randn_like(p))
    language = [(n, p) for n, p in changed.named_parameters() if not n.startswith("model.visual.")]
    assert engine.update_weights(language) == len(language)
    image = _image(6, SIZES[0])
    out = engine.generate([ids], GREEDY, multi_modal=[MultiModalInput(images=[image])])
    assert out[0].outputs[0].token_ids == _hf_greedy(changed, processor, ids, image)


def test_preempted_image_sequences_are_recomputed(setup):
    """A cache too small for every sample: preempted sequences re-prefill prompt + outputs with the same
    positions, so the completions are those of an unconstrained engine."""
    hf, processor, ids, engine = setup
    small = LLMEngine(
        model=hf, tokenizer=processor.tokenizer, config=_config(num_kv_blocks=24),
        image_processor=processor.image_processor,
    )  # fmt: skip
    images = [MultiModalInput(images=[_image(10 + i, SIZES[i % 3])]) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    want = engine.generate([ids] * 4, params, multi_modal=images)
    preempted = []
    preempt = small.scheduler._preempt
    small.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
    got = small.generate([ids] * 4, params, multi_modal=images)
    assert preempted  # the small cache did preempt image sequences
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_bad_requests_and_refusals(setup, tmp_path):
    hf, processor, ids, engine = setup
    image = _image(7, SIZES[0])
    with pytest.raises(ValueError, match="placeholder tokens but no images"):
        engine.generate([ids], GREEDY)
    with pytest.raises(ValueError, match="1 image placeholder token.*2 image"):
        engine.generate([ids], GREEDY, multi_modal=[MultiModalInput(images=[image, image])])
    with pytest.raises(ValueError, match="multi_modal inputs for 2 prompts"):
        engine.generate([ids, ids], GREEDY, multi_modal=[None])
    with pytest.raises(ValueError, match="tensor_parallel is not supported for the qwen2_5_vl family"):
        LLMEngine(model=hf, tokenizer=processor.tokenizer, config=_config(tp_size=2))
    from tidal.testing import build_tiny_model

    text_model = build_tiny_model(tmp_path / "text", "qwen2")
    text_engine = LLMEngine(text_model, _config())
    with pytest.raises(ValueError, match="has images but the model has no vision tower"):
        text_engine.generate([[5, 6, 7]], GREEDY, multi_modal=[MultiModalInput(images=[image])])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_generate_and_batch_inference_with_images(vlm_dir, tmp_path, capsys, family):
    """``tidal generate --image_key``: rows in OpenRLHF's format, greedy answers equal transformers'."""
    import json

    from tidal.cli.batch_inference import main as batch_main
    from tidal.cli.generate import main as generate_main
    from tidal.testing import ColourTask, build_tiny_vlm
    from tidal.testing.vision_tasks import greedy_answers

    if family != "qwen2_5_vl":
        vlm_dir = build_tiny_vlm(tmp_path / family, family)
    data = ColourTask(seed=1).write_jsonl(tmp_path / "rows.jsonl", 6)
    flags = ["--pretrain", str(vlm_dir), "--dataset", str(data), "--input_key", "prompt", "--apply_chat_template",
             "--max_new_tokens", "4", "--temperature", "0", "--max_num_seqs", "8"]  # fmt: skip
    generate_main([*flags, "--output_path", str(tmp_path / "out.jsonl"), "--image_key", "images",
                   "--max_images_per_prompt", "1"])  # fmt: skip
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert [o["output"].strip() for o in out] == greedy_answers(vlm_dir, rows, tmp_path)
    batch_main([*flags, "--eval_task", "generate", "--output_path", str(tmp_path / "b.jsonl"),
                "--data.max_images_per_prompt", "1"])  # fmt: skip
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "out.jsonl").read_text()
    with pytest.raises(SystemExit):  # one line naming the row and the flag
        generate_main([*flags, "--output_path", str(tmp_path / "x.jsonl")])
    assert "has 1 image(s) under 'images', but --max_images_per_prompt is 0" in capsys.readouterr().err


def test_step_api_takes_images(setup):
    """``add_request(..., multi_modal=)``: requests with and without images share the continuous batch."""
    hf, processor, ids, engine = setup
    image = _image(11, SIZES[0])
    want = (
        engine.generate([ids], GREEDY, multi_modal=[MultiModalInput(images=[image])])[0].outputs[0].token_ids
    )
    first = engine.add_request(ids, GREEDY, multi_modal=MultiModalInput(images=[image]))
    engine.add_request([5, 6, 7], GREEDY)
    done = {}
    while engine.has_unfinished():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    assert done[first].outputs[0].token_ids == want


def test_other_vision_language_families_are_refused(tmp_path, monkeypatch):
    """The transformers fallback would drop the images: one line naming the family (a tiny Qwen3-VL with
    its family taken out of the registry stands for a vision-language family the engine lacks)."""
    from tidal.rollout import make_engine
    from tidal.rollout.engine import hf_engine
    from tidal.rollout.models.registry import VISION_FAMILIES
    from tidal.testing import build_tiny_vlm

    path = build_tiny_vlm(tmp_path / "q3", "qwen3_vl")
    # make_engine's view of the registry without qwen3_vl (the registry's own dict keeps its order)
    others = {name: f for name, f in VISION_FAMILIES.items() if name != "qwen3_vl"}
    monkeypatch.setattr(hf_engine, "VISION_FAMILIES", others)
    served = ", ".join(sorted(others))
    with pytest.raises(
        ValueError,
        match=f"qwen3_vl is a vision-language model: the rollout engine serves images for {served} only",
    ):
        make_engine(path, _config())


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_float32_matches_transformers_and_graphs_keep_the_decode_delta(vlm_dir, eager):
    """On CUDA (float32, Triton attention): greedy on images equals transformers', eager and with CUDA
    graphs / async scheduling (the decode delta is read inside the captured graph)."""
    from transformers import AutoModelForImageTextToText

    from tidal.data.vision import load_vision_processor
    from tidal.models import load_tokenizer

    tokenizer = load_tokenizer(str(vlm_dir))
    processor = load_vision_processor(str(vlm_dir), tokenizer)
    hf = AutoModelForImageTextToText.from_pretrained(str(vlm_dir)).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    config = EngineConfig(
        device="cuda", dtype="float32", max_model_len=256, block_size=16, enforce_eager=eager
    )
    engine = LLMEngine(
        model=hf, tokenizer=tokenizer, config=config, image_processor=processor.image_processor
    )
    images = [_image(20 + i, size) for i, size in enumerate(SIZES)]
    for _ in range(2):  # the second run replays the captured graphs
        outs = engine.generate([ids] * 3, GREEDY, multi_modal=[MultiModalInput(images=[im]) for im in images])
        for image, out in zip(images, outs, strict=True):
            assert out.outputs[0].token_ids == _hf_greedy(hf, processor, ids, image)


def test_image_placeholders_are_never_sampled_and_logprobs_stay_the_models(setup):
    """A response with an image placeholder would be read as an image by the trainer's model: the engine
    never samples one, and reports the model's own log-probs (the placeholder's mass included)."""
    from transformers import AutoModelForImageTextToText

    hf, processor, ids, engine = setup
    image = _image(12, SIZES[0])
    first = (
        engine.generate([ids], GREEDY, multi_modal=[MultiModalInput(images=[image])])[0]
        .outputs[0]
        .token_ids[0]
    )
    tempted = AutoModelForImageTextToText.from_config(hf.config).eval()
    tempted.load_state_dict(hf.state_dict())
    with torch.no_grad():  # the placeholder's logit is twice the greedy token's: transformers picks it
        tempted.lm_head.weight[processor.image_token_id] = 2 * tempted.lm_head.weight[first]
    assert (
        _hf_greedy(tempted, processor, ids, image, suppress_placeholders=False)[0] == processor.image_token_id
    )
    config = _config()
    tempting = LLMEngine(
        model=tempted, tokenizer=processor.tokenizer, config=config, image_processor=processor.image_processor
    )
    out = tempting.generate([ids], GREEDY, multi_modal=[MultiModalInput(images=[image])])[0].outputs[0]
    assert processor.image_token_id not in out.token_ids
    ref = _hf_logprobs(tempted, processor, ids, image, out.token_ids)
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4)


def test_async_scheduling_samples_as_the_synchronous_loop(setup):
    """Decode steps launched ahead read the same per-sequence M-RoPE deltas (seeded n samples agree)."""
    hf, processor, ids, _ = setup
    images = [MultiModalInput(images=[_image(30 + i, SIZES[i % 3])]) for i in range(4)]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=1)
    outs = []
    for ahead in (False, True):
        engine = LLMEngine(
            model=hf, tokenizer=processor.tokenizer, config=_config(async_scheduling=ahead),
            image_processor=processor.image_processor,
        )  # fmt: skip
        assert engine.async_scheduling == ahead
        result = engine.generate([ids] * 4, params, multi_modal=images)
        outs.append([[(c.token_ids, c.logprobs) for c in out.outputs] for out in result])
    assert outs[0] == outs[1] and engine.ahead_stats.used > 0
