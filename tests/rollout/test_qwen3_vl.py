"""Qwen3-VL (``tidal/rollout/models/qwen3_vl.py``) and Qwen3.5's vision-language models (``qwen3_5_vl.py``:
the same tower without DeepStack, the hybrid Qwen3.5 decoder, dense or MoE) in the rollout engine against
transformers' ``Qwen3VLForConditionalGeneration`` / ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration`` on the tiny offline VLMs (CPU, float32); every test runs for each
family unless it names one.

Greedy completions on images equal ``transformers.generate`` (images of 1, 2 and 4 tokens, a prompt with
two images), batched with a text-only prompt; the family's features each change the result when left out:
zeroed DeepStack features change the greedy tokens (and the engine follows transformers there, after a
weight update of the vision tower under HF names), contiguous instead of interleaved M-RoPE sections give
other log-probs; n samples share one prefill and their log-probs equal an HF forward; weight updates of
the language model only (``--freeze_visual_encoder``) then of the vision tower; chunked prefill equals one
prefill; the MoE family's recorded experts are transformers' router choices; refusals are one line. Prefix
caching with images runs in test_vlm_prefix_cache.py.
"""

from __future__ import annotations

import pytest
import torch

from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.models.qwen3_vl import interleaved_rope_axis
from tidal.rollout.runner.multimodal import MultiModalInput

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
SIZES = [(64, 64), (32, 64), (32, 32)]  # 4, 2 and 1 image tokens (16-pixel patches merged 2x2)
ONE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
TWO = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]


def _image(seed: int, size: tuple[int, int]):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(size[1], size[0], 3, generator=g) * 255).byte().numpy())


def _config(**overrides) -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", max_model_len=256, block_size=4, **overrides)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5", "qwen3_5_moe"])
def vlm_dir(request, tmp_path_factory):
    from tidal.testing import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp(request.param) / "m", request.param)


def _load(path):
    """(HF model with peaked logits, processor, prompt ids of ONE, prompt ids of TWO)."""
    from transformers import AutoModelForImageTextToText

    from tidal.data.vision import load_vision_processor
    from tidal.models import load_tokenizer

    tokenizer = load_tokenizer(str(path))
    processor = load_vision_processor(str(path), tokenizer)
    hf = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)  # peaked distributions, as a trained model's

    def ids(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return hf, processor, ids(ONE), ids(TWO)


@pytest.fixture(scope="module")
def setup(vlm_dir):
    hf, processor, one, two = _load(vlm_dir)
    return hf, processor, one, two, _engine(hf, processor)


def _family(hf) -> str:
    return hf.config.model_type


def _engine(hf, processor, **overrides) -> LLMEngine:
    return LLMEngine(
        model=hf, tokenizer=processor.tokenizer, config=_config(**overrides),
        image_processor=processor.image_processor,
    )  # fmt: skip


def _inputs(processor, ids, images, output=()):
    """transformers' inputs for prompt ``ids`` (one placeholder per image) + ``output``."""
    from tidal.data.vision import expand_image_tokens

    counts = processor.token_counts(images)
    expanded = expand_image_tokens(ids, [0] * len(ids), counts, processor.image_token_id)[0]
    input_ids = torch.tensor([expanded + list(output)])
    kwargs = processor.pixel_inputs(images)
    kwargs["mm_token_type_ids"] = (input_ids == processor.image_token_id).int()  # M-RoPE positions
    return len(expanded), input_ids, kwargs


@torch.inference_mode()
def _hf_greedy(hf, processor, ids, images) -> list[int]:
    n, input_ids, kwargs = _inputs(processor, ids, images)
    device = next(hf.parameters()).device
    input_ids = input_ids.to(device)
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    out = hf.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=10,
        suppress_tokens=[processor.image_token_id, hf.config.video_token_id], **kwargs,
    )  # fmt: skip
    return out[0, n:].tolist()


