"""Fixtures for rollout tests: tiny HF models built once per session, and the HF models to compare with."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(family, seed=0, **config_overrides)`` -> path of a tiny HF folder (built once)."""
    from tidal.testing import build_tiny_model

    cache = {}

    def build(family: str = "llama", seed: int = 0, **overrides):
        key = (family, seed, repr(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny_{family}_{seed}")
            cache[key] = build_tiny_model(path, family, seed=seed, **overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def hf_model():
    """``hf_model(path)`` -> the transformers model of a folder, float32, eval mode (loaded once)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def load(path):
        if str(path) not in cache:
            cache[str(path)] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        return cache[str(path)]

    return load
