"""One flags → ``EngineConfig`` mapping serves RL and ``tidal generate``/``chat``; its dtype rule."""

from __future__ import annotations

import pytest

from tidal.config import ConfigError
from tidal.config.engine import engine_config, rollout_engine_config
from tidal.config.rl import RolloutConfig
from tidal.inference.config import PolicyConfig


def test_rl_engine_runs_auto_dtype_and_reads_the_vllm_flags():
    cfg = RolloutConfig(prompt_max_len=8, generate_max_len=4, vllm_generate_batch_size=3,
                        vllm_gpu_memory_utilization=0.25, enforce_eager=True)  # fmt: skip
    engine = rollout_engine_config(cfg, "cpu", 7)
    # --vllm_generate_batch_size is the prompts of a generation call (OpenRLHF's meaning), not max_num_seqs
    assert (engine.dtype, engine.max_num_seqs, engine.max_model_len) == ("auto", 256, 12)
    assert (engine.gpu_memory_utilization, engine.device, engine.seed, engine.enforce_eager) == (
        0.25,
        "cpu",
        7,
        True,
    )
    assert rollout_engine_config(RolloutConfig(), "auto", 0).max_num_seqs == 256
    # a prompt's samples are scheduled together: more of them than 256 raise the cap
    assert rollout_engine_config(RolloutConfig(n_samples_per_prompt=300), "cpu", 0).max_num_seqs == 300
    assert rollout_engine_config(RolloutConfig(eval_n_samples_per_prompt=512), "cpu", 0).max_num_seqs == 512


@pytest.mark.parametrize(("flag", "dtype"), [("auto", "auto"), ("bf16", "bfloat16"), ("fp32", "float32")])
def test_generate_maps_its_param_dtype_through_the_same_function(flag, dtype):
    policy = PolicyConfig(pretrain="m", param_dtype=flag, max_num_seqs=4, max_model_len=64)
    assert policy.engine_config(seed=1) == engine_config(
        max_num_seqs=4, max_model_len=64, gpu_memory_utilization=0.5, seed=1, param_dtype=flag
    )
    assert policy.engine_config(seed=1).dtype == dtype


def test_engine_rejections_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="^gpu_memory_utilization"):
        engine_config(max_num_seqs=1, max_model_len=None, gpu_memory_utilization=1.5, seed=0)


def test_an_engine_knob_declared_on_its_flag_reaches_the_engine():
    """Each ``arg(..., engine=<field>)`` of RolloutConfig names an EngineConfig field and sets it, with no
    other list to update (a knob flipped from its default shows up in the engine's config)."""
    import dataclasses

    from tidal.config.engine import engine_knobs
    from tidal.rollout import EngineConfig

    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    knobs = engine_knobs(RolloutConfig())
    assert set(knobs) <= engine_fields
    assert {"enforce_eager", "record_routing", "tp_size", "enable_prefix_caching", "exact_logprobs"} <= set(
        knobs
    )
    flipped = RolloutConfig(enforce_eager=True, moe_router_replay=True, exact_logprobs=True)
    engine = rollout_engine_config(flipped, "cpu", 0)
    assert (engine.enforce_eager, engine.record_routing, engine.exact_logprobs) == (True, True, True)
    assert rollout_engine_config(RolloutConfig(vllm_tensor_parallel_size=2), "cpu", 0).tp_size == 2
    # tidal generate/chat declare theirs the same way
    assert PolicyConfig(pretrain="m", enable_prefix_caching=True).engine_config(seed=0).enable_prefix_caching
    assert PolicyConfig(pretrain="m", tp_size=2).engine_config(seed=0).tp_size == 2


def test_a_knob_is_not_an_argparse_keyword():
    import argparse

    from tidal.config.args import add_config_group

    parser = argparse.ArgumentParser()
    add_config_group(parser, RolloutConfig, "rollout")  # would raise on an unknown add_argument keyword
    assert parser.parse_args(["--moe_router_replay"]).moe_router_replay
