"""The prefill through torch's variable-length flash attention (``attention.flash_prefill_attention``):
the metadata it reads, and (``gpu``) its output against the padded SDPA path and a float32 reference at
model shapes, the dispatch, and an engine's prefill on either path.

bfloat16 tolerance: every path gets the same bf16 q/k/v; the reference is the padded path in float32 on
those values. The kernel's error is its roundings (probabilities to bf16 before the P.V product, the
output to bf16) and the float32 accumulation: each sequence's relative error must stay under 1e-2 and
within 1.5x of the padded bf16 path's own (plus 1e-3). Attending across a sequence boundary, or a
window one key too wide or too narrow at 128 keys, is far outside that.
"""

from __future__ import annotations

import pytest
import torch

from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.runner import attention
from tidal.rollout.runner.attention import AttentionMetadata


def _spy_prefills(monkeypatch) -> list[AttentionMetadata]:
    seen, inner = [], attention.prefill_attention

    def spy(q, k, v, meta, *args, **kwargs):
        seen.append(meta)
        return inner(q, k, v, meta, *args, **kwargs)

    monkeypatch.setattr("tidal.rollout.models.layers.prefill_attention", spy)
    return seen


def test_the_prefill_step_marks_where_each_sequence_starts(tiny_model, monkeypatch):
    """``cu_seqlens`` is [0, cumulative lengths] of the step's prompts and agrees with ``pad_index``; on the
    CPU the padded path runs (flash is for CUDA in half precision)."""
    seen = _spy_prefills(monkeypatch)
    engine = LLMEngine(tiny_model("qwen2"), EngineConfig(device="cpu", dtype="float32", max_model_len=64))
    prompts = [[5, 6, 7], [8] * 11, [9]]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=2))
    meta = seen[0]
    assert meta.cu_seqlens.dtype == torch.int32
    assert meta.cu_seqlens.tolist() == [0, 3, 14, 15]
    assert meta.pad_index[:, 0].tolist() == meta.cu_seqlens[:-1].tolist()
    q = torch.zeros(15, 2, 8)
    assert not attention.flash_prefill_usable(q, q, q, meta)


