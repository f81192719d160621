"""Reference results from ``transformers`` that the rollout engine must reproduce, and shared prompts."""

from __future__ import annotations

import torch

from tidal.rollout import EngineConfig, SamplingParams
from tidal.rollout.models.registry import FAMILIES as REGISTERED

FAMILIES = tuple(REGISTERED)  # every family the engine supports, in registry order


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: ``transformers`` greedy generation of one unpadded prompt."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float = 0.0) -> torch.Tensor:
    """log_softmax(logits / T) of each output token from one HF forward over prompt + output."""
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def assert_follows(
    reference, prompts: list[list[int]], outs, max_new_tokens: int, atol: float = 1e-4
) -> None:
    """Each engine output's greedy tokens are ``reference``'s (``hf_greedy``) and its log-probs the
    reference's forward over them (``hf_logprobs``) within ``atol``."""
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(reference, prompt, max_new_tokens)
        want = hf_logprobs(reference, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(out.outputs[0].logprobs, want.tolist(), strict=True)) < atol


# Prompts of different lengths (some not multiples of the KV block size).
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [100, 200, 300, *range(17, 34)], [42] * 3]


def cpu_config(**overrides) -> EngineConfig:
    """Tests compare with float32 CPU references, also on machines where ``device="auto"`` picks CUDA."""
    return EngineConfig(device="cpu", dtype="float32", **overrides)


def small_cache_config(**overrides) -> EngineConfig:
    """A CPU engine with 128-token contexts in blocks of 4 (prefix-cache and chunked-prefill tests)."""
    return cpu_config(**{"max_model_len": 128, "block_size": 4, **overrides})


def greedy(n: int) -> SamplingParams:
    """Greedy sampling of exactly ``n`` tokens."""
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def assert_same_outputs(expected, got, tol: float = 1e-5) -> None:
    """Same sampled tokens and log-probs within ``tol``, request by request and sample by sample."""
    for a, b in zip(expected, got, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < tol


def assert_same_start(expected, got, tokens: int = 4, tol: float = 0.05) -> None:
    """The first ``tokens`` sampled tokens equal and their log-probs within ``tol``, request by request: the
    bfloat16 comparison, where a near tie may send later tokens apart."""
    for a, b in zip(expected, got, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids[:tokens] == y.token_ids[:tokens]
        assert max(abs(p - q) for p, q in zip(x.logprobs[:tokens], y.logprobs[:tokens], strict=True)) < tol
