"""The CUDA modes' bookkeeping of FP8 rollouts, on the CPU: the linear layers' ``scaled_mm`` mode and the
experts' ``triton_fp8`` mode hold e4m3 buffers and scales (their model-dtype weights freed) that every
weight sync quantizes its tensors into, in place (the addresses captured CUDA graphs read). Here their GEMMs are stood in for by the dequantized products, so the
engine must generate exactly what the emulated engine does, before and after a sync.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tests.rollout.reference import PROMPTS, cpu_config, greedy
from tests.rollout.test_fp8_engine import FP8_FAMILIES
from tidal.rollout import LLMEngine
from tidal.rollout.models import moe
from tidal.rollout.quant import linear
from tidal.rollout.quant.fp8 import dequantize


def _cpu_gemm(x, q, scales, granularity):
    return F.linear(x, dequantize(q, scales, granularity, x.dtype))


def _cpu_experts(self, x, weights, ids):
    gate_up = dequantize(self.fp8_gate_up_proj, self.fp8_gate_up_proj_scale, "channel", x.dtype)
    down = dequantize(self.fp8_down_proj, self.fp8_down_proj_scale, "channel", x.dtype)
    return moe.unfused_expert_forward(x, gate_up, down, weights, ids, self.act)


def _take_cuda_modes(monkeypatch) -> None:
    """Every module takes its CUDA mode, with the stand-in GEMMs."""
    monkeypatch.setattr(linear, "scaled_mm_problem", lambda target, granularity: None)
    monkeypatch.setattr(linear, "experts_kernel_problem", lambda target, granularity: None)
    monkeypatch.setattr(linear, "fp8_linear", _cpu_gemm)
    monkeypatch.setattr(linear.Fp8ExpertsForward, "forward", _cpu_experts)


def _outputs(engine):
    outs = engine.generate(PROMPTS, greedy(8))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _per_expert(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """A state dict with stacked experts split into checkpoint-style per-expert tensors (the sync then
    updates each expert, its gate and its up rows apart)."""
    out = []
    for name, tensor in state.items():
        block, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":
            for e, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                out += [(f"{block}.{e}.gate_proj.weight", gate), (f"{block}.{e}.up_proj.weight", up)]
        elif kind == "down_proj" and block.endswith("experts"):
            out += [(f"{block}.{e}.down_proj.weight", t) for e, t in enumerate(tensor)]
        else:
            out.append((name, tensor))
    return out


def _buffers(engine) -> dict[str, int]:
    return {n: b.data_ptr() for n, b in engine.model.named_buffers() if ".fp8_" in n}


# 128-row blocks need packed parts of multiples of 128 rows (``scaled_mm_problem``): heads of 128
BLOCK_SHAPES = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
                "intermediate_size": 384}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "quantization", "overrides"),
    [("llama", "fp8_block", BLOCK_SHAPES), ("qwen3_moe", "fp8", {})],
)
def test_buffers_are_rewritten_in_place_and_generate_as_the_emulated_engine(
    family, quantization, overrides, tiny_model, monkeypatch
):
    old, new = tiny_model(family, seed=0, **overrides), tiny_model(family, seed=1, **overrides)
    emulated_old = _outputs(LLMEngine(old, cpu_config(quantization=quantization)))
    emulated_new = _outputs(LLMEngine(new, cpu_config(quantization=quantization)))
    _take_cuda_modes(monkeypatch)
    engine = LLMEngine(old, cpu_config(quantization=quantization))
    modes = engine.model.fp8.modes()
    assert set(modes) == ({"scaled_mm", "triton_fp8"} if family == "qwen3_moe" else {"scaled_mm"})
    assert _outputs(engine) == emulated_old
    addresses = _buffers(engine)
    assert addresses
    for target in engine.model.fp8.targets.values():  # the model-dtype weights are freed
        assert all(getattr(target.module, param).numel() == 0 for param in target.parts)
    # a sync in two buckets that cut the packed projections (and, for the MoE, the experts) apart
    weights = _per_expert(AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32).state_dict())
    first = {n for n, _ in weights if "q_proj" in n or "gate_proj" in n or ".experts.0." in n}
    engine.update_weights([(n, t) for n, t in weights if n in first])
    engine.update_weights([(n, t) for n, t in weights if n not in first])
    assert _buffers(engine) == addresses
    assert _outputs(engine) == emulated_new


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_every_family_s_sync_quantizes_into_the_buffers_a_fresh_load_fills(family, tiny_model, monkeypatch):
    """Each family's HF names (renames, packing, fused checkpoint projections, per-expert or stacked
    experts, shared experts) reach the buffers: after a sync they hold, bit for bit, a fresh FP8 engine's."""
    _take_cuda_modes(monkeypatch)
    old, new = tiny_model(family, seed=0), tiny_model(family, seed=1)
    engine = LLMEngine(old, cpu_config(quantization="fp8"))
    engine.update_weights(
        AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32).named_parameters()
    )
    fresh = LLMEngine(new, cpu_config(quantization="fp8"))
    assert "emulated" not in engine.model.fp8.modes()
    want = dict(fresh.model.named_buffers())
    for name, buffer in engine.model.named_buffers():
        if ".fp8_" in name:
            assert torch.equal(_raw(buffer), _raw(want[name])), name
    want = dict(fresh.model.named_parameters())
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, want[name]), name
