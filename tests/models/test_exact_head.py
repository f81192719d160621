"""The exact-mode forward's chunked LM head (``tidal.models.forward._exact_token_values``, through
``logprob_head.head_logprobs``): the sampled tokens' log-probs computed ``chunk_size`` tokens at a time
(batch-invariant linear, then log-softmax) are the full logits' bit for bit, whatever the chunk size and
wherever a chunk boundary falls in a sample, with no call ever holding more than a chunk's logits; and the
samples' layout computed once per forward (``batch_invariant.segment_layout``, handed to every layer) gives
each sample the attention it gets alone. The engine's values still equal the trainer's:
tests/rollout/test_exact_*.py, tests/trainers/ppo/test_exact_rl.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.rollout.triton_interpreter import EXACT_KERNELS, interpreted
from tidal.models.forward import token_logprobs
from tidal.rollout import batch_invariant as bi
from tidal.testing import build_tiny_model

TEMPERATURE = 0.8
LENGTHS = [7, 13, 1, 5, 11]  # packed samples (one of a single token)
CHUNKS = [1, 5, 16, 17, 2048]  # 5 and 17 cut inside samples; 2048 (the default) holds the whole row


@pytest.fixture(scope="module")
def exact_model(tmp_path_factory):
    """``exact_model(family, dtype, **overrides)`` -> a tiny transformers model through ``make_exact``."""
    cache = {}

    def build(family: str, dtype: torch.dtype = torch.float32, **overrides):
        key = (family, dtype, repr(sorted(overrides.items())))
        if key not in cache:
            path = build_tiny_model(tmp_path_factory.mktemp(family), family, logit_scale=4.0, **overrides)
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            cache[key] = bi.make_exact(model, compute_dtype=dtype)
        return cache[key]

    return build


def _batches() -> list[dict]:
    """One packed row of ``LENGTHS`` samples and three right-padded rows."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (1, sum(LENGTHS)), generator=g)
    packed = {
        "input_ids": ids,
        "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None],
        "segment_ids": torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))[None],
    }
    mask = torch.zeros(3, 12, dtype=torch.long)
    for row, n in enumerate((12, 4, 9)):
        mask[row, :n] = 1
    padded = {
        "input_ids": ids[:, :36].view(3, 12),
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    }
    return [packed, padded]


def _head_rows(monkeypatch, vocab: int = 512) -> list[int]:
    """Records the row count of every vocabulary-wide GEMM through ``batch_invariant.linear`` looked up on
    the package, as the chunked head (and exact LoRA) call it; the switched layers hold their own reference."""
    rows, linear = [], bi.linear

    def spy(x, weight, bias=None):
        if weight.shape[0] == vocab:
            rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return linear(x, weight, bias)

    monkeypatch.setattr(bi, "linear", spy)
    return rows


@pytest.mark.parametrize(
    ("family", "dtype"),
    [
        ("qwen2", torch.float32),  # tied embeddings
        ("llama", torch.float32),  # an untied head
        ("qwen3_moe", torch.float32),
        ("qwen2", torch.bfloat16),  # the GPU's compute dtype (float32 master weights rounded once)
    ],
)
def test_chunked_exact_head_gives_the_full_logits_bits(exact_model, monkeypatch, family, dtype):
    model = exact_model(family, dtype)
    exact_forward = model.get_output_embeddings().__dict__["forward"]
    rows = _head_rows(monkeypatch)
    for batch in _batches():
        with torch.no_grad():
            full, full_out = token_logprobs(model, batch, TEMPERATURE, chunk_size=None, with_entropy=True)
            assert rows == []  # chunk_size=None: the head's own forward, full logits
            for chunk in CHUNKS:
                lp, out = token_logprobs(model, batch, TEMPERATURE, chunk_size=chunk, with_entropy=True)
                assert torch.equal(lp, full) and lp.dtype == torch.float32
                assert torch.equal(out.entropy, full_out.entropy)
                tokens = batch["input_ids"].numel() - batch["input_ids"].shape[0]
                assert max(rows) == min(chunk, tokens) and sum(rows) == tokens
                rows.clear()
                assert torch.equal(out.logits, full_out.logits)  # computed on demand, as the default path's
        # make_exact's head forward is back in place after each forward
        assert model.get_output_embeddings().__dict__["forward"] is exact_forward
    # with grad (the policy loss): the chunked values, spliced onto the default forward's gradient
    model.train()
    try:
        lp = token_logprobs(model, _batches()[0], TEMPERATURE, chunk_size=5)[0]
    finally:
        model.eval()
    with torch.no_grad():
        assert torch.equal(lp.detach(), token_logprobs(model, _batches()[0], TEMPERATURE, chunk_size=None)[0])
    assert lp.requires_grad


