"""Fixtures for agent tests: a tiny engine, its tokenizer, and an engine spy that records every call."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine(tiny_llama):
    from tidal.rollout import EngineConfig, LLMEngine

    return LLMEngine(tiny_llama, EngineConfig(max_num_seqs=32, num_kv_blocks=256, max_model_len=256))


@pytest.fixture(scope="session")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


class SpyEngine:
    """Forwards to a real engine and records (prompts, params, outputs) of every ``generate`` call."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = []

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params):
        outputs = self.engine.generate(prompts, sampling_params)
        self.calls.append((prompts, sampling_params, outputs))
        return outputs


@pytest.fixture
def spy(engine):
    return SpyEngine(engine)
