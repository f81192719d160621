"""FP8 rollouts in the engine (``EngineConfig.quantization``, ``tidal/rollout/quant/linear.py``) on the CPU,
where the FP8 weights are emulated (quantized, then dequantized to the engine's dtype): greedy tokens equal
``transformers.generate`` on a model whose linear weights were rounded the same way, weight syncs
re-quantize what they load (and only that), and the settings FP8 cannot run with are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.rollout.reference import PROMPTS, assert_follows, cpu_config, greedy
from tidal.rollout import EngineConfig, LLMEngine
from tidal.rollout.models.registry import FAMILIES, VISION_FAMILIES
from tidal.rollout.quant.fp8 import quantize_dequantize
from tidal.rollout.quant.linear import registry_family_problem


@torch.no_grad()
def fp8_hf_model(path, granularity: str, keep: tuple[str, ...] = ()):
    """The transformers model of ``path`` with the weights the engine quantizes rounded through FP8: the
    decoder layers' projections and stacked experts (each HF projection alone: per-channel rows and
    128-blocks start at its first row), not the embeddings, norms, routers or LM head, nor the modules
    named in ``keep`` (DeepSeek-V3's absorbed ``kv_b_proj``)."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for name, param in model.model.layers.named_parameters():
        module, _, kind = name.rpartition(".")
        if module.endswith(("gate", "router", *keep)) or param.dim() < 2:  # routers, norms, biases
            continue
        if kind == "gate_up_proj":  # stacked experts [E, 2I, H]: gate rows, then up rows
            gate, up = param.chunk(2, dim=1)
            gate.copy_(quantize_dequantize(gate.clone(), granularity))
            up.copy_(quantize_dequantize(up.clone(), granularity))
        else:
            param.copy_(quantize_dequantize(param, granularity))
    return model


def _fp8_engine(path, quantization: str = "fp8", **kwargs) -> LLMEngine:
    return LLMEngine(path, cpu_config(quantization=quantization), **kwargs)


@pytest.mark.parametrize(("family", "quantization"), [("llama", "fp8"), ("qwen2", "fp8_block")])
def test_greedy_tokens_and_logprobs_are_the_fp8_rounded_model_s(family, quantization, tiny_model):
    """qwen2: q/k/v biases (kept in the model dtype) and 128-blocks on 64-row k/v parts."""
    path = tiny_model(family)
    engine = _fp8_engine(path, quantization)
    assert engine.model.fp8.modes() == {"emulated": 4 * engine.model.args.num_layers}
    reference = fp8_hf_model(path, "channel" if quantization == "fp8" else "block")
    outs = engine.generate(PROMPTS, greedy(10))
    assert_follows(reference, PROMPTS, outs, 10)
    # The rounding shows: the unquantized engine's log-probs of the same tokens differ.
    plain = LLMEngine(path, cpu_config()).generate(PROMPTS, greedy(10))
    gaps = [abs(a - b) for o, p in zip(outs, plain, strict=True)
            for a, b in zip(o.outputs[0].logprobs, p.outputs[0].logprobs, strict=False)]  # fmt: skip
    assert max(gaps) > 1e-4


def test_a_weight_sync_requantizes_and_equals_a_fresh_fp8_engine(tiny_model):
    """Two buckets (q and k/v of each layer's packed projection in different ones, as a bucketed sync can
    cut them) of another model's weights: generation changes and equals an FP8 engine loaded from them."""
    old, new = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    engine = _fp8_engine(old)
    before = engine.generate(PROMPTS, greedy(8))
    weights = list(AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32).state_dict().items())
    in_first = {n for n, _ in weights if "q_proj" in n or "gate_proj" in n}
    engine.update_weights([(n, t) for n, t in weights if n in in_first])
    engine.update_weights([(n, t) for n, t in weights if n not in in_first])
    after = engine.generate(PROMPTS, greedy(8))
    fresh = _fp8_engine(new).generate(PROMPTS, greedy(8))
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in fresh]
    assert [o.outputs[0].logprobs for o in after] == [o.outputs[0].logprobs for o in fresh]
    assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in before]


