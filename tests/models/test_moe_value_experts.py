"""MoE critic / reward models (``AutoModelForSequenceClassification``) on the trainer's MoE experts
(``tidal.models.moe_experts``): float32 values and gradients bit-equal to transformers' grouped forward,
and ``load_value_model`` switching a MoE family to them (bf16 grouped GEMMs under bf16 autocast)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tidal.config import ModelConfig
from tidal.models.moe_experts import TRAINER_EXPERTS, use_trainer_experts
from tidal.models.moe_routing import router_modules
from tidal.models.value_model import load_value_model
from tidal.testing.tiny import build_tiny_model, tiny_config

CPU = torch.device("cpu")
IDS = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
MASK = torch.ones_like(IDS)


def _values_and_grads(model, autocast=None):
    """Per-token values and every parameter's gradient of one forward/backward (fresh gradients)."""
    model.zero_grad(set_to_none=True)
    with autocast or contextlib.nullcontext():
        values = model(input_ids=IDS, attention_mask=MASK)
    values = values.logits if hasattr(values, "logits") else values
    values.float().square().mean().backward()
    return values.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_value_model_float32_equals_transformers_grouped_mm(family):
    torch.manual_seed(0)
    config = tiny_config(family, num_labels=1, pad_token_id=0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    assert model.config._experts_implementation == "grouped_mm"  # transformers' default
    values, grads = _values_and_grads(model)
    use_trainer_experts(model)
    assert model.config._experts_implementation == TRAINER_EXPERTS
    values2, grads2 = _values_and_grads(model)
    assert torch.equal(values, values2)
    assert grads.keys() == grads2.keys()
    assert all(torch.equal(grads[name], grads2[name]) for name in grads)


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


def test_load_value_model_runs_moe_experts_in_the_autocast_dtype(tmp_path, grouped_mm_operands):
    """The critic / reward model of a tiny Qwen3-MoE: switched, its values equal the float32 forward of
    transformers' own experts, and under bf16 autocast every expert GEMM takes bf16 operands (the float32
    master weights untouched)."""
    folder = build_tiny_model(tmp_path / "moe", "qwen3_moe", seed=0)
    critic = load_value_model(ModelConfig(pretrain=str(folder)), CPU)
    assert critic.config._experts_implementation == TRAINER_EXPERTS
    values, _ = _values_and_grads(critic)
    critic.set_experts_implementation("grouped_mm")
    reference, _ = _values_and_grads(critic)
    assert torch.equal(values, reference)
    critic.set_experts_implementation(TRAINER_EXPERTS)
    grouped_mm_operands.clear()
    _values_and_grads(critic, torch.autocast("cpu", dtype=torch.bfloat16))
    assert grouped_mm_operands == [(torch.bfloat16, torch.bfloat16)] * (2 * len(router_modules(critic)))
    assert critic.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
