"""DeepSeek-V3 in the engine (``models/deepseek_v3.py``, ``models/mla.py``): greedy completions equal to
``transformers.generate`` on tiny random-init checkpoints, each family feature shown to matter, the latent
cache's shape, its reads by prefix caching / chunked prefill, weight updates, and the router."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.rollout.reference import (
    PROMPTS,
    assert_same_outputs,
    cpu_config,
    greedy,
    hf_greedy,
    hf_logprobs,
    small_cache_config,
)
from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.models import mla
from tidal.rollout.models.moe import group_limited_route

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """The registry's tiny deepseek_v3 (q_lora_rank 48, 4 groups of 2 experts with 2 eligible, one dense
    layer, interleaved rope) with a non-zero ``e_score_correction_bias`` (random init leaves it 0) and
    larger q/k projections (random init attends almost uniformly, whatever the positions)."""
    from transformers import AutoModelForCausalLM

    from tidal.testing import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny_deepseek_v3"), "deepseek_v3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(10)
            layer.self_attn.kv_a_proj_with_mqa.weight.mul_(10)
            layer.self_attn.kv_b_proj.weight.mul_(5)
            if layer.mlp.__class__.__name__ == "DeepseekV3MoE":
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    model.save_pretrained(path)
    return path, model


def _completions(engine, prompts=PROMPTS, n: int = NEW_TOKENS) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in engine.generate(prompts, greedy(n))]


def test_greedy_matches_hf_and_every_feature_changes_the_completions(deepseek, monkeypatch):
    path, hf = deepseek
    config = hf.config
    assert config.q_lora_rank and config.n_group > config.topk_group > 0 and config.first_k_dense_replace == 1
    assert config.rope_interleave
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=4, max_num_seqs=8))
    reference = [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in PROMPTS]
    outputs = engine.generate(PROMPTS, greedy(NEW_TOKENS))
    assert [out.outputs[0].token_ids for out in outputs] == reference
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected = hf_logprobs(hf, prompt, out.outputs[0].token_ids)
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), expected, atol=1e-4, rtol=0)

    # The cache holds one latent row per token and layer (kv_lora_rank + qk_rope_head_dim = 40 values),
    # not per-head K/V (2 x 6 heads x 24 = 288 values here).
    runner = engine.runner
    assert runner.kv_cache.shape == (4, 1, runner.num_blocks + 1, 4, 1, 32 + 8)
    per_head_kv = config.num_attention_heads * (config.qk_nope_head_dim + 8 + config.v_head_dim)
    assert runner.kv_cache[0, :, 0, 0].numel() == 40 < per_head_kv

    # Each feature left out changes some completion (the engine's model modified in place).
    model = engine.model
    attentions = [layer.self_attn for layer in model.model.layers]
    routers = [layer.mlp.gate for layer in model.model.layers[1:]]
    with monkeypatch.context() as m:
        m.setattr(mla, "apply_rope", lambda x, cos, sin: x)
        assert _completions(engine) != reference, "the rope part of q/k"
    with monkeypatch.context() as m:
        m.setattr(mla, "deinterleave", lambda x: x)
        assert _completions(engine) != reference, "the interleaved rope layout"
    with monkeypatch.context() as m:
        for attention in attentions:
            m.setattr(attention.kv_a_layernorm, "forward", lambda x: x)
        assert _completions(engine) != reference, "the latent's RMSNorm"
    with monkeypatch.context() as m:
        for router in routers:
            m.setattr(
                router, "routing", dataclasses.replace(router.routing, top_groups=router.routing.num_groups)
            )
        assert _completions(engine) != reference, "group-limited routing"
    saved = [router.e_score_correction_bias.clone() for router in routers]
    for router in routers:
        router.e_score_correction_bias.zero_()
    assert _completions(engine) != reference, "the correction bias"
    for router, bias in zip(routers, saved, strict=True):
        router.e_score_correction_bias.copy_(bias)
    assert _completions(engine) == reference


def test_plain_q_proj_yarn_and_rotate_half_rope_match_hf(tiny_model, hf_model):
    """V2-Lite-shaped attention (``q_lora_rank`` None: one ``q_proj``), rope without interleaving, YaRN
    scaling whose ``mscale_all_dim`` also scales the softmax (as transformers' ``yarn_apply_mscale``)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1)  # fmt: skip
    path = tiny_model("deepseek_v3", q_lora_rank=None, rope_interleave=False, rope_parameters=yarn)
    hf = hf_model(path)
    assert hf.model.layers[0].self_attn.q_proj is not None
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=8))
    attention = engine.model.model.layers[0].self_attn
    assert attention.shape.softmax_scale == pytest.approx(
        yarn_apply_mscale(hf.config.rope_parameters, 24**-0.5)
    )
    assert attention.shape.softmax_scale != pytest.approx(24**-0.5)
    prompts = PROMPTS[1:3]  # 30 and 20 tokens: past original_max_position_embeddings with the output
    assert _completions(engine, prompts, 16) == [hf_greedy(hf, prompt, 16) for prompt in prompts]


