"""Gemma 4 text (``tidal/rollout/models/gemma4.py``) against transformers' ``modeling_gemma4``.

The tiny checkpoint has two sliding-window layers (window 8, 32-wide heads) and two full-attention
layers (64-wide heads, proportional RoPE), the last two layers KV-shared (they read layers 0 and 1),
per-layer input embeddings, double-wide MLPs in the shared layers and layer scalars set away from 1.
Greedy tokens and log-probs equal transformers'; leaving out the per-layer embeddings, the sliding window
or the layer scalars changes them, and so does computing the shared layers' own keys/values instead of
reading their producers' (shown on transformers itself). The cache has slots for the two producing
layers only. Also: ``attention_k_eq_v`` checkpoints, batching, n samples, prefix caching, chunked
prefill, ``update_weights``, sleep/wake, the MoE checkpoints and the refusals.
"""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import PROMPTS, cpu_config, hf_greedy, hf_logprobs, small_cache_config
from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.models import gemma4, gemma4_moe

FAMILY = "gemma4_text"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
LONG = PROMPTS[1:3]  # 30 and 20 tokens: longer than the tiny sliding window (8)
SCALARS = (0.6, 1.7, 0.8, 1.4)


def _save(model, tokenizer_from, path):
    from transformers import AutoTokenizer

    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def setup(tiny_model, hf_model, tmp_path_factory):
    """The tiny gemma4_text with peaked logits and layer scalars away from 1: (path, HF model, engine)."""
    from transformers import AutoModelForCausalLM

    base = tiny_model(FAMILY, logit_scale=4.0)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()  # not the shared copy
    with torch.no_grad():
        for layer, scalar in zip(hf.model.layers, SCALARS, strict=True):
            layer.layer_scalar.fill_(scalar)
    path = _save(hf, base, tmp_path_factory.mktemp("tiny_gemma4_scaled"))
    engine = LLMEngine(path, small_cache_config(max_num_seqs=8))
    return path, hf, engine


def _tokens(engine, prompts=LONG, params=GREEDY):
    return [out.outputs[0].token_ids for out in engine.generate(prompts, params)]


def test_greedy_and_logprobs_match_transformers_and_each_feature_matters(setup, monkeypatch):
    path, hf, engine = setup
    expected = [hf_greedy(hf, prompt, 12) for prompt in PROMPTS]
    for prompt, out, want in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), expected, strict=True):
        assert out.outputs[0].token_ids == want
        logprobs = hf_logprobs(hf, prompt, want)
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), logprobs, atol=1e-4, rtol=0)
    want, model = expected[1:3], engine.model
    assert [layer.self_attn.window for layer in model.model.layers] == [8, None, 8, None]

    # Left out one at a time, each feature changes the completions: the per-layer input embeddings, ...
    with monkeypatch.context() as m:
        m.setattr(gemma4.Gemma4ForCausalLM, "per_layer_inputs", lambda self, ids, x: None)
        assert _tokens(engine) != want
    # ... the sliding window (every layer attending to the whole prompt), ...
    with monkeypatch.context() as m:
        for layer in model.model.layers:
            m.setattr(layer.self_attn, "window", None)
        assert _tokens(engine) != want
    # ... and the layer scalars.
    for layer in model.model.layers:
        layer.layer_scalar.fill_(1.0)
    assert _tokens(engine) != want
    for layer, scalar in zip(model.model.layers, SCALARS, strict=True):
        layer.layer_scalar.fill_(scalar)
    assert _tokens(engine) == want  # everything restored


