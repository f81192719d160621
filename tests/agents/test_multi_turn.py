"""MultiTurnAgentExecutor on a tiny model: token-in-token-out, masks, log-probs, limits and errors."""

from __future__ import annotations

import pytest
import torch

from tidal.agents import AgentError, AgentInstanceBase, MultiTurnAgentExecutor
from tidal.rollout import SamplingParams

FEEDBACK = [" wrong, again:", " still wrong:", " ok"]


class ScriptedEnv(AgentInstanceBase):
    """Fixed feedback for two turns, then done with reward 1 (and the last feedback appended)."""

    def __init__(self):
        self.turn = 0
        self.seen = []

    async def step(self, states, **kwargs):
        self.seen.append(states)
        self.turn += 1
        done = self.turn == 3
        return {
            "rewards": torch.tensor(1.0) if done else 0.0,
            "scores": 0.5 if done else 0.0,
            "environment_feedback": FEEDBACK[self.turn - 1],
            "done": done,
            "extra_logs": {"turn": torch.tensor(float(self.turn))},
        }


def sp(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True, "seed": 7, **kw})


def test_token_in_token_out(spy, tokenizer, tiny_llama):
    [traj] = MultiTurnAgentExecutor(ScriptedEnv).run(spy, tokenizer, ["12+34="], ["46"], sp(), max_length=200)
    prompt_ids = tokenizer("12+34=")["input_ids"]
    assert len(spy.calls) == 3 and traj.num_turns == 3 and traj.finish_reason == "done"
    expected, mask, logprobs = list(prompt_ids), [0] * len(prompt_ids), [0.0] * len(prompt_ids)
    for (prompts, _, outputs), feedback in zip(spy.calls, FEEDBACK, strict=True):
        assert prompts == [expected]  # each turn continues from exactly the trajectory's ids
        action = outputs[0].outputs[0]
        fb = tokenizer(feedback, add_special_tokens=False)["input_ids"]
        expected += action.token_ids + fb
        mask += [1] * len(action.token_ids) + [0] * len(fb)
        logprobs += action.logprobs + [0.0] * len(fb)
    assert traj.token_ids == expected and traj.action_mask == mask and traj.rollout_logprobs == logprobs
    assert traj.prompt_len == len(prompt_ids) and traj.response_ids == expected[len(prompt_ids) :]
    assert (traj.reward, traj.score, traj.extra_logs) == (1.0, 0.5, {"turn": 2.0})
    assert traj.response_text == tokenizer.decode(expected[len(prompt_ids) :], skip_special_tokens=True)
    # The log-probs the trainer will recompute (temperature 1: plain log_softmax) match the engine's.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([traj.token_ids])).logits[0, :-1].log_softmax(-1)
    recomputed = logits.gather(-1, torch.tensor(traj.token_ids[1:])[:, None])[:, 0]
    actions = torch.tensor(traj.action_mask[1:], dtype=torch.bool)
    torch.testing.assert_close(
        recomputed[actions], torch.tensor(traj.rollout_logprobs[1:])[actions], atol=1e-4, rtol=0
    )


def test_step_states_and_batching(spy, tokenizer):
    envs = []

    class Recording(ScriptedEnv):
        def __init__(self):
            super().__init__()
            envs.append(self)

    prompts, labels = ["1+2=", "30+4="], ["3", "34"]
    trajs = MultiTurnAgentExecutor(Recording).run(spy, tokenizer, prompts, labels, sp(n=2), max_length=200)
    assert [t.prompt for t in trajs] == ["1+2=", "1+2=", "30+4=", "30+4="]  # prompt-major
    assert [t.label for t in trajs] == ["3", "3", "34", "34"]
    assert [len(c[0]) for c in spy.calls] == [4, 4, 4]  # every turn of the 4 samples in one engine call
    for env in envs:
        first, second = env.seen[0], env.seen[1]
        assert first["observation_text"] in prompts and isinstance(first["sampling_params"], SamplingParams)
        assert second["observation_text"] == first["observation_text"] + first["action_text"] + FEEDBACK[0]
    # Distinct per-sample seeds: the two samples of a prompt differ.
    assert trajs[0].token_ids != trajs[1].token_ids


