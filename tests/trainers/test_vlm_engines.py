"""RL with images on a rollout engine in a process of its own (``--vllm_num_engines 1`` without
``--colocate_all_models``): the prompts' ``ImageRef``s travel with their texts, the engine process makes
the pixels and returns them with the trajectories, and the weight sync sends the language model only
(``--freeze_visual_encoder``). A GAE run with a vision-language critic and packed samples then takes the
same steps as with the engine on the trainer's device, the second rollout on the synced weights."""

from __future__ import annotations

from tests.trainers.test_vlm_grpo import _flags
from tidal.cli.train_ppo import parse_run
from tidal.testing import build_tiny_vlm
from tidal.testing.tolerance import assert_same_steps
from tidal.trainers.ppo import run_ppo

KEYS = ("reward", "rollout/logprob_mismatch", "critic/loss", "policy/loss", "values/mean", "grad_norm")


def test_an_engine_process_generates_from_the_images_as_the_local_engine(tmp_path):
    vlm = build_tiny_vlm(tmp_path / "policy")
    flags = ["--advantage_estimator", "gae", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
             "--freeze_visual_encoder", "--packing_samples"]  # fmt: skip
    local = run_ppo(parse_run(_flags(vlm, tmp_path / "local", *flags)))
    separate = run_ppo(parse_run(_flags(vlm, tmp_path / "engine", *flags, "--vllm_num_engines", "1")))
    assert len(local) == 2
    assert max(step["rollout/logprob_mismatch"] for step in separate) < 1e-3  # step 2: after the sync
    assert_same_steps(local, separate, KEYS, n_terms=200_000)  # about the tiny VLM's parameter count
