"""FP8 rollouts on CUDA (skipped without a GPU): ``torch._scaled_mm`` against the emulated product on
model-sized shapes, the fused MoE kernels on e4m3 experts against the dequantized reference, and the
engine with CUDA graphs and async scheduling across a weight sync.

Tolerances: the CUDA GEMM also quantizes the activations per token (3 mantissa bits), which moves a
product of random operands by ~2.6% of its norm (measured with the emulation on the CPU); the emulated
reference rounds the weights only. A dropped or transposed scale would be off by far more.

The fused MoE kernels on e4m3 experts run W8A8 by default on FP8-capable GPUs (the engine's path); their
W8A16 variant (no ``quantize_activations``) is checked against the weight-only reference.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.cuda_graphs import capture
from tests.rollout.reference import PROMPTS, greedy
from tests.rollout.test_fp8_kernels import QuantizeSpy, w8a8_reference

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("granularity", ["channel", "block"])
@pytest.mark.parametrize(("tokens", "out_features", "in_features"), [(1, 4096, 4096), (256, 11008, 4096),
                                                                     (3000, 896, 4864)])  # fmt: skip
def test_scaled_mm_matches_the_emulated_product(granularity, tokens, out_features, in_features):
    from tidal.rollout.quant.fp8 import dequantize, quantize
    from tidal.rollout.quant.linear import Target, fp8_linear, scaled_mm_problem

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, in_features, device="cuda", generator=gen).bfloat16()
    # groups of 128 rows of very different sizes (log-uniform in [1/4, 4]): other rows' or tiles' scales
    # are far off
    groups = 4 ** (2 * torch.rand(out_features // 128, 1, device="cuda", generator=gen) - 1)
    rows = groups.repeat_interleave(128, dim=0)
    w = (torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02 * rows).bfloat16()
    module = torch.nn.Linear(in_features, out_features, bias=False, device="cuda", dtype=torch.bfloat16)
    problem = scaled_mm_problem(Target(module, {"weight": (out_features,)}), granularity)  # the probe ran
    if problem and granularity == "block":  # cuBLAS's block-wise FP8 GEMM, shape-dependent on Hopper
        pytest.skip(f"torch's 1x128 x 128x128 FP8 GEMM refused on {torch.cuda.get_device_name()}: {problem}")
    assert problem is None
    q, scales = quantize(w, granularity)
    got = fp8_linear(x, q, scales, granularity)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, out_features)
    emulated = F.linear(x.float(), dequantize(q, scales, granularity, torch.float32))
    assert _rel(got, emulated) < 0.04
    assert _rel(got, F.linear(x.float(), w.float())) < 0.05  # and the bf16 product itself
    if granularity == "channel":  # a bias added in the row-wise GEMM's epilogue (``fuses_bias``)
        bias = torch.randn(out_features, device="cuda", generator=gen).bfloat16()
        assert _rel(fp8_linear(x, q, scales, granularity, bias), got.float() + bias.float()) < 1e-2
    wrong = scales.flip(0)  # another row's scales: a bookkeeping bug
    assert _rel(fp8_linear(x, q, wrong, granularity), emulated) > 0.2


@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize(("tokens", "width"), [(1, 896), (37, 4864), (256, 18944)])
def test_triton_activation_quantization_is_the_torch_one_bit_for_bit(group, tokens, width):
    from tidal.rollout.quant.fp8 import quantize_rows
    from tidal.rollout.quant.triton_fp8 import quantize_rows_triton

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = (torch.randn(tokens, width, device="cuda", generator=gen) * 3).bfloat16()
    x[0, :256] = 0  # an all-zero group (scale 1)
    q, scales = quantize_rows_triton(x, group)
    want_q, want_scales = quantize_rows(x, group)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    if group is not None:  # the layout torch's block-wise GEMM reads, and its rows padded to 128
        assert scales.stride() == (1, tokens) or tokens == 1
        padded = -(-tokens // 128) * 128
        q_pad, scales_pad = quantize_rows_triton(x, group, padded)
        assert torch.equal(q_pad[:tokens].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(scales_pad[:tokens], scales) and scales_pad.stride() == (1, padded)
        assert (q_pad[tokens:].float() == 0).all() and (scales_pad[tokens:] == 1).all()


@pytest.mark.parametrize("block_k", [128, 256])  # 256: the 7B table's o and down launches at 256 rows
@pytest.mark.parametrize("tma", [0, 1])
@pytest.mark.parametrize("split_k", [1, 4, 7])  # 7: not a power of two (the search tries any count)
@pytest.mark.parametrize(("tokens", "n", "k"), [(1, 4608, 3584), (37, 37888, 3584), (256, 3584, 18944),
                                                 (300, 896, 4864)])  # fmt: skip
def test_triton_fp8_gemm_is_the_product_of_its_e4m3_operands(tokens, n, k, split_k, tma, block_k):
    """The dense Triton FP8 GEMM (``triton_fp8_gemm``) at 7B and 0.5B decode shapes, bf16 out: the float32
    product of its e4m3 operands and scales (+ bias) up to bf16 rounding, and ``torch._scaled_mm``'s
    result as closely; replayed from a CUDA graph (the split-K workspace allocated in the capture) it
    gives the eager bits; another row's scales are far off."""
    _needs_fp8_mma()
    from tidal.accel import tma_loadable
    from tidal.rollout.quant.fp8 import quantize
    from tidal.rollout.quant.fp8_gemm_config import Fp8GemmConfig
    from tidal.rollout.quant.gemm import _quantize_activations
    from tidal.rollout.quant.triton_fp8_gemm import fp8_gemm

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = (
        torch.randn(tokens, k, device="cuda", generator=gen)
        * 4 ** (2 * torch.rand(tokens, 1, device="cuda", generator=gen) - 1)
    ).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    q, scales = quantize(w, "channel")
    xq, xs = _quantize_activations(x, None)
    want = (xq.float() * xs) @ (q.float() * scales).t() + bias.float()
    config = Fp8GemmConfig(
        16 if tokens <= 16 else 64, 128, block_k, split_k, 4, 3 if block_k == 128 else 4, tma
    )
    got = fp8_gemm(xq, xs, q, scales, config, bias, torch.bfloat16)
    if tma:  # the copy engine's tiles (not a silent fallback): the pointer launch's bits
        assert tma_loadable(xq) and tma_loadable(q)
        assert torch.equal(got, fp8_gemm(xq, xs, q, scales, replace(config, tma=0), bias, torch.bfloat16))
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, n)
    assert _rel(got, want) < 4e-3
    torch_mm = torch._scaled_mm(
        xq, q.t(), scale_a=xs, scale_b=scales.view(1, -1), bias=bias, out_dtype=torch.bfloat16
    )
    assert _rel(got, torch_mm) < 4e-3
    graph, replayed = capture(lambda: fp8_gemm(xq, xs, q, scales, config, bias, torch.bfloat16))
    graph.replay()
    assert torch.equal(replayed, got)
    if tokens > 1:
        assert _rel(fp8_gemm(xq, xs.roll(1, 0), q, scales, config, bias, torch.bfloat16), want) > 0.2