@torch.inference_mode()
def _hf_logprobs(hf, processor, ids, images, output: list[int]) -> torch.Tensor:
    """log_softmax of each output token from one transformers forward over prompt + output."""
    n, input_ids, kwargs = _inputs(processor, ids, images, output)
    logits = hf(input_ids=input_ids, **kwargs).logits[0, n - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def _greedy(engine, ids, images) -> list[int]:
    return (
        engine.generate([ids], GREEDY, multi_modal=[MultiModalInput(images=images)])[0].outputs[0].token_ids
    )


def test_greedy_equals_transformers_generate_batched_with_text(setup):
    hf, processor, one, two, engine = setup
    singles = [[_image(i, size)] for i, size in enumerate(SIZES)]
    pair = [_image(5, SIZES[0]), _image(6, SIZES[1])]
    text = one[:2] + [300, 301, 302]  # no placeholder: a text-only request in the same batch
    prompts, images = [one] * 3 + [two, text], [*singles, pair, None]
    outs = engine.generate(prompts, GREEDY, multi_modal=[im and MultiModalInput(images=im) for im in images])
    for ids, ims, out in zip(prompts[:4], images[:4], outs, strict=False):
        assert out.outputs[0].token_ids == _hf_greedy(hf, processor, ids, ims)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([text]), do_sample=False, max_new_tokens=10)[0, len(text) :].tolist()
    assert outs[4].outputs[0].token_ids == ref
    first = outs[0].outputs[0]
    ref = _hf_logprobs(hf, processor, one, singles[0], first.token_ids)
    assert torch.allclose(torch.tensor(first.logprobs), ref, atol=1e-4)


def test_interleaved_rope_axis_by_hand():
    # the tiny model: 8 frequencies, sections (2, 3, 3): t h w t h w t h
    assert interleaved_rope_axis([2, 3, 3], 8).tolist() == [0, 1, 2, 0, 1, 2, 0, 1] * 2
    # Qwen3-VL's (24, 20, 20) over 64 frequencies: h at 1, 4, ..., 58; w at 2, 5, ..., 59; t elsewhere
    axis = interleaved_rope_axis([24, 20, 20], 64)[:64]
    assert axis[1:60:3].eq(1).all() and axis[2:60:3].eq(2).all()
    assert axis[0:60:3].eq(0).all() and axis[60:].eq(0).all()


def test_interleaved_mrope_matters(setup):
    """Contiguous M-RoPE sections (Qwen2.5-VL's layout) give log-probs other than transformers'; the
    interleaved ones agree to float32 noise."""
    hf, processor, one, _, _ = setup
    engine = _engine(hf, processor)
    images = [_image(1, SIZES[0])]
    out = engine.generate([one], GREEDY, multi_modal=[MultiModalInput(images=images)])[0].outputs[0]
    ref = _hf_logprobs(hf, processor, one, images, out.token_ids)
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5)
    contiguous = torch.cat([torch.full((n,), i) for i, n in enumerate(engine.model.args.mrope_section)])
    engine.model.rope_axis = torch.cat([contiguous, contiguous])
    out = engine.generate([one], GREEDY, multi_modal=[MultiModalInput(images=images)])[0].outputs[0]
    ref = _hf_logprobs(hf, processor, one, images, out.token_ids)
    assert (torch.tensor(out.logprobs) - ref).abs().max() > 1e-3


