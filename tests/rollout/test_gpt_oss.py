"""gpt-oss (``tidal/rollout/models/gpt_oss.py``) against transformers' ``modeling_gpt_oss``.

The registry-parametrised tests (``test_engine_vs_hf.py``, ``test_families.py``) run the plain tiny
checkpoint; here a variant whose sinks, router bias and expert biases are large enough to matter shows
that greedy tokens equal ``transformers.generate`` and that leaving out each gpt-oss feature (sinks,
the sliding window, top-k-then-softmax routing, the router bias, the clamped SwiGLU) changes them. Also:
prefill with context (prefix caching, chunked prefill), router replay's recorded experts, YaRN tables,
``update_weights`` from a trainer's parameters, and MXFP4 checkpoints (``mxfp4.py``).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.rollout.reference import (
    PROMPTS,
    assert_same_start,
    cpu_config,
    hf_greedy,
    hf_logprobs,
    small_cache_config,
)
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.kernels.sink_attention import sink_sdpa
from tidal.rollout.models import gpt_oss
from tidal.rollout.models.mxfp4 import dequantize_mxfp4, e2m1_values

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
LONG = PROMPTS[1:3]  # 30 and 20 tokens: longer than the tiny sliding window (8)


@pytest.fixture(scope="module")
def strong(tiny_model, hf_model, tmp_path_factory):
    """The tiny gpt_oss with sinks, router bias and expert biases scaled up (path, HF model)."""
    hf = hf_model(tiny_model("gpt_oss"))
    torch.manual_seed(3)
    state = {}
    for name, p in hf.state_dict().items():
        if name.endswith("sinks"):
            p = torch.randn_like(p) * 2.0
        elif name.endswith(("router.bias", "proj_bias")):
            p = torch.randn_like(p) * 0.5
        state[name] = p.clone()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32)
    model.load_state_dict(state)
    path = tmp_path_factory.mktemp("tiny_gpt_oss_strong")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model("gpt_oss")).save_pretrained(path)
    return path, model.eval()


def _tokens(engine, prompts=LONG):
    return [out.outputs[0].token_ids for out in engine.generate(prompts, GREEDY)]


def test_greedy_matches_hf_and_each_feature_changes_it(strong, monkeypatch):
    path, hf = strong
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=4))
    got = engine.generate(LONG, GREEDY)
    expected = [hf_greedy(hf, prompt, 12) for prompt in LONG]
    for prompt, out, want in zip(LONG, got, expected, strict=True):
        assert out.outputs[0].token_ids == want
        logprobs = hf_logprobs(hf, prompt, want)
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), logprobs, atol=1e-4, rtol=0)

    model = engine.model
    attentions = [layer.self_attn for layer in model.model.layers]
    moes = [layer.mlp for layer in model.model.layers]
    assert [a.window for a in attentions] == [8, None, 8, None]

    def changed(**patches) -> bool:
        with monkeypatch.context() as m:
            for target, value in patches.items():
                m.setattr(gpt_oss, target, value)
            return _tokens(engine) != expected

    with torch.no_grad():
        sinks = [a.sinks.clone() for a in attentions]
        for a in attentions:
            a.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
        assert changed()
        for a, s in zip(attentions, sinks, strict=True):
            a.sinks.copy_(s)
        for a in attentions:
            a.window = None
        assert changed()
        attentions[0].window = attentions[2].window = 8
        bias = [m.router.bias.clone() for m in moes]
        for m in moes:
            m.router.bias.zero_()
        assert changed()
        for m, b in zip(moes, bias, strict=True):
            m.router.bias.copy_(b)

    def softmax_then_top_k(logits, k):  # Mixtral-style routing without renormalisation
        return torch.softmax(logits, -1).topk(k, dim=-1)

    assert changed(route_top_logits=softmax_then_top_k)
    assert changed(clamped_swiglu=lambda gate, up, alpha, limit: F.silu(gate) * up)
    assert _tokens(engine) == expected  # everything restored


def test_prefix_caching_and_chunked_prefill_match_hf(strong):
    """Prefill with context: each chunk's queries attend the cached keys (sinks and windows included)."""
    path, hf = strong
    shared = LONG[0]
    prompts = [shared + [7, 8, 9], shared + [300, 301, 302, 303, 304, 305]]
    engine = LLMEngine(
        path,
        small_cache_config(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=8),
    )
    for _ in range(2):  # the second run starts from the cached prefix
        assert _tokens(engine, prompts) == [hf_greedy(hf, p, 12) for p in prompts]


