"""Forward passes: chunked LM-head log-probs vs full logits, and packed (varlen) vs padded attention."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.algorithms.logprobs import entropy_from_logits, gather_logprobs
from tidal.data import collate_packed, collate_padded
from tidal.data.sft import SFTSample
from tidal.models import forward as forward_module
from tidal.models import token_logprobs
from tidal.models.logprob_head import chunked_logprobs
from tidal.models.packed_attention import (
    VARLEN,
    enable_varlen_attention,
    varlen_attention_forward,
    varlen_kwargs,
    with_equal_head_dims,
)

SAMPLES = [
    SFTSample([1, 40, 41, 42, 43, 44, 3], [0, 1, 1, 1, 1, 1, 1]),
    SFTSample([1, 50, 3], [0, 1, 1]),
    SFTSample([1, 60, 61, 62, 63, 64, 65, 66, 67, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
]


@pytest.fixture(scope="module")
def tiny_deepseek_v3(tmp_path_factory):
    """A tiny DeepSeek-V3 whose value head dim (16) differs from the query/key one (16 + 8), as the real
    model's (128 vs 192); the registry's tiny config has them equal."""
    from tidal.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_deepseek_v3"), "deepseek_v3", v_head_dim=16)


def _model(path, attn="sdpa", device="cpu"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=attn).to(
        device
    )


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _loss_and_grads(model, batch, **kwargs):
    lp, out = token_logprobs(model, batch, **kwargs)
    mask = batch["loss_mask"].float()
    loss = -(lp * mask).sum() / mask.sum()
    entropy = getattr(out, "entropy", None)
    if entropy is not None:
        loss = loss - 0.1 * (entropy * mask).sum() / mask.sum()
    loss.backward()
    return lp.detach(), None if entropy is None else entropy.detach(), _grads(model)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
def test_chunked_logprobs_entropy_and_grads_match_full_logits(family, packing, entropy, request):
    model = _model(request.getfixturevalue(family))
    batch = (collate_packed if packing else collate_padded)(SAMPLES, 0)
    for temperature in (1.0, 0.7):
        full = _loss_and_grads(model, batch, temperature=temperature, chunk_size=None, with_entropy=entropy)
        chunked = _loss_and_grads(model, batch, temperature=temperature, chunk_size=3, with_entropy=entropy)
        torch.testing.assert_close(chunked[0], full[0], atol=1e-5, rtol=1e-5)
        if entropy:
            torch.testing.assert_close(chunked[1], full[1], atol=1e-5, rtol=1e-5)
        assert chunked[2].keys() == full[2].keys() and len(full[2]) > 5
        for name, grad in full[2].items():
            torch.testing.assert_close(chunked[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_chunked_logprobs_function_against_reference():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    logp, ent = chunked_logprobs(hidden, weight, None, targets, 0.9, chunk_size=8, with_entropy=True)
    z = hidden @ weight.T
    torch.testing.assert_close(logp, gather_logprobs(z, targets, 0.9).to(logp.dtype))
    torch.testing.assert_close(ent, entropy_from_logits(z, 0.9).to(ent.dtype))
    (g_h, g_w) = torch.autograd.grad((logp + ent).sum(), (hidden, weight))
    z_ref = hidden @ weight.T
    ref = gather_logprobs(z_ref, targets, 0.9) + entropy_from_logits(z_ref, 0.9)
    (r_h, r_w) = torch.autograd.grad(ref.sum(), (hidden, weight))
    torch.testing.assert_close(g_h, r_h)
    torch.testing.assert_close(g_w, r_w)


def test_chunk_function_gradcheck_with_bias_and_temperature():
    torch.manual_seed(0)
    hidden = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 9, (11,))

    def fn(h, w, b):
        return chunked_logprobs(h, w, b, targets, 0.8, chunk_size=4)[0]

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_chunked_grads_under_bf16_autocast_match_full_logits(tiny_qwen2, device):
    """The backward replays the forward's autocast: bf16 matmuls, float32 gradients on the parameters."""
    model = _model(tiny_qwen2, device=device)
    batch = {k: v.to(device) for k, v in collate_packed(SAMPLES).items()}
    results = []
    for chunk in (None, 4):
        with torch.autocast(device, dtype=torch.bfloat16):
            lp, _ = token_logprobs(model, batch, chunk_size=chunk)
        (lp * batch["loss_mask"]).sum().backward()
        results.append((lp.detach(), _grads(model)))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    for name, grad in want_grads.items():
        assert got_grads[name].dtype == torch.float32
        assert (got_grads[name] - grad).norm() <= 3e-2 * grad.norm() + 1e-6, name


