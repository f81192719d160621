"""Partial rollouts (tidal.placement.partial): with no update during a rollout the samples are bit-equal to
plain async generation; an update posted mid-rollout lands between two engine steps, each token records
whether it came after it, the tokens before it are the plain run's, and the ones after come from the new
weights (the running sequences keep their KV cache)."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.cli.train_ppo import parse_run
from tidal.data.prompts import PromptSample
from tidal.models import load_tokenizer
from tidal.placement.partial import token_updates
from tidal.placement.rollout import LocalRollout

PROMPTS = [PromptSample(prompt=f"{i} fox", label=str(i)) for i in range(3)]
N, LENGTH = 2, 12


# on CUDA the engine runs its defaults (CUDA graphs, async scheduling: an update drops the step launched ahead)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def rollout(model, tmp_path, partial: bool, device: str = "cpu") -> LocalRollout:
    flags = ["--pretrain", str(model), "--prompt_data", str(tmp_path / "unused.jsonl"), "--n_samples_per_prompt",
             str(N), "--generate_max_len", str(LENGTH), "--prompt_max_len", "8", "--rollout_batch_size", "3",
             "--train_batch_size", "6", "--save_path", str(tmp_path / "final"), "--ckpt_path", str(tmp_path / "ck"),
             "--async_train", *(["--partial_rollout_enable"] if partial else [])]  # fmt: skip
    run = parse_run(flags)
    tok = load_tokenizer(str(model))
    return LocalRollout(
        str(model), tok, run.rollout, run.agent, torch.device(device), tok.pad_token_id, False, 0
    )


def test_token_updates_splits_the_tokens_at_each_update():
    assert token_updates([], 3) == [0, 0, 0]
    assert token_updates([(2, 1)], 5) == [0, 0, 1, 1, 1]
    assert token_updates([(1, 1), (3, 2)], 4) == [0, 1, 1, 2]
    assert token_updates([(6, 1)], 4) == [0, 0, 0, 0]  # the update came after its last token


@pytest.mark.parametrize("device", DEVICES)
def test_without_an_update_partial_rollouts_equal_plain_generation(tiny_qwen2, tmp_path, device):
    plain = rollout(tiny_qwen2, tmp_path, False, device).generate(PROMPTS, N, 1.0, seed=7)
    partial = rollout(tiny_qwen2, tmp_path, True, device).generate(PROMPTS, N, 1.0, seed=7)
    for a, b in zip(plain, partial, strict=True):
        assert a.token_ids == b.token_ids and a.rollout_logprobs == b.rollout_logprobs
        assert a.weight_updates is None and b.weight_updates == [0] * len(b.token_ids)


@pytest.fixture
def new_policy(tiny_qwen2):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    return model


@pytest.mark.parametrize("device", DEVICES)
def test_an_update_lands_between_engine_steps(tiny_qwen2, tmp_path, new_policy, device):
    plain = rollout(tiny_qwen2, tmp_path, False, device).generate(PROMPTS, N, 1.0, seed=7)
    role = rollout(tiny_qwen2, tmp_path, True, device)
    hook, calls, reached = role.partial._between_steps, [0], threading.Event()

    def held(groups):  # at the 4th step, wait until the trainer has posted its weights
        calls[0] += 1
        if calls[0] == 4:
            reached.set()
            with role.partial._cond:
                role.partial._cond.wait_for(lambda: role.partial._pending is not None)
        hook(groups)

    role.partial._between_steps = held
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("t", role.generate(PROMPTS, N, 1.0, seed=7)))
    thread.start()
    assert reached.wait(timeout=120)
    assert role.sync_weights(new_policy) > 0  # returns once the engine has the new weights
    thread.join(timeout=120)
    after = 0
    for a, b in zip(plain, out["t"], strict=True):
        start, updates = b.prompt_len, b.weight_updates[b.prompt_len :]
        old = updates.count(0)
        assert updates == [0] * old + [1] * (len(updates) - old)
        # before the update: the plain run's tokens and log-probs, bit for bit
        assert b.token_ids[: start + old] == a.token_ids[: start + old]
        assert b.rollout_logprobs[: start + old] == a.rollout_logprobs[: start + old]
        if len(updates) > old:  # after it: the new weights' log-probs (the stored ones are the engine's)
            after += 1
            assert b.rollout_logprobs[start + old] != a.rollout_logprobs[start + old]
    assert after > 0
    # the update reached the engine: a fresh rollout now samples from the new weights
    assert role.generate(PROMPTS, N, 1.0, seed=7)[0].rollout_logprobs != plain[0].rollout_logprobs


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--async_train", "--partial_rollout_enable"], "--partial_rollout_enable runs in one process"),
        (["--async_train", "--vllm_generate_batch_size", "6"], "over-sampling runs in one process"),
    ],
)
def test_several_processes_refuse_partial_rollouts_and_over_sampling(tiny_qwen2, tmp_path, extra, message):
    from tidal.config.args import ConfigError
    from tidal.distributed.world import World
    from tidal.placement.data_parallel import check_data_parallel

    run = parse_run(["--pretrain", str(tiny_qwen2), "--prompt_data", str(tmp_path / "p.jsonl"),
                     "--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--train_batch_size", "4",
                     "--save_path", str(tmp_path / "f"), "--ckpt_path", str(tmp_path / "c"), *extra])  # fmt: skip
    check_data_parallel(run, World(), None)  # one process: fine
    with pytest.raises(ConfigError, match=message):
        check_data_parallel(run, World(rank=0, world_size=2), None)
