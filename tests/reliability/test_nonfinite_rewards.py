"""NaN and ±inf rewards from every reward source are refused by one shared check with a one-line
message naming the source and the sample: reward functions, reward servers, reward models, agents
(one step or several, and executors that build trajectories themselves), and a whole ``tidal ppo``
run, which must stop with that message and export nothing."""

from __future__ import annotations

import json
import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from torch import nn

from tidal.agents import AgentError, AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor, Trajectory
from tidal.experience.experience import Experience
from tidal.experience.maker import from_trajectories
from tidal.experience.reward_models import RewardModels
from tidal.models.precision import Precision
from tidal.rewards import RemoteReward, RewardError, RewardFunction
from tidal.rollout import SamplingParams
from tidal.rollout.outputs import CompletionOutput, RequestOutput

BAD = [float("nan"), float("inf"), float("-inf")]
BATCH = (["q0", "q1", "q2"], ["p0", "p1", "p2"], ["a", "b", "c"])


def _shown(value: float) -> str:
    return "nan" if math.isnan(value) else str(value)  # how the message prints it: (nan), (inf), (-inf)


# ---- reward functions ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", BAD, ids=_shown)
def test_reward_function(tmp_path, bad):
    path = tmp_path / "reward_func.py"
    path.write_text(f"def reward_func(queries, prompts, labels):\n    return [1.0, float('{bad}'), 0.0]\n")
    with pytest.raises(RewardError) as info:
        RewardFunction(path)(*BATCH)
    message = str(info.value)
    assert message == f"reward_func in {path} returned a non-finite reward ({_shown(bad)}) for sample 1 of 3"


