"""The registry of model families and what reads it: engine classes, tiny builders, the trainer's forward.

Every test here is parametrised over the registry, so a family added there is covered without editing
tests (as are the engine-vs-HF tests of ``test_engine_vs_hf.py``, via ``reference.FAMILIES``).
"""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import FAMILIES, cpu_config
from tidal.config.model import ModelConfig
from tidal.data import collate_packed, collate_padded
from tidal.data.sft import SFTSample
from tidal.models import token_logprobs
from tidal.models.loading import load_causal_lm
from tidal.models.logprob_head import CHUNKABLE_MODEL_TYPES, chunkable_head
from tidal.models.packed_attention import enable_varlen_attention
from tidal.rollout import LLMEngine
from tidal.rollout.models import registry
from tidal.rollout.models.layers import CausalLM
from tidal.testing import TINY_FAMILIES, build_tiny_model
from tidal.testing.tiny import tiny_config

SAMPLES = [
    SFTSample([1, 40, 41, 42, 43, 44, 3], [0, 0, 1, 1, 1, 1, 1]),
    SFTSample([1, 50, 3], [0, 1, 1]),
    SFTSample([1, 60, 61, 62, 63, 64, 65, 66, 67, 3], [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]),
]


def test_registry_is_the_one_list():
    assert set(FAMILIES) == set(registry.FAMILIES) == set(TINY_FAMILIES)
    assert registry.supported_model_types() == tuple(sorted(registry.FAMILIES))
    assert registry.chunkable_model_types() <= CHUNKABLE_MODEL_TYPES
    with pytest.raises(
        registry.UnsupportedModelError, match=r"model_type 'gpt2' for the rollout engine; supported: "
    ):
        registry.model_class("gpt2")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_has_an_engine_class_and_a_tiny_config(family):
    cls = registry.model_class(family)
    assert issubclass(cls, CausalLM)
    config = tiny_config(family)
    assert config.model_type == family
    args = cls.args_from_hf_config(config)
    assert (args.model_type, args.num_layers, args.vocab_size) == (family, 4, 512)


def test_unknown_tiny_family_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model family 'gpt2'"):
        build_tiny_model(tmp_path / "m", "gpt2")
    assert not (tmp_path / "m").exists()


def test_rope_tables_are_buffers_that_follow_the_model(tiny_model):
    """``sleep(level=2)`` / ``wake_up`` move the model with ``.to(device)``: the RoPE tables must move with
    it (non-persistent buffers), without being weights or state-dict entries."""
    model = LLMEngine(tiny_model("llama"), cpu_config(max_model_len=64)).model
    assert {name for name, _ in model.named_buffers()} == {"rotary.cos", "rotary.sin"}
    assert not any("rotary" in name for name in model.state_dict())
    assert model.rotary.cos.dtype == torch.float32 and model.rotary.cos.shape[0] == 64
    model.to("meta")
    assert model.rotary.cos.is_meta and model.rotary.sin.is_meta


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_side_loads_each_family_and_takes_an_sft_step(family, tiny_model):
    """RL trains the policy through ``tidal.models`` (transformers): the same families must load there, give
    the same log-probs packed (varlen path) and padded, chunked head and full logits, and learn."""
    if reason := registry.feature_refusal(family, "packing_samples"):
        pytest.skip(reason)
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_model(family))), torch.device("cpu"))
    assert (chunkable_head(model) is not None) == registry.FAMILIES[family].chunkable_head
    padded, packed = collate_padded(SAMPLES, 0), collate_packed(SAMPLES)
    with torch.no_grad():
        full, _ = token_logprobs(model, padded, chunk_size=None)
        chunked, _ = token_logprobs(model, padded, chunk_size=4)
        # Gemma 2 loads with eager attention (SDPA cannot soft-cap): its packed rows take the 4-D mask path.
        assert enable_varlen_attention(model, force=True) or model.config._attn_implementation == "eager"
        packed_lp, _ = token_logprobs(model, packed)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=0)
    want = full[padded["loss_mask"].bool()]
    torch.testing.assert_close(packed_lp[packed["loss_mask"].bool()], want, atol=1e-5, rtol=0)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mask = packed["loss_mask"].float()
    losses = []
    for _ in range(2):
        lp, _ = token_logprobs(model, packed)
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[1] < losses[0]


def test_a_family_refuses_the_features_its_record_names(tiny_model, monkeypatch):
    """``Family.refuses``: a feature asked for is refused in one line naming it and the family; a refused
    ``cuda_graphs`` / ``async_scheduling`` runs eager / synchronous instead."""
    import dataclasses

    reasons = {"prefix_caching": "no saved states", "cuda_graphs": "dynamic shapes"}
    entry = dataclasses.replace(registry.FAMILIES["qwen2"], refuses=reasons)
    monkeypatch.setitem(registry.FAMILIES, "qwen2", entry)
    path = tiny_model("qwen2")
    with pytest.raises(
        ValueError, match="prefix_caching is not supported for the qwen2 family: no saved states"
    ):
        LLMEngine(path, cpu_config(enable_prefix_caching=True))
    assert registry.feature_refusal("qwen2", "cuda_graphs").endswith("dynamic shapes")
    assert registry.feature_refusal("qwen2", "tensor_parallel") is None
    engine = LLMEngine(path, cpu_config(max_model_len=64))
    assert engine.eager
    with pytest.raises(ValueError, match="unknown engine feature 'paging'"):
        registry.feature_refusal("qwen2", "paging")