def test_recorded_routing_is_what_the_hf_routers_pick(strong):
    from tidal.models.moe_routing import capture_router_logits

    path, hf = strong
    engine = LLMEngine(path, cpu_config(record_routing=True, max_model_len=64))
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=0, ignore_eos=True)
    out = engine.generate([PROMPTS[0]], params)[0]
    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    recorded = torch.from_numpy(out.outputs[0].routed_experts).long()
    with torch.no_grad(), capture_router_logits(hf) as logits:
        hf(input_ids=torch.tensor([tokens[:-1]]))
    expected = torch.stack([x.topk(2, dim=-1).indices for x in logits], dim=1)
    assert recorded.shape == (len(tokens) - 1, 4, 2)
    assert torch.equal(recorded.sort(-1).values, expected.sort(-1).values)


def test_yarn_rope_tables_match_hf(strong):
    """The tiny config's RoPE is YaRN (factor 4): the engine's cos/sin equal transformers' rotary module."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    path, hf = strong
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    engine = LLMEngine(path, cpu_config(max_model_len=128))
    cos, sin = GptOssRotaryEmbedding(hf.config)(torch.zeros(1), torch.arange(128)[None])
    half = cos.shape[-1]
    torch.testing.assert_close(engine.model.rotary.cos[:, :half], cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(engine.model.rotary.sin[:, half:], sin[0], atol=1e-6, rtol=0)
    assert engine.model.rotary.scale > 1.0  # YaRN's attention factor


def test_update_weights_from_trainer_parameters(strong, tiny_model, hf_model):
    """A trainer's ``named_parameters()`` (stacked, input-major, interleaved gate/up) load like a checkpoint."""
    path, hf = strong
    engine = LLMEngine(tiny_model("gpt_oss"), cpu_config(max_model_len=64, block_size=4))
    assert engine.update_weights(hf.named_parameters()) == len(list(hf.named_parameters()))
    assert _tokens(engine) == [hf_greedy(hf, p, 12) for p in LONG]


def test_experts_are_transformers_experts(strong):
    """One layer's experts on random tokens and routes: the sorted path and the every-expert path (CUDA
    graphs in float32) both equal transformers' ``GptOssExperts`` (interleaved, input-major weights)."""
    path, hf = strong
    engine = LLMEngine(path, cpu_config(max_model_len=32))
    ours, theirs = engine.model.model.layers[1].mlp.experts, hf.model.layers[1].mlp.experts
    torch.manual_seed(0)
    x = torch.randn(9, hf.config.hidden_size) * 50  # large enough for the SwiGLU clamp (7) to bite
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(9)])
    weights = torch.rand(9, 2).softmax(-1)
    with torch.no_grad():
        want = theirs(x, ids, weights)
        torch.testing.assert_close(ours(x, weights, ids), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours._every_expert(x, weights, ids), want, atol=1e-5, rtol=1e-5)
        ours.limit = float("inf")
        assert (ours(x, weights, ids) - want).abs().max() > 1e-2  # the clamp was in play


def test_fused_experts_are_transformers_experts(strong, monkeypatch):
    """On CUDA the experts take ``triton_moe``'s fused kernels with their biases and clamped SwiGLU (here
    run by Triton's interpreter on the CPU, skipped without triton; the gpu tests run them compiled): the
    same as transformers' ``GptOssExperts``, the clamp in play."""
    from tests.rollout.triton_interpreter import interpreted
    from tidal.rollout.models import moe

    path, hf = strong
    engine = LLMEngine(path, cpu_config(max_model_len=32))
    ours, theirs = engine.model.model.layers[1].mlp.experts, hf.model.layers[1].mlp.experts
    torch.manual_seed(1)
    x = torch.randn(11, hf.config.hidden_size) * 50
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(11)])
    weights = torch.rand(11, 2).softmax(-1)
    with interpreted({"tidal.rollout.kernels.triton_moe": "_moe_gemm"}) as (kernels,), torch.no_grad():
        calls, fused = [], kernels.fused_expert_forward
        monkeypatch.setattr(
            kernels, "fused_expert_forward", lambda *a, **k: calls.append(k) or fused(*a, **k)
        )
        monkeypatch.setattr(moe, "triton_usable", lambda t: True)
        got = ours(x, weights, ids)
        want = theirs(x, ids, weights)
    assert len(calls) == 1 and calls[0]["swiglu"].limit == ours.limit
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_seeded_samples_logprobs_sleep_and_wake(strong):
    """n samples sharing a prefill, seeded: log-probs are HF's tempered ones and survive sleep / wake-up."""
    path, hf = strong
    engine = LLMEngine(path, cpu_config(max_model_len=64, block_size=4))
    params = SamplingParams(temperature=0.8, n=3, max_new_tokens=8, seed=5, ignore_eos=True)
    first = engine.generate(LONG, params)
    for prompt, out in zip(LONG, first, strict=True):
        assert len({tuple(s.token_ids) for s in out.outputs}) > 1
        for sample in out.outputs:
            want = hf_logprobs(hf, prompt, sample.token_ids, temperature=0.8)
            torch.testing.assert_close(torch.tensor(sample.logprobs), want, atol=1e-4, rtol=0)
    engine.sleep(level=2)
    engine.wake_up()
    again = engine.generate(LONG, params)
    assert [[s.token_ids for s in o.outputs] for o in again] == [
        [s.token_ids for s in o.outputs] for o in first
    ]


