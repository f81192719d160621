"""The trainer's Qwen-VL towers attend by runs of equal segments (``tidal/models/vision_attention.py``,
``use_segment_attention``, applied by ``tidal.models.loading.load_causal_lm`` and the vision value
models) with transformers' values, forward and backward.

- Qwen2.5-VL (window blocks then a full-attention block) and Qwen3-VL (full attention per image), three
  images of two sizes (ragged windows; two equal images in one run), in a padded batch of two rows: the
  loss and every parameter's gradient (tower, merger and language model) of a model from
  ``load_causal_lm`` are bit-identical to the stock transformers model's (SDPA per window/image) on CPU
  in float32, with and without gradient checkpointing, in fewer SDPA calls; (gpu) within bf16 rounding
  on CUDA under autocast;
- only the tower's config changes (the language model keeps sdpa), nothing of it is saved, the value
  models' towers switch too, and an eager tower (``--attn_implementation eager``) is left alone.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tidal.config.model import ModelConfig
from tidal.models.forward import model_inputs
from tidal.models.loading import load_causal_lm
from tidal.models.vision_value import load_vision_value_model
from tidal.rollout.models.vision_attention import SEGMENT_ATTENTION, use_segment_attention
from tidal.testing import build_tiny_vlm

# patch grids (t, h, w): merged 4×6, 4×6 and 6×6 tokens; Qwen2.5-VL's 4×4-token windows are ragged
GRIDS = [[1, 8, 12], [1, 8, 12], [1, 12, 12]]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def tiny(request, tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


def _stock(path, gradient_checkpointing: bool, device: str = "cpu"):
    """transformers' own model, towers attending per window/image with SDPA."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="sdpa"
    )
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device).train()


def _batch(model, device: str) -> dict:
    """Two right-padded rows: images 1 and 2 in the first, image 3 in the second; labels on the text."""
    config = model.config
    patch = config.vision_config.patch_size
    grid = torch.tensor(GRIDS)
    merged = (grid.prod(-1) // config.vision_config.spatial_merge_size**2).tolist()
    image = [config.vision_start_token_id, *[config.image_token_id] * merged[0], config.vision_end_token_id]
    image2 = [config.vision_start_token_id, *[config.image_token_id] * merged[2], config.vision_end_token_id]
    rows = [[5, *image, 6, 7, *image, 8, 9], [10, *image2, 11, 12, 13]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = ids.masked_fill((mask == 0) | (ids >= config.vision_start_token_id), -100)
    pixels = torch.randn(
        int(grid.prod(-1).sum()), 3 * 2 * patch * patch, generator=torch.Generator().manual_seed(0)
    )
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    batch = dict(
        input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels, pixel_values=pixels,
        image_grid_thw=grid,
    )  # fmt: skip
    return {k: v.to(device) for k, v in batch.items()}


def _loss_and_grads(model, batch: dict, autocast: bool = False) -> tuple[torch.Tensor, dict, int]:
    """Loss, every parameter's gradient, and the SDPA calls of one forward + backward."""
    calls = [0]
    sdpa = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return sdpa(*args, **kwargs)

    model.zero_grad(set_to_none=True)
    try:
        F.scaled_dot_product_attention = counted  # transformers and tidal look it up at call time
        with torch.autocast(batch["input_ids"].device.type, torch.bfloat16, enabled=autocast):
            logits = model(**model_inputs(model, batch)).logits  # the trainer's inputs (M-RoPE positions)
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
    finally:
        F.scaled_dot_product_attention = sdpa
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads, calls[0]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_trainer_tower_loss_and_grads_equal_transformers(tiny, checkpointing):
    cfg = ModelConfig(
        pretrain=str(tiny), gradient_checkpointing=checkpointing, gradient_checkpointing_use_reentrant=False
    )
    ours = load_causal_lm(cfg, torch.device("cpu")).train()
    assert ours.config.vision_config._attn_implementation == SEGMENT_ATTENTION
    assert ours.config._attn_implementation == ours.config.text_config._attn_implementation == "sdpa"
    stock = _stock(tiny, checkpointing)
    batch = _batch(stock, "cpu")
    loss, grads, calls = _loss_and_grads(ours, batch)
    expected_loss, expected_grads, expected_calls = _loss_and_grads(stock, batch)
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected_grads.keys() and any(".visual." in n for n in grads)
    tower_qkv = next(n for n in grads if ".visual.blocks.0.attn.qkv.weight" in n)
    assert grads[tower_qkv].abs().sum() > 0  # the tower's gradient flows (also through checkpoints)
    different = [n for n in grads if not torch.equal(grads[n], expected_grads[n])]
    assert different == []
    # a window block: 7 runs of equal windows for 10 windows; a full-attention block: 2 runs for 3 images
    assert calls < expected_calls


def test_only_the_tower_switches_and_nothing_is_saved(tiny, tmp_path):
    cpu = torch.device("cpu")
    critic = load_vision_value_model(ModelConfig(pretrain=str(tiny)), cpu)
    assert critic.config.vision_config._attn_implementation == SEGMENT_ATTENTION
    assert critic.config.text_config._attn_implementation == "sdpa"
    critic.save_pretrained(str(tmp_path))
    assert "_attn_implementation" not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
    eager = load_causal_lm(ModelConfig(pretrain=str(tiny), attn_implementation="eager"), cpu)
    assert eager.config.vision_config._attn_implementation == "eager"  # the user's choice, left alone
    assert use_segment_attention(eager) == 0


@pytest.mark.gpu
def test_trainer_tower_on_cuda_bf16_close_to_transformers(tiny):
    cfg = ModelConfig(
        pretrain=str(tiny), gradient_checkpointing=True, gradient_checkpointing_use_reentrant=False
    )
    ours = load_causal_lm(cfg, torch.device("cuda")).train()
    assert ours.config.vision_config._attn_implementation == SEGMENT_ATTENTION
    stock = _stock(tiny, True, "cuda")
    batch = _batch(stock, "cuda")
    loss, grads, _ = _loss_and_grads(ours, batch, autocast=True)
    expected_loss, expected_grads, _ = _loss_and_grads(stock, batch, autocast=True)
    # bf16: a batched kernel may round apart from one call per segment
    torch.testing.assert_close(loss, expected_loss, rtol=1e-2, atol=1e-2)
    for name, grad in expected_grads.items():
        error = (grads[name] - grad).norm()
        assert error <= 5e-2 * grad.norm() + 1e-5, f"{name}: gradient error {error:.3g} of {grad.norm():.3g}"
