"""``--attn_implementation flash_attention_2`` without the flash-attn package (most OpenRLHF scripts
pass it) loads the model with sdpa, said once at info level, instead of transformers' ImportError."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from tidal.config.model import ModelConfig
from tidal.models import loading
from tidal.models.loading import available_attn_implementation, load_causal_lm

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here"
)


def test_flash_attention_2_without_flash_attn_maps_to_sdpa_once(monkeypatch):
    loading._say_no_flash_attn.cache_clear()
    messages = []
    logger = logging.getLogger("tidal.tidal.models.loading")
    monkeypatch.setattr(loading, "get_logger", lambda name: logger)
    monkeypatch.setattr(logger, "info", lambda msg, *a: messages.append(msg))
    assert available_attn_implementation("flash_attention_2") == "sdpa"
    assert available_attn_implementation("flash_attention_2") == "sdpa"
    assert available_attn_implementation("eager") == "eager"
    assert len(messages) == 1 and "flash-attn package is not installed" in messages[0]


def test_a_model_loads_with_flash_attention_2_requested(tiny_llama):
    cfg = ModelConfig(pretrain=str(tiny_llama), attn_implementation="flash_attention_2")
    model = load_causal_lm(cfg, torch.device("cpu"))
    assert model.config._attn_implementation == "sdpa"