def _packed_case(lens, heads, kv_heads, head_dim, seed):
    """q/k/v as non-contiguous views of one packed projection (as the attention layer's), bf16 on CUDA,
    and the prefill metadata ``ModelRunner._prefill_tensors`` builds for ``lens``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = sum(lens)
    packed = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device="cuda", generator=gen) * 2
    packed = packed.to(torch.bfloat16)
    q, k, v = packed.split([heads, kv_heads, kv_heads], dim=1)
    lens_t = torch.tensor(lens, device="cuda")
    starts = torch.cumsum(lens_t, 0) - lens_t
    cols = torch.arange(max(lens), device="cuda")
    valid = cols[None, :] < lens_t[:, None]
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.zeros(tokens, dtype=torch.int64, device="cuda"),
        pad_index=torch.where(valid, starts[:, None] + cols[None, :], 0),
        pad_valid=valid,
        cu_seqlens=torch.nn.functional.pad(torch.cumsum(lens_t, 0), (1, 0)).int(),
    )
    return q, k, v, meta


def _padded(q, k, v, meta, window, scale):
    attention.FLASH_PREFILL = False
    try:
        return attention.prefill_attention(
            q, k, v, AttentionMetadata(**vars(meta) | {"_masks": {}}), window, scale
        )
    finally:
        attention.FLASH_PREFILL = True


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, window",
    [(28, 4, 128, None), (28, 4, 128, 128), (14, 2, 64, None), (8, 4, 256, 1024), (16, 16, 128, None)],
)
def test_flash_prefill_matches_the_padded_path_at_model_shapes(heads, kv_heads, head_dim, window):
    lens = [1, 17, 300, 1024, 777, 2048, 4096]
    q, k, v, meta = _packed_case(lens, heads, kv_heads, head_dim, seed=heads + head_dim)
    scale = head_dim**-0.5
    assert attention.flash_prefill_usable(q, k, v, meta)
    out = attention.prefill_attention(q, k, v, meta, window, scale)
    padded = _padded(q, k, v, meta, window, scale)
    ref = _padded(q.float(), k.float(), v.float(), meta, window, scale)
    assert out.shape == ref.shape == (sum(lens), heads * head_dim)
    bounds = meta.cu_seqlens.tolist()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        err, own = _rel(out[a:b], ref[a:b]), _rel(padded[a:b], ref[a:b])
        assert err < 1e-2 and err <= 1.5 * own + 1e-3, (lens[i], err, own)
    # Bugs this tolerance catches: keys from the sequence before (one merged sequence), a window off by one.
    merged = AttentionMetadata(**vars(meta) | {"cu_seqlens": meta.cu_seqlens[[0, -1]]})
    merged.pad_index = torch.arange(sum(lens), device="cuda")[None]
    wrong = attention.flash_prefill_attention(q, k, v, merged, window, scale)
    last = slice(bounds[-2], bounds[-1])
    assert _rel(wrong[last], ref[last]) > 0.1
    if window is not None:
        for other in (window - 1, window + 1):
            off = attention.flash_prefill_attention(q, k, v, meta, other, scale)
            assert _rel(off[last], ref[last]) > 3 * _rel(out[last], ref[last])


@pytest.mark.gpu
def test_flash_prefill_declines_what_it_does_not_compute():
    q, k, v, meta = _packed_case([5, 9], 4, 2, 64, seed=0)
    assert attention.flash_prefill_usable(q, k, v, meta)
    assert not attention.flash_prefill_usable(q.float(), k.float(), v.float(), meta)  # float32: SDPA
    wide_qk = torch.zeros(14, 4, 192, device="cuda", dtype=torch.bfloat16)  # MLA: q/k 192, v 128
    assert not attention.flash_prefill_usable(wide_qk, wide_qk[:, :2], v, meta)
    wide = torch.zeros(14, 4, 512, device="cuda", dtype=torch.bfloat16)  # Gemma 4's global heads
    assert not attention.flash_prefill_usable(wide, wide[:, :2], wide[:, :2], meta)
    spans = AttentionMetadata(**vars(meta) | {"image_spans": (meta.pad_index, meta.pad_index)})
    assert not attention.flash_prefill_usable(q, k, v, spans)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):  # the user turned flash attention off
        assert not attention.flash_prefill_usable(q, k, v, meta)
    assert attention.flash_prefill_usable(q, k, v, meta)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
def test_an_engines_prefill_agrees_on_either_path(family, tiny_model, monkeypatch):
    """A bf16 engine's first sampled token's log-prob (which the prefill alone computes) on the flash path
    and on the padded one, prompts of mixed lengths (gemma3: sliding-window layers)."""
    path = tiny_model(family)
    prompts = [list(range(3, 3 + n)) for n in (1, 7, 40, 95)]
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    results, taken, inner = {}, [], attention.flash_prefill_attention
    monkeypatch.setattr(attention, "flash_prefill_attention", lambda *a: taken.append(1) or inner(*a))
    for flash in (True, False):
        monkeypatch.setattr(attention, "FLASH_PREFILL", flash)
        taken.clear()
        engine = LLMEngine(path, EngineConfig(device="cuda", max_model_len=128))
        outs = engine.generate(prompts, params)
        results[flash] = [(o.outputs[0].token_ids[0], o.outputs[0].logprobs[0]) for o in outs]
        assert bool(taken) == flash
        del engine
    for (tok_a, lp_a), (tok_b, lp_b) in zip(results[True], results[False], strict=True):
        assert tok_a == tok_b and abs(lp_a - lp_b) < 0.02, (tok_a, lp_a, tok_b, lp_b)