def test_max_length_truncates(spy, tokenizer):
    prompt_len = len(tokenizer("12+34=")["input_ids"])
    fb0 = len(tokenizer(FEEDBACK[0], add_special_tokens=False)["input_ids"])
    executor = MultiTurnAgentExecutor(ScriptedEnv)
    # Room for the first action and part of its feedback only.
    [short] = executor.run(spy, tokenizer, ["12+34="], ["46"], sp(), max_length=prompt_len + 4 + 1)
    assert len(short.token_ids) == prompt_len + 5 and short.finish_reason == "length"
    assert short.num_turns == 1 and short.reward == 0.0 and short.action_mask[-1] == 0
    # The second action is capped at the 2 tokens left.
    [capped] = executor.run(spy, tokenizer, ["12+34="], ["46"], sp(), max_length=prompt_len + 4 + fb0 + 2)
    assert capped.num_turns == 2 and capped.finish_reason == "length"
    assert capped.action_mask[-2:] == [1, 1] and spy.calls[-1][1][0].max_new_tokens == 2


def test_step_sampling_params_apply_next_turn(spy, tokenizer):
    class Shorter(ScriptedEnv):
        async def step(self, states, **kwargs):
            answer = await super().step(states)
            answer["sampling_params"] = {"max_tokens": 2}  # dicts override fields of the current params
            return answer

    [traj] = MultiTurnAgentExecutor(Shorter).run(spy, tokenizer, ["5+5="], ["10"], sp(), max_length=200)
    assert [c[1][0].max_new_tokens for c in spy.calls] == [4, 2, 2]
    assert sum(traj.action_mask) == 8


def test_async_init_instances(spy, tokenizer):
    class AsyncInit(ScriptedEnv):
        async def __init__(self, limit=1):
            super().__init__()
            self.turn = 3 - limit  # done after `limit` steps

    executor = MultiTurnAgentExecutor(AsyncInit, instance_kwargs={"limit": 2})
    trajs = executor.run(spy, tokenizer, ["1+1="], ["2"], sp(n=3), max_length=200)
    assert [t.num_turns for t in trajs] == [2, 2, 2] and all(t.reward == 1.0 for t in trajs)


def bad_env(answer_or_error, where="step"):
    class BadEnv(AgentInstanceBase):
        async def reset(self, states, **kwargs):
            if where == "reset":
                return answer_or_error
            return {"observation": states["observation"]}

        async def step(self, states, **kwargs):
            if isinstance(answer_or_error, Exception):
                raise answer_or_error
            return answer_or_error

    return BadEnv


OK = {"rewards": 0.0, "environment_feedback": "", "done": True}


@pytest.mark.parametrize(
    "env, message",
    [
        (bad_env({"rewards": 1.0, "done": True}), r"step returned .*missing keys \['environment_feedback'\]"),
        (bad_env({**OK, "environment_feedback": 3}), r"environment_feedback must be a str, got int"),
        (bad_env({**OK, "rewards": torch.ones(2)}), r"rewards must be one number"),
        (bad_env({**OK, "done": "yes"}), r"done must be a bool"),
        (bad_env({**OK, "sampling_params": {"nope": 1}}), r"step returned"),
        (bad_env([1, 2]), r"step returned \[1, 2\]: expected a dict"),
        (bad_env("text", where="reset"), r"BadEnv .*\.reset returned 'text'"),
    ],
)
def test_bad_agents_are_explained(spy, tokenizer, env, message):
    with pytest.raises(AgentError, match=message):
        MultiTurnAgentExecutor(env).run(spy, tokenizer, ["1+1="], ["2"], sp(), max_length=200)


def test_observation_longer_than_max_length(spy, tokenizer):
    with pytest.raises(AgentError, match="leaving no room for an action under max_length=3"):
        MultiTurnAgentExecutor(ScriptedEnv).run(spy, tokenizer, ["12+34="], ["46"], sp(), max_length=3)