def test_lazy_logits_and_aux_outputs_match_the_plain_forward(tiny_llama):
    model = _model(tiny_llama).eval()
    batch = collate_padded(SAMPLES, 0)
    with torch.no_grad():
        _, plain = token_logprobs(model, batch, chunk_size=None)
        _, lazy = token_logprobs(model, batch)
        torch.testing.assert_close(lazy.logits, plain.logits)
        torch.testing.assert_close(lazy["logits"], plain.logits)
    assert lazy.past_key_values is None  # other attributes come from the model's own outputs


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_deepseek_v3"])
def test_varlen_implementation_matches_padded_on_cpu_fallback(family, request):
    """``tidal_varlen`` on the CPU takes its mask fallback: this checks the plumbing (kwargs reach the
    attention layers, padded batches keep SDPA's mask) that the CUDA kernel path shares."""
    model = _model(request.getfixturevalue(family)).eval()
    padded, packed = collate_padded(SAMPLES, 0), collate_packed(SAMPLES)
    with torch.no_grad():
        want_pad, _ = token_logprobs(model, padded)
        assert enable_varlen_attention(model, force=True) and model.config._attn_implementation == VARLEN
        assert "cu_seq_lens_q" in forward_module.model_inputs(model, packed)
        got_pad, _ = token_logprobs(model, padded)
        got_pack, _ = token_logprobs(model, packed)
        packed.pop("cu_seqlens")  # the experience batches carry only segment ids
        got_pack_seg, _ = token_logprobs(model, packed)
    torch.testing.assert_close(got_pad, want_pad, atol=1e-6, rtol=0)
    want = want_pad[padded["loss_mask"].bool()]
    torch.testing.assert_close(got_pack[packed["loss_mask"].bool()], want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_pack_seg, got_pack)


