"""Multi-turn agents on prompts with images (``tidal ppo --agent_func_path --max_images_per_prompt 1``).

Each episode starts from its prompt's images (``tidal.agents.base.PROMPT_IMAGES``): every turn's request
carries them, then the environment's images too (``tidal.agents.images``), and the trajectory keeps all of
them for the trainer, so a GAE run (critic on the same images) sees the engine's log-probs within float32
noise on turn 2, after the observation's image. A reset that drops the prompt's placeholders is one line.
"""

from __future__ import annotations

import pytest

from tests.agents.test_vlm_agent import AGENT
from tests.trainers.test_vlm_grpo import _flags
from tidal.agents import AgentError
from tidal.agents.loader import load_agent_executor
from tidal.cli.train_ppo import parse_run
from tidal.experience.images import ExperienceImages, run_with_images
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.testing import ColourTask, build_tiny_vlm
from tidal.trainers.ppo import run_ppo


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "policy")


def test_agent_episodes_start_from_the_prompts_images(vlm, tmp_path, monkeypatch):
    made = []  # the experiences' images, as the trainer gets them
    original = ExperienceImages.from_trajectories.__func__
    monkeypatch.setattr(
        ExperienceImages,
        "from_trajectories",
        classmethod(lambda cls, t: made.append(original(cls, t)) or made[-1]),
    )
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    flags = ["--agent_func_path", str(agent), "--advantage_estimator", "gae", "--n_samples_per_prompt", "2",
             "--train_batch_size", "8", "--num_episodes", "1", "--max_samples", "4", "--packing_samples"]  # fmt: skip
    history = run_ppo(parse_run(_flags(vlm, tmp_path, *flags)))
    assert len(history) == 1 and "critic/loss" in history[0]
    rows = [row for images in made for row in images.rows]
    # the prompt's 28x28 square (one token: grid 1x2x2), then the environment's 56x56 picture (1x4x4)
    assert len(rows) == 8 and all(row[1].tolist() == [[1, 2, 2], [1, 4, 4]] for row in rows)
    print(f"VLM agent on image prompts |Δ log-prob|: {history[0]['rollout/logprob_mismatch']}")
    assert history[0]["rollout/logprob_mismatch"] < 1e-3


DROPS_THE_IMAGE = AGENT.replace(
    'return {"observation": states["observation"]}', 'return {"observation": "no picture here"}'
)


def test_a_reset_that_drops_the_prompts_image_is_one_line(vlm, tmp_path):
    from tidal.data.images import ImageRef

    agent = tmp_path / "agent.py"
    agent.write_text(DROPS_THE_IMAGE)
    engine = LLMEngine(str(vlm), EngineConfig(device="cpu", dtype="float32", max_model_len=128))
    rows = ColourTask().rows(tmp_path, 1)
    refs = [[ImageRef(path=str(tmp_path / rows[0]["images"][0]))]]
    params = SamplingParams(n=1, max_new_tokens=2, seed=0)

    def run(e):
        return load_agent_executor(agent).run(e, engine.tokenizer, ["x"], ["red"], params, 64)

    with pytest.raises(AgentError, match="reset must keep the prompt's image placeholders") as err:
        run_with_images(engine, refs, 1, run)
    assert "\n" not in str(err.value)