def test_kv_shared_layers_have_no_cache_slot_and_sharing_matters(setup, tiny_model, hf_model, tmp_path):
    """The cache holds the two producing layers only, its rows as wide as the widest layer's heads. The
    same weights without KV sharing (each shared layer given its producer's k/v projections and norms)
    make transformers itself generate otherwise, and the engine follows it there too (4 cache layers)."""
    from transformers import AutoModelForCausalLM

    path, hf, engine = setup
    args = engine.model.args
    assert args.kv_sources == (0, 1, 0, 1) and args.kv_layers == 2
    # [kv layers, k/v, blocks + 1, block size, 1, row]: rows of 2 KV heads x 64 (full); sliding use 2 x 32.
    assert tuple(engine.runner.kv_cache.shape) == (2, 2, engine.num_kv_blocks + 1, 4, 1, 128)
    assert [layer.self_attn.kv_index for layer in engine.model.model.layers] == [0, 1, 0, 1]
    assert not hasattr(engine.model.model.layers[2].self_attn, "k_proj")
    # Checkpoints may still hold k/v projections and norms for the shared layers: ignored, as transformers does.
    extra = {f"model.layers.2.self_attn.{part}": hf.state_dict()[f"model.layers.0.self_attn.{part}"] * 3
             for part in ("k_proj.weight", "v_proj.weight", "k_norm.weight")}  # fmt: skip
    with_extra = LLMEngine(path, small_cache_config(), state_dict={**hf.state_dict(), **extra})
    assert _tokens(with_extra) == _tokens(engine)

    # Sharing shown on transformers itself, with a checkpoint of plain-width MLPs in the shared layers.
    narrow = tiny_model(FAMILY, logit_scale=4.0, use_double_wide_mlp=False)
    shared = hf_model(narrow)
    config = shared.config.to_dict()
    config.update(num_kv_shared_layers=0)
    unshared = AutoModelForCausalLM.from_config(type(shared.config).from_dict(config), dtype=torch.float32)
    state = dict(shared.state_dict())
    for consumer, producer in ((2, 0), (3, 1)):
        for part in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
            state[f"model.layers.{consumer}.self_attn.{part}"] = state[
                f"model.layers.{producer}.self_attn.{part}"
            ]
    unshared.load_state_dict(state, strict=True)
    unshared.eval()
    other = [hf_greedy(unshared, prompt, 12) for prompt in LONG]
    assert other != [hf_greedy(shared, prompt, 12) for prompt in LONG]
    assert _tokens(LLMEngine(narrow, small_cache_config())) == [hf_greedy(shared, p, 12) for p in LONG]
    plain = LLMEngine(_save(unshared, narrow, tmp_path / "unshared"), small_cache_config())
    assert plain.model.args.kv_layers == 4 and plain.runner.kv_cache.shape[0] == 4
    assert _tokens(plain) == other


def test_k_eq_v_checkpoints_and_a_loaded_model(tiny_model, hf_model, setup):
    """``attention_k_eq_v`` (the 31B layout): full layers with one KV head whose values are the keys'
    projection; then every layer's row fills the cache's (the reshaped-cache path). An engine built from a
    loaded transformers model (``model=``) also takes its layer scalars (buffers)."""
    path = tiny_model(FAMILY, logit_scale=4.0, attention_k_eq_v=True, num_global_key_value_heads=1)
    hf = hf_model(path)
    assert not hasattr(hf.model.layers[1].self_attn.v_proj, "weight")
    engine = LLMEngine(path, small_cache_config())
    assert engine.model.args.layer_kv_heads == (2, 1, 2, 1) and engine.runner.kv_cache.shape[-1] == 64
    assert _tokens(engine, PROMPTS) == [hf_greedy(hf, prompt, 12) for prompt in PROMPTS]
    _, scaled, _ = setup
    from_model = LLMEngine(None, cpu_config(max_model_len=64), model=scaled)
    assert _tokens(from_model) == [hf_greedy(scaled, prompt, 12) for prompt in LONG]