def test_a_partial_sync_rounds_only_what_it_loaded(tiny_model):
    """Loading one projection again leaves every other weight bit for bit as it was (an FP8-rounded weight
    is not rounded a second time) and that one as a fresh load rounds it."""
    path = tiny_model("llama")
    engine = _fp8_engine(path)
    before = {n: p.clone() for n, p in engine.model.named_parameters()}
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    k_proj = hf.model.layers[1].self_attn.k_proj.weight
    engine.update_weights([("model.layers.1.self_attn.k_proj.weight", k_proj * 3)])
    rows = slice(engine.model.args.q_size, engine.model.args.q_size + engine.model.args.kv_size)
    for name, param in engine.model.named_parameters():
        if name == "model.layers.1.self_attn.qkv_proj.weight":
            torch.testing.assert_close(
                param[rows], quantize_dequantize(k_proj * 3, "channel"), rtol=0, atol=0
            )
            assert torch.equal(param[: rows.start], before[name][: rows.start])
            assert torch.equal(param[rows.stop :], before[name][rows.stop :])
        else:
            assert torch.equal(param, before[name]), name


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_experts_are_quantized_too(family, tiny_model):
    """Per expert and output channel; the router and LM head stay float32 (the reference rounds neither)."""
    path = tiny_model(family)
    engine = _fp8_engine(path)
    from tidal.rollout.models.moe import Experts

    targets = engine.model.fp8.targets.values()
    sparse = sum(isinstance(t.module, Experts) for t in targets)
    assert sparse == sum(engine.model.args.moe.sparse_layers) > 0
    assert engine.model.fp8.modes() == {"emulated": len(targets)}
    reference = fp8_hf_model(path, "channel")
    assert_follows(reference, PROMPTS, engine.generate(PROMPTS, greedy(8)), 8)


def test_settings_fp8_cannot_run_with_are_refused(tiny_model):
    with pytest.raises(ValueError, match=r"^EngineConfig: --rollout_quantization must be one of none, fp8, "
                       r"fp8_block, not 'int8'$"):  # fmt: skip
        EngineConfig(quantization="int8")
    with pytest.raises(ValueError, match="exact_logprobs cannot run with FP8 rollouts"):
        EngineConfig(quantization="fp8", exact_logprobs=True)
    with pytest.raises(ValueError, match="need tp_size 1"):
        EngineConfig(quantization="fp8", tp_size=2)
    from tidal.rollout.engine.hf_engine import fallback_problem

    assert fallback_problem(EngineConfig(quantization="fp8_block"), "bamba") == (
        "FP8 rollouts (fp8_block) is not supported for the bamba family: it is not native to tidal's engine "
        "and runs on the transformers fallback, which lacks it"
    )


def test_a_family_with_an_untraced_loader_of_its_own_is_refused():
    """Before anything loads (the engine's config check) and on a built model: a loader of a family's own
    that does not declare ``fp8_traced_loader``. The families whose loaders are traced pass."""
    from tidal.rollout.engine.config import family_problem as engine_problem
    from tidal.rollout.models.llama import LlamaForCausalLM
    from tidal.rollout.quant.linear import loader_problem

    class OwnLoader(LlamaForCausalLM):
        def load_weights(self, named_tensors):
            return super().load_weights(named_tensors)

    assert loader_problem(OwnLoader, "custom") == (
        "--rollout_quantization fp8 supports the families on the shared weight loader, not 'custom' "
        "(its own loader: weight syncs could not be traced to the FP8 weights)"
    )
    for family in ("deepseek_v3", "gpt_oss", "gemma4_text", "qwen3_moe"):
        assert engine_problem(EngineConfig(quantization="fp8"), family) is None


FP8_FAMILIES = [
    name for name in FAMILIES if name not in VISION_FAMILIES and registry_family_problem(name) is None
]


@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_every_family_s_sync_rounds_the_weights_a_fresh_load_does(family, tiny_model):
    """Each family's names (renames, packing, per-expert or stacked experts, shared experts, fused
    checkpoint projections) reach the FP8 weights: after a sync, every parameter is bit for bit a fresh FP8
    engine's."""
    old, new = tiny_model(family, seed=0), tiny_model(family, seed=1)
    engine = _fp8_engine(old)
    engine.update_weights(
        AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32).named_parameters()
    )
    fresh = dict(_fp8_engine(new).model.named_parameters())
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, fresh[name]), name
