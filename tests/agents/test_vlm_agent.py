"""Multi-turn agents whose environment answers with an image, on the tiny offline Qwen2.5-VL (CPU, float32).

The agent's first ``step`` returns ``environment_feedback`` as content parts holding an image; the
executor writes its markers and expanded placeholders into the trajectory, the next turn's request
carries its pixels, and the trajectory keeps them for the trainer. Checked: the second turn's engine
log-probs equal a transformers forward over the whole trajectory with the image; one GRPO step of
``tidal ppo --agent_func_path`` with engine-vs-trainer log-prob mismatch below 1e-3; an image cut in part
by the length limit is dropped whole; an image given to a text-only policy is one line.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tidal.agents import AgentError
from tidal.agents.multi_turn import MultiTurnAgentExecutor
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

# The environment shows a picture after the first answer and ends after the second; the reward is the
# share of letters of the second answer that are in the label (so the group's rewards differ).
AGENT = """
import io

import torch
from PIL import Image

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


def picture(seed):
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(56, 56, 3, generator=g) * 255).byte().numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()  # PNG bytes (a PIL image or a data URI work too)


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        if self.turn == 1:
            feedback = [{"type": "text", "text": " look:"}, {"type": "image", "image": picture(len(states["label"]))},
                        {"type": "text", "text": " now?"}]
            return {"rewards": 0.0, "environment_feedback": feedback, "done": False}
        letters = [c for c in states["action_text"].lower() if c.isalpha()]
        reward = sum(c in states["label"] for c in letters) / max(len(letters), 1)
        return {"rewards": reward, "environment_feedback": "", "done": True}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from tidal.testing import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "policy")


@pytest.fixture(scope="module")
def agent_cls(tmp_path_factory):
    from tidal.agents.loader import load_agent_executor

    path = tmp_path_factory.mktemp("agent") / "agent.py"
    path.write_text(AGENT)
    return type(load_agent_executor(path)), path


def _engine(path) -> LLMEngine:
    return LLMEngine(str(path), EngineConfig(device="cpu", dtype="float32", max_model_len=256, block_size=4))


def _run(executor, engine, max_length: int, prompts=("red square", "blue")):
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=4, seed=0)
    return executor.run(
        engine, engine.tokenizer, list(prompts), ["red", "blue"][: len(prompts)], params, max_length
    )


def test_second_turn_sees_the_image_and_the_trajectory_keeps_it(vlm, agent_cls):
    from transformers import AutoModelForImageTextToText

    engine = _engine(vlm)
    trajectories = _run(agent_cls[0](), engine, 64)
    image_id = engine.vision.image_token_id
    for traj in trajectories:
        assert traj.num_turns == 2 and traj.finish_reason == "done"
        pixels, grid = traj.images
        assert grid.tolist() == [[1, 4, 4]]  # 56x56 pixels: 4x4 patches, 4 image tokens
        assert traj.token_ids.count(image_id) == 4
        assert not any(m for t, m in zip(traj.token_ids, traj.action_mask, strict=True) if t == image_id)
    # the engine's log-probs of both turns' actions equal one transformers forward over the trajectory
    hf = AutoModelForImageTextToText.from_pretrained(str(vlm)).eval()
    traj = trajectories[0]
    ids = torch.tensor([traj.token_ids])
    with torch.inference_mode():
        logits = hf(
            input_ids=ids,
            pixel_values=traj.images[0],
            image_grid_thw=traj.images[1],
            mm_token_type_ids=(ids == image_id).int(),
        ).logits[0, :-1]
    logprobs = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    mask = torch.tensor(traj.action_mask[1:], dtype=torch.bool)
    expected = logprobs[mask]
    got = torch.tensor(traj.rollout_logprobs[1:])[mask]
    assert mask.sum() > 4  # actions of both turns, the second after the image
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_an_image_cut_by_the_length_limit_is_dropped_whole(vlm, agent_cls):
    engine = _engine(vlm)
    full = _run(agent_cls[0](), engine, 64, prompts=("red square",))[0]
    image_start = full.token_ids.index(engine.vision.image_token_id) - 1  # its <|vision_start|>
    cut = _run(agent_cls[0](), engine, image_start + 3, prompts=("red square",))[0]
    assert cut.images is None and cut.token_ids == full.token_ids[:image_start]
    assert cut.finish_reason == "length" and cut.num_turns == 1


