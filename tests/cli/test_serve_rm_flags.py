"""``tidal serve_rm``'s OpenRLHF flags: ``--packing_samples`` (packed micro-batches score like padded
ones), ``--load_in_4bit`` (bitsandbytes NF4 layers, on the CPU too), ``--disable_fast_tokenizer``."""

from __future__ import annotations

import pytest
import torch
import transformers

from tidal.checkpoint import save_hf_model
from tidal.cli.serve_rm import parse_config
from tidal.config import ModelConfig
from tidal.distributed import World
from tidal.models import load_tokenizer
from tidal.models.value_model import load_value_model, reward_config
from tidal.rewards.server import RewardScorer

QUERIES = ["1+2=3", "10+20=30 and a longer answer", "7+8=15", "x"]


@pytest.fixture(scope="module")
def rm_path(tiny_llama, tmp_path_factory):
    tokenizer = load_tokenizer(str(tiny_llama))
    torch.manual_seed(0)
    model = load_value_model(ModelConfig(pretrain=str(tiny_llama)), torch.device("cpu"))
    out = tmp_path_factory.mktemp("rm")
    return save_hf_model(model, tokenizer, out, World(), reward_config(model, tokenizer))


def _scorer(rm_path, *flags) -> RewardScorer:
    return RewardScorer.load(parse_config(["--reward_pretrain", str(rm_path), *flags]), torch.device("cpu"))


def test_packed_micro_batches_give_the_padded_rewards(rm_path):
    padded = _scorer(rm_path, "--batch_size", "3")(QUERIES)
    packed_scorer = _scorer(rm_path, "--batch_size", "3", "--packing_samples")
    seen = []
    forward = packed_scorer.model.scores
    packed_scorer.model.scores = lambda batch: seen.append(batch["input_ids"].shape[0]) or forward(batch)
    assert packed_scorer(QUERIES) == pytest.approx(padded, abs=1e-5)
    assert seen == [1, 1]  # two micro-batches, each one packed row


def test_load_in_4bit_quantizes_the_reward_model(rm_path):
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.nn import Linear4bit

    scorer = _scorer(rm_path, "--load_in_4bit")
    assert any(isinstance(m, Linear4bit) for m in scorer.model.modules())
    rewards = scorer(QUERIES)
    full = _scorer(rm_path)(QUERIES)
    assert all(isinstance(r, float) and r == r for r in rewards)
    assert rewards != full  # quantized weights, other rewards
    assert rewards == pytest.approx(full, abs=0.5)  # but the same model


def test_disable_fast_tokenizer_asks_for_the_slow_tokenizer(rm_path, monkeypatch):
    calls = []
    load = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda path, **kw: calls.append(kw.get("use_fast")) or load(path, **kw),
    )
    _scorer(rm_path, "--disable_fast_tokenizer")
    _scorer(rm_path)
    assert calls == [False, True]
