"""``tidal ppo --rollout_quantization fp8``: two GRPO steps with FP8 rollouts (emulated on the CPU) and TIS;
the engine's log-probs are the FP8 policy's and the trainer's float32, so ``rollout/logprob_mismatch``
shows the gap (it stays below 1e-3 without FP8: tests/rollout/grpo.py), and the refusals come before
anything loads."""

from __future__ import annotations

import math

import pytest
import torch

from tests.rollout.grpo import grpo_flags
from tidal.cli.train_ppo import main, parse_run
from tidal.trainers.ppo import run_ppo


def test_grpo_with_fp8_rollouts_trains_and_logs_the_mismatch(tiny_model, tmp_path):
    policy = tiny_model("qwen2")
    flags = grpo_flags(policy, tmp_path, "--rollout_quantization", "fp8", "--enable_vllm_is_correction")
    run = parse_run(flags)
    assert run.rollout.rollout_quantization == "fp8"
    history = run_ppo(run)
    assert len(history) == 2
    mismatch = [step["rollout/logprob_mismatch"] for step in history]
    assert all(math.isfinite(m) and 1e-3 < m < 0.5 for m in mismatch), mismatch
    assert all("policy/mismatch_clip_ratio" in step for step in history)  # TIS ran on the FP8 log-probs
    assert (tmp_path / "rl" / "final" / "model.safetensors").exists()


def test_grpo_with_an_fp8_kv_cache_trains_and_logs_the_mismatch(tiny_model, tmp_path):
    """``--rollout_kv_cache_dtype fp8`` alone (model-dtype weights): the engine's decode steps read rounded keys
    and values, so its log-probs move off the trainer's (measured: ~2.5e-3 a step, against ~2.5e-7 for the
    float32 engine with a float32 cache)."""
    policy = tiny_model("qwen2")
    flags = grpo_flags(policy, tmp_path, "--kv_cache_dtype", "fp8", "--enable_vllm_is_correction")
    run = parse_run(flags)
    assert run.rollout.rollout_kv_cache_dtype == "fp8"  # vLLM's spelling of the flag
    history = run_ppo(run)
    assert len(history) == 2
    mismatch = [step["rollout/logprob_mismatch"] for step in history]
    assert all(math.isfinite(m) and 1e-4 < m < 0.5 for m in mismatch), mismatch


def test_a_family_an_fp8_kv_cache_cannot_serve_is_refused_before_loading(tiny_model, tmp_path):
    from tidal.config import ConfigError
    from tidal.trainers.ppo.entry import check_models_before_loading

    run = parse_run(grpo_flags(tiny_model("gemma2"), tmp_path, "--rollout_kv_cache_dtype", "fp8"))
    with pytest.raises(
        ConfigError, match=r"^--rollout_kv_cache_dtype fp8: fp8_kv_cache is not supported for the gemma2"
    ):
        check_models_before_loading(run)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rollout_quantization", "int8"], "invalid choice: 'int8' (choose from 'none', 'fp8', 'fp8_block')"),
        (["--rollout_quantization", "fp8", "--exact_logprobs"], "--exact_logprobs cannot run with "
         "--rollout_quantization: the engine's log-probs are then the FP8 policy's, never bit-equal to the "
         "trainer's"),
        (["--rollout_quantization", "fp8_block", "--vllm_tensor_parallel_size", "2"],
         "--rollout_quantization needs --vllm_tensor_parallel_size 1"),
        (["--rollout_kv_cache_dtype", "fp16"], "invalid choice: 'fp16' (choose from 'auto', 'fp8')"),
        (["--kv_cache_dtype", "fp8", "--exact_logprobs"], "--exact_logprobs cannot run with "
         "--rollout_kv_cache_dtype fp8"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_in_one_line(extra, message, tmp_path, capsys):
    flags = grpo_flags(tmp_path / "no_model", tmp_path, *extra)
    with pytest.raises(SystemExit) as exc:
        main(flags)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_family_fp8_cannot_quantize_is_refused_before_loading(tiny_model, tmp_path):
    """gpt2 runs on the transformers fallback, which has no FP8; the engine's families with loaders of
    their own (DeepSeek-V3 here) are accepted."""
    from tidal.config import ConfigError
    from tidal.testing.tiny import build_tiny_fallback_model
    from tidal.trainers.ppo.entry import check_models_before_loading

    policy = build_tiny_fallback_model(tmp_path / "gpt2", "gpt2")
    run = parse_run(grpo_flags(policy, tmp_path, "--rollout_quantization", "fp8"))
    with pytest.raises(
        ConfigError, match=r"^--pretrain .*: FP8 rollouts \(fp8\) is not supported for the gpt2 "
    ):
        check_models_before_loading(run)
    deepseek = parse_run(grpo_flags(tiny_model("deepseek_v3"), tmp_path, "--rollout_quantization", "fp8"))
    check_models_before_loading(deepseek)
    # where the engines run on CUDA it is refused (DeepseekV3ForCausalLM.fp8_cuda_refused)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(
            ConfigError, match=r"^--rollout_quantization fp8 is refused for 'deepseek_v3' on CUDA"
        ):
            check_models_before_loading(deepseek)
