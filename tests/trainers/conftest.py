"""Fixtures shared by the trainer tests: a reference model that differs from the tiny policy."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def perturbed_llama(tiny_llama, tmp_path_factory):
    """``tiny_llama`` with 0.05 x N(0, 1) (seed 0) added to every weight: a DPO/KTO reference that differs
    from the policy, so the log-ratios (and KTO's KL reference point) are not all zero."""
    import torch
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("perturbed_llama")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return path
