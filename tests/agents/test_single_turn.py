"""SingleTurnAgentExecutor: one engine call, n samples per prompt in prompt-major order."""

from __future__ import annotations

import pytest

from tidal.agents import SingleTurnAgentExecutor
from tidal.rollout import SamplingParams


def test_n_samples_prompt_major_sharing_prompt_ids(spy, tokenizer):
    prompts, labels = ["1+2=", "30+41=", "7+8="], ["3", "71", "15"]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=5, seed=1)
    trajs = SingleTurnAgentExecutor().run(spy, tokenizer, prompts, labels, params, max_length=64)
    assert len(spy.calls) == 1 and len(trajs) == 9
    [(sent, sent_params, outputs)] = spy.calls
    assert [p.n for p in sent_params] == [3, 3, 3]  # one prefill per prompt, shared by its samples
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt)["input_ids"]
        assert sent[i] == ids
        group = trajs[3 * i : 3 * i + 3]
        for j, traj in enumerate(group):
            completion = outputs[i].outputs[j]
            assert (traj.prompt, traj.label, traj.prompt_len) == (prompt, labels[i], len(ids))
            assert traj.token_ids == ids + completion.token_ids
            assert traj.action_mask == [0] * len(ids) + [1] * len(completion.token_ids)
            assert traj.rollout_logprobs == [0.0] * len(ids) + completion.logprobs
            assert traj.response_text == completion.text and traj.finish_reason == completion.finish_reason
            assert traj.reward is None and traj.score is None and traj.num_turns == 1
    # Each prompt gets its own seed derived from the base seed.
    assert len({p.seed for p in sent_params}) == 3


def test_max_length_caps_new_tokens(spy, tokenizer):
    params = SamplingParams(n=2, max_new_tokens=50, ignore_eos=True)
    ids = tokenizer("12+34=")["input_ids"]
    trajs = SingleTurnAgentExecutor().run(spy, tokenizer, ["12+34="], ["46"], params, max_length=len(ids) + 3)
    assert all(len(t.token_ids) == len(ids) + 3 and t.finish_reason == "length" for t in trajs)
    with pytest.raises(ValueError, match="prompt 0 has .* no room for a response under max_length=2"):
        SingleTurnAgentExecutor().run(spy, tokenizer, ["12+34="], ["46"], params, max_length=2)


def test_chat_rendered_prompts_skip_special_tokens(spy, tokenizer):
    executor = SingleTurnAgentExecutor()
    executor.add_special_tokens = False  # as a trainer sets it for --apply_chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1"}], tokenize=False, add_generation_prompt=True
    )
    [traj] = executor.run(spy, tokenizer, [text], ["2"], SamplingParams(max_new_tokens=2), max_length=64)
    assert traj.token_ids[: traj.prompt_len] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert traj.token_ids.count(tokenizer.bos_token_id) == 1  # the template's bos, not a second one


def test_execute_per_sample_matches_run_shape(spy, tokenizer):
    from tidal.agents.base import AgentExecutorBase

    params = SamplingParams(n=2, max_new_tokens=3, seed=3)
    # The generic asyncio path (execute per sample through LLMClient) batches into one engine call too.
    trajs = AgentExecutorBase.run(
        SingleTurnAgentExecutor(), spy, tokenizer, ["1+1=", "2+2="], ["2", "4"], params, 64
    )
    assert [t.prompt for t in trajs] == ["1+1=", "1+1=", "2+2=", "2+2="]
    assert len(spy.calls) == 1 and len(spy.calls[0][0]) == 4


def test_engine_without_tokenizer_and_run_inside_event_loop(spy, tokenizer):
    import asyncio

    class NoTokenizer(type(spy)):
        tokenizer = None  # the engine returns ids only; the executor decodes with the given tokenizer

    engine = NoTokenizer(spy.engine)
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)

    async def inside_a_loop():  # e.g. a Ray async actor: run() must not call asyncio.run on this loop
        return SingleTurnAgentExecutor().run(engine, tokenizer, ["1+1="], ["2"], params, 32)

    trajs = asyncio.run(inside_a_loop())
    for traj in trajs:
        assert traj.response_text == tokenizer.decode(traj.response_ids, skip_special_tokens=True)
    multi = asyncio.run(_multi_turn_inside_loop(engine, tokenizer, params))
    assert len(multi) == 2 and all(t.num_turns == 1 for t in multi)


async def _multi_turn_inside_loop(engine, tokenizer, params):
    from tidal.agents import AgentInstanceBase, MultiTurnAgentExecutor

    class OneStep(AgentInstanceBase):
        async def step(self, states, **kwargs):
            return {"rewards": 1, "environment_feedback": "", "done": True}

    return MultiTurnAgentExecutor(OneStep).run(engine, tokenizer, ["1+1="], ["2"], params, 32)
