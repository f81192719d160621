"""``--agent_endpoint``: an agent function written against the OpenAI API trains in RL. Episodes'
recorded requests become trajectories of the served token ids (multi-turn observations, failures),
and a tidal ppo run over loopback with the ``openai`` client trains on exactly the tokens and
log-probs the endpoint returned, counting an agent that raises as a failed episode."""

from __future__ import annotations

import json

import pytest

from tidal.agents.base import EpisodeError
from tidal.agents.endpoint import trajectory_from_requests
from tidal.serve.recorder import RecordedRequest, RecordedSample


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def request(order, prompt_ids, *samples):
    return RecordedRequest(order, "completions", prompt_ids, [RecordedSample(ids, [-0.5] * len(ids), "stop")
                                                               for ids in samples])  # fmt: skip


def test_turns_become_actions_and_observations():
    requests = [request(1, [1, 2], [3, 4]), request(2, [1, 2, 3, 4, 9, 9], [5])]
    traj = trajectory_from_requests("p", "l", requests, _Tok(), max_length=100)
    assert traj.token_ids == [1, 2, 3, 4, 9, 9, 5]
    assert traj.action_mask == [0, 0, 1, 1, 0, 0, 1]
    assert traj.rollout_logprobs == [0, 0, -0.5, -0.5, 0, 0, -0.5]
    assert (traj.prompt_len, traj.num_turns, traj.error, traj.response_text) == (2, 2, None, "3 4 9 9 5")
    traj.check()


def test_truncated_at_max_length():
    traj = trajectory_from_requests("p", "l", [request(1, [1, 2], [3, 4, 5])], _Tok(), max_length=4)
    assert (traj.token_ids, traj.finish_reason) == ([1, 2, 3, 4], "length")


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ([request(1, [1, 2], [3]), request(2, [1, 7, 3], [5])], "does not extend the episode's tokens"),
        ([request(1, [1, 2], [3], [4])], "asked for 2 samples"),
    ],
)
def test_unusable_requests_fail_the_episode(requests, message):
    traj = trajectory_from_requests("p", "l", requests, _Tok(), max_length=100)
    assert traj.error_kind == "endpoint_errors" and message in traj.error
    assert (traj.reward, traj.finish_reason) == (0.0, "error")
    traj.check()


def test_no_request_is_an_episode_error():
    with pytest.raises(EpisodeError, match="no request"):
        trajectory_from_requests("p", "l", [], _Tok(), max_length=100)


AGENT = """
import json
import zlib

import openai

async def agent(base_url, prompt, label):
    if label == "3":
        raise RuntimeError("no tools today")
    # No seed: the run's seed gives each episode its own (tidal.agents.endpoint), so the rewards do not
    # depend on the order in which the concurrent episodes' requests reach the server.
    async with openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0) as client:
        out = await client.completions.create(model="policy", prompt=prompt, max_tokens=4, logprobs=0)
    choice = out.choices[0]
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"prompt": prompt, "tokens": choice.logprobs.tokens,
                             "logprobs": choice.logprobs.token_logprobs}}) + "\\n")
    return float(zlib.crc32(choice.text.encode()) % 2)  # a reward that varies (the model is random)
"""


@pytest.mark.parametrize("placement", [[], ["--vllm_num_engines", "1"]], ids=["local", "separate_engine"])
def test_ppo_trains_on_the_endpoint_tokens(tiny_qwen2, tmp_path, monkeypatch, placement):
    from tidal.cli.train_ppo import parse_run
    from tidal.experience import scoring as scoring_module
    from tidal.serve.protocol import token_text
    from tidal.trainers.ppo import run_ppo

    calls = tmp_path / "calls.jsonl"
    (tmp_path / "agent.py").write_text(AGENT.format(log=str(calls)))
    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i}>", "label": str(i)}) + "\n")
    seen = []
    original = scoring_module.from_trajectories

    def spy(trajectories, pad_id):
        seen.extend(trajectories)
        return original(trajectories, pad_id)

    monkeypatch.setattr(scoring_module, "from_trajectories", spy)
    out = tmp_path / "out"
    history = run_ppo(parse_run([
        "--pretrain", str(tiny_qwen2), "--prompt_data", str(tmp_path / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--agent_endpoint", str(tmp_path / "agent.py"), "--n_samples_per_prompt", "2",
        "--advantage_estimator", "rloo", "--rollout_batch_size", "4", "--train_batch_size", "8",
        "--micro_train_batch_size", "8", "--generate_max_len", "4", "--prompt_max_len", "8", "--init_kl_coef", "0",
        "--actor_learning_rate", "1e-3", "--seed", "5", "--save_path", str(out / "final"), "--ckpt_path",
        str(out / "ckpt"), *placement,
    ]))  # fmt: skip
    assert len(history) == 2 and all(h["grad_norm"] > 0 for h in history)
    # the one prompt whose agent raises ("3>", 2 samples) fails alone, and training goes on
    assert sum(h["agent/errors"] for h in history) == 2
    assert sum(h.get("agent/agent_errors", 0) for h in history) == 2
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(str(tiny_qwen2))
    served = sorted((c["prompt"], tuple(c["tokens"]), tuple(c["logprobs"]))
                    for c in map(json.loads, calls.read_text().splitlines()))  # fmt: skip
    trained = sorted(
        (t.prompt, tuple(token_text(tokenizer, i) for i in t.response_ids),
         tuple(lp for lp, m in zip(t.rollout_logprobs, t.action_mask, strict=True) if m))
        for t in seen if t.error is None
    )  # fmt: skip
    assert len(trained) == 14  # 16 episodes, of which the 2 of the prompt "3>" failed
    assert [(p, tok) for p, tok, _ in trained] == [(p, tok) for p, tok, _ in served]
    for (_, _, a), (_, _, b) in zip(trained, served, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_agent_endpoint_and_agent_func_path_are_exclusive(tmp_path):
    from tidal.cli.train_ppo import parse_run
    from tidal.config.args import ConfigError

    with pytest.raises(ConfigError, match="either --agent_func_path .* or --agent_endpoint"):
        parse_run(["--pretrain", "m", "--prompt_data", "p.jsonl", "--agent_func_path", "a.py",
                   "--agent_endpoint", "b.py"])  # fmt: skip
