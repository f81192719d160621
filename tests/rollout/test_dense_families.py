"""Gemma 2, Gemma 3 text and Phi-3 against ``transformers`` beyond the registry-driven tests: soft-capping
strong enough to matter, trained-looking norm weights, Gemma 3's scaled global RoPE, Phi-3's LongRoPE
(within, across and beyond ``original_max_position_embeddings``), and what the engine refuses."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import PROMPTS, cpu_config, hf_logprobs
from tests.rollout.test_engine_vs_hf import _check_against_hf
from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.models import registry
from tidal.testing.tiny import tiny_config

SHORT = SamplingParams(temperature=0.0, max_new_tokens=12)


@torch.inference_mode()
def hf_generate_logprobs(model, prompt: list[int], max_new_tokens: int):
    """Greedy tokens and their log-probs from the logits ``generate`` itself computed, step by step with
    its KV cache (LongRoPE's rotation depends on the length at each step, unlike one full forward)."""
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :]
    logits = torch.cat(out.logits).float()
    return tokens.tolist(), logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]


def test_gemma2_soft_capping_matches_hf_and_matters(tiny_model, hf_model):
    """Caps small enough to bend the tiny model's scores and logits: the engine still matches HF, and HF
    with the same weights but no caps gives other log-probs (so the comparison tests the caps)."""
    caps = dict(attn_logit_softcapping=0.2, final_logit_softcapping=1.0)
    capped, plain = tiny_model("gemma2", **caps), tiny_model("gemma2", attn_logit_softcapping=None)
    engine = LLMEngine(capped, cpu_config(max_model_len=128, block_size=4))
    _check_against_hf(engine, hf_model(capped), PROMPTS[1:3], SHORT)

    hf_capped, hf_plain = hf_model(capped), hf_model(plain)
    hf_plain.config.final_logit_softcapping = None
    prompt, output = PROMPTS[1], list(range(60, 72))
    difference = (hf_logprobs(hf_capped, prompt, output) - hf_logprobs(hf_plain, prompt, output)).abs()
    assert difference.max() > 1e-2


def _with_random_norms(src, dst, seed: int = 0):
    """Copy of a tiny folder whose norm weights are random (the tiny builder leaves them at their init:
    ones, or zeros for Gemma's ``1 + weight``), so the norms' scaling is exercised too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.5 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(dst))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dst))
    return dst


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3"])
def test_trained_looking_norm_weights_match_hf(family, tiny_model, hf_model, tmp_path):
    path = _with_random_norms(tiny_model(family), tmp_path / family)
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=4))
    _check_against_hf(engine, hf_model(path), PROMPTS[1:3], SHORT)


def test_gemma3_scaled_global_rope_matches_hf(tiny_model, hf_model):
    # rope_scaling goes to the global ("full_attention") layers only, as in Gemma 3 4B-27B (linear x8).
    path = tiny_model("gemma3_text", rope_scaling={"rope_type": "linear", "factor": 8.0})
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=4))
    assert not torch.equal(engine.model.rotary.cos, engine.model.rotary_local.cos)
    _check_against_hf(engine, hf_model(path), PROMPTS[1:3], SHORT)


# head_dim 32 -> 16 factors each; distinct short and long sets, so a wrong pick changes the numbers.
LONGROPE = dict(
    rope_scaling={
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(16)],
        "long_factor": [1.0 + 0.9 * i for i in range(16)],
    },
    original_max_position_embeddings=24,
)


@torch.inference_mode()
def hf_cached_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probs of ``tokens`` from HF forwards with a KV cache, one token per step (no cache reset)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    logits = [out.logits[0, -1]]
    for i, token in enumerate(tokens[:-1]):
        position = torch.tensor([[len(prompt) + i]])
        out = model(torch.tensor([[token]]), cache=out.cache, position_ids=position, use_cache=True)
        logits.append(out.logits[0, -1])
    return torch.stack(logits).float().log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_phi3_longrope_within_across_and_beyond_the_original_length(tiny_model, hf_model):
    """One mixed batch: prompts of 5 and 3 tokens stay short and 30 tokens starts past position 24 (the
    whole sequence takes the long factors): all as ``generate``. 20 tokens crosses it while decoding: as
    HF's cached forward (``generate`` recomputes the cache there instead; see ``phi3.py``)."""
    path = tiny_model("phi3", **LONGROPE)
    hf = hf_model(path)
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=4, max_num_seqs=8))
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, SHORT), strict=True):
        tokens, logprobs = hf_generate_logprobs(hf, prompt, SHORT.max_new_tokens)
        sample = out.outputs[0]
        assert sample.token_ids == tokens
        crosses = len(prompt) <= 24 < len(prompt) + len(tokens) - 1
        if crosses:
            logprobs = hf_cached_logprobs(hf, prompt, tokens)
        torch.testing.assert_close(torch.tensor(sample.logprobs), logprobs, atol=1e-4, rtol=0)
    assert any(len(p) <= 24 < len(p) + SHORT.max_new_tokens - 1 for p in PROMPTS)  # the crossing case ran


def test_phi3_longrope_tables_differ_only_past_the_original_length(tiny_model):
    model = LLMEngine(tiny_model("phi3", **LONGROPE), cpu_config(max_model_len=64)).model
    assert model.longrope_original == 24
    assert not torch.allclose(model.rotary.cos, model.rotary_long.cos)
    plain = LLMEngine(tiny_model("phi3"), cpu_config(max_model_len=64)).model
    assert plain.longrope_original is None


def test_phi3_fused_checkpoint_weights_load_unchanged(tiny_model):
    """The checkpoint's own qkv_proj / gate_up_proj tensors are our packed parameters, byte for byte."""
    from safetensors.torch import load_file

    path = tiny_model("phi3")
    state = load_file(str(path / "model.safetensors"))
    model = LLMEngine(path, cpu_config(max_model_len=64)).model
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.3.mlp.gate_up_proj.weight"):
        assert torch.equal(model.get_parameter(name), state[name])


def test_engine_refuses_what_it_does_not_implement():
    gemma = registry.model_class("gemma3_text")
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        gemma.args_from_hf_config(tiny_config("gemma3_text", use_bidirectional_attention=True))
    for family in ("gemma2", "gemma3_text"):
        assert registry.FAMILIES[family].chunkable_head is False  # soft-capping after lm_head
    assert registry.FAMILIES["phi3"].chunkable_head is True
