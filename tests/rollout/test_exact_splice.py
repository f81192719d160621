"""The trainer's exact-mode forward with grad enabled (the policy loss): its log-prob values are the engine's
bit for bit (a no-grad forward through the batch-invariant ops) and its gradient is the default forward's
(the straight-through splice of ``tidal.models.forward.exact_token_logprobs``), with gradient checkpointing
(whose recompute runs with grad enabled) and packed rows; and the block-GEMM exact attention is attention."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.models.forward import spliced_logprobs, token_logprobs
from tidal.rollout import EngineConfig, LLMEngine
from tidal.rollout import batch_invariant as bi
from tidal.rollout.sampling_params import SamplingParams

TEMPERATURE = 0.8


def _rollout(path, device: str = "cpu"):
    """Six exact-mode samples of mixed prompt and response lengths, and one packed row of them."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (int(k),), generator=g).tolist() for k in (3, 17, 9, 25, 5, 12)]
    params = [
        SamplingParams(temperature=TEMPERATURE, max_tokens=m, seed=i, ignore_eos=True)
        for i, m in enumerate((7, 2, 15, 9, 1, 11))
    ]
    config = EngineConfig(device=device, max_model_len=128, num_kv_blocks=64, exact_logprobs=True)
    engine = LLMEngine(path, config)
    outputs = engine.generate(prompts, params)
    engine.close()
    rows = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
    lengths = [len(r) for r in rows]
    batch = {
        "input_ids": torch.tensor([t for r in rows for t in r])[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "segment_ids": torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))[None],
    }
    return prompts, outputs, lengths, {k: t.to(device) for k, t in batch.items()}


def _policy(path, exact: bool, device: str = "cpu"):
    """A float32 master policy as ``tidal ppo`` trains it (exact mode computes in the engine's dtype)."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return bi.make_exact(model) if exact else model


def _loss_and_grads(model, batch, autocast: bool = False):
    """The log-probs and the parameters' gradients of a fixed weighting of them (bf16 autocast on CUDA)."""
    device = batch["input_ids"].device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        lp = token_logprobs(model, batch, TEMPERATURE)[0].float()
    weights = torch.linspace(-1.0, 1.0, lp.shape[1], device=lp.device)[None]
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_exact_forward_with_grad_gives_the_engine_values_and_the_default_gradient(tiny_model, family):
    path = tiny_model(family, logit_scale=4.0)
    prompts, outputs, lengths, batch = _rollout(path)
    exact_lp, exact_grads = _loss_and_grads(_policy(path, exact=True), batch)
    default_lp, default_grads = _loss_and_grads(_policy(path, exact=False), batch)
    offset, default_gap = 0, 0.0
    for p, o, n in zip(prompts, outputs, lengths, strict=True):
        engine = torch.tensor(o.outputs[0].logprobs)
        span = slice(offset + len(p), offset + n)
        assert torch.equal(exact_lp[0, span], engine)  # bit for bit, with grad enabled
        default_gap = max(default_gap, (default_lp[0, span] - engine).abs().max().item())
        offset += n
    assert 0.0 < default_gap < 1e-3  # the default forward is not exact: the check above is not vacuous
    for name, grad in default_grads.items():  # the default forward's gradient, up to float32 rounding
        torch.testing.assert_close(exact_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_cuda_spliced_forward_gives_the_bf16_engine_values_and_the_autocast_gradient(tiny_model):
    """On CUDA: a bf16 engine, a float32 master policy under bf16 autocast (as ``tidal ppo`` runs it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = tiny_model("qwen2", logit_scale=4.0)
    prompts, outputs, lengths, batch = _rollout(path, "cuda")
    exact_lp, exact_grads = _loss_and_grads(_policy(path, True, "cuda"), batch, autocast=True)
    _, default_grads = _loss_and_grads(_policy(path, False, "cuda"), batch, autocast=True)
    offset = 0
    for p, o, n in zip(prompts, outputs, lengths, strict=True):
        engine = torch.tensor(o.outputs[0].logprobs)
        assert torch.equal(exact_lp[0, offset + len(p) : offset + n].cpu(), engine)
        offset += n
    for name, grad in default_grads.items():  # the same bf16 autocast forward: equal up to its rounding
        torch.testing.assert_close(exact_grads[name], grad, rtol=2e-2, atol=1e-4, msg=name)


def test_splice_value_is_exact_bitwise_and_gradient_is_the_fast_ones():
    exact = torch.tensor([[0.0, -1.25, -3.0e-8, -17.5]])
    fast = torch.tensor([[0.0, -1.2500001, -2.9e-8, -17.49]], requires_grad=True)
    out = spliced_logprobs(exact, fast)
    assert torch.equal(out, exact)
    (out * torch.tensor([[1.0, 2.0, 3.0, 4.0]])).sum().backward()
    assert torch.equal(fast.grad, torch.tensor([[1.0, 2.0, 3.0, 4.0]]))


@pytest.mark.parametrize("window", [None, 5])
def test_exact_attention_is_causal_attention(window):
    """The block-GEMM attention (every query block x key block product one same-shaped GEMM) computes
    causal (sliding-window) GQA attention: close to SDPA's, for prefill-like and decode-like queries."""
    from tidal.rollout.batch_invariant.causal_attention import _torch_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, h, 8, generator=g) for n, h in ((21, 4), (37, 2), (37, 2)))
    pos = torch.tensor([list(range(16, 37)), list(range(21))])  # a continued row and a fresh one
    torch.testing.assert_close(
        bi.attention(q, k, v, pos, 0.35, window), _torch_attention(q, k, v, pos, 0.35, window)
    )
    last = pos[:, -1:]  # one decode query per row
    torch.testing.assert_close(
        bi.attention(q[:, -1:], k, v, last, 0.35, window),
        _torch_attention(q[:, -1:], k, v, last, 0.35, window),
    )
