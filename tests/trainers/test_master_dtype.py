"""``--master_dtype bf16``: SFT trains with weights, gradients and AdamW moments stored in bf16 (on the CPU
under bf16 autocast, ``--param_dtype bf16``) and resumes from its checkpoint exactly; GRPO runs with a bf16
reference, the engine colocated and asleep between phases, and weight syncs; bf16 storage is refused in
one line where the compute dtype is not bf16."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests.trainers.test_sft import flags as sft_flags
from tidal.cli.train_sft import parse_run
from tidal.config import ConfigError
from tidal.models import load_causal_lm
from tidal.testing import AdditionTask
from tidal.trainers import loop as loop_module
from tidal.trainers.sft import run_sft


@pytest.fixture(scope="module")
def addition_file(tmp_path_factory):
    return AdditionTask(digits=2).write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", 64)


def flags(model, data, out, *extra):
    """``test_sft``'s SFT flags on 64 samples, micro-batches of 8, bf16 compute and bf16 storage,
    a checkpoint every 2 steps over 2 epochs (later flags win)."""
    return sft_flags(model, data, out, "--micro_train_batch_size", "8", "--max_samples", "64",
                     "--param_dtype", "bf16", "--master_dtype", "bf16", "--save_steps", "2",
                     "--max_epochs", "2", "--logging_steps", "1", *extra)  # fmt: skip


def test_bf16_master_trains_stores_bf16_and_resumes_exactly(tiny_qwen2, addition_file, tmp_path, crash_after):
    seen = {}
    step = loop_module.SupervisedTrainer.train_step

    def grads(optimizer, args, kwargs):  # right before AdamW steps (the loop frees them after)
        seen["grads"] = {
            p.grad.dtype for g in optimizer.param_groups for p in g["params"] if p.grad is not None
        }

    def recording(self, samples):
        if "params" not in seen:
            self.opt.optimizer.register_step_pre_hook(grads)
        out = step(self, samples)
        seen["params"] = {p.dtype for p in self.opt.model.parameters()}
        seen["moments"] = {
            v.dtype for s in self.opt.optimizer.state.values() for k, v in s.items() if k != "step"
        }
        return out

    loop_module.SupervisedTrainer.train_step = recording
    try:
        full = run_sft(parse_run(flags(tiny_qwen2, addition_file, tmp_path / "full")))
    finally:
        loop_module.SupervisedTrainer.train_step = step
    assert seen == {"params": {torch.bfloat16}, "grads": {torch.bfloat16}, "moments": {torch.bfloat16}}
    assert len(full) == 8
    assert full[-1]["loss"] < 0.7 * full[0]["loss"], [h["loss"] for h in full]

    restore = crash_after(loop_module.SupervisedTrainer, "train_step", 5)  # checkpoint at step 4
    with pytest.raises(KeyboardInterrupt):
        run_sft(parse_run(flags(tiny_qwen2, addition_file, tmp_path / "cut")))
    restore()
    resumed = run_sft(parse_run(flags(tiny_qwen2, addition_file, tmp_path / "cut", "--load_checkpoint")))
    assert [h["step"] for h in resumed] == [5, 6, 7, 8]
    assert [h["loss"] for h in resumed] == [h["loss"] for h in full[4:]]  # bf16 state restored bit for bit


def test_bf16_master_needs_bf16_compute(tiny_qwen2, addition_file, tmp_path):
    run = parse_run(flags(tiny_qwen2, addition_file, tmp_path, "--param_dtype", "auto"))
    with pytest.raises(
        ConfigError, match=r"--master_dtype bf16 needs bf16 compute.*auto computes in float32"
    ):
        load_causal_lm(run.model, torch.device("cpu"))  # auto is float32 on the CPU
    with pytest.raises(ConfigError, match="use --param_dtype bf16 \\(not fp32\\)"):
        parse_run(flags(tiny_qwen2, addition_file, tmp_path, "--param_dtype", "fp32"))


def test_bf16_master_grpo_with_reference_sleep_and_weight_sync(tiny_qwen2, tmp_path):
    from tests.trainers.test_ppo import rl_flags, write_echo_data
    from tidal.cli.train_ppo import parse_run as parse_ppo
    from tidal.trainers.ppo import run_ppo

    data = write_echo_data(tmp_path / "echo")
    history = run_ppo(parse_ppo(rl_flags(
        tiny_qwen2, data, tmp_path, "--advantage_estimator", "group_norm", "--max_samples", "32",
        "--init_kl_coef", "0.01", "--param_dtype", "bf16", "--master_dtype", "bf16", "--colocate_all_models",
        "--vllm_enable_sleep", "--deepspeed_enable_sleep",
    )))  # fmt: skip
    assert len(history) == 2 and all(h["nonfinite_steps"] == 0 for h in history)
    # the reference loads in bf16 like the policy (frozen_copy_config): the same log-probs at step 1
    assert history[0]["kl"] == 0.0
    with safe_open(str(tmp_path / "final" / "model.safetensors"), "pt") as saved:
        assert {saved.get_tensor(k).dtype for k in saved.keys()} == {torch.bfloat16}  # noqa: SIM118
