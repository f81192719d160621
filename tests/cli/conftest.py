"""Fixtures shared by the CLI tests."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


@pytest.fixture(scope="module")
def reward_model(tiny_llama, tmp_path_factory):
    """A reward model on the policy's tokenizer: the tiny LM's body with a random (seeded) value head."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_llama), num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    model.config.pad_token_id = tokenizer.pad_token_id
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def nan_model(tiny_llama, tmp_path_factory):
    """The tiny model with every weight NaN (it samples token 0 with a NaN log-prob: empty text)."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    path = tmp_path_factory.mktemp("nan_model")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(str(tiny_llama)).save_pretrained(path)
    return path