def test_batching_n_samples_prefix_cache_and_chunked_prefill(setup):
    path, hf, engine = setup
    alone = [_tokens(engine, [prompt])[0] for prompt in PROMPTS]
    assert _tokens(engine, PROMPTS) == alone
    # n samples share a prefill; seeded samples repeat and their log-probs are transformers' tempered ones.
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=3, seed=3, ignore_eos=True)
    first = engine.generate(PROMPTS[:2], params)
    again = engine.generate(PROMPTS[:2], params)
    for prompt, out, out2 in zip(PROMPTS[:2], first, again, strict=True):
        assert len({tuple(s.token_ids) for s in out.outputs}) > 1
        assert [s.token_ids for s in out.outputs] == [s.token_ids for s in out2.outputs]
        for sample in out.outputs:
            expected = hf_logprobs(hf, prompt, sample.token_ids, temperature=1.0)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
    # Prefix caching: the second run of prompts sharing a 30-token head computes their tails against the
    # cached blocks (the shared layers reading their producers' cached keys/values).
    cached = LLMEngine(path, small_cache_config(enable_prefix_caching=True))
    prompts = [PROMPTS[1] + [7, 8, 9], PROMPTS[1] + [300, 301, 302, 303, 304, 305]]
    want = [hf_greedy(hf, prompt, 12) for prompt in prompts]
    for _ in range(2):
        assert _tokens(cached, prompts) == want
    assert cached.scheduler.num_cached_tokens >= 28
    # Chunked prefill: prompts split over steps of 7 tokens, shared layers reading their producer's cache.
    chunked = LLMEngine(path, small_cache_config(enable_chunked_prefill=True, max_num_batched_tokens=7))
    assert _tokens(chunked, PROMPTS) == alone


def test_update_weights_sleep_and_refusals(setup, tiny_model, hf_model):
    path, hf, _ = setup
    engine = LLMEngine(path, small_cache_config())
    before = _tokens(engine)
    new = hf_model(tiny_model(FAMILY, seed=1, logit_scale=4.0))
    assert engine.update_weights(new.named_parameters()) == len(list(new.named_parameters()))
    with torch.no_grad():  # the scalars are buffers: a trainer does not send them, the engine keeps its own
        for layer, scalar in zip(engine.model.model.layers, (1.0,) * 4, strict=True):
            layer.layer_scalar.fill_(scalar)
    after = _tokens(engine)
    assert after == [hf_greedy(new, prompt, 12) for prompt in LONG] and after != before
    engine.sleep()
    assert engine.runner.kv_cache is None
    engine.wake_up()
    assert _tokens(engine) == after

    with pytest.raises(ValueError, match=f"tensor_parallel is not supported for the {FAMILY} family: "):
        LLMEngine(path, cpu_config(tp_size=2))
    with pytest.raises(ValueError, match=f"exact_logprobs supports the .* families, not '{FAMILY}'"):
        LLMEngine(path, cpu_config(exact_logprobs=True))


def test_moe_checkpoints_match_transformers(tiny_model, monkeypatch):
    """``enable_moe_block`` (the 26B-A4B layout): routed experts beside every layer's MLP, with Gemma 4's
    router (scaled input, per-expert scales). Leaving out the experts or the per-expert scales changes the
    completions; router replay is refused."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(
        FAMILY,
        logit_scale=4.0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # not the shared copy
    with torch.no_grad():  # per-expert scales away from 1, as trained checkpoints have them
        for layer in hf.model.layers:
            layer.router.per_expert_scale.copy_(torch.tensor([0.3, 2.0, 1.2, 0.6]))
    engine = LLMEngine(None, small_cache_config(), model=hf)
    want = [hf_greedy(hf, prompt, 12) for prompt in PROMPTS]
    for prompt, out, tokens in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), want, strict=True):
        assert out.outputs[0].token_ids == tokens
        logprobs = hf_logprobs(hf, prompt, tokens)
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), logprobs, atol=1e-4, rtol=0)
    layers = engine.model.model.layers
    with monkeypatch.context() as m:
        m.setattr(
            gemma4_moe.Gemma4Router,
            "forward",
            lambda self, h: (torch.zeros(h.shape[0], 2), torch.zeros(h.shape[0], 2, dtype=torch.long)),
        )
        assert _tokens(engine, PROMPTS) != want
    with torch.no_grad():
        for layer in layers:
            layer.router.per_expert_scale.fill_(1.0)
    assert _tokens(engine, PROMPTS) != want
    with pytest.raises(ValueError, match=f"record_routing is not supported for the {FAMILY} family: "):
        LLMEngine(path, cpu_config(record_routing=True))
