"""Session-wide fixtures: tiny offline models, and an environment with no network and no W&B login."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray's memory monitor counts the page cache as used memory where no cgroup limit is set (ray-project/ray
# #59796, open): after minutes of tests reading files, it once killed test_ray's workers at "22.7 of 23.5
# GB used" on the 24 GiB CI machine (once in six suite runs). The kernel's OOM killer still guards.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")


def pytest_configure(config):
    """One torch thread: tiny models gain nothing from two, and two threads on a shared 2-core machine
    (parallel test processes, gloo workers) oversubscribe it and slow small matmuls ~50x."""
    import torch

    torch.set_num_threads(1)


# Tests that start several processes (torchrun or fork-launched ranks, Ray clusters, engine workers) or
# time signals and kills: under ``make test`` (pytest-xdist, two workers, ``--dist loadscope``) they are one
# scope, so one worker runs them one after another while the other takes the single-process tests (one
# core each: ``pytest_configure``). Two multi-rank launches at once would oversubscribe two cores, and two
# Ray clusters on one machine find each other; one launch beside a single-process test fills the cores.
ONE_AT_A_TIME = (
    "tests/distributed/",
    "tests/reliability/",
    "tests/bench/test_ring_sft.py",
    "tests/bench/test_rl_placement.py",
    "tests/checkpoint/test_export_distributed.py",
    "tests/models/test_ring_attention.py",
    "tests/agents/test_endpoint_rl.py",
    "tests/logging/test_logging_wandb.py",
    "tests/rollout/test_tp_",
    "tests/rollout/test_async_scheduling.py",
    "tests/trainers/ppo/test_exact_rl.py",
    "tests/trainers/ppo/test_gae_1vN.py",
    "tests/trainers/test_eval_share.py",
    "tests/trainers/test_ppo_critic_placement.py",
    "tests/trainers/test_ppo_engines.py",
    "tests/trainers/test_ppo_roles.py",
    "tests/trainers/test_preference_distributed.py",
    "tests/trainers/test_ring",
    "tests/trainers/test_teacher_placement.py",
    "tests/trainers/test_vlm_engines.py",
)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is installed
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with the ``ONE_AT_A_TIME`` tests as one scope (other tests: one per module).
    (``--dist loadgroup`` with ``xdist_group`` marks would say the same, but pytest-xdist 3.8 under pytest
    9 no longer groups them.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneAtATime(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "one-at-a-time" if nodeid.startswith(ONE_AT_A_TIME) else super()._split_scope(nodeid)

    return OneAtATime(config, log)


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
