"""FP8 rollouts (``tidal/rollout/quant/linear.py``) for the families with their own weight loader, on the
CPU (emulated: the weights rounded through FP8 in place). gpt-oss: its attention projections and its
stacked, biased experts (gate and up rows quantized apart, the interleaved checkpoint layout undone
first) are rounded; greedy tokens and log-probs equal ``transformers.generate`` on the HF model rounded
the same way, and an MXFP4 sync rounds what a dense sync of the same weights does. (The sync of every
family's HF names equals a fresh FP8 load: ``test_fp8_engine.py`` / ``test_fp8_buffers.py``.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.rollout.reference import PROMPTS, assert_follows, cpu_config, greedy, hf_greedy, hf_logprobs
from tidal.rollout import LLMEngine
from tidal.rollout.models.registry import VISION_FAMILIES
from tidal.rollout.quant.fp8 import quantize_dequantize


def _config(**overrides):
    return cpu_config(num_kv_blocks=64, **overrides)  # a small KV cache: cheap engines


@torch.no_grad()
def gpt_oss_fp8_hf_model(path, granularity: str):
    """transformers' gpt-oss with the weights the engine quantizes rounded through FP8: the attention
    projections, and the experts in the engine's layout (output rows; gate and up rows each alone, their
    checkpoint columns interleaved gate 0, up 0, gate 1, ...). Router, sinks, biases and norms stay."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for layer in model.model.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            proj.weight.copy_(quantize_dequantize(proj.weight, granularity))
        experts = layer.mlp.experts
        rows = experts.gate_up_proj.transpose(1, 2)  # [E, 2I, H], a view: writes reach the parameter
        for half in (rows[:, 0::2], rows[:, 1::2]):
            half.copy_(quantize_dequantize(half.clone(), granularity))
        down = experts.down_proj.transpose(1, 2)  # [E, H, I]
        down.copy_(quantize_dequantize(down.clone(), granularity))
    return model


@pytest.mark.parametrize("quantization", ["fp8", "fp8_block"])
def test_gpt_oss_greedy_tokens_and_logprobs_are_the_fp8_rounded_model_s(quantization, tiny_model):
    path = tiny_model("gpt_oss")
    engine = LLMEngine(path, _config(quantization=quantization))
    layers = engine.model.args.num_layers
    assert engine.model.fp8.modes() == {"emulated": 3 * layers}  # qkv_proj, o_proj, experts
    reference = gpt_oss_fp8_hf_model(path, "channel" if quantization == "fp8" else "block")
    outs = engine.generate(PROMPTS, greedy(8))
    assert_follows(reference, PROMPTS, outs, 8)
    # The experts are rounded: the engine's expert weights are not the unquantized model's.
    plain = LLMEngine(path, _config()).model.model.layers[0].mlp.experts
    ours = engine.model.model.layers[0].mlp.experts
    assert not torch.equal(ours.gate_up_proj, plain.gate_up_proj)
    assert not torch.equal(ours.down_proj, plain.down_proj)
    assert torch.equal(ours.gate_up_proj_bias, plain.gate_up_proj_bias)


def test_gpt_oss_mxfp4_sync_rounds_as_the_dense_sync_of_its_weights(tiny_model):
    """Experts synced as MXFP4 ``_blocks`` / ``_scales`` halves (layer 0's in a first bucket, the rest in a
    second; a tensor's two halves share a bucket, as ``gpt_oss.load_weights`` needs) end as the same
    FP8-rounded weights as the dense (transformers-layout) tensors they dequantize to."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = tiny_model("gpt_oss")
    packed, dense = (LLMEngine(path, _config(quantization="fp8")) for _ in range(2))
    gen = torch.Generator().manual_seed(3)
    halves, tensors = [], []
    for name, param in dense.model.named_parameters():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        experts, out, inp = param.shape  # ours: output-major
        blocks = torch.randint(0, 256, (experts, out, inp // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(118, 124, (experts, out, inp // 32), dtype=torch.uint8, generator=gen)
        halves += [(f"{name}_blocks", blocks), (f"{name}_scales", scales)]
        tensors.append((name, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)))
        if name.endswith("gate_up_proj"):  # transformers' [E, H, 2I] holds the interleaved columns as-is
            assert tensors[-1][1].shape == (experts, inp, out)
    packed.update_weights([(n, t) for n, t in halves if ".layers.0." in n])
    packed.update_weights([(n, t) for n, t in halves if ".layers.0." not in n])
    dense.update_weights(tensors)
    want = dict(dense.model.named_parameters())
    for name, param in packed.model.named_parameters():
        assert torch.equal(param, want[name]), name
    assert _outputs(packed) == _outputs(dense)


@torch.no_grad()
def plain_linears_fp8_hf_model(path, granularity: str, leaves: tuple[str, ...]):
    """transformers' model of ``path`` with its decoder layers' ``nn.Linear``s named ``leaves`` rounded
    through FP8 (each alone: the family packs none), nothing else."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in leaves:
            module.weight.copy_(quantize_dequantize(module.weight, granularity))
    return model


