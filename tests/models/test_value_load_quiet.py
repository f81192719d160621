"""Building a critic/reward model from a causal LM prints no transformers load report (``score.weight
MISSING`` is the design: a new head); weights missing from the body are still warned about, by tidal.
Applying LoRA shows no deprecation warning from peft reading transformers' old property."""

from __future__ import annotations

import logging

import pytest
import torch

from tidal.config.model import ModelConfig
from tidal.models import value_model
from tidal.models.value_model import load_value_model


def test_critic_from_policy_prints_no_load_report(tiny_llama, capfd):
    load_value_model(ModelConfig(pretrain=str(tiny_llama)), torch.device("cpu"))
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "MISSING" not in err and "not sharded" not in err
    assert logging.getLogger("transformers.modeling_utils").level == logging.NOTSET  # restored


def test_missing_body_weights_are_still_warned(monkeypatch):
    warnings = []
    monkeypatch.setattr(value_model.log, "warning", lambda msg, *args: warnings.append(msg % args))
    value_model.warn_missing_body_weights("m", {"missing_keys": ["score.weight"]})
    assert warnings == []
    value_model.warn_missing_body_weights("m", {"missing_keys": ["score.weight", "model.norm.weight"]})
    assert warnings == [
        "m: 1 weights missing from the checkpoint were initialised at random: model.norm.weight"
    ]


@pytest.mark.parametrize("name", value_model.QUIET_LOAD_LOGGERS)
def test_quiet_load_report_restores_levels(name):
    logger = logging.getLogger(f"transformers.{name}")
    before = logger.level
    with value_model.quiet_load_report():
        assert logger.level >= logging.ERROR
    assert logger.level == before


def test_lora_prints_no_deprecation_warning(tiny_llama):
    import warnings

    from tidal.models.loading import apply_lora, load_causal_lm

    model = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(model, ModelConfig(pretrain=str(tiny_llama), lora_rank=4))
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