@pytest.mark.parametrize("tokens", [4, 300])
def test_fused_moe_on_fp8_experts_matches_the_dequantized_reference(tokens):
    from tidal.rollout.kernels.triton_moe import fused_expert_forward
    from tidal.rollout.models.moe import route_torch, unfused_expert_forward
    from tidal.rollout.quant.fp8 import dequantize, quantize

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    experts, hidden, inter, top_k = 64, 2048, 768, 8  # Qwen3-30B-A3B's expert shapes
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    rows = 4 ** (2 * torch.rand(experts, 2 * inter, 1, device="cuda", generator=gen) - 1)  # row sizes 1/4..4
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02 * rows).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.02).bfloat16()
    weights, ids = route_torch(torch.randn(tokens, experts, device="cuda", generator=gen).bfloat16(), top_k,
                               True, True)  # fmt: skip
    q_gu, s_gu = quantize(gate_up, "channel")
    q_d, s_d = quantize(down, "channel")
    # no activation quantizer: the weight-only (W8A16) variant; the engine runs W8A8 (below)
    got = fused_expert_forward(x, q_gu, q_d, weights, ids, scales=(s_gu[..., 0], s_d[..., 0]))
    ref = unfused_expert_forward(
        x.float(), dequantize(q_gu, s_gu, "channel", torch.float32), dequantize(q_d, s_d, "channel", torch.float32),
        weights.float(), ids, F.silu,
    )  # fmt: skip
    assert got.dtype == torch.bfloat16
    assert _rel(got, ref) < 1e-2  # weight-only FP8: bf16 roundings only
    swapped = fused_expert_forward(x, q_gu, q_d, weights, ids, scales=(s_gu.flip(1)[..., 0], s_d[..., 0]))
    assert _rel(swapped, ref) > 0.1


