"""RewardFunction: loading a user's reward_func.py, accepted return shapes, and clear errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from tidal.rewards import RewardError, RewardFunction, RewardResult, load_reward_source
from tidal.testing import AdditionTask

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BATCH = (["1+1=2", "2+2=5", "3+3=6"], ["1+1=", "2+2=", "3+3="], ["2", "4", "6"])


def write(tmp_path, body: str, name: str = "reward_func.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_list_rewards_default_scores(tmp_path):
    path = write(
        tmp_path,
        """
        def reward_func(queries, prompts, labels):
            return {"rewards": [float(q.endswith(l)) for q, l in zip(queries, labels)]}
        """,
    )
    result = RewardFunction(path)(*BATCH)
    assert isinstance(result, RewardResult)
    assert result.rewards.dtype == torch.float32
    assert result.rewards.tolist() == [1.0, 0.0, 1.0]
    assert torch.equal(result.scores, result.rewards)
    assert result.extra_logs == {}


def test_tensor_scores_extra_logs_and_kwargs(tmp_path):
    path = write(
        tmp_path,
        """
        import torch
        def reward_func(queries, prompts, labels, **kwargs):
            r = torch.tensor([1, 0, 1])
            return {"rewards": r, "scores": r * 0.5, "extra_logs": {"acc": r.float(), "n": len(queries),
                    "step": kwargs.get("step", -1)}}
        """,
    )
    result = RewardFunction(path)(*BATCH, step=7)
    assert result.rewards.tolist() == [1.0, 0.0, 1.0]
    assert result.scores.tolist() == [0.5, 0.0, 0.5]
    assert result.extra_logs == pytest.approx({"acc": 2 / 3, "n": 3.0, "step": 7.0})


def test_bare_tensor_and_seed_signature_without_kwargs(tmp_path):
    # The seed's signature takes no **kwargs: extra keyword arguments must not be passed.
    path = write(
        tmp_path,
        """
        import torch
        def reward_func(queries, prompts, labels):
            return torch.ones(len(queries))
        """,
    )
    result = RewardFunction(path)(*BATCH, step=3)
    assert result.rewards.tolist() == [1.0, 1.0, 1.0]


def test_raising_function_names_file(tmp_path):
    path = write(tmp_path, "def reward_func(queries, prompts, labels):\n    raise KeyError('answer')\n")
    with pytest.raises(RewardError, match=rf"reward_func in {path}.*KeyError"):
        RewardFunction(path)(*BATCH)


@pytest.mark.parametrize(
    "returned, message",
    [
        ("[1.0, 0.0]", r"returned rewards of length 2 for 3 samples"),
        ("{'scores': [1, 1, 1]}", r"without 'rewards'"),
        ("'good'", r"returned a str"),
        ("{'rewards': ['a', 'b', 'c']}", r"not numeric"),
        ("{'rewards': [1, 2, float('nan')]}", r"returned a non-finite reward \(nan\) for sample 2 of 3$"),
        (
            "{'rewards': [float('inf'), 2, -float('inf')]}",
            r"non-finite reward \(inf\) for sample 0 of 3 \(2 samples",
        ),
        (
            "{'rewards': [1, 2, 3], 'scores': [0, float('nan'), 1]}",
            r"non-finite score \(nan\) for sample 1 of 3",
        ),
        ("{'rewards': [1, 2, 3], 'scores': [1]}", r"returned scores of length 1"),
        ("{'rewards': [1, 2, 3], 'extra_logs': {'x': 'text'}}", r"extra_logs\['x'\]"),
    ],
)
def test_bad_returns_are_explained(tmp_path, returned, message):
    path = write(tmp_path, f"def reward_func(queries, prompts, labels):\n    return {returned}\n")
    with pytest.raises(RewardError, match=message) as info:
        RewardFunction(path)(*BATCH)
    assert str(path) in str(info.value)


def test_missing_file_and_missing_function(tmp_path):
    with pytest.raises(RewardError, match="nope.py does not exist"):
        RewardFunction(tmp_path / "nope.py")
    path = write(tmp_path, "def reward(queries, prompts, labels):\n    return []\n")
    with pytest.raises(RewardError, match=rf"{path} defines no function reward_func"):
        RewardFunction(path)
    broken = write(tmp_path, "import not_a_module_anywhere\n", "broken.py")
    with pytest.raises(RewardError, match=rf"importing .*{broken}.*ModuleNotFoundError"):
        RewardFunction(broken)


def test_load_reward_source_dispatch(tmp_path):
    path = write(tmp_path, "def reward_func(q, p, l):\n    return [0.0] * len(q)\n")
    assert isinstance(load_reward_source(str(path)), RewardFunction)
    remote = load_reward_source("http://127.0.0.1:1/a, https://127.0.0.1:2/b")
    assert remote.urls == ["http://127.0.0.1:1/a", "https://127.0.0.1:2/b"]
    for bad in ["", "reward.txt", "ftp://x/y", "http://a/b,not-a-url"]:
        with pytest.raises(ValueError, match="--remote_rm_url"):
            load_reward_source(bad)


def test_example_reward_func_on_addition_task():
    samples = AdditionTask(digits=2, seed=0).samples(4)
    prompts = [s["prompt"] for s in samples]
    labels = [s["answer"] for s in samples]
    responses = [labels[0], labels[1] + " because", "0" if labels[2] != "0" else "1", "no idea"]
    queries = [p + r for p, r in zip(prompts, responses, strict=True)]
    result = RewardFunction(EXAMPLES / "reward_func.py")(queries, prompts, labels)
    assert result.scores.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert result.rewards.tolist() == pytest.approx([1.1, 1.0, 0.1, 0.0])
    assert result.extra_logs == pytest.approx({"accuracy": 0.5, "format": 0.5})