def test_zeroed_deepstack_changes_the_completion_and_vision_weights_update(setup):
    """DeepStack matters: with its mergers' outputs zeroed (a weight update of the vision tower under HF
    names) the greedy tokens change, and still equal transformers' for the zeroed model."""
    from transformers import AutoModelForImageTextToText

    hf, processor, one, _, _ = setup
    if _family(hf) != "qwen3_vl":
        pytest.skip("Qwen3.5's vision tower has no DeepStack mergers")
    engine = _engine(hf, processor)
    images = [_image(0, SIZES[0])]
    before = _greedy(engine, one, images)
    flat = AutoModelForImageTextToText.from_config(hf.config).eval()
    flat.load_state_dict(hf.state_dict())
    update = []
    with torch.no_grad():
        for name, p in flat.named_parameters():
            if "deepstack_merger_list" in name and "linear_fc2" in name:
                p.zero_()
                update.append((name, p))
    assert update and all(name.startswith("model.visual.") for name, _ in update)
    assert engine.update_weights(update) == len(update)
    after = _greedy(engine, one, images)
    assert after != before
    assert after == _hf_greedy(flat, processor, one, images)


@torch.inference_mode()
def test_n_samples_share_the_prefill_and_logprobs_match_hf_forward(setup):
    hf, processor, _, two, engine = setup
    images = [_image(3, SIZES[0]), _image(4, SIZES[2])]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=5, ignore_eos=True)
    out = engine.generate([two], params, multi_modal=[MultiModalInput(images=images)])[0]
    for sample in out.outputs:
        ref = _hf_logprobs(hf, processor, two, images, sample.token_ids)
        assert torch.allclose(torch.tensor(sample.logprobs), ref, atol=1e-4)
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1  # the samples differ


def test_update_weights_language_model_then_vision_tower(setup):
    """A trainer's names: the language model alone (what ``--freeze_visual_encoder`` syncs) leaves the
    tower as it was; the tower's names then update it too."""
    from transformers import AutoModelForImageTextToText

    hf, processor, one, _, _ = setup
    engine = _engine(hf, processor)
    changed = AutoModelForImageTextToText.from_config(hf.config).eval()
    changed.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    named = list(changed.named_parameters())
    language = [(n, p) for n, p in named if not n.startswith("model.visual.")]
    vision = [(n, p) for n, p in named if n.startswith("model.visual.")]
    assert engine.update_weights(language) == len(language)
    half = AutoModelForImageTextToText.from_config(hf.config).eval()
    half.load_state_dict({**hf.state_dict(), **dict(language)})
    images = [_image(6, SIZES[0])]
    assert _greedy(engine, one, images) == _hf_greedy(half, processor, one, images)
    assert engine.update_weights(vision) == len(vision)
    assert _greedy(engine, one, images) == _hf_greedy(changed, processor, one, images)
    with pytest.raises(ValueError, match=f"unexpected weight 'model.visual.nope' for a {_family(hf)} vision"):
        engine.update_weights([("model.visual.nope", torch.zeros(1))])


def test_sleep_and_wake_up_keep_the_completions(setup):
    hf, processor, one, two, _ = setup
    engine = _engine(hf, processor)
    images = [[_image(50, SIZES[0])], [_image(51, SIZES[2]), _image(52, SIZES[1])]]
    mm = [MultiModalInput(images=im) for im in images]
    before = engine.generate([one, two], GREEDY, multi_modal=mm)
    engine.sleep()
    engine.wake_up()
    after = engine.generate([one, two], GREEDY, multi_modal=mm)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_moe_routing_records_transformers_router_choices(setup):
    """Router replay's input: the experts the engine records for every token (image tokens included) are
    the top-k of transformers' router logits over the same prompt and output."""
    hf, processor, one, _, _ = setup
    if _family(hf) != "qwen3_5_moe":
        pytest.skip("not a MoE family")
    engine = _engine(hf, processor, record_routing=True)
    images = [_image(1, SIZES[0])]
    out = engine.generate([one], GREEDY, multi_modal=[MultiModalInput(images=images)])[0].outputs[0]
    _, input_ids, kwargs = _inputs(processor, one, images, out.token_ids)
    with torch.no_grad():
        router_logits = hf(input_ids=input_ids, output_router_logits=True, **kwargs).router_logits
    k = hf.config.text_config.num_experts_per_tok
    want = torch.stack([logits.topk(k, -1).indices for logits in router_logits], 1)[:-1]
    got = torch.as_tensor(out.routed_experts)
    assert got.shape == want.shape and torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_refusals(setup):
    """Tensor parallelism (both), prefix caching where the registry refuses it (none now): one line each."""
    from tidal.rollout.models.registry import feature_refusal

    hf, processor, _, _, _ = setup
    refused = [("tensor_parallel", {"tp_size": 2})]
    if feature_refusal(_family(hf), "prefix_caching"):
        refused.append(("prefix_caching", {"enable_prefix_caching": True}))
    for feature, flags in refused:
        with pytest.raises(ValueError, match=f"{feature} is not supported for the {_family(hf)} family"):
            LLMEngine(model=hf, tokenizer=processor.tokenizer, config=_config(**flags))


