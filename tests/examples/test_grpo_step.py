"""``examples/grpo_step.py`` takes the step ``tidal ppo --advantage_estimator group_norm`` takes.

The example and one rollout step of ``tidal ppo`` (through its public entry points only:
``tidal.cli.train_ppo.parse_run`` and ``tidal.trainers.ppo.run_ppo``) start from the same tiny model,
prompts, seed and settings (``GRPOConfig.flags()``); they must sample the same responses (equal
rewards), compute the same loss and gradient norm, and end with the same weights after one AdamW step.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tidal.cli.train_ppo import parse_run
from tidal.testing import AdditionTask
from tidal.trainers.ppo import run_ppo

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_step.py"


def load_example():
    """Import the example by path (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("grpo_step_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_example_step_equals_one_tidal_ppo_step(tiny_llama, tmp_path):
    example = load_example()
    cfg = example.GRPOConfig()
    dataset = AdditionTask(seed=0).samples(cfg.prompts_per_step)  # exactly one rollout: one step
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in dataset))
    history = run_ppo(parse_run([
        "--pretrain", str(tiny_llama), "--prompt_data", str(data), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(EXAMPLE), "--save_path", str(tmp_path / "ppo"),
        "--ckpt_path", str(tmp_path / "ckpt"), *cfg.flags(),
    ]))  # fmt: skip
    assert len(history) == 1
    trainer = history[0]

    policy, reference, optimizer, engine = example.build(tiny_llama, cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    prompts, labels = example.pick_prompts(dataset, cfg)
    result = example.grpo_step(policy, reference, optimizer, engine, tokenizer, prompts, labels, cfg)

    assert (
        result.advantages.abs().sum() > 0
    )  # the step has a learning signal, so the comparison means something
    assert float(result.rewards.mean()) == pytest.approx(trainer["reward"], abs=1e-7)  # same samples
    assert result.loss == pytest.approx(trainer["policy/loss"], rel=1e-5, abs=1e-8)
    assert result.grad_norm == pytest.approx(trainer["grad_norm"], rel=1e-5)

    exported = load_file(str(tmp_path / "ppo" / "model.safetensors"))
    weights, before = policy.state_dict(), reference.state_dict()
    assert set(exported) <= set(weights)
    moved = max(float((weights[name] - before[name]).abs().max()) for name in exported)
    assert moved > cfg.learning_rate / 2  # AdamW's first step moves weights by about the learning rate
    for name, tensor in exported.items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-6, rtol=0, msg=name)