# Decode shapes: gpt-oss-20b's experts (biases, clamped SwiGLU) and Qwen3.5-35B-A3B's.
W8A8_SHAPES = {"gpt_oss": (32, 4, 2880, 2880, True), "qwen3_5": (256, 8, 2048, 512, False)}


def _fp8_moe_problem(shape: str, tokens: int = 256):
    """Random bf16 tokens and routing, e4m3 experts (per-channel scales, rows of sizes 1/4..4), and for
    gpt-oss bf16 biases and its clamped SwiGLU: ``fused_expert_forward``'s arguments."""
    from tidal.rollout.kernels.triton_moe import ClampedSwiGLU
    from tidal.rollout.models.moe import route_torch
    from tidal.rollout.quant.fp8 import quantize

    experts, top_k, hidden, inter, gpt_oss = W8A8_SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(experts)
    cuda = dict(device="cuda", generator=gen)
    # tokens of different sizes (1/4..4): another token's activation scale is far off
    x = (torch.randn(tokens, hidden, **cuda) * 4 ** (2 * torch.rand(tokens, 1, **cuda) - 1)).bfloat16()
    rows = 4 ** (2 * torch.rand(experts, 2 * inter, 1, **cuda) - 1)
    q_gu, s_gu = quantize((torch.randn(experts, 2 * inter, hidden, **cuda) * 3 / hidden**0.5 * rows).bfloat16(),
                          "channel")  # fmt: skip
    q_d, s_d = quantize((torch.randn(experts, hidden, inter, **cuda) / inter**0.5).bfloat16(), "channel")
    weights, ids = route_torch(torch.randn(tokens, experts, **cuda).bfloat16(), top_k, True, True)
    kwargs = dict(scales=(s_gu[..., 0], s_d[..., 0]))
    if gpt_oss:
        biases = (
            torch.randn(experts, 2 * inter, **cuda).bfloat16(),
            torch.randn(experts, hidden, **cuda).bfloat16(),
        )
        kwargs.update(biases=biases, swiglu=ClampedSwiGLU(alpha=1.702, limit=7.0))
    return (x, q_gu, q_d, weights, ids), kwargs, (s_gu, s_d)


def _needs_fp8_mma():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"{torch.cuda.get_device_name()} has no FP8 tensor cores (sm89+)")


@pytest.mark.parametrize("shape", sorted(W8A8_SHAPES))
def test_w8a8_fused_moe_is_the_product_of_its_e4m3_operands(shape):
    """The engine's FP8 experts (W8A8) against the float32 product of the e4m3 activations and weights each
    launch read (``w8a8_reference``), tokens of sizes 1/4..4. Tolerance 2e-2 of the norm: the kernels round
    the gated output and the pair outputs to bf16 (2^-9 relative each) and Hopper's FP8 MMA adds into its
    float32 accumulator with ~14 bits kept (Triton's default on sm90: no periodic promotion), a few 1e-3
    over K = 2880; reading another row's activation scales (the tokens' differ by up to 16x) or dropping a
    scale is off by more than 0.1 (the interpreter tests check the same launches at 1e-5)."""
    from tidal.rollout.kernels.triton_moe import fused_expert_forward, tile_configs
    from tidal.rollout.quant.fp8 import dequantize
    from tidal.rollout.quant.triton_fp8 import quantize_rows_triton

    _needs_fp8_mma()
    args, kwargs, (s_gu, s_d) = _fp8_moe_problem(shape)
    x, q_gu, q_d, weights, ids = args
    spy = QuantizeSpy(quantize_rows_triton)
    got = fused_expert_forward(*args, **kwargs, quantize_activations=spy)
    assert got.dtype == torch.bfloat16
    assert len(spy.calls) == 2 and torch.equal(spy.calls[0][0], x)  # the tokens, then the gated output
    block_m = tile_configs(ids.numel(), q_gu.shape[0], fp8=True)[0].block_m
    deq_gu, deq_d = (dequantize(q, s, "channel", torch.float32) for q, s in ((q_gu, s_gu), (q_d, s_d)))
    extra = {k: v for k, v in kwargs.items() if k != "scales"}
    used, gated, want = w8a8_reference(spy.calls, ids, weights, deq_gu, deq_d, block_m, **extra)
    assert _rel(spy.calls[1][0][used], gated) < 2e-2
    assert _rel(got, want) < 2e-2
    # handed another row's scales (the next token's), the gated launch is far off
    wrong = QuantizeSpy(quantize_rows_triton, wrong=0, rows=torch.arange(x.shape[0], device="cuda"))
    fused_expert_forward(*args, **kwargs, quantize_activations=wrong)
    assert _rel(wrong.calls[1][0][used], gated) > 0.1