def test_chunked_prefill_equals_one_prefill(setup):
    """A 3-token budget: chunks stop before an image or hold all of it, so the vision tower (and DeepStack)
    sees whole images; the completions are those of one prefill."""
    hf, processor, one, two, engine = setup
    chunked = _engine(hf, processor, enable_chunked_prefill=True, max_num_batched_tokens=3)
    prompts = [one, two, one]
    images = [[_image(40, SIZES[0])], [_image(41, SIZES[1]), _image(42, SIZES[0])], [_image(43, SIZES[2])]]
    mm = [MultiModalInput(images=im) for im in images]
    want = engine.generate(prompts, GREEDY, multi_modal=mm)
    got = chunked.generate(prompts, GREEDY, multi_modal=mm)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(
            torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs), atol=1e-5
        )


def test_async_scheduling_samples_as_the_synchronous_loop(setup):
    """Decode steps launched ahead read the same per-sequence M-RoPE deltas (seeded n samples agree)."""
    from tidal.rollout.models.registry import feature_refusal

    hf, processor, one, _, _ = setup
    if feature_refusal(_family(hf), "async_scheduling"):
        pytest.skip(feature_refusal(_family(hf), "async_scheduling"))
    images = [MultiModalInput(images=[_image(30 + i, SIZES[i % 3])]) for i in range(3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=1)
    outs = []
    for ahead in (False, True):
        engine = _engine(hf, processor, async_scheduling=ahead)
        assert engine.async_scheduling == ahead
        result = engine.generate([one] * 3, params, multi_modal=images)
        outs.append([[(c.token_ids, c.logprobs) for c in out.outputs] for out in result])
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_float32_matches_transformers_with_and_without_graphs(vlm_dir, eager):
    """On CUDA (float32, Triton attention): greedy on images equals transformers', eager and with CUDA
    graphs / async scheduling (the decode delta is read inside the captured graph)."""
    hf, processor, one, two = _load(vlm_dir)
    config = EngineConfig(
        device="cuda", dtype="float32", max_model_len=256, block_size=16, enforce_eager=eager
    )
    engine = LLMEngine(
        model=hf, tokenizer=processor.tokenizer, config=config, image_processor=processor.image_processor
    )
    images = [[_image(20 + i, size)] for i, size in enumerate(SIZES)] + [[_image(24, SIZES[0])] * 2]
    prompts = [one] * 3 + [two]
    from tidal.rollout.models import gated_delta

    if _family(hf).startswith("qwen3_5") and gated_delta.fla_installed():
        # transformers takes fla's kernels whenever fla is importable, and they run on CUDA only: the
        # reference is a second copy of the model (peaked as the engine's) on the GPU
        hf = _load(vlm_dir)[0].cuda()
    for _ in range(2):  # the second run replays the captured graphs
        outs = engine.generate(prompts, GREEDY, multi_modal=[MultiModalInput(images=im) for im in images])
        for ids, ims, out in zip(prompts, images, outs, strict=True):
            assert out.outputs[0].token_ids == _hf_greedy(hf, processor, ids, ims)  # transformers on the CPU
