"""Router replay with agents: multi-turn and ``--agent_endpoint`` trajectories carry the engine's experts
for every token some engine forward read, aligned with their token ids (tiny Qwen3-MoE, CPU, fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.agents import AgentError, AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor
from tidal.agents.base import Trajectory
from tidal.rollout import SamplingParams

FEEDBACK = [" wrong, again:", " still wrong:", " ok"]


class ScriptedEnv(AgentInstanceBase):
    """Feedback after each of three turns; the last feedback ends the trajectory (no forward reads it)."""

    def __init__(self):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn == 3
        return {"rewards": float(done), "environment_feedback": FEEDBACK[self.turn - 1], "done": done}


class RecordingEngine:
    """A real recording engine that keeps each ``generate`` call's (prompts, outputs)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    def generate(self, prompts, params):
        outputs = self.engine.generate(prompts, params)
        self.calls.append((prompts, outputs))
        return outputs


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    from tidal.rollout import EngineConfig, LLMEngine
    from tidal.testing import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", seed=0)
    config = EngineConfig(device="cpu", dtype="float32", record_routing=True, max_model_len=256)
    return LLMEngine(str(path), config)


def sp(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True, "seed": 7, **kw})


def fresh_prefill(engine, token_ids: list[int]) -> np.ndarray:
    """The experts a single prefill of ``token_ids`` routes each of them to."""
    [out] = engine.generate([token_ids], SamplingParams(max_new_tokens=1, temperature=0.0))
    return out.outputs[0].routed_experts[: len(token_ids)]


def test_multi_turn_trajectory_carries_the_routing_of_every_read_token(moe_engine):
    spy = RecordingEngine(moe_engine)
    tok = moe_engine.tokenizer
    prompts = ["12+34=", "7+8="]
    trajectories = MultiTurnAgentExecutor(ScriptedEnv).run(spy, tok, prompts, ["46", "15"], sp(n=2), 200)
    final = len(tok(FEEDBACK[-1], add_special_tokens=False)["input_ids"])
    assert len(spy.calls) == 3 and all(t.num_turns == 3 for t in trajectories)
    for traj in trajectories:
        routed = traj.routed_experts
        # Every token but the final feedback and the last action token before it: no forward read those.
        assert routed.shape == (len(traj.token_ids) - final - 1, 3, 2) and (routed >= 0).all()
        # Prompt and observation tokens: as a prefill of the whole trajectory routes them.
        prefill = fresh_prefill(moe_engine, traj.token_ids)
        context = [p for p in range(len(routed)) if not traj.action_mask[p]]
        np.testing.assert_array_equal(routed[context], prefill[context])
        # Sampled tokens: as the decode steps of their turn did (the turn's last token: the next prefill).
        turns = [
            (ids, out.outputs[0])
            for prompts, outs in spy.calls
            for ids, out in zip(prompts, outs, strict=True)
        ]
        mine = [
            (ids, o) for ids, o in turns if traj.token_ids[: len(ids) + len(o.token_ids)] == ids + o.token_ids
        ]
        assert len(mine) == 3
        for prompt_ids, output in mine:
            start, stop = len(prompt_ids), len(prompt_ids) + len(output.token_ids) - 1
            np.testing.assert_array_equal(routed[start:stop], output.routed_experts[start:stop])
        np.testing.assert_array_equal(routed, prefill[: len(routed)])  # fp32: decode routes as prefill


def test_truncation_failures_and_executors_without_routing(moe_engine):
    tok = moe_engine.tokenizer
    prompt_len = len(tok("12+34=")["input_ids"])

    class FailsAtReset(ScriptedEnv):
        async def reset(self, states, **kwargs):
            raise RuntimeError("no sandbox")

    [short] = MultiTurnAgentExecutor(ScriptedEnv).run(
        moe_engine, tok, ["12+34="], ["46"], sp(), prompt_len + 6
    )
    assert len(short.token_ids) == prompt_len + 6 and len(short.routed_experts) == prompt_len + 3
    # An episode that failed before acting has an empty record next to the others' (it trains nothing).
    mixed = [MultiTurnAgentExecutor(ScriptedEnv), MultiTurnAgentExecutor(FailsAtReset)]
    ok, failed = (e.run(moe_engine, tok, ["12+34="], ["46"], sp(), 200)[0] for e in mixed)
    assert failed.error is not None and failed.routed_experts is None  # alone in its rollout: no record
    from tidal.agents.base import complete_routing

    complete_routing([ok, failed], mixed[1])
    assert failed.routed_experts.shape == (0, 3, 2)

    class Forgetful(AgentExecutorBase):  # a custom execute that does not call add_routing
        async def execute(self, prompt, label, sampling_params, llm, tokenizer, max_length):
            ids = self.encode_prompt(tokenizer, prompt)
            out = await llm.generate(ids, sampling_params)
            traj = Trajectory.start(prompt, label, ids)
            traj.add_action(out.token_ids, out.logprobs)
            return traj

    with pytest.raises(AgentError, match=r"Forgetful.*without routed_experts.*add_routing"):
        Forgetful().run(moe_engine, tok, ["12+34="], ["46"], sp(), 200)


def test_endpoint_episode_carries_routing(moe_engine):
    """``--agent_endpoint``: the recorder keeps each request's experts and the trajectory joins them."""
    from tidal.agents.endpoint import trajectory_from_requests
    from tidal.serve.recorder import RequestRecorder

    tok = moe_engine.tokenizer
    recorder = RequestRecorder()
    ids = tok("12+34=")["input_ids"]
    for turn in range(2):
        [out] = moe_engine.generate([ids], sp(seed=turn))
        recorder.record("ep", turn, "completions", out)
        ids = ids + out.outputs[0].token_ids + tok(FEEDBACK[turn], add_special_tokens=False)["input_ids"]
    traj = trajectory_from_requests("12+34=", "46", recorder.pop("ep"), tok, max_length=200)
    last = len(tok(FEEDBACK[1], add_special_tokens=False)["input_ids"])
    assert traj.token_ids == ids[:-last] and len(traj.routed_experts) == len(traj.token_ids) - 1
    np.testing.assert_array_equal(traj.routed_experts, fresh_prefill(moe_engine, traj.token_ids)[:-1])


def test_routing_rows_cannot_outnumber_tokens():
    traj = Trajectory.start("p", None, [1, 2])
    traj.add_action([3], [0.0])
    traj.add_routing(np.zeros((2, 3, 2), dtype=np.int16))
    traj.add_routing(np.ones((4, 3, 2), dtype=np.int16))  # a later record extends past the rows held
    assert torch.equal(
        torch.from_numpy(traj.routed_experts[:, 0, 0]), torch.tensor([0, 0, 1, 1], dtype=torch.int16)
    )
    with pytest.raises(ValueError, match="4 rows for 3 tokens"):
        traj.check()