@pytest.mark.parametrize("shape", sorted(W8A8_SHAPES))
def test_w8a8_fused_moe_replays_in_a_cuda_graph_as_eager(shape):
    """Decode replays captured graphs: the two activation quantizations and the two W8A8 launches, replayed
    on new tokens, give those tokens' eager result bit for bit (the same kernels, no atomics)."""
    from tidal.rollout.kernels.triton_moe import fused_expert_forward
    from tidal.rollout.quant.triton_fp8 import quantize_rows_triton

    _needs_fp8_mma()
    args, kwargs, _ = _fp8_moe_problem(shape)
    kwargs["quantize_activations"] = quantize_rows_triton  # the engine's W8A8 (``quant/experts.py``)
    x = args[0]
    graph, out = capture(lambda: fused_expert_forward(*args, **kwargs))
    x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_expert_forward(*args, **kwargs))


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_cuda_graphs_and_async_scheduling_stay_valid_across_a_sync(family):
    """bf16 engines with CUDA graphs and async scheduling: before and after a weight sync (the FP8 buffers
    rewritten in place under the captured graphs) they generate what an eager engine does; the LM head
    (a 152k vocabulary) and the embeddings stay bf16."""
    from transformers import AutoModelForCausalLM

    from tests.rollout.reference import assert_same_start
    from tidal.rollout import EngineConfig, LLMEngine
    from tidal.testing.tiny import tiny_config

    config = tiny_config(family, vocab_size=151936, hidden_size=256, intermediate_size=512,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip

    def model(seed: int):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()

    def engine(weights, **kw):
        settings = EngineConfig(device="cuda", dtype="bfloat16", quantization="fp8", max_model_len=256, **kw)
        return LLMEngine(config=settings, model=weights)

    old, new = model(0), model(1)
    graphs = engine(old)
    modes = graphs.model.fp8.modes()
    assert "emulated" not in modes and modes.get("scaled_mm", 0) > 0, modes
    assert ("triton_fp8" in modes) == (family == "qwen3_moe")
    assert graphs.model.lm_head.weight.dtype == torch.bfloat16 and "lm_head" not in graphs.model.fp8.targets
    assert graphs.async_scheduling and not graphs.eager
    assert_same_start(engine(old, enforce_eager=True).generate(PROMPTS, greedy(12)),
                      graphs.generate(PROMPTS, greedy(12)))  # fmt: skip
    graphs.update_weights(new.named_parameters())
    assert_same_start(engine(new, enforce_eager=True).generate(PROMPTS, greedy(12)),
                      graphs.generate(PROMPTS, greedy(12)))  # fmt: skip


def families_with_deepseek_xfail(reason: str) -> list:
    """The families on loaders of their own, DeepSeek-V3 a strict xfail with ``reason`` (its FP8 engine
    is refused on CUDA: ``DeepseekV3ForCausalLM.fp8_cuda_refused``)."""
    xfail = pytest.mark.xfail(strict=True, reason=reason)
    return ["gpt_oss", "gemma4_text", pytest.param("deepseek_v3", marks=xfail)]


@pytest.mark.parametrize(
    "family",
    families_with_deepseek_xfail(
        "after the sync the FP8 graphs engine's greedy tokens differ from a fresh eager engine's "
        "(H200, session 14; refused on CUDA: DeepseekV3ForCausalLM.fp8_cuda_refused); passing means "
        "the cause is gone and the refusal can go"
    ),
)
def test_the_families_on_loaders_of_their_own_run_fp8_with_graphs_across_a_sync(
    family, tiny_model, monkeypatch
):
    """bf16 engines of the tiny gpt-oss / Gemma 4 / DeepSeek-V3 with CUDA graphs and async scheduling:
    their projections run ``torch._scaled_mm`` (gpt-oss's experts the fused Triton MoE kernels on e4m3 weights,
    staged; DeepSeek-V3's absorbed ``kv_b_proj`` not quantized), and before and after a weight sync they
    generate what eager engines do."""
    from transformers import AutoModelForCausalLM

    from tests.rollout.reference import assert_same_start
    from tidal.rollout import EngineConfig, LLMEngine

    # Peaked distributions (logit_scale, as a trained model's): the graphs' padded batches may run other
    # GEMM kernels than eager steps, and on the flat logits of a random-init model that rounding alone could
    # flip a near-tie greedy token. (deepseek_v3 failed with them too, after the sync only: the xfail.)
    old, new = tiny_model(family, seed=0, logit_scale=4.0), tiny_model(family, seed=1, logit_scale=4.0)
    if family == "deepseek_v3":  # run what the refusal keeps users from (the xfail above)
        from tidal.rollout.models.deepseek_v3 import DeepseekV3ForCausalLM

        monkeypatch.setattr(DeepseekV3ForCausalLM, "fp8_cuda_refused", None)

    def engine(path, **kw):
        settings = EngineConfig(device="cuda", dtype="bfloat16", quantization="fp8", max_model_len=256, **kw)
        return LLMEngine(path, settings)

    graphs = engine(old)
    targets = graphs.model.fp8.targets
    assert graphs.model.fp8.modes().get("scaled_mm", 0) > 0
    experts = {t.mode for t in targets.values() if hasattr(t.module, "fp8_parts")}
    assert experts == ({"triton_fp8"} if family == "gpt_oss" else set())
    assert not any(path.endswith("kv_b_proj") for path in targets)
    assert graphs.async_scheduling and not graphs.eager
    assert_same_start(engine(old, enforce_eager=True).generate(PROMPTS, greedy(12)),
                      graphs.generate(PROMPTS, greedy(12)))  # fmt: skip
    graphs.update_weights(
        AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.bfloat16).named_parameters()
    )
    assert_same_start(engine(new, enforce_eager=True).generate(PROMPTS, greedy(12)),
                      graphs.generate(PROMPTS, greedy(12)))  # fmt: skip


