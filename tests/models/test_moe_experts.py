"""The trainer's MoE experts (``tidal.models.moe_experts``): transformers' grouped forward, bit-identical in
float32, with bf16 operands under bf16 autocast, selected for MoE models by ``load_causal_lm``."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.config import ModelConfig
from tidal.config.distributed import DistributedConfig
from tidal.distributed import World
from tidal.models import load_causal_lm
from tidal.models.frozen import load_frozen
from tidal.models.moe_experts import TRAINER_EXPERTS, use_trainer_experts
from tidal.models.moe_routing import router_modules
from tidal.testing.tiny import build_tiny_model, tiny_config

CPU = torch.device("cpu")
BF16_AUTOCAST = torch.autocast("cpu", dtype=torch.bfloat16)


def _tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)


def _forward_backward(model, ids: torch.Tensor, autocast=None):
    """Logits and every parameter's gradient of one forward/backward (fresh gradients)."""
    model.zero_grad(set_to_none=True)
    with autocast or contextlib.nullcontext():
        logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture
def grouped_mm_operands(monkeypatch):
    """The (input, weight) dtypes of every grouped GEMM that reaches torch."""
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    grouped_mm = torch.nn.functional.grouped_mm

    def spy(mat_a, mat_b, *args, **kwargs):
        seen.append((mat_a.dtype, mat_b.dtype))
        return grouped_mm(mat_a, mat_b, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "grouped_mm", spy)
    return seen


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_float32_forward_and_backward_equal_transformers_grouped_mm(family):
    model = _tiny(family)
    assert model.config._experts_implementation == "grouped_mm"  # transformers' default
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    logits, grads = _forward_backward(model, ids)
    use_trainer_experts(model)
    assert model.config._experts_implementation == TRAINER_EXPERTS
    logits2, grads2 = _forward_backward(model, ids)
    assert torch.equal(logits, logits2)
    assert grads.keys() == grads2.keys()
    assert all(torch.equal(grads[name], grads2[name]) for name in grads)


def test_bf16_autocast_runs_the_grouped_gemms_in_bf16(grouped_mm_operands):
    model = _tiny("qwen3_moe")
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    _, fp32_grads = _forward_backward(model, ids)
    # transformers' default casts the inputs to the float32 master weights: the cause of issue #17.
    _forward_backward(model, ids, BF16_AUTOCAST)
    assert set(grouped_mm_operands) == {(torch.float32, torch.float32)}
    grouped_mm_operands.clear()

    use_trainer_experts(model)
    _, grads = _forward_backward(model, ids, BF16_AUTOCAST)
    # Two projections per MoE layer in the forward; the backward's GEMMs are autograd's, not this call.
    assert grouped_mm_operands == [(torch.bfloat16, torch.bfloat16)] * (2 * len(router_modules(model)))
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32  # the master weights are not touched
    for name in ("gate_up_proj", "down_proj"):  # gradients reach them, in float32, close to fp32's
        grad = grads[f"model.layers.0.mlp.experts.{name}"]
        reference = fp32_grads[f"model.layers.0.mlp.experts.{name}"]
        assert grad.dtype == torch.float32 and grad.abs().max() > 0
        assert torch.nn.functional.cosine_similarity(grad.flatten(), reference.flatten(), dim=0) > 0.98


def test_bf16_weights_without_autocast_stay_bf16(grouped_mm_operands):
    """Weights already in bf16 (FSDP2's all-gathered copies) need no cast and get none."""
    model = use_trainer_experts(_tiny("qwen3_moe").to(torch.bfloat16))
    with torch.no_grad():
        model(input_ids=torch.arange(12)[None])
    assert set(grouped_mm_operands) == {(torch.bfloat16, torch.bfloat16)}


@pytest.fixture(scope="module")
def tiny_moe_folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", seed=0)


def test_trainer_and_frozen_models_use_it_and_do_not_save_it(tiny_moe_folder, tiny_llama, tmp_path):
    policy = load_causal_lm(ModelConfig(pretrain=str(tiny_moe_folder)), CPU)
    assert policy.config._experts_implementation == TRAINER_EXPERTS
    reference = load_frozen(
        str(tiny_moe_folder), ModelConfig(pretrain=str(tiny_moe_folder)), True, DistributedConfig(), World(),
        "--ref_pretrain",
    )  # fmt: skip
    assert reference.model.config._experts_implementation == TRAINER_EXPERTS
    dense = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU)
    assert dense.config._experts_implementation != TRAINER_EXPERTS
    # A saved checkpoint loads in plain transformers: the choice is not written to config.json.
    policy.save_pretrained(str(tmp_path / "saved"))
    assert TRAINER_EXPERTS not in json.dumps(json.loads((tmp_path / "saved" / "config.json").read_text()))
