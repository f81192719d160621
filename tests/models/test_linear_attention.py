"""The start-up check for training Gated DeltaNet models through flash-linear-attention
(``tidal.models.linear_attention``): which GPU / Triton / tilelang combinations fla's backward refuses, and
that a trainable hybrid model on such a GPU stops at start in one line, before any generation."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.config.args import ConfigError
from tidal.models import linear_attention as la
from tidal.testing.tiny import tiny_config

HOPPER = (9, 0)


@pytest.mark.parametrize(
    ("fla", "tilelang", "capability", "triton", "refused"),
    [
        ("0.6.0", False, HOPPER, "3.6.0", True),
        ("0.6.0", False, HOPPER, "3.4.0", True),  # the range's first version
        ("0.6.0", False, HOPPER, "3.7.0+git4f2e", True),  # a local build's suffix
        ("0.6.0", False, HOPPER, "3.7.1", False),  # fixed from here on
        ("0.6.0", False, HOPPER, "3.9.0", False),
        ("0.6.0", False, HOPPER, "3.3.1", False),  # before the bug
        ("0.6.0", True, HOPPER, "3.6.0", False),  # tilelang runs the backward instead
        ("0.6.0", False, (8, 0), "3.6.0", False),  # an A100
        ("0.6.0", False, (10, 0), "3.6.0", False),  # a Blackwell
        (None, False, HOPPER, "3.6.0", False),  # fla not installed: transformers' torch fallback
        ("0.6.0", False, HOPPER, None, False),  # no triton: fla cannot run at all
    ],
)
def test_fla_backward_problem_is_flas_own_condition(fla, tilelang, capability, triton, refused):
    problem = la.fla_backward_problem(fla, tilelang, capability, triton)
    assert (problem is not None) == refused
    if refused:
        assert (
            f"Triton {triton}" in problem and "#640" in problem and "3.4.0" in problem and "3.7.1" in problem
        )


def test_release_reads_the_numeric_version():
    assert la.release("3.6.0") == (3, 6, 0)
    assert la.release("3.7") == (3, 7, 0)
    assert la.release("3.10.2.post1") == (3, 10, 2)
    with pytest.raises(ValueError, match="not a version"):
        la.release("nightly")


def _model(family: str):
    return AutoModelForCausalLM.from_config(tiny_config(family, vocab_size=64))


def test_only_models_with_linear_attention_layers_are_checked():
    assert la.has_linear_attention(_model("qwen3_5_text"))
    assert la.has_linear_attention(_model("qwen3_5_moe_text"))
    assert not la.has_linear_attention(_model("qwen2"))
    assert not la.has_linear_attention(torch.nn.Linear(2, 2))  # no config at all
    vision_language = torch.nn.Module()  # Qwen3.5's VLMs keep the layer types in their text config
    vision_language.config = SimpleNamespace(text_config=SimpleNamespace(layer_types=["linear_attention"]))
    assert la.has_linear_attention(vision_language)


@pytest.fixture
def hopper_with_fla_on_triton_3_6(monkeypatch):
    """This machine made to look like an H200 with fla 0.6.0 and Triton 3.6.0, without tilelang."""
    real_find_spec = importlib.util.find_spec
    present = {"fla": True, "tilelang": False}
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            object() if present.get(name) else (None if name in present else real_find_spec(name, *a))
        ),
    )
    monkeypatch.setattr(la, "_version", {"fla-core": "0.6.0", "triton": "3.6.0"}.get)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: HOPPER)
    return present


def test_a_trainable_hybrid_model_on_such_a_gpu_stops_in_one_line(hopper_with_fla_on_triton_3_6):
    with pytest.raises(ConfigError) as err:
        la.check_linear_attention_training(_model("qwen3_5_text"), torch.device("cuda"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("flash-linear-attention 0.6.0 refuses the backward")
    for remedy in ("upgrade Triton to >= 3.7.1", "install tilelang", "uninstall flash-linear-attention"):
        assert remedy in message


def test_other_models_devices_and_installs_pass(hopper_with_fla_on_triton_3_6):
    la.check_linear_attention_training(_model("qwen2"), torch.device("cuda"))  # no Gated DeltaNet layers
    la.check_linear_attention_training(_model("qwen3_5_text"), torch.device("cpu"))  # fla is CUDA-only
    hopper_with_fla_on_triton_3_6["tilelang"] = True
    la.check_linear_attention_training(_model("qwen3_5_text"), torch.device("cuda"))
    hopper_with_fla_on_triton_3_6.update(tilelang=False, fla=False)
    la.check_linear_attention_training(_model("qwen3_5_text"), torch.device("cuda"))