def test_an_image_for_a_text_policy_is_one_line(tiny_qwen2, agent_cls):
    engine = LLMEngine(str(tiny_qwen2), EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_model_len=128))
    with pytest.raises(
        AgentError, match="environment_feedback holds an image but the policy's engine takes no images"
    ):
        _run(agent_cls[0](), engine, 64)


def test_bad_image_parts_are_one_line(vlm):
    from tidal.agents import AgentInstanceBase

    class Bad(AgentInstanceBase):
        async def step(self, states, **kwargs):
            return {"rewards": 0.0, "environment_feedback": [{"type": "image"}], "done": True}

    class Corrupt(AgentInstanceBase):
        async def step(self, states, **kwargs):
            return {
                "rewards": 0.0,
                "environment_feedback": [{"type": "image", "image": b"no png"}],
                "done": True,
            }

    engine = _engine(vlm)
    with pytest.raises(AgentError, match=r"environment_feedback\[0\] must be"):
        _run(MultiTurnAgentExecutor(Bad), engine, 64)
    with pytest.raises(AgentError, match="an environment_feedback image .*not a readable image"):
        _run(MultiTurnAgentExecutor(Corrupt), engine, 64)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_one_grpo_step_through_tidal_ppo_matches_the_engine(vlm, agent_cls, tmp_path, monkeypatch, packing):
    from tidal.cli.train_ppo import parse_run
    from tidal.experience.images import ExperienceImages
    from tidal.trainers.ppo import run_ppo

    made = []  # the experiences' images: every trajectory carries its observation's image to the trainer
    original = ExperienceImages.from_trajectories.__func__

    def spy(cls, trajectories):
        made.append(original(cls, trajectories))
        return made[-1]

    monkeypatch.setattr(ExperienceImages, "from_trajectories", classmethod(spy))

    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "label": c}) + "\n" for p, c in [("a", "red"), ("b", "blue")])
    )
    history = run_ppo(parse_run([
        "--pretrain", str(vlm), "--prompt_data", str(data), "--input_key", "prompt", "--label_key", "label",
        "--agent_func_path", str(agent_cls[1]), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "2", "--rollout_batch_size", "2", "--train_batch_size", "4",
        "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4", "--generate_max_len", "4",
        "--prompt_max_len", "32", "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
        "--save_path", str(tmp_path / "final"), "--ckpt_path", str(tmp_path / "ckpt"), "--seed", "1",
        *(["--packing_samples"] if packing else []),
    ]))  # fmt: skip
    assert len(history) == 1 and "policy/loss" in history[0]
    rows = [row for images in made for row in images.rows]
    assert len(rows) == 4 and all(row[1].tolist() == [[1, 4, 4]] for row in rows)
    print(f"VLM agent GRPO |Δ log-prob|: {history[0]['rollout/logprob_mismatch']}")
    assert history[0]["rollout/logprob_mismatch"] < 1e-3


def test_client_passes_images_only_with_images():
    from tidal.agents.client import LLMClient

    class Spy:
        calls = []

        def generate(self, prompts, params, **kwargs):
            from tidal.rollout import CompletionOutput, RequestOutput

            self.calls.append(kwargs)
            return [
                RequestOutput(i, None, p, [CompletionOutput(0, "x", [1], [0.0], "length")])
                for i, p in enumerate(prompts)
            ]

    spy, params = Spy(), SamplingParams(max_new_tokens=1)

    async def both():
        client = LLMClient(spy)
        await asyncio.gather(client.generate([1], params), client.generate([2], params, multi_modal="mm"))
        await client.generate([3], params)

    asyncio.run(both())
    assert spy.calls == [{"multi_modal": [None, "mm"]}, {}]


def test_agent_endpoint_episodes_refuse_images(vlm):
    import base64
    import http.client
    import io

    from PIL import Image

    pytest.importorskip("uvicorn")
    from tidal.agents.endpoint import episode_server
    from tidal.serve.recorder import RequestRecorder

    buffer = io.BytesIO()
    Image.new("RGB", (28, 28), "red").save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "colour?"}]
    body = {"model": "policy", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    recorder = RequestRecorder()
    with episode_server(_engine(vlm), recorder, 4) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/episodes/e1/v1/chat/completions", body=json.dumps(body).encode())
        resp = conn.getresponse()
        status, answer = resp.status, json.loads(resp.read())
    assert status == 400 and "--agent_endpoint episodes take text only" in answer["error"]["message"]
    assert recorder.episode_ids() == []
