"""OpenRLHF scripts' launcher and later-version flags: ``--local_rank`` on every command (deepspeed's
launcher appends it), HEAD's ``--data.max_len`` budget, and v0.9.2's async agent script's
``--async_train --colocate_all_models --deepspeed_enable_sleep`` with OpenRLHF's meaning."""

from __future__ import annotations

import importlib

import pytest

from tidal.cli import main, train_ppo
from tidal.config.args import ConfigError
from tidal.config.placement import separate_engines

PPO = ["--pretrain", "m", "--prompt_data", "d", "--remote_rm_url", "r.py"]


@pytest.mark.parametrize("command", sorted(main.COMMANDS))
def test_every_command_takes_local_rank(command):
    parser = importlib.import_module(main.COMMANDS[command][0]).build_parser()
    action = parser._option_string_actions["--local_rank"]
    assert (action.default, action.type) == (-1, int) and "LOCAL_RANK" in action.help


def test_batch_inference_runs_past_local_rank(tmp_path):
    """``deepspeed --module openrlhf.cli.batch_inference ... --local_rank=0`` parses to the same run."""
    from tidal.cli import batch_inference

    argv = ["--pretrain", "m", "--dataset", "d", "--output_path", str(tmp_path / "o.jsonl")]
    argv, _ = batch_inference.split_eval_task(["--eval_task", "generate_vllm", *argv, "--local_rank=0"])
    ns = batch_inference.build_parser().parse_args(argv)
    assert (ns.pretrain, ns.local_rank) == ("m", 0)


def _rollout(*argv):
    return train_ppo.parse_run([*PPO, *argv]).rollout


def test_head_max_len_alone_bounds_prompt_and_response():
    """HEAD has no prompt limit: ``--data.max_len 1024`` lets a prompt take 1023 tokens and each response
    what its prompt leaves (the executors cap new tokens at total_len - prompt length)."""
    r = _rollout("--data.max_len", "1024")
    assert (r.prompt_max_len, r.generate_max_len, r.total_len) == (1023, 1023, 1024)
    r = _rollout("--data.max_len", "512", "--rollout.max_new_tokens", "64")  # HEAD's cap on top
    assert (r.prompt_max_len, r.generate_max_len, r.total_len) == (511, 64, 512)
    r = _rollout("--max_len", "512", "--max_new_tokens", "100")  # v0.10's flat spellings
    assert (r.generate_max_len, r.total_len) == (100, 512)


def test_v0_9_2_lengths_are_unchanged():
    r = _rollout()
    assert (r.prompt_max_len, r.generate_max_len, r.max_len, r.total_len) == (1024, 1024, None, 2048)
    r = _rollout("--prompt_max_len", "100", "--generate_max_len", "50", "--max_len", "120")
    assert (r.prompt_max_len, r.generate_max_len, r.total_len) == (100, 50, 120)
    with pytest.raises(
        ConfigError, match="--max_len 100 leaves no room for a response after --prompt_max_len 100"
    ):
        _rollout("--prompt_max_len", "100", "--max_len", "100")


def test_the_response_budget_is_what_the_prompt_leaves():
    from tidal.agents.single_turn import _prompt_params
    from tidal.rollout.sampling_params import SamplingParams

    r = _rollout("--data.max_len", "1024")
    params = SamplingParams(max_new_tokens=r.generate_max_len)
    assert _prompt_params(params, 0, 1000, r.total_len).max_new_tokens == 24
    assert _prompt_params(params, 0, 10, r.total_len).max_new_tokens == 1014


ASYNC_SCRIPT = [
    "--async_train",
    "--colocate_all_models",
    "--deepspeed_enable_sleep",
]  # v0.9.2's agent async script


def test_async_with_colocated_models_and_deepspeed_sleep_is_accepted():
    run = train_ppo.parse_run([*PPO, *ASYNC_SCRIPT])
    assert run.placement.async_train and run.placement.deepspeed_enable_sleep


def test_async_colocates_only_the_trained_models():
    """OpenRLHF: "Using --colocate_all_models in async RLHF only colocates DeepSpeed models"; the engines
    generate while the models train, so --vllm_num_engines puts them on devices of their own."""
    run = train_ppo.parse_run([*PPO, *ASYNC_SCRIPT, "--vllm_num_engines", "1"])
    assert separate_engines(run.placement, run.rollout.vllm_num_engines)
    sync = train_ppo.parse_run([*PPO, "--colocate_all_models", "--vllm_num_engines", "1"])
    assert not separate_engines(sync.placement, sync.rollout.vllm_num_engines)


def test_async_with_vllm_sleep_is_refused_as_openrlhf_does():
    with pytest.raises(ConfigError) as info:
        train_ppo.parse_run([*PPO, *ASYNC_SCRIPT, "--vllm_enable_sleep"])
    assert str(info.value).splitlines() == [
        "--async_train generates while training, so the engine never sleeps: drop --vllm_enable_sleep "
        "(--deepspeed_enable_sleep still offloads the trained models between their updates)"
    ]


def test_the_async_agent_scripts_engine_flags_run(tiny_llama, tmp_path):
    """v0.9.2's async agent script's engine flags, and HEAD's --data.max_len, on a tiny two-rollout run
    (on the CPU the offload has nothing to move: this shows the combination trains end to end)."""
    import json

    from tidal.trainers.ppo import run_ppo

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(8))
    )
    reward = tmp_path / "reward_func.py"
    reward.write_text("from tidal.testing.tasks import addition_reward as reward_func\n")
    history = run_ppo(train_ppo.parse_run([
        "--pretrain", str(tiny_llama), "--prompt_data", str(prompts), "--input_key", "prompt", "--label_key",
        "label", "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm", "--n_samples_per_prompt",
        "2", "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "8",
        "--data.max_len", "16", "--rollout.max_new_tokens", "4", "--init_kl_coef", "0", "--save_path",
        str(tmp_path / "out"), "--ckpt_path", str(tmp_path / "ckpt"), *ASYNC_SCRIPT, "--local_rank=0",
    ]))  # fmt: skip
    assert len(history) == 2 and all(h["response_length"] <= 4 for h in history)