@pytest.mark.parametrize(
    "family",
    families_with_deepseek_xfail(
        "on the H200 (session 15) the synced FP8 graphs engine gave a fresh one's greedy tokens "
        "but log-probs 1e-3 to 2e-2 apart, while the bf16 twin (test_new_families_gpu.py, weight_sync) "
        "passed: DeepSeek-V3's FP8 sync leaves the engine different; refused on CUDA until this passes"
    ),
)
def test_a_synced_fp8_graphs_engine_is_a_fresh_one_bit_for_bit(family, tiny_model, monkeypatch):
    """Tells a wrong sync from graph-vs-eager rounding (the DeepSeek-V3 xfail above compares a synced
    graphs engine with a fresh *eager* one): the same kernels on the same FP8 weights give the same tokens
    and log-probs, so a graphs engine synced from one model to another must equal a fresh graphs engine
    on the second, exactly. If this passes for deepseek_v3 while the xfail fails, its sync is right and
    the refusal (``fp8_cuda_refused``) rests on eager-vs-graphs rounding alone."""
    from transformers import AutoModelForCausalLM

    from tidal.rollout import EngineConfig, LLMEngine
    from tidal.rollout.models.deepseek_v3 import DeepseekV3ForCausalLM

    monkeypatch.setattr(DeepseekV3ForCausalLM, "fp8_cuda_refused", None)
    old, new = tiny_model(family, seed=0, logit_scale=4.0), tiny_model(family, seed=1, logit_scale=4.0)
    settings = EngineConfig(device="cuda", dtype="bfloat16", quantization="fp8", max_model_len=256)
    synced = LLMEngine(old, settings)
    synced.generate(PROMPTS, greedy(12))  # captures the decode graphs on the old weights
    synced.update_weights(
        AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.bfloat16).named_parameters()
    )

    def outputs(engine):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in engine.generate(PROMPTS, greedy(12))]

    assert outputs(synced) == outputs(LLMEngine(new, settings))
