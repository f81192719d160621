"""The engine's Qwen-VL vision towers (``tidal/models/vision_attention.py``) and what a prefill
computes per image (``tidal/rollout/runner/multimodal.py``), on CPU in float32.

- ``equal_length_runs`` by hand; ``segment_attention`` (one SDPA call per run of equal segments) equals
  transformers' per-segment SDPA on ragged segments;
- a tower from ``build_vision_tower`` attends by segments, leaves the caller's config as it was, and gives
  the features of transformers' SDPA tower with the same weights, on two images whose windows are ragged
  (Qwen2.5-VL's window blocks and a full-attention block), on CPU in float32 and (gpu) CUDA in bf16;
- in the engine, each image goes through the tower exactly once per request, also when chunked prefill
  splits the prompts, and no image is hashed without prefix caching.
"""

from __future__ import annotations

import pytest
import torch

from tidal.rollout.models.vision_attention import (
    SEGMENT_ATTENTION,
    build_vision_tower,
    equal_length_runs,
    segment_attention,
)


def test_equal_length_runs_by_hand():
    assert equal_length_runs([64, 64, 16, 64]) == [(0, 64, 2), (128, 16, 1), (144, 64, 1)]
    assert equal_length_runs([4, 0, 4, 2, 2, 2]) == [(0, 4, 2), (8, 2, 3)]  # empty segments dropped
    assert equal_length_runs([]) == []


def test_segment_attention_equals_per_segment_sdpa():
    import torch.nn.functional as F

    lengths = [6, 6, 6, 3, 6, 1, 1]
    q, k, v = (
        torch.randn(1, 2, sum(lengths), 8, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    cu = torch.tensor([0, *lengths]).cumsum(0).int()
    out, _ = segment_attention(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu)
    expected = torch.cat(
        [
            F.scaled_dot_product_attention(a, b, c, scale=0.3)
            for a, b, c in zip(*(x.split(lengths, 2) for x in (q, k, v)), strict=True)
        ],
        dim=2,
    ).transpose(1, 2)  # [1, tokens, heads, dim]
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    # without cu_seqlens (a transformers that splits the segments itself): one segment
    first = [x[:, :, :6] for x in (q, k, v)]
    alone, _ = segment_attention(None, *first, None, scaling=0.3)
    torch.testing.assert_close(alone, expected[:, :6], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="dropout must be 0"):
        segment_attention(None, q, k, v, None, dropout=0.1, cu_seq_lens_q=cu)


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)],
    ids=["cpu", "cuda-bf16"],
)
def test_tower_attends_by_segments_as_transformers_sdpa_tower(device, dtype):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel as Tower,
    )

    vision = Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=16,
                           patch_size=14, spatial_merge_size=2, window_size=112, fullatt_block_indexes=[1]),
    ).vision_config  # fmt: skip
    vision._attn_implementation = "sdpa"
    torch.manual_seed(0)
    reference = Tower._from_config(vision).eval()
    ours = build_vision_tower(Tower, vision).eval()
    ours.load_state_dict(reference.state_dict())
    reference, ours = (m.to(device, dtype) for m in (reference, ours))
    assert ours.config._attn_implementation == SEGMENT_ATTENTION and vision._attn_implementation == "sdpa"
    # merged grids 4×6 and 6×6 with 4×4 windows: windows of 16, 8, 8, 8 and 4 merged tokens
    grid = torch.tensor([[1, 8, 12], [1, 12, 12]])
    pixels = torch.randn(
        int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1)
    )
    pixels, grid = pixels.to(device, dtype), grid.to(device)
    with torch.inference_mode():
        expected = reference(pixels, grid_thw=grid).pooler_output
        got = ours(pixels, grid_thw=grid).pooler_output
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: a batch's kernel may round apart from one call's
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_each_image_runs_the_tower_once_under_chunked_prefill(tmp_path, monkeypatch):
    from PIL import Image

    from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
    from tidal.rollout.runner import multimodal
    from tidal.rollout.runner.multimodal import MultiModalInput
    from tidal.testing import build_tiny_vlm

    path = build_tiny_vlm(tmp_path / "vlm")
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=64, block_size=4,
                          enable_chunked_prefill=True, max_num_batched_tokens=8)  # fmt: skip
    engine = LLMEngine(str(path), config)
    images = []
    tower = engine.model.visual
    run_tower = tower.forward
    monkeypatch.setattr(
        tower,
        "forward",
        lambda pixels, grid_thw: images.extend(grid_thw.tolist()) or run_tower(pixels, grid_thw),
    )
    hashed = []
    monkeypatch.setattr(multimodal, "image_hash", lambda *a: hashed.append(a) or "0")
    token = engine.vision.image_token_id
    colours = [(200, 0, 0), (0, 200, 0), (0, 0, 200)]
    prompts = [
        [5, token, 6, 7, 8, 9, 10, 11],
        [12, token, 13, 14, 15, 16, 17],
        [18, token, 19, 20, 21, 22, 23],
    ]
    mm = [MultiModalInput(images=[Image.new("RGB", (56, 56), c)]) for c in colours]  # 4 image tokens each
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=2), multi_modal=mm)
    assert [len(o.outputs[0].token_ids) for o in out] == [2, 2, 2]
    assert images == [[1, 4, 4]] * 3  # 3 prompts of 11-12 tokens in chunks of 8: each image once
    assert hashed == []  # no prefix cache: nothing reads the hashes
    engine.close()