def test_refused_features_are_named(strong):
    path, _ = strong
    with pytest.raises(ValueError, match="tensor_parallel is not supported for the gpt_oss family"):
        LLMEngine(path, cpu_config(tp_size=2))
    with pytest.raises(ValueError, match="exact_logprobs supports the .* not 'gpt_oss'"):
        LLMEngine(path, cpu_config(exact_logprobs=True))


def test_sink_sdpa_is_transformers_eager_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    sinks = torch.randn(6) * 2
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[1, 0, 2] = False  # a row with no key at all: only the sink, so a zero output
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, 3, False
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25)
    got = sink_sdpa(q, k, v, mask, 0.25, sinks)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-6, rtol=1e-5)
    assert got[1, :, 2].abs().max() == 0


def test_mxfp4_dequantization():
    """E2M1 values and E8M0 scales from the format's definition, and transformers' own dequantisation."""
    from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

    assert e2m1_values().tolist() == FP4_VALUES
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0], blocks[0, 1] = 0x21, 0xF7  # (0.5, 1.0), (6.0, -6.0): the low nibble comes first
    out = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8))  # scale 2^(128 - 127)
    assert out[:4].tolist() == [1.0, 2.0, 12.0, -12.0] and out[4:].abs().sum() == 0  # one block of 32
    nan = dequantize_mxfp4(blocks, torch.tensor([255], dtype=torch.uint8))
    assert nan.isnan().all()
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(117, 137, (3, 6, 2), dtype=torch.uint8, generator=g)
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales), reference.transpose(1, 2))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :1])


def test_mxfp4_checkpoint_loads_as_its_dequantised_weights(strong, tmp_path):
    """A checkpoint whose experts are MXFP4 ``_blocks``/``_scales`` runs as the same model in float32."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, _ = strong
    state = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inp, out = state.pop(name).shape
        blocks = torch.randint(0, 256, (experts, out, inp // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 124, (experts, out, inp // 32), dtype=torch.uint8, generator=g)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        state[name] = convert_moe_packed_tensors(
            blocks, scales, dtype=torch.float32
        )  # transformers' [E, in, out]
    dense, quantised = tmp_path / "dense", tmp_path / "mxfp4"
    config = json.loads((path / "config.json").read_text())
    for folder, keep in ((dense, lambda n: not n.endswith(("_blocks", "_scales"))), (quantised, None)):
        folder.mkdir()
        tensors = {n: t for n, t in state.items() if keep is None or keep(n)}
        if keep is None:  # the quantised folder has the blocks and scales instead of the float tensors
            tensors = {
                n: t
                for n, t in tensors.items()
                if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))
            }
            config = {**config, "quantization_config": {"quant_method": "mxfp4"}}
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(config))
        for file in ("tokenizer.json", "tokenizer_config.json"):
            (folder / file).write_text((path / file).read_text())
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    want = LLMEngine(dense, cpu_config(max_model_len=64)).generate(LONG, params)
    got = LLMEngine(quantised, cpu_config(max_model_len=64)).generate(LONG, params)
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.gpu
def test_cuda_float32_with_graphs_matches_hf(strong):
    """CUDA graphs capture decode (float32 experts: the every-expert path) and equal transformers."""
    path, hf = strong
    hf = hf.cuda()
    try:
        engine = LLMEngine(
            path, EngineConfig(device="cuda", dtype="float32", max_model_len=128, block_size=16)
        )
        assert not engine.eager
        for prompt, out in zip(LONG, engine.generate(LONG, GREEDY), strict=True):
            with torch.inference_mode():
                ref = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=12)
            assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
    finally:
        hf.cpu()


@pytest.mark.gpu
def test_cuda_bfloat16_graphs_prefix_cache_and_chunks_agree_with_eager(strong):
    """bfloat16 (grouped GEMM experts): graphs vs eager, and prefix caching with chunked prefill."""
    path, _ = strong
    base = dict(device="cuda", dtype="bfloat16", max_model_len=128, block_size=16)
    eager = LLMEngine(path, EngineConfig(enforce_eager=True, **base)).generate(LONG, GREEDY)
    for extra in (
        dict(),
        dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16),
    ):
        engine = LLMEngine(path, EngineConfig(**base, **extra))
        for _ in range(2):
            assert_same_start(eager, engine.generate(LONG, GREEDY))
