"""Math answer extraction and grading (``tidal.rewards.math_grading``), and reward files written for
OpenRLHF (``from openrlhf.utils import extract_boxed_answer, grade_answer``) loading unchanged."""

from __future__ import annotations

import sys

import pytest
import torch

from tidal.rewards import RewardError, load_reward_source
from tidal.rewards.math_grading import extract_boxed_answer, grade_answer
from tidal.rewards.openrlhf_compat import openrlhf_installed

needs_no_openrlhf = pytest.mark.skipif(openrlhf_installed(), reason="the real openrlhf is installed")


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"first \boxed{1}, then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # the last box, nested braces whole
        (r"\boxed{\sqrt{x^{2}}}", r"\sqrt{x^{2}}"),
        (r"\fbox{7}", "7"),
        (r"\boxed 5$", "5"),
        (r"\boxed{unclosed", None),
        ("no box here", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_boxed_answer(text, answer):
    assert extract_boxed_answer(text) == answer


@pytest.mark.parametrize(
    ("given", "reference"),
    [
        ("0.5", r"\frac{1}{2}"),
        ("1/2", "0.5"),
        (r"\dfrac{3}{4}", "0.75"),
        ("2", "2.0"),
        (r"\sqrt{4}", "2"),
        ("1,000", "1000"),
        ("x+1", "1+x"),
        (r"\text{yes}", "yes"),
        ("46", 46),  # a numeric label
    ],
)
def test_equivalent_answers_grade_correct(given, reference):
    assert grade_answer(given, reference) is True


@pytest.mark.parametrize(
    ("given", "reference"),
    [
        ("3", "4"),
        ("0.51", r"\frac{1}{2}"),
        ("x+2", "x+1"),
        (None, "1"),
        ("1", None),
        ("", "1"),
        ("no", "yes"),
    ],
)
def test_different_or_missing_answers_grade_wrong(given, reference):
    assert grade_answer(given, reference) is False


# A reward file shaped like OpenRLHF's math reward example: its import line, unchanged.
OPENRLHF_MATH_REWARD = """
import torch
from openrlhf.utils import extract_boxed_answer, grade_answer

def reward_func(queries, prompts, labels, **kwargs):
    rewards = [float(grade_answer(extract_boxed_answer(q[len(p):]), label))
               for q, p, label in zip(queries, prompts, labels)]
    return {"rewards": torch.tensor(rewards), "scores": torch.tensor(rewards), "extra_logs": {}}
"""


@needs_no_openrlhf
def test_an_openrlhf_math_reward_file_runs_unchanged(tmp_path):
    path = tmp_path / "math_reward_func.py"
    path.write_text(OPENRLHF_MATH_REWARD)
    source = load_reward_source(str(path))
    result = source(["Q: half? \\boxed{0.5}", "Q: 2+2? \\boxed{5}", "Q: 1? none"], ["Q: half? ", "Q: 2+2? ", "Q: 1? "],
                    [r"\frac{1}{2}", "4", "1"])  # fmt: skip
    assert result.rewards.tolist() == [1.0, 0.0, 0.0]
    # the stand-in was scoped to loading: nothing named openrlhf is left importable
    assert not any(name == "openrlhf" or name.startswith("openrlhf.") for name in sys.modules)
    with pytest.raises(ModuleNotFoundError):
        __import__("openrlhf")
    assert isinstance(result.rewards, torch.Tensor)


@needs_no_openrlhf
@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("from openrlhf.utils import get_tokenizer", "openrlhf.utils.get_tokenizer"),
        ("import openrlhf.models", "openrlhf.models"),
        ("from openrlhf.utils.agent import AgentInstanceBase", "openrlhf.utils.agent"),  # agent files only
    ],
)
def test_other_openrlhf_names_fail_with_one_line_naming_tidals_module(tmp_path, line, named):
    path = tmp_path / "reward_func.py"
    path.write_text(
        f"{line}\n\ndef reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n"
    )
    with pytest.raises(RewardError) as info:
        load_reward_source(str(path))
    message = str(info.value)
    assert "\n" not in message
    assert f"{named} is OpenRLHF's and has no tidal stand-in" in message
    assert "openrlhf.utils (extract_boxed_answer, grade_answer: tidal.rewards.math_grading)" in message
    assert "openrlhf" not in sys.modules