# ---- reward servers -----------------------------------------------------------------------------
class Server:
    """A loopback reward server answering ``rewards`` as given (Python's json writes NaN/Infinity)."""

    def __init__(self, rewards: list[float]):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                data = json.dumps({"rewards": rewards}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("bad", BAD, ids=_shown)
def test_reward_server(bad):
    with Server([0.0, 1.0, bad]) as server, pytest.raises(RewardError) as info:
        RemoteReward(server.url)(*BATCH)
    assert str(info.value) == (
        f"reward server {server.url} returned a non-finite reward ({_shown(bad)}) for sample 2 of 3"
    )


# ---- reward models ------------------------------------------------------------------------------
class ConstantRewardModel(nn.Module):
    """Scores every sequence with a fixed list of values (a stand-in for a diverged value head)."""

    def __init__(self, values: list[float]):
        super().__init__()
        self.values = torch.tensor(values)
        self.name_or_path = "/models/rm"

    def scores(self, batch: dict) -> torch.Tensor:
        return self.values[: batch["input_ids"].shape[0]]


def _experience(n: int) -> Experience:
    ones = torch.ones(n, 3, dtype=torch.long)
    zeros = torch.zeros(n, 3)
    return Experience(ones, ones, ones, zeros, rewards=torch.zeros(n), scores=torch.zeros(n))


@pytest.mark.parametrize("bad", BAD, ids=_shown)
def test_reward_model(bad):
    models = RewardModels(
        [ConstantRewardModel([0.5, 0.5]), ConstantRewardModel([0.1, bad])],
        Precision.create("fp32", torch.device("cpu")),
        micro_size=2,
    )
    with pytest.raises(RewardError) as info:
        models(_experience(2))
    assert str(info.value) == (
        f"reward model 1 (/models/rm) returned a non-finite reward ({_shown(bad)}) for sample 1 of 2"
    )


# ---- agents -------------------------------------------------------------------------------------
class CharTokenizer:
    """One token per character: enough for executors, no files needed."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FixedEngine:
    """An engine that answers every prompt with the two tokens "7!"."""

    tokenizer = None

    def generate(self, prompts, params):
        outputs = [CompletionOutput(0, "7!", [ord("7"), ord("!")], [-0.5, -0.25], "stop")]
        return [RequestOutput(i, None, list(ids), outputs) for i, ids in enumerate(prompts)]


def _rewarding(values_by_turn: dict[int, float], turns: int = 1) -> type:
    """An environment rewarding turn t with ``values_by_turn.get(t, 0.0)`` for prompt "bad", done after
    ``turns`` turns (1: a single-turn agent)."""

    class Env(AgentInstanceBase):
        def __init__(self):
            self.turn = 0

        async def reset(self, states, **kwargs):
            self.prompt = states["observation"]
            return {"observation": self.prompt}

        async def step(self, states, **kwargs):
            self.turn += 1
            reward = values_by_turn.get(self.turn, 0.0) if self.prompt == "bad" else 1.0
            return {"rewards": reward, "environment_feedback": " again", "done": self.turn >= turns}

    return Env


def _run(executor, prompts=("ok", "bad")):
    params = SamplingParams(n=2, max_new_tokens=2)
    return executor.run(FixedEngine(), CharTokenizer(), list(prompts), ["x"] * len(prompts), params, 64)


@pytest.mark.parametrize("bad", BAD, ids=_shown)
def test_single_turn_agent_step(bad):
    with pytest.raises(AgentError) as info:
        _run(MultiTurnAgentExecutor(_rewarding({1: bad})))
    message = str(info.value)
    assert "Env (" in message and ".step returned {'rewards': " in message
    assert message.endswith(f": a non-finite reward ({_shown(bad)}) for turn 1 (prompt 1, sample 0 of 2)")
    assert "\n" not in message


@pytest.mark.parametrize("bad", BAD, ids=_shown)
def test_multi_turn_agent_step_before_the_last(bad):
    """A non-finite reward at turn 1 of 3 is refused although only the last turn's reward is kept."""
    with pytest.raises(
        AgentError, match=rf"non-finite reward \({_shown(bad)}\) for turn 1 \(prompt 1, sample 0"
    ):
        _run(MultiTurnAgentExecutor(_rewarding({1: bad, 3: 1.0}, turns=3)))


def test_agent_step_score():
    class Env(AgentInstanceBase):
        async def step(self, states, **kwargs):
            return {"rewards": 1.0, "scores": float("nan"), "environment_feedback": "", "done": True}

    with pytest.raises(
        AgentError, match=r"a non-finite score \(nan\) for turn 1 \(prompt 0, sample 0 of 2\)$"
    ):
        _run(MultiTurnAgentExecutor(Env), prompts=("ok",))


class SelfRewardingExecutor(AgentExecutorBase):
    """A custom executor that builds its trajectory and reward itself (no environment steps)."""

    def __init__(self, reward: float):
        self.reward = reward

    async def execute(self, prompt, label, sampling_params, llm, tokenizer, max_length):
        out = await llm.generate(self.encode_prompt(tokenizer, prompt), sampling_params)
        traj = Trajectory.start(prompt, label, self.encode_prompt(tokenizer, prompt))
        traj.add_action(out.token_ids, out.logprobs)
        traj.reward = self.reward if prompt == "bad" else 0.0
        return traj


@pytest.mark.parametrize("bad", BAD, ids=_shown)
def test_custom_executor_trajectory_reward(bad):
    with pytest.raises(AgentError) as info:
        _run(SelfRewardingExecutor(bad))
    assert str(info.value).endswith(
        f"SelfRewardingExecutor ({__file__}).execute returned a malformed Trajectory (prompt 1, sample 0 of 2): "
        f"a non-finite reward ({_shown(bad)}) for the trajectory"
    )


def test_trajectories_from_an_overridden_run_are_checked_too():
    """Executors that override ``run`` skip the per-sample checks; making the experience checks."""
    good = Trajectory.start("p", "l", [1, 2])
    good.add_action([3], [-0.1])
    bad = Trajectory.start("p", "l", [1, 2])
    bad.add_action([3], [-0.1])
    good.reward, bad.reward = 1.0, float("inf")
    with pytest.raises(RewardError, match=r"^agent returned a non-finite reward \(inf\) for sample 1 of 2$"):
        from_trajectories([good, bad], pad_id=0)


# ---- a whole run ---------------------------------------------------------------------------------
NAN_AGENT = """
from tidal.agents import AgentInstanceBase, MultiTurnAgentExecutor


class NanEnv(AgentInstanceBase):
    async def step(self, states, **kwargs):
        reward = float("nan") if states["label"] == "3" else 1.0
        return {"rewards": reward, "environment_feedback": "", "done": True}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(NanEnv)
"""

NAN_REWARD_FUNC = """
def reward_func(queries, prompts, labels):
    return [float("inf") if label == "3" else 0.0 for label in labels]
"""


def _weights_are_finite(folder: Path) -> bool:
    from safetensors.torch import load_file

    return all(
        torch.isfinite(t).all() for f in folder.rglob("*.safetensors") for t in load_file(str(f)).values()
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("agent", r"NanEnv \(\S+\)\.step returned .*: a non-finite reward \(nan\) for turn 1 \(prompt \d, sample \d of 2\)"),
        ("reward_func", r"reward_func in \S+ returned a non-finite reward \(inf\) for sample \d of 8"),
    ],
)  # fmt: skip
def test_ppo_run_stops_with_one_line_and_exports_nothing(tiny_qwen2, tmp_path, capsys, source, message):
    from tidal.cli.train_ppo import main as ppo_main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}>", "label": str(i)}) + "\n" for i in range(4)))
    user_file = tmp_path / f"{source}.py"
    user_file.write_text(NAN_AGENT if source == "agent" else NAN_REWARD_FUNC)
    flag = "--agent_func_path" if source == "agent" else "--remote_rm_url"
    out = tmp_path / "out"
    argv = [
        "--pretrain", str(tiny_qwen2), "--prompt_data", str(prompts), "--input_key", "prompt",
        "--label_key", "label", flag, str(user_file), "--n_samples_per_prompt", "2",
        "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "8",
        "--micro_rollout_batch_size", "8", "--generate_max_len", "2", "--prompt_max_len", "8",
        "--init_kl_coef", "0", "--advantage_estimator", "group_norm", "--save_path", str(out / "final"),
        "--ckpt_path", str(out / "ckpt"), "--save_steps", "1", "--seed", "1",
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        ppo_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    assert re.search(message, errors[0]), errors[0]
    assert not (out / "final" / "model.safetensors").exists()
    assert _weights_are_finite(out)
