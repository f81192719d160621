"""Fixtures for rollout tests: tiny HF models built once per session, and the HF models to compare with."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's spinning
    threads make each matmul up to 100x slower; restore the setting for other test folders."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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