def test_gemma4_greedy_tokens_and_logprobs_are_the_fp8_rounded_model_s(tiny_model):
    """Gemma 4's unpacked projections (per layer kind's widths; KV-shared layers have no k/v), rounded; the
    per-layer-embedding projections keep the model dtype, as in the reference."""
    path = tiny_model("gemma4_text")
    engine = LLMEngine(path, _config(quantization="fp8"))
    shared = sum(i != s for i, s in enumerate(engine.model.args.kv_sources))
    assert engine.model.fp8.modes() == {"emulated": 7 * engine.model.args.num_layers - 2 * shared}
    reference = plain_linears_fp8_hf_model(path, "channel", type(engine.model).fp8_linears)
    eos = reference.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, greedy(8)), strict=True):
        tokens = out.outputs[0].token_ids
        hf_tokens = hf_greedy(reference, prompt, 8)  # transformers stops at an EOS, the engine goes on
        assert tokens[: len(hf_tokens)] == hf_tokens and (len(hf_tokens) == 8 or hf_tokens[-1] in eos)
        want = hf_logprobs(reference, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(out.outputs[0].logprobs, want.tolist(), strict=True)) < 1e-4
    plain = LLMEngine(path, _config()).model.model.layers[0]
    ours = engine.model.model.layers[0]
    assert not torch.equal(ours.self_attn.q_proj.weight, plain.self_attn.q_proj.weight)
    assert torch.equal(ours.per_layer_projection.weight, plain.per_layer_projection.weight)


def test_deepseek_v3_greedy_tokens_and_logprobs_are_the_fp8_rounded_model_s(tiny_model):
    """MLA's q_a/q_b and kv_a projections, o_proj, the dense MLP, shared and routed experts rounded;
    ``kv_b_proj`` (absorbed into the latent attention, which reads its weight) keeps the model dtype."""
    from tests.rollout.test_fp8_engine import fp8_hf_model

    path = tiny_model("deepseek_v3")
    engine = LLMEngine(path, _config(quantization="fp8"))
    attention = engine.model.model.layers[0].self_attn
    paths = set(engine.model.fp8.targets)
    assert "model.layers.0.self_attn.q_a_proj" in paths and "model.layers.0.self_attn.kv_b_proj" not in paths
    plain = LLMEngine(path, _config()).model.model.layers[0].self_attn
    assert torch.equal(attention.kv_b_proj.weight, plain.kv_b_proj.weight)
    assert not torch.equal(attention.kv_a_proj_with_mqa.weight, plain.kv_a_proj_with_mqa.weight)
    reference = fp8_hf_model(path, "channel", keep=("kv_b_proj",))
    # a prompt longer than a decode: the expanded prefill and the latent (absorbed) decode both run
    assert_follows(reference, PROMPTS, engine.generate(PROMPTS, greedy(8)), 8)


def test_deepseek_v3_fp8_is_refused_on_cuda_only_with_its_reason():
    """DeepSeek-V3's FP8 engine disagreed with a fresh one after a weight sync on the H200
    (``fp8_cuda_refused``): refused on CUDA in one line, before a model loads (the engine's config check and
    ``tidal ppo``'s both call ``registry_family_problem`` with the engines' device); the CPU's emulation,
    tested above, stays. Other families are not refused."""
    from tidal.rollout.engine.config import EngineConfig, family_problem
    from tidal.rollout.quant.linear import registry_family_problem

    refusal = registry_family_problem("deepseek_v3", torch.device("cuda"))
    assert refusal.startswith(
        "--rollout_quantization fp8 is refused for 'deepseek_v3' on CUDA: after a weight"
    )
    assert "\n" not in refusal
    assert registry_family_problem("deepseek_v3", torch.device("cpu")) is None
    assert registry_family_problem("deepseek_v3") is None  # no device given: the loader check only
    assert registry_family_problem("qwen3_moe", torch.device("cuda")) is None
    assert family_problem(EngineConfig(device="cuda", quantization="fp8"), "deepseek_v3") == refusal
    assert family_problem(EngineConfig(device="cpu", quantization="fp8"), "deepseek_v3") is None


def _outputs(engine):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in engine.generate(PROMPTS, greedy(4))]


@pytest.mark.parametrize("family", sorted(VISION_FAMILIES))
def test_vision_families_quantize_the_language_model_only_and_syncs_reround_it(family, tmp_path):
    """The language model's projections and experts are rounded, the vision tower keeps the checkpoint's
    weights, and a sync of the checkpoint's own tensors (vision and language, through the family's
    loader) gives the fresh load's weights bit for bit (an untraced sync would leave them unrounded)."""
    from safetensors.torch import load_file

    from tidal.testing import build_tiny_vlm

    path = build_tiny_vlm(tmp_path / family, family)
    engine = LLMEngine(path, _config(quantization="fp8"))
    model = engine.model
    assert model.fp8.targets and not any(p.startswith("visual.") for p in model.fp8.targets)
    state = load_file(str(path / "model.safetensors"))
    params = dict(model.named_parameters())
    ours = {model._our_name(name): tensor for name, tensor in state.items()}
    vision = [name for name in ours if name.startswith("visual.") and name in params]
    assert vision and all(torch.equal(params[name], ours[name]) for name in vision)
    rounded = [f"{p}.weight" for p in model.fp8.targets if f"{p}.weight" in ours]
    assert rounded and all(not torch.equal(params[name], ours[name]) for name in rounded)
    before = {name: param.clone() for name, param in params.items()}
    engine.update_weights(list(state.items()))
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
