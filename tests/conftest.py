"""Session-wide fixtures: tiny offline models, and an environment with no network and no W&B login."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_configure(config):
    """One torch thread: tiny models gain nothing from two, and two threads on a shared 2-core machine
    (parallel test processes, gloo workers) oversubscribe it and slow small matmuls ~50x."""
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu``-marked tests on machines without CUDA."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random-init Llama-family model folder (with tokenizer)."""
    from tidal.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A tiny random-init Qwen2-family model folder (tied embeddings, qkv bias)."""
    from tidal.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=0)
