"""``tidal ppo`` on a family outside the engine's registry (a tiny hybrid Mamba, bamba): the rollout runs
on the transformers fallback and a GRPO step trains the policy; engine features the fallback lacks are
refused in one line before any model loads."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tidal.cli.train_ppo import parse_run
from tidal.config import ConfigError
from tidal.rollout import HFEngine
from tidal.testing.tiny import build_tiny_fallback_model
from tidal.trainers.ppo import run_ppo
from tidal.trainers.ppo.entry import check_models_before_loading

# The response's length in characters: a random-init policy's samples differ in it, so GRPO's group-normed
# advantages are not all zero (an addition reward would be 0 for every sample of a random policy).
LENGTH_REWARD = """
import torch

def reward_func(queries, prompts, labels, **kwargs):
    lengths = torch.tensor([float(len(q) - len(p)) for q, p in zip(queries, prompts)])
    return {"rewards": lengths, "scores": lengths}
"""


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    return build_tiny_fallback_model(tmp_path_factory.mktemp("tiny_bamba"), "bamba", seed=0)


def grpo_flags(model, tmp_path, *extra) -> list[str]:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(2)))
    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    return [
        "--pretrain", str(model), "--prompt_data", str(data), "--input_key", "prompt", "--label_key", "label",
        "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "2", "--rollout_batch_size", "2", "--train_batch_size", "4",
        "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4", "--generate_max_len", "4",
        "--prompt_max_len", "8", "--actor_learning_rate", "1e-2", "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
        "--temperature", "1.0", "--save_path", str(tmp_path / "final"), "--seed", "3", *extra,
    ]  # fmt: skip


def test_grpo_steps_on_a_fallback_family(bamba, tmp_path, monkeypatch):
    # Two rollouts: the second generates after the trained weights were copied into the fallback engine.
    synced = []
    update = HFEngine.update_weights
    monkeypatch.setattr(
        HFEngine, "update_weights", lambda self, named: synced.append(update(self, named)) or synced[-1]
    )
    history = run_ppo(parse_run(grpo_flags(bamba, tmp_path, "--num_episodes", "2")))
    assert len(history) == 2 and all(h["reward"] > 0 for h in history)
    assert synced and all(count == len(load_file(bamba / "model.safetensors")) for count in synced)
    before, after = (
        load_file(bamba / "model.safetensors"),
        load_file(tmp_path / "final" / "model.safetensors"),
    )
    assert set(before) == set(after)
    assert any(not before[name].equal(after[name]) for name in before)  # the step changed the policy


def test_fallback_family_refuses_prefix_caching(bamba, tmp_path):
    run = parse_run(grpo_flags(bamba, tmp_path, "--enable_prefix_caching"))
    with pytest.raises(
        ConfigError, match=r"^--pretrain .*: prefix_caching is not supported for the bamba family"
    ):
        check_models_before_loading(run)


def test_fallback_family_refuses_packing(bamba, tmp_path):
    run = parse_run(grpo_flags(bamba, tmp_path, "--packing_samples"))
    with pytest.raises(ConfigError, match=r"^--packing_samples: not supported for the bamba family outside"):
        check_models_before_loading(run)


def test_trainer_takes_full_logits_for_a_fallback_family(bamba):
    """The chunked log-prob head only takes registry families: bamba's log-probs come from its own forward."""
    from transformers import AutoModelForCausalLM

    from tidal.models.logprob_head import chunkable_head

    assert chunkable_head(AutoModelForCausalLM.from_pretrained(str(bamba))) is None