def test_a_head_that_is_not_a_plain_linear_keeps_the_full_logits(tmp_path, monkeypatch):
    """A LoRA adapter on ``lm_head`` (peft's wrapper, merged in exact mode) is not chunked: the head's own
    exact forward gives full logits (every token in one GEMM), whatever ``chunk_size`` says."""
    from peft import LoraConfig, get_peft_model

    from tidal.models.exact_lora import make_lora_exact

    path = build_tiny_model(tmp_path, "qwen2", logit_scale=4.0, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=["lm_head", "q_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)  # adapters that change the logits
    model = make_lora_exact(bi.make_exact(model))
    rows = _head_rows(monkeypatch)
    with torch.no_grad():
        for batch in _batches():
            full = token_logprobs(model, batch, TEMPERATURE, chunk_size=None)[0]
            assert torch.equal(token_logprobs(model, batch, TEMPERATURE, chunk_size=5)[0], full)
            assert rows == [batch["input_ids"].numel()] * 2
            rows.clear()


def test_a_sliding_window_family_keeps_its_bits(exact_model):
    """Mistral with a window shorter than the samples: every layer reads the one layout of the forward."""
    model = exact_model("mistral", sliding_window=4)
    with torch.no_grad():
        for batch in _batches():
            full = token_logprobs(model, batch, TEMPERATURE, chunk_size=None)[0]
            assert torch.equal(token_logprobs(model, batch, TEMPERATURE, chunk_size=3)[0], full)


def test_the_forwards_layout_gives_each_sample_its_own_attention():
    """``hf_exact_attention`` with the forward's layout (``tidal_segments``) or its own from the positions
    gives the same bits, and those are each sample's attention computed alone; padding tokens (positions
    that do not continue) are samples of their own."""
    from types import SimpleNamespace

    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 0, 0, 0, 0]])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 10, 8, generator=g)  # [B, H, T, D] as transformers hands it
    k, v = (torch.randn(2, 2, 10, 8, generator=g) for _ in range(2))
    module = SimpleNamespace()
    layout = bi.segment_layout(position_ids)
    assert layout.index.shape == (9, 6)  # samples of 4, 2, 3, 1 and 6, 1, 1, 1, 1 tokens
    with torch.no_grad():  # (with grad: the model's default attention)
        own = bi.hf_exact_attention(module, q, k, v, None, position_ids=position_ids)[0]
        given = bi.hf_exact_attention(module, q, k, v, None, tidal_segments=layout)[0]
    assert torch.equal(own, given)
    for row, starts in enumerate(([0, 4, 6, 9, 10], [0, 6, 7, 8, 9, 10])):
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            alone = bi.attention(
                *(x[row : row + 1, :, a:b].transpose(1, 2) for x in (q, k, v)),
                torch.arange(b - a)[None],
                8**-0.5,
            )
            assert torch.equal(given[row : row + 1, a:b], alone)


@pytest.fixture
def on_kernels(monkeypatch):
    """Every batch-invariant op on CPU tensors through the CUDA path's Triton kernels, interpreted."""
    with interpreted(EXACT_KERNELS):
        monkeypatch.setattr(bi.dispatch, "on_triton", lambda x: True)
        yield


def test_interpreted_chunked_exact_head_gives_the_full_logits_bits(exact_model, on_kernels):
    """The CUDA dispatch (Triton GEMM and log-prob kernels) chunked as on the GPU: the same bits."""
    model = exact_model(
        "qwen2", num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4
    )
    batch = _batches()[0]
    with torch.no_grad():
        full = token_logprobs(model, batch, TEMPERATURE, chunk_size=None)[0]
        for chunk in (5, 16):
            assert torch.equal(token_logprobs(model, batch, TEMPERATURE, chunk_size=chunk)[0], full)