def test_deepseek_v3_packed_mask_path_losses_and_grads_equal_padded(tiny_deepseek_v3):
    """Packed rows through SDPA's 4-D mask (the CPU path; v_head_dim 16 vs q/k 24 is fine for SDPA): the
    same log-probs and the same gradients of the summed token loss as the padded batch."""
    model = _model(tiny_deepseek_v3)
    assert model.config.v_head_dim != model.config.qk_nope_head_dim + model.config.qk_rope_head_dim
    padded, packed = collate_padded(SAMPLES, 0), collate_packed(SAMPLES)
    results = {}
    for name, batch in (("padded", padded), ("packed", packed)):
        lp, _ = token_logprobs(model, batch)
        (lp * batch["loss_mask"]).sum().backward()
        results[name] = (lp.detach()[batch["loss_mask"].bool()], _grads(model))
    torch.testing.assert_close(results["packed"][0], results["padded"][0], atol=1e-5, rtol=0)
    assert results["packed"][1].keys() == results["padded"][1].keys()
    for name, grad in results["padded"][1].items():
        torch.testing.assert_close(results["packed"][1][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def _causal_sdpa(q, k, v, scale):
    """The stand-in kernel: causal SDPA on ``[T, H, D]`` tensors (one sample)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("qk_dim, v_dim", [(24, 16), (16, 24), (8, 8)])
def test_equal_head_dims_padding_is_exact(qk_dim, v_dim):
    """Zero-padding the narrower of q/k and v for a kernel that needs one head dim, then cutting the
    output back to v's width, equals attention on the unpadded tensors (values and gradients)."""
    torch.manual_seed(0)
    q, k = (torch.randn(7, 3, qk_dim, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(7, 3, v_dim, dtype=torch.float64, requires_grad=True)
    widths = []

    def kernel(q, k, v):
        widths.append({q.shape[-1], k.shape[-1], v.shape[-1]})
        return _causal_sdpa(q, k, v, qk_dim**-0.5)

    got = with_equal_head_dims(kernel, q, k, v)
    assert widths == [{max(qk_dim, v_dim)}] and got.shape == (7, 3, v_dim)
    want = _causal_sdpa(q, k, v, qk_dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    cotangent = torch.randn_like(want)
    grads = torch.autograd.grad(got, (q, k, v), cotangent)
    want_grads = torch.autograd.grad(want, (q, k, v), cotangent)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


@pytest.mark.gpu
def test_cuda_varlen_with_deepseek_head_dims_matches_padded_sdpa():
    """The flash varlen path with DeepSeek-V3's head dims (q/k 192, v 128, 128 heads' worth cut to 4) in
    bf16: per-sample causal attention, as SDPA on each sample's unpadded tensors computes it."""
    torch.manual_seed(0)
    lengths, heads = [5, 17, 9], 4
    total = sum(lengths)
    query, key = (torch.randn(1, heads, total, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    value = torch.randn(1, heads, total, 128, device="cuda", dtype=torch.bfloat16)
    for t in (query, key, value):
        t.requires_grad_(True)
    segment_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None].cuda()
    kwargs = varlen_kwargs({"input_ids": segment_ids, "segment_ids": segment_ids})
    scale = 192**-0.5
    got, _ = varlen_attention_forward(torch.nn.Module(), query, key, value, None, scaling=scale, **kwargs)
    parts, start = [], 0
    for n in lengths:
        q, k, v = (t[0, :, start : start + n].transpose(0, 1).float() for t in (query, key, value))
        parts.append(_causal_sdpa(q, k, v, scale))
        start += n
    want = torch.cat(parts)[None]
    assert got.shape == want.shape == (1, total, heads, 128)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    cotangent = torch.randn_like(want)
    grads = torch.autograd.grad(got.float(), (query, key, value), cotangent)
    want_grads = torch.autograd.grad(want, (query, key, value), cotangent)
    for g, w in zip(grads, want_grads, strict=True):
        assert (g.float() - w.float()).norm() <= 5e-2 * w.float().norm(), g.shape


def test_eager_models_keep_the_additive_mask(tiny_llama):
    model = _model(tiny_llama, attn="eager")
    assert not enable_varlen_attention(model, force=True)
    kwargs = forward_module.model_inputs(model, collate_packed(SAMPLES))
    assert kwargs["attention_mask"].dtype == torch.float32 and "cu_seq_lens_q" not in kwargs


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_deepseek_v3"])
def test_cuda_varlen_packed_matches_mask_path_in_bf16(family, request, monkeypatch):
    """On CUDA, packed rows run the flash varlen kernel; log-probs and gradients agree with the 4-D
    mask path (both bf16 autocast, so within bf16 tolerance)."""
    results = {}
    for mode in ("mask", "auto"):
        monkeypatch.setattr(forward_module, "PACKED_ATTENTION", mode)
        model = _model(request.getfixturevalue(family), device="cuda")
        batch = {k: v.cuda() for k, v in collate_packed(SAMPLES).items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp, _ = token_logprobs(model, batch)
        (lp * batch["loss_mask"]).sum().backward()
        assert (model.config._attn_implementation == VARLEN) == (mode == "auto")
        results[mode] = (lp.detach(), _grads(model))
    torch.testing.assert_close(results["auto"][0], results["mask"][0], atol=3e-2, rtol=0)
    for name, grad in results["mask"][1].items():
        got = results["auto"][1][name]
        assert (got - grad).norm() <= 5e-2 * grad.norm() + 1e-6, name


@pytest.mark.gpu
def test_triton_head_kernels_match_the_torch_path_in_float32():
    """On CUDA a chunk's log-probs and logit gradients come from Triton kernels; in float32 they match
    the torch path (run on the CPU) with temperature, across chunk boundaries and a 50k vocabulary."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 64, generator=g)
    weight = torch.randn(50_000, 64, generator=g) * 0.2
    targets = torch.randint(0, 50_000, (300,), generator=g)
    upstream = torch.randn(300, generator=g)
    results = {}
    for device in ("cpu", "cuda"):
        h, w = (t.detach().to(device).requires_grad_() for t in (hidden, weight))
        logp, _ = chunked_logprobs(h, w, None, targets.to(device), 0.7, chunk_size=128)
        (logp * upstream.to(device)).sum().backward()
        results[device] = [t.detach().cpu() for t in (logp, h.grad, w.grad)]
    for got, want in zip(results["cuda"], results["cpu"], strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