def test_prefix_caching_chunked_prefill_and_samples_read_the_latent_cache(deepseek):
    """Prompts computed in chunks against their cached latents (context prefill in latent space), a
    shared prefix served from the cache, and n samples sharing one prefill: the plain engine's results."""
    path, _ = deepseek
    shared = list(range(50, 70))
    prompts = [shared + [7, 8, 9], shared + [11, 12], PROMPTS[1]]
    params = SamplingParams(temperature=0.8, max_new_tokens=10, n=2, seed=5, ignore_eos=True)
    plain = LLMEngine(path, small_cache_config()).generate(prompts, params)
    cached = LLMEngine(
        path,
        small_cache_config(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=8),
    )
    cached.generate(prompts[:1], params)  # the shared prefix's blocks are cached from here on
    assert_same_outputs(plain, cached.generate(prompts, params))


def test_update_weights_and_sleep_wake(deepseek, tiny_model, hf_model):
    """``update_weights`` with a trainer's ``named_parameters()`` (stacked experts, the router's float32
    weights) and a checkpoint of other weights, then sleep / wake_up: the new model's completions."""
    from safetensors.torch import load_file

    path, _ = deepseek
    other_path = tiny_model("deepseek_v3", seed=1)
    other = hf_model(other_path)
    engine = LLMEngine(path, cpu_config(max_model_len=64, block_size=8))
    buffers = {n: b for n, b in other.named_buffers() if n.endswith("e_score_correction_bias")}
    # A full checkpoint's multi-token-prediction layer (past num_hidden_layers) is skipped, as transformers does.
    mtp = [("model.layers.4.self_attn.kv_b_proj.weight", torch.zeros(6 * 40, 32))]
    engine.update_weights(list(other.named_parameters()) + list(buffers.items()) + mtp)
    engine.sleep(level=2)
    engine.wake_up()
    prompts = PROMPTS[:2]
    assert _completions(engine, prompts) == [hf_greedy(other, prompt, NEW_TOKENS) for prompt in prompts]
    assert engine.model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    # A bfloat16 engine keeps the router in float32, as transformers 5.24 does.
    bf16 = LLMEngine(path, dataclasses.replace(cpu_config(max_model_len=64), dtype="bfloat16"))
    gate = bf16.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    saved = load_file(path / "model.safetensors")["model.layers.1.mlp.gate.weight"]
    assert torch.equal(gate.weight, saved)  # not rounded through bfloat16


def test_engine_from_the_loaded_model_equals_the_folders_and_keeps_the_bias_across_syncs(deepseek):
    """``LLMEngine(model=hf)`` (a trainer's colocated engine): the router's bias is a buffer in transformers
    (``named_parameters()`` lacks it), taken from the model's buffers; a sync of ``named_parameters()`` only
    (what the trainer sends) keeps the bias loaded, which nothing trains."""
    from transformers import AutoTokenizer

    path, hf = deepseek
    assert not any(name.endswith("e_score_correction_bias") for name, _ in hf.named_parameters())
    config = cpu_config(max_model_len=64, block_size=4, max_num_seqs=4)
    prompts, params = PROMPTS[:2], greedy(8)
    from_folder = LLMEngine(path, config).generate(prompts, params)
    engine = LLMEngine(model=hf, tokenizer=AutoTokenizer.from_pretrained(path), config=config)
    assert_same_outputs(from_folder, engine.generate(prompts, params), tol=1e-6)
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0  # the fixture's non-zero bias, which changes the completions
    assert engine.update_weights(hf.named_parameters()) == len(list(hf.named_parameters()))
    assert torch.equal(engine.model.model.layers[1].mlp.gate.e_score_correction_bias, bias)
    assert_same_outputs(from_folder, engine.generate(prompts, params), tol=1e-6)


def test_group_limited_route_matches_transformers_router():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=16, n_routed_experts=12, num_experts_per_tok=3, n_group=4,
                              topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(64, 16)
    logits, hf_weights, hf_ids = router(x)
    weights, ids = group_limited_route(logits, router.e_score_correction_bias, 3, 4, 2, True, 2.5)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))
    # Only experts of the top 2 groups are chosen (a token's groups: experts // 3).
    assert all(len(set((row // 3).tolist())) <= 2 for row in ids)


@pytest.mark.gpu
def test_cuda_graphs_and_async_steps_match_eager_decode_in_bfloat16(deepseek):
    """On CUDA the latent attention runs in torch (the Triton paged kernels take per-head K/V pages); its
    decode steps replay as CUDA graphs, with the fused Triton experts, as eager synchronous steps do.
    (float32 parity with transformers on CUDA: tests/rollout/test_gpu.py, parametrised over families.)"""
    from tidal.rollout import EngineConfig

    path, _ = deepseek
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=24, seed=3, ignore_eos=True)
    base = dict(device="cuda", dtype="bfloat16", max_model_len=128, block_size=16, max_num_seqs=8)
    graphs = LLMEngine(path, EngineConfig(**base, async_scheduling=True))
    assert graphs.runner.graphs is not None and graphs.runner.kv_cache.shape[-2:] == (1, 40)
    eager = LLMEngine(path, EngineConfig(**base, enforce_eager=True, async_scheduling=False))
    assert_same_outputs(eager.generate(PROMPTS, params), graphs.generate(PROMPTS, params), tol=1e-2)


def test_fp8_checkpoints_are_refused_in_one_line():
    from tidal.rollout.models.deepseek_v3 import DeepseekV3ForCausalLM
    from tidal.testing.tiny import tiny_config

    config = tiny_config("deepseek_v3")
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="^deepseek_v3: fp8-quantized checkpoints are not supported"):
        DeepseekV3ForCausalLM.args_from_hf_config(config)
